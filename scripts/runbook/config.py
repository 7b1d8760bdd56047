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

# What every server of a run gets, A and B alike: AITER on, with the FP8 BMM
# for the MLA absorb (the profile step checks those kernels are used).
SERVE_ENV = {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP8BMM": "1"}


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


@dataclass(frozen=True)
class Config:
    """One run. Every field has a default a ROCm engineer can keep."""

    machine: Machine
    out_dir: Path
    project_root: Path
    baseline_image: str = "vllm/vllm-openai-rocm:v0.33.0"  # A
    candidate_image: str = "vllm-k3-dspark-rocm:v0.33.0-overlay"  # B (make rocm-image)
    # B for the device tests: B's overlay on an image with vLLM's test
    # requirements (pytest, ...); release images have none. Default: B.
    test_image: str | None = None
    model: str = TARGET_MODEL
    speculative_config: dict = field(default_factory=lambda: dict(SPECULATIVE_CONFIG))
    serve_env: dict = field(default_factory=lambda: dict(SERVE_ENV))
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
    # Timeouts, seconds. Loading Kimi-K3 on 8 GPUs takes a while.
    server_ready_timeout: float = 3600
    bench_timeout: float = 3600
    lm_eval_timeout: float = 4 * 3600
    tests_timeout: float = 3600
    # Names of the steps to run (from steps.NAMES, which has their order); None: all.
    steps: tuple[str, ...] | None = None
    # A line on top of the report (the committed example says it is synthetic).
    banner: str | None = None

    @property
    def speculative_json(self) -> str:
        return json.dumps(self.speculative_config, separators=(", ", ": "))

    @property
    def tests_image(self) -> str:
        return self.test_image or self.candidate_image

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
