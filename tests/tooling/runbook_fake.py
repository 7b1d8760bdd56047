"""A recording stand-in for the ROCm machine, for the runbook's tests and example.

`RecordingExecutor` answers the runbook's commands the way docker, `vllm serve`,
`vllm bench serve`, lm-eval and pytest answer them on the machine: it writes
their result files (from runbook_samples/, varied per configuration and cell)
to the host paths the commands name through the /runbook mount, and records
every command. A `Scenario` makes it misbehave: a missing image, a server that
never becomes ready, a malformed result file, a broken drafter, a skipped
ROCm-only test.

`python3 -m tests.tooling.runbook_fake docs/runbook-example` writes the example
report from these samples (matplotlib installed: .venv has it).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scripts.runbook import plan
from scripts.runbook.executor import Result

SAMPLES = Path(__file__).resolve().parent / "runbook_samples"
NVIDIA, AMD = "vllm.models.kimi_k3.nvidia.dspark_mla", "vllm.models.kimi_k3.amd.dspark_mla"


@dataclass
class Scenario:
    missing_image: str | None = None  # "A" or "B"
    never_ready: str | None = None  # a config whose server keeps loading
    server_exits: str | None = None  # a config whose server dies while loading
    malformed_bench: tuple[str, int, int] | None = None  # (config, concurrency, output len)
    broken_drafter: str | None = None  # a config whose outputs turn to repetitive garbage
    rocm_test_skipped: bool = False
    kernel_bench_absent: bool = False
    no_pytest_in_b: bool = False  # a release image: no test requirements
    polls_until_ready: int = 3
    port_taken: bool = False  # another server already answers on the port
    # The draft's attention A/B (MI355X): AITER's non-causal decode ignores the
    # flag (its device test fails, its drafts are rejected more), and how much
    # faster its decode step is than TRITON_MLA's.
    aiter_decode_causal: bool = False
    aiter_speedup: float = 1.0
    gcn_arch: str | None = None  # what the images see (default: the sample's gfx942)


@dataclass
class RecordingExecutor:
    out_dir: Path
    scenario: Scenario = field(default_factory=Scenario)
    commands: list[list[str]] = field(default_factory=list)
    clock: float = 0.0
    _polls: int = 0
    serving: str | None = None  # the config being served
    serving_env: dict = field(default_factory=dict)  # its --env=KEY=VALUE flags
    _profile_dir: str | None = None
    draft_backend: str | None = None  # the served speculative config's, if any

    # --- Executor ------------------------------------------------------------

    def run(self, argv, *, timeout, log, kind="", meta=None) -> Result:
        self.commands.append(list(argv))
        meta = meta or {}
        self.clock += 1
        code, output = getattr(self, f"_{kind}", self._other)(argv, meta)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
        return Result(code, output)

    def http_status(self, url: str) -> int | None:
        if self.serving is None:  # before the runbook started its server
            return 200 if self.scenario.port_taken else None
        self._polls += 1
        if self.serving in (self.scenario.never_ready, self.scenario.server_exits):
            return None
        return 200 if self._polls >= self.scenario.polls_until_ready else None

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def now(self) -> float:
        return self.clock

    def timestamp(self) -> str:
        return f"2026-11-30T04:{int(self.clock) // 60 % 60:02d}:{int(self.clock) % 60:02d}+0000"

    # --- the machine's answers, by command kind ------------------------------

    def host(self, container_path: str) -> Path:
        return self.out_dir / Path(container_path).relative_to(plan.IN_CONTAINER)

    @staticmethod
    def option(argv: list[str], name: str) -> str:
        for i, arg in enumerate(argv):
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
            if arg == name:
                return argv[i + 1]
        raise AssertionError(f"{name} not in {argv}")

    def _other(self, argv, meta):
        if argv[1:3] == ["rm", "--force"]:
            self.serving = None
        if argv[1] == "logs" and self.serving:
            return 0, self._server_log()
        return 0, ""

    def _server_log(self) -> str:
        """What vLLM 0.34.0 logs choosing the draft's attention on gfx950 with
        AITER on: the pinned backend, else ROCM_AITER_MLA."""
        line = "INFO 11-30 04:10:00 [rocm.py:828] Using {} backend (selected via " \
               "--attention-backend).\n"
        if self.draft_backend is None:
            line = "INFO 11-30 04:10:00 [rocm.py:928] Using {} backend out of potential " \
                   "backends: ['ROCM_AITER_MLA', 'TRITON_MLA'].\n"
        return "INFO starting\n" + line.format(self.draft_backend or "ROCM_AITER_MLA")

    def _engine(self, argv, meta):
        return 0, "Server:\n Server Version: 28.2.2\n"

    def _image(self, argv, meta):
        if meta["config"] == self.scenario.missing_image:
            return 1, f"Error response from daemon: No such image: {argv[-1]}\n"
        return 0, f"sha256:{'a' if meta['config'] == 'A' else 'b'}{'0' * 63}\n"

    def _probe(self, argv, meta):
        probe = json.loads((SAMPLES / "probe_B.json").read_text())
        if self.scenario.gcn_arch:
            probe["gcn_arch"] = self.scenario.gcn_arch
        if meta["config"] == "B" and self.scenario.no_pytest_in_b:
            probe["pytest"] = None
        if meta["config"] == "A":
            probe["drafter"] = {"vllm.models.kimi_k3.K3DSparkForCausalLM": None,
                                "ModelRegistry['K3DSparkModel']": NVIDIA}
        return 0, "WARNING torch: some noise\n" + json.dumps(probe) + "\n"

    def _server(self, argv, meta):
        self._polls = 0
        self.serving = meta["config"]
        self.serving_env = dict(a[len("--env="):].split("=", 1) for a in argv
                                if a.startswith("--env=") and "=" in a[len("--env="):])
        if "--speculative-config" in argv:
            spec = json.loads(self.option(argv, "--speculative-config"))
            self.draft_backend = spec.get("attention_backend")
        if "--profiler-config" in argv:
            self._profile_dir = json.loads(self.option(argv, "--profiler-config"))[
                "torch_profiler_dir"]
        return 0, "f00dcafe\n"

    def _inspect(self, argv, meta):
        return 0, "false\n" if self.serving == self.scenario.server_exits else "true\n"

    def _pytest(self, argv, meta):
        junit = (SAMPLES / "pytest_junit.xml").read_text()
        if self.scenario.rocm_test_skipped:
            junit = junit.replace(
                'name="test_k3_dspark_rocm_decoder_builds_mla_wrapper" time="5.118" />',
                'name="test_k3_dspark_rocm_decoder_builds_mla_wrapper" time="0.001">'
                '<skipped type="pytest.skip" message="ROCm only">'
                'tests/models/test_dspark_mla_rocm.py:471: ROCm only</skipped></testcase>')
        target = self.host(self.option(argv, "--junitxml"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(junit)
        return 0, "5 passed, 1 skipped\n"

    def _bench_file(self, argv) -> Path:
        return self.host(self.option(argv, "--result-dir")) / self.option(
            argv, "--result-filename")

    def _profile(self, argv, meta):
        result = bench_figures("B", 1, 64, num_prompts=1)
        write_json(self._bench_file(argv), result)
        drafts = result["spec_decode_num_drafts"]
        folder = self.host(self._profile_dir)
        for rank in range(2):  # two of the eight ranks keep the test small
            write_json(folder / f"rank{rank}.1796002104.pt.trace.json",
                       decode_trace(drafts, self.serving_env))
        write_json(folder / "frontend.1796002104.pt.trace.json",
                   {"schemaVersion": 1, "traceEvents": [
                       {"ph": "X", "cat": "user_annotation", "name": "AsyncLLM.generate",
                        "ts": 1.0, "dur": 2.0}]})
        return 0, "Profiler started\nProfiler stopped\n"

    def _bench(self, argv, meta):
        label, c, o = meta["config"], meta["concurrency"], meta["output_len"]
        target = self._bench_file(argv)
        if (label, c, o) == self.scenario.malformed_bench:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text('{"date": "20261130-041208", "completed": 8, "output_throu')
            return 0, "truncated\n"
        write_json(target, bench_figures(label, c, o,
                                         num_prompts=int(self.option(argv, "--num-prompts"))))
        return 0, "============ Serving Benchmark Result ============\n"

    def _draft_pytest(self, argv, meta):
        """The draft-attention device test: every case passes, unless AITER's
        decode is causal (then the AITER cases fail)."""
        cases = [f"{h}-{q}-{p}-{kv}" for h in (8, 16) for q in (3, 6, 8) for p in (16, 64)
                 for kv in ("bf16", "fp8")]
        failure = ('<failure message="AssertionError: ROCM_AITER_MLA differs from the '
                   'non-causal reference by 1.8125" />')
        bad = self.scenario.aiter_decode_causal
        junit = "".join(
            f'<testcase classname="test_draft_attention" name="test_aiter_non_causal_draft_'
            f'block_matches_triton_mla[{c}]" time="0.8">{failure if bad else ""}</testcase>'
            for c in cases)
        target = self.host(self.option(argv, "--junitxml"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite '
                          f'name="pytest">{junit}</testsuite></testsuites>\n')
        return (1 if bad else 0), f"{len(cases)} {'failed' if bad else 'passed'}\n"

    def _draft_bench(self, argv, meta):
        """B's cell with the draft on one backend: AITER's decode step is
        `aiter_speedup` times faster; a causal AITER decode loses acceptance."""
        result = bench_figures("B", meta["concurrency"], meta["output_len"],
                               num_prompts=int(self.option(argv, "--num-prompts")))
        if (self.draft_backend or "ROCM_AITER_MLA") == "ROCM_AITER_MLA":
            speedup = self.scenario.aiter_speedup
            result["mean_itl_ms"] /= speedup
            result["mean_tpot_ms"] /= speedup
            result["output_throughput"] *= speedup
            if self.scenario.aiter_decode_causal:
                result["spec_decode_acceptance_length"] *= 0.8
        write_json(self._bench_file(argv), result)
        return 0, "============ Serving Benchmark Result ============\n"

    def _lm_eval(self, argv, meta):
        label = meta["config"]
        folder = self.host(self.option(argv, "--output_path")) / "moonshotai__Kimi-K3"
        results = json.loads((SAMPLES / "lm_eval_results_gsm8k.json").read_text())
        task = results["results"]["gsm8k"]
        # Speculative decoding is lossless: A and B land within noise of ref.
        shift = {"ref": 0.0, "A": -0.0023, "B": 0.0015}[label]
        if label == self.scenario.broken_drafter:
            shift = -0.41
        for metric in ("strict-match", "flexible-extract"):
            task[f"exact_match,{metric}"] = round(task[f"exact_match,{metric}"] + shift, 6)
        write_json(folder / "results_2026-11-30T04-12-09.118221.json", results)
        samples = (SAMPLES / "lm_eval_samples_gsm8k.jsonl").read_text().splitlines()
        if label != self.scenario.broken_drafter:
            samples = [s for s in samples if json.loads(s)["doc_id"] == 0]
        (folder / "samples_gsm8k_2026-11-30T04-12-09.118221.jsonl").write_text(
            "\n".join(samples) + "\n")
        return 0, "|Tasks|Version|     Filter     |n-shot|  Metric   |\n"

    def _kernels(self, argv, meta):
        if self.scenario.kernel_bench_absent:
            return 2, ("usage: python3 -m scripts [-h] {fetch,apply,...}\npython3 -m scripts: "
                       "error: argument command: invalid choice: 'gpubench'\n")
        if "--sweep" in argv:
            return 0, ("sweep gfx942 bf16 _MLABlockTile(64, 16, 8, 1) ... 0.0412 ms\n"
                       "best tile gfx942 bf16: _MLABlockTile(64, 16, 8, 1) 0.0412 ms "
                       "(geometric mean; shipped tile 0.0412 ms)\n"
                       "best tile gfx942 fp8: _MLABlockTile(32, 16, 8, 1, waves_per_eu=2) "
                       "0.0371 ms (geometric mean; shipped tile 0.0398 ms)\n")
        return 0, ("# draft-block attention (TRITON_MLA), bf16, 16 heads, kv_lora_rank 512\n"
                   "case,batch,draft_tokens,context,impl,us\n"
                   "mla_decode,1,6,4096,grouped,41.2\nmla_decode,1,6,4096,per_layer,57.9\n"
                   "mla_decode,16,6,4096,grouped,88.4\nmla_decode,16,6,4096,per_layer,131.0\n")


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) + "\n")


def bench_figures(label: str, concurrency: int, output_len: int, num_prompts: int) -> dict:
    """The recorded result file with figures of a plausible A or B cell."""
    result = json.loads((SAMPLES / "bench_serve_result.json").read_text())
    # B gains most where the draft dominates: low concurrency, long outputs.
    gain = 1.0 if label == "A" else 1 + 0.09 / math.sqrt(concurrency) + 0.01 * math.log2(
        output_len / 256 + 1)
    acceptance = (3.12 if label == "A" else 3.14) - 0.04 * math.log2(output_len / 256 + 1)
    per_request = 27.0 * acceptance / 3.12 * gain / (1 + 0.11 * math.log2(concurrency))
    throughput = per_request * concurrency
    tpot = 1000.0 / per_request
    drafts = int(num_prompts * output_len / acceptance)
    result.update({
        "num_prompts": num_prompts, "max_concurrency": concurrency, "completed": num_prompts,
        "total_input_tokens": num_prompts * 1024, "total_output_tokens": num_prompts * output_len,
        "output_throughput": throughput, "total_token_throughput": throughput * (
            1 + 1024 / output_len), "request_throughput": throughput / output_len,
        "duration": num_prompts * output_len / throughput,
        "mean_tpot_ms": tpot, "median_tpot_ms": tpot * 0.99, "std_tpot_ms": tpot * 0.05,
        "p99_tpot_ms": tpot * 1.18, "mean_itl_ms": tpot * acceptance,
        "median_itl_ms": tpot * acceptance * 0.98, "p99_itl_ms": tpot * acceptance * 1.6,
        "mean_ttft_ms": 180.0 + 9.0 * concurrency, "median_ttft_ms": 172.0 + 9.0 * concurrency,
        "p99_ttft_ms": 260.0 + 14.0 * concurrency,
        "spec_decode_acceptance_length": acceptance,
        "spec_decode_acceptance_rate": 100 * (acceptance - 1) / 5,
        "spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": 5 * drafts,
        "spec_decode_accepted_tokens": int(drafts * (acceptance - 1)),
        "runbook_config": label,
    })
    result.pop("latencies", None)
    result.pop("queue_times", None)
    return result


def decode_trace(drafts: int, env: dict | None = None) -> dict:
    """Rank 0's decode-step events, once per draft step (timestamps shifted).
    The sample is a step served with AITER and its FP8 BMM on (the default
    `env`); other AITER switches get the kernels vLLM launches for them."""
    trace = json.loads((SAMPLES / "trace_decode_step_rank0.pt.trace.json").read_text())
    step = _as_served(trace["traceEvents"], env or {"VLLM_ROCM_USE_AITER": "1",
                                                    "VLLM_ROCM_USE_AITER_FP8BMM": "1"})
    trace["traceEvents"] = [{**e, "ts": e["ts"] + 200.0 * i} for i in range(drafts)
                            for e in step]
    return trace


# What the sample's AITER kernels become under other switches: the absorb on
# torch's bmm (hipBLASLt), the FP4 BMM on gfx950. The draft's RoPE + cache
# write is vLLM's fused launch under every switch.
_TORCH_BMM = [{"ph": "X", "cat": "cpu_op", "name": "aten::bmm"},
              {"ph": "X", "cat": "kernel", "name": "Cijk_Alik_Bljk_BBS_BH_MT64x64x64_MI16x16x1"}]
_FP4_BMM = [{"ph": "X", "cat": "kernel", "name": "_batched_gemm_a16wfp4_kernel"}]


def _as_served(events: list[dict], env: dict) -> list[dict]:
    aiter = env.get("VLLM_ROCM_USE_AITER") == "1"
    fp4 = aiter and env.get("VLLM_ROCM_USE_AITER_FP4BMM") == "1"  # gfx950: the fake's MI355
    fp8 = aiter and env.get("VLLM_ROCM_USE_AITER_FP8BMM") == "1" and not fp4
    out = []
    for e in events:
        name = e.get("name", "")
        if "batched_gemm_a8w8" in name and not fp8:
            out += [{**x, "ts": e["ts"], "dur": e["dur"]} for x in (_FP4_BMM if fp4 else
                                                                     _TORCH_BMM)]
        else:
            out.append(e)
    return out


EXAMPLE_BANNER = ("SYNTHETIC EXAMPLE: generated from the recorded sample files of "
                  "tests/tooling/runbook_samples/ by a recording executor; no GPU ran. "
                  "These are not hardware results.")
# The example shows these paths instead of the temporary ones it was made in.
EXAMPLE_OUT, EXAMPLE_ROOT = "/home/rocm/runbook-mi300x", "/home/rocm/k3-dspark-stack"


def project_checkout(root: Path) -> Path:
    """What the runbook reads from the project on the machine: the overlay's
    manifest (the stack's test files) and the patched tree's tests/ (make apply)."""
    repo = Path(__file__).resolve().parents[2]
    (root / "vllm_overlay").mkdir(parents=True)
    shutil.copyfile(repo / "pin.toml", root / "pin.toml")  # the release: A and B
    shutil.copyfile(repo / "vllm_overlay" / "MANIFEST.json",
                    root / "vllm_overlay" / "MANIFEST.json")
    (root / "build" / "vllm" / "tests").mkdir(parents=True)
    (root / "build" / "vllm" / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    return root


def write_example(dest: Path, tmp: Path) -> None:
    """Run the whole runbook on the recording executor; copy its report to `dest`."""
    from scripts.runbook.cli import run
    from scripts.runbook.config import MACHINES, Config

    root = project_checkout(tmp / "project")
    config = Config(MACHINES["mi300x"], tmp / "out", root, banner=EXAMPLE_BANNER,
                    hf_cache=Path("/home/rocm/.cache/huggingface"))
    code = run(config, RecordingExecutor(config.out_dir), say=lambda _: None)
    assert code == 0, f"the example run failed ({code})"
    dest.mkdir(parents=True, exist_ok=True)
    for item in sorted((config.out_dir / "report").iterdir()):
        if item.suffix == ".png":
            shutil.copyfile(item, dest / item.name)
        else:
            text = item.read_text().replace(str(config.out_dir), EXAMPLE_OUT)
            (dest / item.name).write_text(text.replace(str(root), EXAMPLE_ROOT))


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        write_example(Path(sys.argv[1]), Path(scratch))
