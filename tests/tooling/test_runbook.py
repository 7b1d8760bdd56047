"""`python3 -m scripts runbook`: the plan, the steps on a recording ROCm machine,
resuming, gating, and how bad input ends.

The machine is tests/tooling/runbook_fake.py's RecordingExecutor: it answers
each command with the files the real tools write (runbook_samples/), so what
is tested is the runbook's own logic: which commands, in which order, what it
concludes from their results and what it writes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tomllib
from pathlib import Path

import pytest

from scripts.runbook import cli, plan
from scripts.runbook.config import MACHINES, SPECULATIVE_CONFIG, Config
from tests.tooling.conftest import PYTHON, REPO
from tests.tooling.runbook_fake import RecordingExecutor, Scenario, project_checkout


@pytest.fixture
def config(tmp_path) -> Config:
    return Config(MACHINES["mi300x"], tmp_path / "out", project_checkout(tmp_path / "project"))


def run(config: Config, scenario: Scenario | None = None, capsys=None):
    executor = RecordingExecutor(config.out_dir, scenario or Scenario())
    code = cli.run(config, executor, say=lambda _: None)
    err = capsys.readouterr().err if capsys else ""
    return code, executor, err


def commands_with(executor: RecordingExecutor, *words: str) -> list[list[str]]:
    return [c for c in executor.commands if all(w in c for w in words)]


# --- the plan ------------------------------------------------------------------


@pytest.mark.parametrize("machine, arch, gpu, regimes", [
    ("mi300x", "gfx942", "MI300X", ["AITER off", "AITER on, BMM flags off", "AITER on + FP8 BMM"]),
    ("mi355x", "gfx950", "MI355X", ["AITER off", "AITER on, BMM flags off", "AITER on + FP8 BMM",
                                    "AITER on + FP4 BMM"])])
def test_dry_run_prints_the_whole_plan_and_runs_nothing(tmp_path, machine, arch, gpu, regimes):
    out = tmp_path / "results"
    result = subprocess.run(
        [PYTHON, "-m", "scripts", "runbook", "--machine", machine, "--dry-run",
         "--out", str(out), "--baseline-image", "registry/vllm-rocm:v0.34.0",
         "--candidate-image", "registry/k3:ci", "--port", "8123"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"# K3 DSpark hardware runbook: plan for {machine} ({arch}, "
                           f"AMD Instinct {gpu}, tensor parallel 8)")
    headers = [ln for ln in text.splitlines() if ln.startswith("## ")]
    ref, a, b = ("target without speculative decoding (image A)",
                 "baseline: vLLM release, NVIDIA drafter module on ROCm (image A)",
                 "candidate: release + this stack's overlay, AMD drafter (image B)")
    fp8 = "AITER on + FP8 BMM"
    others = [r for r in regimes if r != fp8]
    # The draft's attention A/B runs on MI355X only (gfx942 has one candidate).
    backends = ("TRITON_MLA", "ROCM_AITER_MLA", "unset") if arch == "gfx950" else ()
    draft = [f"## 4c. draft attention (B){': correctness' if backends else ''}",
             *(f"## 4c. draft attention (B): attention_backend {b}, {fp8}" for b in backends)]
    assert headers == [
        "## 0. preflight", "## 1. device tests (B)",
        *(f"## 2. profile (B): {r}" for r in regimes),
        # The sweep's regime first, with A; B against its reference in every other.
        f"## 3. accuracy: {ref}, {fp8}", f"## 3. accuracy: {a}, {fp8}",
        f"## 3. accuracy: {b}, {fp8}",
        *(f"## 3. accuracy: {config}, {r}" for r in others for config in (ref, b)),
        f"## 4. sweep: {a}, {fp8}", f"## 4. sweep: {b}, {fp8}",
        "## 4b. kernel benchmark (B)", *draft, "## 5. report"]
    commands = [ln[2:] for ln in text.splitlines() if ln.startswith("$ ")]
    starts = [c for c in commands if c.startswith("docker run --detach")]
    n = len(regimes)
    assert len(starts) == n + (3 + 2 * (n - 1)) + 2 + len(backends)  # + the draft A/B
    assert all("--tensor-parallel-size 8" in c and "--port 8123" in c for c in starts)
    assert all("--env=HF_TOKEN " in c for c in starts)
    # Every server sets each AITER switch, as its regime says.
    switches = [tuple(w for w in c.split() if w.startswith("--env=VLLM_ROCM_USE_AITER"))
                for c in starts]
    assert all(len(s) == 3 for s in switches)
    assert sum(s[0] == "--env=VLLM_ROCM_USE_AITER=0" for s in switches) == 1 + 2
    assert sum("--env=VLLM_ROCM_USE_AITER_FP8BMM=1" in s for s in switches) == 1 + 3 + 2 + len(
        backends)
    assert sum("--env=VLLM_ROCM_USE_AITER_FP4BMM=1" in s for s in switches) == (
        1 + 2 if arch == "gfx950" else 0)
    spec = json.dumps(SPECULATIVE_CONFIG, separators=(", ", ": "))
    assert sum(f"--speculative-config '{spec}'" in c for c in starts) == len(starts) - n - len(
        backends)
    assert sum("registry/vllm-rocm:v0.34.0 serve" in c for c in starts) == n + 2  # refs, A, A
    assert sum("registry/k3:ci serve" in c for c in starts) == 2 * n + 1 + len(backends)
    bench = [c for c in commands if " vllm bench serve " in c]
    assert len(bench) == n + 2 * 3 * 4 + 2 * len(backends)
    assert "wait until http://127.0.0.1:8123/health answers 200" in text
    lm_eval = [c for c in commands if "--model local-completions" in c]
    assert len(lm_eval) == 2 * n + 1
    assert all(c.startswith("docker run --rm --network=host ") and " -c 'python3 -m pip "
               "install --quiet \"$0\" && exec lm_eval \"$@\"' 'lm_eval[api]==0.4.13' " in c
               for c in lm_eval)
    assert not out.exists()


def test_regimes_choose_the_profiles_and_accuracy_runs(tmp_path):
    """--regimes narrows the matrix; the sweep's regime stays in it; FP4 needs
    gfx950; the AITER switches cannot come through --env."""
    from scripts.common import Layout

    root = project_checkout(tmp_path / "project")

    def config_of(*argv):
        return cli.config_from(Layout(root), cli.parser().parse_args(
            ["--out", str(tmp_path / "out"), *argv]))

    config = config_of("--machine", "mi300x", "--regimes", "aiter-off")
    assert [r.name for r in config.matrix] == ["aiter-off", "aiter-fp8bmm"]
    assert [(r, label) for r, label in plan.accuracy_runs(config)] == [
        ("aiter-fp8bmm", "ref"), ("aiter-fp8bmm", "A"), ("aiter-fp8bmm", "B"),
        ("aiter-off", "ref"), ("aiter-off", "B")]
    assert [s.server.regime for s in plan.profile(config)] == ["aiter-off", "aiter-fp8bmm"]
    config = config_of("--machine", "mi355x", "--regimes", "aiter-fp4bmm")
    (_, fp4) = plan.profile(config)
    assert "--env=VLLM_ROCM_USE_AITER_FP4BMM=1" in fp4.server.start
    assert "--env=VLLM_ROCM_USE_AITER_FP8BMM=0" in fp4.server.start


def test_sweep_cells_cover_output_length_times_concurrency(config):
    sessions = plan.sweep(config)
    cells = {(c.meta["config"], c.meta["output_len"], c.meta["concurrency"])
             for s in sessions for c in s.commands}
    assert cells == {(label, o, c) for label in ("A", "B") for o in (256, 1024, 4096)
                     for c in (1, 4, 16, 64)}


def test_options_choose_steps_grid_and_environment(tmp_path):
    from scripts.common import Layout

    args = cli.parser().parse_args([
        "--machine", "mi355x", "--steps", "report,sweep", "--output-lens", "128,2048",
        "--concurrencies", "2", "--env", "HIP_FORCE_DEV_KERNARG=1", "--out", str(tmp_path),
        "--serve-args", "--kv-cache-dtype fp8 --max-model-len 32768"])
    config = cli.config_from(Layout(project_checkout(tmp_path / "project")), args)
    assert config.steps == ("sweep", "report")  # always in the runbook's order
    assert config.output_lens == (128, 2048) and config.concurrencies == (2,)
    assert config.serve_env == {"HIP_FORCE_DEV_KERNARG": "1"}
    assert config.machine.gcn_arch == "gfx950"
    (session,) = plan.sweep(config, ("B",))
    start = session.server.start
    assert "--env=HIP_FORCE_DEV_KERNARG=1" in start
    assert start[start.index("--seed") + 2:][:4] == ["--kv-cache-dtype", "fp8",
                                                      "--max-model-len", "32768"]


def test_a_step_is_one_entry_of_the_registry(tmp_path, config, monkeypatch):
    """A new step, added as one entry of steps.STEPS, is an option of --steps, is
    planned in its place and runs there."""
    from scripts.common import Layout
    from scripts.runbook import steps

    ran = []
    warmup = steps.Step("warmup", lambda rb: ran.append([s.name for s in steps.chosen(
        rb.config)]), lambda c: [plan.Session("0b. warm-up", [], note="nothing yet")])
    monkeypatch.setattr(steps, "STEPS", (steps.STEPS[0], warmup, *steps.STEPS[1:]))
    monkeypatch.setattr(steps, "NAMES", tuple(s.name for s in steps.STEPS))
    args = cli.parser().parse_args(["--machine", "mi300x", "--steps", "report,warmup",
                                    "--out", str(tmp_path / "out")])
    chosen = cli.config_from(Layout(config.project_root), args)
    assert chosen.steps == ("warmup", "report")
    assert "\n## 0b. warm-up\n# nothing yet\n\n## 5. report\n" in steps.describe(chosen)
    code, _, _ = run(chosen)
    assert code == 0 and ran == [["warmup", "report"]]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "tests,warmup"], "unknown step(s) warmup"),
    (["--concurrencies", "1,x"], "--concurrencies '1,x': give positive integers"),
    (["--env", "NOVALUE"], "--env 'NOVALUE': expected KEY=VALUE"),
    (["--env", "VLLM_ROCM_USE_AITER=0"], "--env 'VLLM_ROCM_USE_AITER=0': the AITER switches "
                                         "are set per regime; choose regimes with --regimes"),
    (["--regimes", "aiter,fast"], "--regimes: unknown regime(s) fast; known: aiter-off, aiter, "
                                  "aiter-fp8bmm, aiter-fp4bmm"),
    (["--regimes", "aiter-fp4bmm"], "--regimes: aiter-fp4bmm needs gfx950; this machine is "
                                    "gfx942"),
    (["--serve-args", "--served-model-name 'k3"], "--serve-args \"--served-model-name 'k3\": "
                                                  "No closing quotation"),
    (["--hf-cache", "~nosuchuser/x"], "--hf-cache '~nosuchuser/x': no such user's home"),
    (["--out", "README.md"], "--out 'README.md' exists and is not a folder"),
    (["--port", "-5"], "--port -5: give a number above 0 and at most 65535"),
    (["--server-ready-timeout", "nan"], "--server-ready-timeout nan: give a number above 0"),
])
def test_bad_options_end_with_one_line(tmp_path, argv, message):
    result = subprocess.run([PYTHON, "-m", "scripts", "runbook", "--machine", "mi300x",
                             "--dry-run", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip() == f"runbook: {message}" or message in result.stderr
    assert "Traceback" not in result.stderr


# --- a whole run ------------------------------------------------------------------


def test_a_full_run_writes_the_report(config, capsys):
    code, executor, err = run(config, capsys=capsys)
    assert code == 0, err
    report = config.out_dir / "report"
    names = {p.name for p in report.iterdir()}
    assert {"summary.md", "sweep.csv", "ratios.csv", "accuracy.csv", "commands.log",
            "plan.txt", "versions.json"} <= names
    sweep = (report / "sweep.csv").read_text().splitlines()
    assert len(sweep) == 1 + 24
    summary = (report / "summary.md").read_text()
    assert "- accuracy gate A (aiter-fp8bmm): passed" in summary
    assert "- accuracy gate B (aiter-fp8bmm): passed" in summary
    assert "- accuracy gate B in the other regimes: aiter-off passed, aiter passed" in summary
    assert "- profile (B): every kernel expectation met in 3 regime(s)" in summary
    # Which kernels each regime launched for the absorb, RoPE and the cache write.
    rope_and_write = ("`rotary_embedding_kernel` × 20<br>`concat_and_cache_mla_rope_fused_kernel`"
                      " × 20 | `concat_and_cache_mla_grouped_kernel` × 20<br>"
                      "`concat_and_cache_mla_rope_fused_kernel` × 20 |")
    assert f"| aiter-off | `aten::bmm` × 20 | {rope_and_write}" in summary
    assert "| aiter-fp8bmm | `_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_" \
           f"tensor_quant_kernel` × 20 | {rope_and_write}" in summary
    assert "| 4096 | 64 |" in summary and "B/A, geometric mean over 12 cells" in summary
    # Every command is on record, in the order it ran, with its exit status.
    log = (report / "commands.log").read_text().splitlines()
    assert len(log) == len(executor.commands)
    assert log[0].endswith("exit 0  1s  docker info")
    lm_eval = [i for i, c in enumerate(executor.commands) if "local-completions" in c]
    sweep = [i for i, c in enumerate(executor.commands) if "bench" in c
             and "--profile" not in c]
    assert len(lm_eval) == 7 and len(sweep) == 24 and max(lm_eval) < min(sweep)


def test_plots_are_png_files_or_a_note_without_matplotlib(config, monkeypatch):
    run(config)
    report = config.out_dir / "report"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Plots: none (matplotlib is not installed" in (report / "summary.md").read_text()
    else:
        for name in ("output_throughput.png", "mean_tpot_ms.png",
                     "spec_decode_acceptance_length.png"):
            assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The ROCm image may lack matplotlib: the report still comes, without plots.
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    for png in report.glob("*.png"):
        png.unlink()
    from scripts.runbook.report import write_report

    write_report(config, config.out_dir)
    assert not list(report.glob("*.png"))
    assert "Plots: none (matplotlib is not installed" in (report / "summary.md").read_text()


def test_a_second_run_resumes_and_measures_nothing_again(config):
    run(config)
    code, executor, _ = run(config)
    assert code == 0
    for word in ("local-completions", "bench", "pytest", "info"):
        assert not any(word in c for c in executor.commands), word
    assert not commands_with(executor, "--detach")


def test_other_images_are_checked_again(config):
    run(config)
    config = dataclasses.replace(config, candidate_image="k3-dspark:rebuilt")
    _, executor, _ = run(config, Scenario(missing_image="B"))
    assert commands_with(executor, "image", "inspect", "--format={{.Id}}", "k3-dspark:rebuilt")


def test_a_deleted_cell_is_measured_again_alone(config):
    run(config)
    (config.out_dir / "bench/B/c16-o1024.json").unlink()
    code, executor, _ = run(config)
    assert code == 0
    bench = [c for c in executor.commands if "bench" in c]
    assert len(bench) == 1 and "--result-filename=c16-o1024.json" in bench[0]
    assert len(commands_with(executor, "--detach")) == 1  # only B's server


# --- gates and expectations ----------------------------------------------------------


def test_a_broken_drafter_fails_its_gate_and_gets_no_performance(config, capsys):
    code, executor, err = run(config, Scenario(broken_drafter="B"), capsys)
    assert code == 1
    assert err.strip() == "runbook: an accuracy gate failed; see report/summary.md"
    assert list((config.out_dir / "bench/A").glob("*.json"))
    assert not (config.out_dir / "bench/B").exists()
    assert not [c for c in executor.commands if "bench" in c and "runbook_config=B" in c
                and "--profile" not in c]
    gate = json.loads((config.out_dir / "accuracy/gate.json").read_text())
    gates = {r: {k: g["passed"] for k, g in v["gates"].items()}
             for r, v in gate["regimes"].items()}
    assert gates == {"aiter-fp8bmm": {"A": True, "B": False}, "aiter-off": {"B": False},
                     "aiter": {"B": False}}
    assert gate["regimes"]["aiter-fp8bmm"]["results"]["B"]["repetitive"] == 0.5
    summary = (config.out_dir / "report/summary.md").read_text()
    assert "- accuracy gate B (aiter-fp8bmm): FAILED: no performance is reported for it" in summary
    assert "Not measured for B: failed the accuracy gate." in summary
    assert "B/A, geometric mean" not in summary


def test_a_skipped_rocm_only_test_fails_the_tests_step(config, capsys):
    code, executor, err = run(config, Scenario(rocm_test_skipped=True), capsys)
    assert code == 1
    assert err.splitlines()[0] == (
        "runbook: tests: ROCm-only test skipped on the ROCm machine: tests.models."
        "test_dspark_mla_rocm::test_k3_dspark_rocm_decoder_builds_mla_wrapper (ROCm only); "
        "see tests/summary.json")
    summary = json.loads((config.out_dir / "tests/summary.json").read_text())
    assert summary["ok"] is False and len(summary["rocm_only_skipped"]) == 1
    assert not commands_with(executor, "--detach")  # nothing after the failed step


def test_the_stacks_test_files_come_from_the_overlay_manifest(config):
    (session,) = plan.tests(config)
    argv = session.commands[0].argv
    assert "tests/models/test_dspark_mla_rocm.py" in argv
    assert argv[argv.index("--entrypoint=python3") + 2:][:5] == [
        "-m", "pytest", "-v", "-rs", "-p"]
    assert not [a for a in argv if a.startswith("vllm_overlay")]


def test_b_without_pytest_asks_for_a_test_image(config, capsys):
    code, _, err = run(config, Scenario(no_pytest_in_b=True), capsys)
    assert code == 1
    assert _one_line_failure(err, config.out_dir) == (
        "runbook: preflight: image vllm-k3-dspark-rocm:v0.34.0-overlay has no pytest: give "
        "--test-image, the overlay on vLLM's ROCm test image (make rocm-image "
        "BASE_IMAGE=<that image>)")


def test_a_test_image_runs_the_device_tests_and_is_checked(config):
    config = dataclasses.replace(config, test_image="k3-dspark:rocm-test")
    code, executor, _ = run(config, Scenario(no_pytest_in_b=True))
    assert code == 0
    (pytest_run,) = commands_with(executor, "pytest")
    assert "k3-dspark:rocm-test" in pytest_run
    assert commands_with(executor, "k3-dspark:rocm-test", "scripts.runbook.probe")
    versions = json.loads((config.out_dir / "preflight/versions.json").read_text())
    assert sorted(versions) == ["A", "B", "tests"]


def test_kernel_step_reports_the_best_tiles(config):
    code, executor, _ = run(config, Scenario())
    assert code == 0
    (sweep,) = commands_with(executor, "/runbook/kernels/gpubench/cases/mla_decode.py", "--sweep")
    assert "--volume=" + str(config.out_dir) + ":/runbook" in sweep
    assert commands_with(executor, "gpubench", "--package", "/runbook/kernels/gpubench")
    summary = json.loads((config.out_dir / "kernels/summary.json").read_text())
    assert [(t["arch"], t["kv"], t["shipped_ms"]) for t in summary["best_tiles"]] == [
        ("gfx942", "bf16", 0.0412), ("gfx942", "fp8", 0.0398)]
    report = (config.out_dir / "report/summary.md").read_text()
    assert "| gfx942 | fp8 | `_MLABlockTile(32, 16, 8, 1, waves_per_eu=2)` | 0.0371 | " \
           "0.0398 | 1.07x |" in report


def test_missing_kernel_benchmark_is_skipped(config):
    code, _, _ = run(config, Scenario(kernel_bench_absent=True))
    assert code == 0
    summary = json.loads((config.out_dir / "kernels/summary.json").read_text())
    assert summary["available"] is False
    assert "Skipped: the project has no such benchmark (optional)." in (
        config.out_dir / "report/summary.md").read_text()


# --- the draft's attention backend (MI355X) ------------------------------------------


@pytest.fixture
def mi355x(tmp_path) -> Config:
    return Config(MACHINES["mi355x"], tmp_path / "out", project_checkout(tmp_path / "project"),
                  steps=("preflight", "draft-attention", "report"))


def _draft_summary(config: Config) -> tuple[dict, str]:
    summary = json.loads((config.out_dir / "draft-attention/summary.json").read_text())
    return summary, (config.out_dir / "report/summary.md").read_text()


def test_draft_attention_serves_b_once_per_draft_backend(mi355x):
    """B with the speculative config's attention_backend TRITON_MLA, ROCM_AITER_MLA
    and none (vLLM's choice, read from the server log), AITER on; the device test
    of AITER's non-causal decode runs first, on the GPUs, from the project."""
    code, executor, _ = run(mi355x, Scenario(gcn_arch="gfx950"))
    assert code == 0
    (test,) = commands_with(executor, "/k3-stack/scripts/runbook/device_tests/"
                                      "test_draft_attention.py")
    assert "--env=VLLM_ROCM_USE_AITER=1" in test and "--device=/dev/kfd" in test
    starts = commands_with(executor, "--detach")
    specs = [json.loads(c[c.index("--speculative-config") + 1]) for c in starts]
    assert [s.get("attention_backend") for s in specs] == ["TRITON_MLA", "ROCM_AITER_MLA", None]
    assert all("--env=VLLM_ROCM_USE_AITER=1" in c for c in starts)
    summary, _ = _draft_summary(mi355x)
    assert {k: v["log_backends"] for k, v in summary["runs"].items()} == {
        "TRITON_MLA": ["TRITON_MLA"], "ROCM_AITER_MLA": ["ROCM_AITER_MLA"],
        "unset": ["ROCM_AITER_MLA"]}
    assert [(c["concurrency"], c["output_len"]) for c in summary["runs"]["unset"]["cells"]] == [
        (1, 1024), (16, 1024)]


@pytest.mark.parametrize("speedup, backend, reason", [
    (1.10, "ROCM_AITER_MLA", "correct, and 10.0% faster per decode step"),
    (1.02, "TRITON_MLA", "ROCM_AITER_MLA is +2.0% faster per decode step, not more than 3%"),
])
def test_draft_attention_verdict_follows_the_rule(mi355x, speedup, backend, reason):
    code, _, _ = run(mi355x, Scenario(gcn_arch="gfx950", aiter_speedup=speedup))
    assert code == 0
    summary, report = _draft_summary(mi355x)
    assert summary["verdict"]["backend"] == backend
    assert summary["verdict"]["reason"].startswith(reason)
    assert ("- K3 draft attention backend, gfx942 (MI300X): TRITON_MLA (vLLM 0.34.0 has no "
            "AITER non-causal decode on gfx942: the only candidate)") in report
    assert f"- K3 draft attention backend, gfx950 (MI355X), AITER on: **{backend}**: " \
           f"{reason}" in report
    assert "| ROCM_AITER_MLA | ROCM_AITER_MLA | 16 | 1024 |" in report


def test_a_causal_aiter_decode_fails_the_step_and_keeps_triton(mi355x, capsys):
    """AITER's decode ignoring causal=False: its device test fails; faster or
    not, the draft stays on TRITON_MLA, and the run ends with one line."""
    code, _, err = run(mi355x, Scenario(gcn_arch="gfx950", aiter_decode_causal=True,
                                        aiter_speedup=1.2), capsys)
    assert code == 1
    assert _one_line_failure(err, mi355x.out_dir).startswith(
        "runbook: draft-attention: draft attention: ROCM_AITER_MLA's non-causal decode was "
        "not shown to match TRITON_MLA's (24 failed, 0 skipped, 0 passed); see "
        "draft-attention/summary.json")
    summary, report = _draft_summary(mi355x)
    assert summary["verdict"]["backend"] == "TRITON_MLA"
    assert "Device test (`draft-attention/junit.xml`" in report and "**FAILED**" in report


def test_draft_attention_on_mi300x_runs_nothing_and_says_triton(config):
    config = dataclasses.replace(config, steps=("preflight", "draft-attention", "report"))
    code, executor, _ = run(config)
    assert code == 0
    assert not commands_with(executor, "--detach")
    summary, report = _draft_summary(config)
    assert summary == {"applies": False, "arch": "gfx942"}
    assert "- gfx950 (MI355X), AITER on: not measured on this machine: run the runbook with " \
           "--machine mi355x" in report


def test_a_resumed_draft_attention_step_measures_nothing_again(mi355x):
    run(mi355x, Scenario(gcn_arch="gfx950"))
    code, executor, _ = run(mi355x, Scenario(gcn_arch="gfx950"))
    assert code == 0
    assert not commands_with(executor, "--detach") and not commands_with(executor, "-m",
                                                                          "pytest")


# --- bad input: one line, results kept --------------------------------------------


def _one_line_failure(err: str, out_dir: Path) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in err, err
    assert lines[1] == (f"runbook: results so far are in {out_dir}; run the same command "
                        "again to resume")
    return lines[0]


def test_a_missing_image_ends_with_one_line(config, capsys):
    code, executor, err = run(config, Scenario(missing_image="B"), capsys)
    assert code == 1
    assert _one_line_failure(err, config.out_dir) == (
        "runbook: preflight: image B exists: exited 1 (Error response from daemon: No such "
        "image: vllm-k3-dspark-rocm:v0.34.0-overlay); log: logs/image-b-exists.log")
    assert (config.out_dir / "report/summary.md").exists()


def test_a_server_that_never_gets_ready_is_stopped_and_named(config, capsys):
    code, executor, err = run(config, Scenario(never_ready="B"), capsys)
    assert code == 1
    assert _one_line_failure(err, config.out_dir) == (
        "runbook: profile: server B (vllm-k3-dspark-rocm:v0.34.0-overlay) was not ready "
        "after 3600 s (http://127.0.0.1:8000/health); its log: "
        "logs/k3-runbook-b-aiter-off-profile.log")
    assert executor.commands[-2:] == [
        ["docker", "logs", "k3-runbook-b-aiter-off-profile"],
        ["docker", "rm", "--force", "k3-runbook-b-aiter-off-profile"]]
    # What the earlier steps gathered stays.
    assert json.loads((config.out_dir / "tests/summary.json").read_text())["ok"] is True


def test_a_port_in_use_is_named_before_any_server_starts(config, capsys):
    code, executor, err = run(config, Scenario(port_taken=True), capsys)
    assert code == 1
    assert _one_line_failure(err, config.out_dir) == (
        "runbook: profile: something already answers on http://127.0.0.1:8000/health: stop "
        "it, or give the runbook another --port")
    assert not commands_with(executor, "--detach")


def test_a_server_that_exits_while_loading_is_named(config, capsys):
    code, _, err = run(config, Scenario(server_exits="ref"), capsys)
    assert code == 1
    assert _one_line_failure(err, config.out_dir).startswith(
        "runbook: accuracy: server ref (vllm/vllm-openai-rocm:v0.34.0) exited before it was "
        "ready; its log: logs/k3-runbook-ref-aiter-fp8bmm.log")


def test_a_malformed_result_file_is_named_and_the_rest_kept(config, capsys):
    code, _, err = run(config, Scenario(malformed_bench=("B", 16, 1024)), capsys)
    assert code == 1
    bad = config.out_dir / "bench/B/c16-o1024.json"
    line = _one_line_failure(err, config.out_dir)
    assert line.startswith(f"runbook: sweep: {bad}: not valid JSON")
    assert len(list((config.out_dir / "bench").glob("*/*.json"))) == 24
    summary = (config.out_dir / "report/summary.md").read_text()
    assert f"- unreadable: {bad}: not valid JSON" in summary
    # Delete the bad file and run again: only that cell is measured.
    bad.unlink()
    code, executor, _ = run(config)
    assert code == 0
    assert len([c for c in executor.commands if "bench" in c]) == 1


def test_the_committed_example_is_what_the_runbook_writes(tmp_path):
    pytest.importorskip("matplotlib")  # the example has plots; .venv has matplotlib
    from tests.tooling.runbook_fake import write_example

    example = REPO / "docs" / "runbook-example"
    write_example(tmp_path / "example", tmp_path / "scratch")
    for name in ("summary.md", "sweep.csv", "ratios.csv", "accuracy.csv", "plan.txt",
                 "commands.log", "versions.json"):
        assert (tmp_path / "example" / name).read_text() == (example / name).read_text(), (
            f"docs/runbook-example/{name} is stale: regenerate it with "
            "`python3 -m tests.tooling.runbook_fake docs/runbook-example`")
    assert {p.name for p in (tmp_path / "example").glob("*.png")} == {
        p.name for p in example.glob("*.png")}


def test_images_a_and_b_default_to_the_release_pin_toml_names(tmp_path):
    """After a rebase the runbook compares the new release's image with the
    new overlay: nothing else to edit."""
    root = project_checkout(tmp_path / "project")
    pin = (root / "pin.toml").read_text()
    version = tomllib.loads(pin)["vllm"]["version"]
    (root / "pin.toml").write_text(pin.replace(version, "0.99.0"))
    config = Config(MACHINES["mi300x"], tmp_path / "out", root)
    assert config.baseline_image == "vllm/vllm-openai-rocm:v0.99.0"
    assert config.candidate_image == "vllm-k3-dspark-rocm:v0.99.0-overlay"
    chosen = Config(MACHINES["mi300x"], tmp_path / "out", root, baseline_image="a:1")
    assert chosen.baseline_image == "a:1"
