"""What a runbook run compares, where, and with which settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# The speculative config of the original request ("[ROCm] Dspark MLA module").
SPECULATIVE_CONFIG = {
    "method": "dspark",
    "model": "Inferact/Kimi-K3-DSpark",
    "num_speculative_tokens": 5,
    "attention_backend": "TRITON_MLA",
    "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block",
}
TARGET_MODEL = "moonshotai/Kimi-K3"
# The draft's attention A/B (MI355X, AITER on): the speculative config's
# attention_backend of each run; "" leaves it unset, so vLLM chooses.
DRAFT_BACKENDS = ("TRITON_MLA", "ROCM_AITER_MLA", "")
# The device test of AITER's non-causal decode against TRITON_MLA's.
DRAFT_TEST = "scripts/runbook/device_tests/test_draft_attention.py"



@dataclass(frozen=True)
class Regime:
    """One setting of vLLM's AITER switches, served on its own. MI300 users run
    AITER on, with the FP8 BMM for the MLA absorb; MI355 can take the FP4 BMM
    instead (vLLM honours VLLM_ROCM_USE_AITER_FP4BMM on gfx950 only)."""

    name: str
    aiter: bool
    bmm: str = ""  # the absorb's AITER BMM: "", "fp8" or "fp4"
    archs: tuple[str, ...] = ("gfx942", "gfx950")  # where vLLM honours it

    @property
    def env(self) -> dict[str, str]:
        """Every AITER switch a regime decides, set both ways: one regime's
        servers never inherit another's."""
        on = {"VLLM_ROCM_USE_AITER": self.aiter, "VLLM_ROCM_USE_AITER_FP8BMM": self.bmm == "fp8",
              "VLLM_ROCM_USE_AITER_FP4BMM": self.bmm == "fp4"}
        return {key: "1" if value else "0" for key, value in on.items()}

    @property
    def title(self) -> str:
        if not self.aiter:
            return "AITER off"
        return f"AITER on + {self.bmm.upper()} BMM" if self.bmm else "AITER on, BMM flags off"


# The flag matrix of the profile and accuracy steps, in the order they run.
REGIMES = {r.name: r for r in (
    Regime("aiter-off", aiter=False),
    Regime("aiter", aiter=True),
    Regime("aiter-fp8bmm", aiter=True, bmm="fp8"),
    Regime("aiter-fp4bmm", aiter=True, bmm="fp4", archs=("gfx950",)),
)}
# What the device tests, the A/B accuracy gate and the sweep serve: what MI300
# deployments run (the original request's test plan profiled it "flags on").
SWEEP_REGIME = "aiter-fp8bmm"
AITER_SWITCHES = tuple(REGIMES[SWEEP_REGIME].env)  # given per regime, never by --env


@dataclass(frozen=True)
class Machine:
    name: str
    gcn_arch: str
    gpu: str
    tensor_parallel_size: int


MACHINES = {
    "mi300x": Machine("mi300x", "gfx942", "AMD Instinct MI300X", 8),
    "mi355x": Machine("mi355x", "gfx950", "AMD Instinct MI355X", 8),
}


def release_images(project_root: Path) -> tuple[str, str]:
    """A and B of the release pin.toml names: vLLM's ROCm image of it, and
    that image with this stack's overlay as `make rocm-image` tags it."""
    from scripts.image.rocm_image import DEFAULT_OVERLAY_BASE, DEFAULT_TAG
    from scripts.stack.pin import load_pin

    version = load_pin(project_root / "pin.toml").version
    return (DEFAULT_OVERLAY_BASE.format(version=version),
            DEFAULT_TAG.format(version=version, recipe="overlay"))


@dataclass(frozen=True)
class Config:
    """One run. Every field has a default a ROCm engineer can keep."""

    machine: Machine
    out_dir: Path
    project_root: Path
    # A and B; default: the pinned release's ROCm image and `make rocm-image`'s tag.
    baseline_image: str = ""
    candidate_image: str = ""
    # B for the device tests: B's overlay on an image with vLLM's test
    # requirements (pytest, ...); release images have none. Default: B.
    test_image: str | None = None
    model: str = TARGET_MODEL
    speculative_config: dict = field(default_factory=lambda: dict(SPECULATIVE_CONFIG))
    # More environment for every server; the AITER switches come from the regime.
    serve_env: dict = field(default_factory=dict)
    # The profile and accuracy steps' regimes (None: every one this machine
    # honours); the sweep's is always among them.
    regimes: tuple[str, ...] | None = None
    sweep_regime: str = SWEEP_REGIME
    serve_args: tuple[str, ...] = ()  # more `vllm serve` options, for every server
    port: int = 8000
    hf_cache: Path = Path("~/.cache/huggingface").expanduser()
    engine: str = "docker"
    # Sweep: every output length with every concurrency (docs/hardware-runbook.md).
    output_lens: tuple[int, ...] = (256, 1024, 4096)
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    input_len: int = 1024
    prompts_per_concurrency: int = 8
    dataset_args: tuple[str, ...] = ("--dataset-name", "random")
    # Accuracy: gsm8k, 5-shot, the full test set unless limited.
    gsm8k_limit: int | None = None
    gsm8k_concurrency: int = 32
    lm_eval_requirement: str = "lm_eval[api]==0.4.13"
    # Two standard errors of the difference: the "noise" of the gate.
    noise_sigmas: float = 2.0
    # The draft-block attention benchmark of the Triton MLA patch (optional),
    # then its sweep of the ROCm candidate tiles. The GPU-bench package is built
    # in the results folder (/runbook in the containers): the project is
    # mounted read-only.
    kernel_bench: tuple[str, ...] = ("python3", "-m", "scripts", "gpubench",
                                     "--case", "mla_decode",
                                     "--package", "/runbook/kernels/gpubench")
    kernel_sweep: tuple[str, ...] = ("python3", "/runbook/kernels/gpubench/cases/mla_decode.py",
                                     "--sweep")
    # The draft's attention A/B: backends, (concurrency, output length) cells,
    # and the margin ROCM_AITER_MLA must beat TRITON_MLA by to be recommended.
    draft_backends: tuple[str, ...] = DRAFT_BACKENDS
    draft_cells: tuple[tuple[int, int], ...] = ((1, 1024), (16, 1024))
    draft_margin: float = 0.03
    draft_test: str = DRAFT_TEST  # relative to the project
    # Timeouts, seconds. Loading Kimi-K3 on 8 GPUs takes a while.
    server_ready_timeout: float = 3600
    bench_timeout: float = 3600
    lm_eval_timeout: float = 4 * 3600
    tests_timeout: float = 3600
    # Names of the steps to run (from steps.NAMES, which has their order); None: all.
    steps: tuple[str, ...] | None = None
    # A line on top of the report (the committed example says it is synthetic).
    banner: str | None = None

    def __post_init__(self) -> None:
        baseline, candidate = release_images(self.project_root)
        object.__setattr__(self, "baseline_image", self.baseline_image or baseline)
        object.__setattr__(self, "candidate_image", self.candidate_image or candidate)

    @property
    def speculative_json(self) -> str:
        return json.dumps(self.speculative_config, separators=(", ", ": "))

    def speculative_json_with(self, backend: str) -> str:
        """The speculative config with the draft's attention backend `backend`
        ("": none named, vLLM chooses)."""
        spec = {k: v for k, v in self.speculative_config.items() if k != "attention_backend"}
        return json.dumps({**spec, **({"attention_backend": backend} if backend else {})},
                          separators=(", ", ": "))

    @property
    def tests_image(self) -> str:
        return self.test_image or self.candidate_image

    @property
    def matrix(self) -> tuple[Regime, ...]:
        """The regimes the profile and accuracy steps serve, in REGIMES' order."""
        names = set(self.regimes or [r.name for r in REGIMES.values()
                                     if self.machine.gcn_arch in r.archs])
        return tuple(r for r in REGIMES.values() if r.name in names | {self.sweep_regime})

    def env(self, regime: str) -> dict[str, str]:
        """A server's environment under `regime`."""
        return {**self.serve_env, **REGIMES[regime].env}

    def image(self, label: str) -> str:
        if label == "tests":
            return self.tests_image
        return self.baseline_image if label in ("A", "ref") else self.candidate_image


# The configurations a run serves. "ref" is the target without speculative
# decoding on the release image: the accuracy reference.
CONFIG_LABELS = {
    "ref": "target without speculative decoding (image A)",
    "A": "baseline: vLLM release, NVIDIA drafter module on ROCm (image A)",
    "B": "candidate: release + this stack's overlay, AMD drafter (image B)",
}
