"""`make bench`: how long the everyday commands take, and how big the outputs are.

The figures are printed next to their goals (a second `make apply` under 10 s,
`make check` under 60 s, `make export` under 30 s; `make rebase`'s code smaller than
before its redesign), never asserted: timings
depend on the machine and its load, so a timed test would flake. Every command
runs as a user runs it (`python3 -m scripts <command>`) in a scratch copy of
the project that shares the download cache, so build/vllm and the real project are never touched.

`make test` cannot run in such a copy (it needs the project's 9 GB .venv), so it
times itself: each run records its wall time and which rows it reused
(scripts/testing/testcache.py), and this prints the latest runs of this project,
against the goal of a warm run after a one-patch change under 5 minutes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, say
from scripts.perf.code_size import rebase_code_row
from scripts.stack.fetch import ensure_artifact
from scripts.stack.pin import load_pin
from scripts.stack.series import read_series
from scripts.stack.venv import venv_python
from scripts.testing.testcache import read_runs, shown_date

REPEATS = 3
RECENT_TEST_RUNS = 5
WARM_TEST_GOAL = 300  # s: `make test` after a one-patch change, reusing the other rows
# The scratch copy's export is signed off by a placeholder nobody submits.
EXPORT_ENV = {"K3_SIGNOFF": "K3 Bench <bench@k3-stack.dev>"}
# The project files a scratch copy needs to apply, check and export the stack.
_PROJECT_FILES = ("pin.toml", "patches", "vllm_overlay")


@dataclass
class Timing:
    what: str
    seconds: list[float]
    goal: float | None = None

    def row(self) -> str:
        median = statistics.median(self.seconds)
        goal = f"< {self.goal:.0f} s" if self.goal else "-"
        verdict = "" if self.goal is None else (
            "within goal" if median < self.goal else "OVER GOAL")
        return (f"  {self.what:<38}{len(self.seconds):>5}{median:>9.2f}s"
                f"{min(self.seconds):>9.2f}s  {goal:<8}{verdict}")


def bench(layout: Layout) -> None:
    pin = load_pin(layout.pin_file)
    ensure_artifact(layout, pin.project, pin.sdist)  # time the commands, not a download
    with tempfile.TemporaryDirectory(prefix="k3-bench-") as tmp:
        scratch = Path(tmp) / "project"
        _copy_project(layout, scratch)
        env = {**os.environ, "K3_PROJECT_ROOT": str(scratch),
               "K3_CACHE_DIR": str(layout.cache_dir)}
        timings = [
            Timing("make check, cold (no build/)", [_time("check", env)], goal=60),
            Timing("make check, again", _repeat("check", env), goal=60),
            Timing("make apply, cold (unpack + git am)", [_time("apply", env)]),
            Timing("make apply, again", _repeat("apply", env), goal=10),
            Timing("make patches, unchanged stack", _repeat("patches", env)),
            Timing("make export (PR folders)", _repeat("export", {**env, **EXPORT_ENV}),
                   goal=30),
        ]
        sizes = _sizes(Layout(scratch))
    say(f"\n  {'command':<38}{'runs':>5}{'median':>10}{'min':>10}  {'goal':<8}")
    for timing in timings:
        say(timing.row())
    say("")
    for name, value in sizes:
        say(f"  {name:<38}{value}")
    say(rebase_code_row())
    say("")
    for line in recorded_test_runs(layout):
        say(line)
    _venv_report(layout, "kernel budget", "tests.verification.kernel_budget")
    # Exits 1 when a kernel breaks an AMD GPU's limits; its table says which.
    _venv_report(layout, "AMD compile resources", "scripts.perf.amd_resources")


def recorded_test_runs(layout: Layout) -> list[str]:
    """The latest `make test` runs of this project, as recorded by make test itself."""
    runs = read_runs(layout)[-RECENT_TEST_RUNS:]
    if not runs:
        return ["  make test: no run recorded yet in build/test-results/runs.jsonl"]
    lines = [f"  make test, latest {len(runs)} run(s) of this project "
             "(build/test-results/runs.jsonl; wall time without `make build`):",
             f"    {'started':<22}{'wall':>8}{'run':>8}{'reused':>8}  "
             f"{'failed':>6}  build/vllm"]
    for run in runs:
        # Commands (a lint run, a test file) since make test keys them one by one.
        commands = run.get("parts_run") is not None
        ran = run["parts_run"] if commands else run["rows_run"]
        reused = run["parts_reused"] if commands else run["rows_reused"]
        verdict = "  (FRESH=1)" if run["fresh"] else ""
        verdict += f"  (ONLY={','.join(run['only'])})" if run.get("only") else ""
        if 0 < reused and ran and not run.get("only"):
            verdict += ("  within goal" if run["wall_seconds"] < WARM_TEST_GOAL
                        else "  OVER GOAL") + f" (< {WARM_TEST_GOAL} s with commands reused)"
        lines.append(f"    {shown_date(run['started']):<22}{run['wall_seconds']:>7.0f}s"
                     f"{ran:>8}{reused:>8}  {run['totals']['failed']:>6}  "
                     f"{run['vllm']['describe']}" + verdict)
    return lines


def _venv_report(layout: Layout, what: str, module: str) -> None:
    """Print what a module of the project prints under .venv: the kernel budget of
    one draft step (tests/verification/kernel_budget.py) and the AMD compile
    resources of the stack's kernels (scripts/perf/amd_resources), both against the
    patched vLLM. A missing venv or a failure is reported, never fatal: the
    figures are informational."""
    python = venv_python(layout)
    if not python.exists():
        say(f"\n  {what}: skipped, .venv is missing (`make build` creates it)")
        return
    result = subprocess.run([str(python), "-m", module],
                            cwd=layout.root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(layout.root)})
    if result.stdout.strip():
        say("\n" + result.stdout.rstrip())
    if result.returncode != 0:
        say(f"\n  {what}: failed (exit {result.returncode})\n"
            f"{result.stderr.strip()[-3000:]}")


def _copy_project(layout: Layout, scratch: Path) -> None:
    scratch.mkdir()
    for name in _PROJECT_FILES:
        source = layout.root / name
        if source.is_dir():
            shutil.copytree(source, scratch / name)
        elif source.exists():
            shutil.copy2(source, scratch / name)


def _repeat(command: str, env: dict[str, str]) -> list[float]:
    return [_time(command, env) for _ in range(REPEATS)]


def _time(command: str, env: dict[str, str]) -> float:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "scripts", command],
                            cwd=Path(__file__).resolve().parents[2], env=env,
                            capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        raise StackError(f"`make {command}` failed in the benchmark's scratch project:\n"
                         f"{(result.stderr or result.stdout).strip()}")
    return seconds


def _sizes(layout: Layout) -> list[tuple[str, str]]:
    patches = read_series(layout)
    patch_bytes = sum(p.path.stat().st_size for p in patches)
    overlay_files = [p for p in layout.overlay_dir.rglob("*") if p.is_file()]
    overlay_bytes = sum(p.stat().st_size for p in overlay_files)
    return [
        ("patches", f"{len(patches)} files, {patch_bytes / 1024:.0f} KiB"),
        ("vllm_overlay/ (incl. MANIFEST.json)",
         f"{len(overlay_files)} files, {overlay_bytes / 1024:.0f} KiB"),
    ]
