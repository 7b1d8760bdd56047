"""`make test`: every suite, against the patched vLLM installed in .venv.

Suites, in order:
- tooling: tests of this repository's scripts (tests/tooling/);
- lint: vLLM's pre-commit checks on the files the stack changes;
- stack: the vLLM test files the stack adds or changes, run in build/vllm;
- prefix k/n: each shorter prefix of the stack, linted and with the vLLM test
  files it adds or changes, run in a worktree (scripts/prefixes.py);
- regression: vLLM's existing tests of the code the stack touches
  (tests/vllm_regression.txt), run in build/vllm;
- verification: this project's end-to-end checks of both drafters on CPU
  (tests/verification/);
- stack (ROCm), regression (ROCm): the stack and regression rows again, in
  separate pytest processes under vLLM's RocmPlatform emulated on CPU
  (tests/rocm_emulation/), minus tests/vllm_regression_rocm.txt's deselects.
A summary table ends the run; any failure makes the exit status non-zero.
"""

from __future__ import annotations

import os
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, say
from scripts.gitrepo import git, read_state
from scripts.lint import run_lints
from scripts.lock import LINT
from scripts.prefixes import check_out, prefix_commits, prefix_worktree, python_path
from scripts.venv import venv_python

REGRESSION_LIST = "tests/vllm_regression.txt"
ROCM_LIST = "tests/vllm_regression_rocm.txt"


@dataclass
class Outcome:
    suite: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""


def run_all(layout: Layout) -> int:
    for python in (venv_python(layout), LINT.python(layout)):
        if not python.exists():
            raise StackError(f"{python.parent.parent.name} is missing; run `make build` "
                             "(make test does it for you)")
    base = read_state(layout.tree)["base_tag"]
    results_dir = layout.build_dir / "test-results"
    results_dir.mkdir(parents=True, exist_ok=True)
    stack_tests = _stack_test_files(layout.tree, base)
    outcomes = [
        _pytest(layout, "tooling", ["tests/tooling"], layout.root, results_dir),
        _lint(layout, base, layout.tree),
    ]
    if stack_tests:
        outcomes.append(_pytest(layout, "stack", stack_tests, layout.tree, results_dir))
    else:
        outcomes.append(Outcome("stack", note="the stack adds or changes no vLLM tests"))
    outcomes += _prefix_outcomes(layout, base, results_dir)
    outcomes.append(_pytest(layout, "regression", _regression_args(layout, stack_tests),
                            layout.tree, results_dir))
    outcomes.append(_pytest(layout, "verification", ["tests/verification"], layout.root,
                            results_dir))
    if stack_tests:
        args, path = _rocm_emulated(layout, stack_tests)
        outcomes.append(_pytest(layout, "stack (ROCm)", args, layout.tree, results_dir,
                                python_path=path))
    args, path = _rocm_emulated(layout, _regression_args(layout, stack_tests))
    outcomes.append(_pytest(layout, "regression (ROCm)", args, layout.tree, results_dir,
                            python_path=path))
    return _summarize(outcomes)


def _stack_test_files(tree: Path, base: str) -> list[str]:
    out = git(tree, "diff", "--no-renames", "--name-only", "--diff-filter=AM",
              base, "HEAD", "--", "tests/").stdout.split()
    return [f for f in out if Path(f).name.startswith("test_") and f.endswith(".py")]


def _regression_args(layout: Layout, already_run: list[str]) -> list[str]:
    """Entries of tests/vllm_regression.txt, minus files the stack suite runs anyway."""
    args: list[str] = []
    for raw in (layout.root / REGRESSION_LIST).read_text().splitlines():
        line = raw.split("  #", 1)[0].split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--deselect "):
            args += ["--deselect", line.split(None, 1)[1]]
        elif line.split("::")[0] not in already_run:
            args.append(line)
    return args


def _rocm_emulated(layout: Layout, args: list[str]) -> tuple[list[str], str]:
    """pytest args and PYTHONPATH that run `args` (vLLM test files and node ids)
    under vLLM's RocmPlatform emulated on CPU, in a pytest process of their own.

    The plugin (tests/rocm_emulation/plugin.py) is imported from <root>/tests as
    top-level packages: in the vLLM tree, `tests` is vLLM's package. ROCM_LIST
    deselects what cannot run there and renames node ids whose parameters
    depend on the platform; every line must give its reason after `#`.
    """
    extra: list[str] = []
    renamed: dict[str, str] = {}
    for number, raw in enumerate((layout.root / ROCM_LIST).read_text().splitlines(), 1):
        entry, _, reason = raw.partition("#")
        if not entry.strip():
            continue
        option, *ids = entry.split()
        if not reason.strip() or (option, len(ids)) not in {("--deselect", 1),
                                                            ("--replace", 2)}:
            raise StackError(f"{ROCM_LIST}:{number}: expected `--deselect <id>  # reason` "
                             f"or `--replace <id> <ROCm id>  # reason`, got {raw.strip()!r}")
        if option == "--deselect":
            extra += ["--deselect", ids[0]]
        else:
            renamed[ids[0]] = ids[1]
    plugin = ["-p", "rocm_emulation.plugin"]
    return ([*plugin, *(renamed.get(a, a) for a in args), *extra],
            os.pathsep.join([str(layout.root / "tests"), str(layout.root)]))


def _prefix_outcomes(layout: Layout, base: str, results_dir: Path) -> list[Outcome]:
    """Lint and stack tests of each proper prefix of the stack, one row each."""
    commits = prefix_commits(layout.tree, base)
    if not commits:
        return []
    total = len(commits) + 1
    outcomes = []
    with prefix_worktree(layout) as worktree:
        for k, commit in enumerate(commits, start=1):
            suite = f"prefix {k}/{total}"
            subject = git(layout.tree, "log", "-1", "--format=%s", commit).stdout.strip()
            say(f"\n=== {suite}: the stack up to {subject!r}")
            check_out(layout, worktree, commit)
            outcome = _lint(layout, base, worktree, suite=suite)
            if tests := _stack_test_files(worktree, base):
                tested = _pytest(layout, suite, tests, worktree, results_dir,
                                 python_path=python_path(layout, worktree))
                outcome.passed += tested.passed
                outcome.failed += tested.failed
                outcome.skipped += tested.skipped
                outcome.seconds += tested.seconds
                outcome.note = tested.note
            outcomes.append(outcome)
    return outcomes


def _pytest(layout: Layout, suite: str, args: list[str], cwd: Path,
            results_dir: Path, python_path: str | None = None) -> Outcome:
    xml = results_dir / f"{suite.replace(' ', '-').replace('/', '-of-')}.xml"
    xml.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": python_path or str(layout.root),
           "K3_PROJECT_ROOT": str(layout.root)}
    cmd = [str(venv_python(layout)), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *args]
    say(f"\n=== {suite}: pytest {' '.join(args)}  (in {cwd})")
    start = time.monotonic()
    code = subprocess.run(cmd, cwd=cwd, env=env).returncode
    outcome = _read_junit(suite, xml)
    outcome.seconds = time.monotonic() - start
    if code not in (0, 1) or (code == 1 and not outcome.failed):
        # Collection errors, usage errors, or no tests at all (exit 5).
        outcome.failed += 1
        outcome.note = f"pytest exited {code}"
    return outcome


def _read_junit(suite: str, xml: Path) -> Outcome:
    outcome = Outcome(suite)
    if not xml.exists():
        return outcome
    for ts in ET.parse(xml).getroot().iter("testsuite"):
        tests, skipped = int(ts.get("tests", 0)), int(ts.get("skipped", 0))
        failed = int(ts.get("failures", 0)) + int(ts.get("errors", 0))
        outcome.passed += tests - skipped - failed
        outcome.failed += failed
        outcome.skipped += skipped
    return outcome


def _lint(layout: Layout, base: str, tree: Path, suite: str = "lint") -> Outcome:
    say(f"\n=== {suite}: vLLM's pre-commit checks on the files changed since {base}")
    start = time.monotonic()
    outcome = Outcome(suite)
    for result in run_lints(layout, base, tree):
        say(f"  {'ok  ' if result.ok else 'FAIL'} {result.name}")
        if not result.ok:
            say("    " + result.output.replace("\n", "\n    "))
        outcome.passed += result.ok
        outcome.failed += not result.ok
    if not outcome.passed + outcome.failed:
        outcome.note = "the stack changes no files"
    outcome.seconds = time.monotonic() - start
    return outcome


def _summarize(outcomes: list[Outcome]) -> int:
    say("\n=== summary")
    say(f"  {'suite':<18}{'passed':>8}{'failed':>8}{'skipped':>9}{'time':>9}")
    for o in outcomes:
        say(f"  {o.suite:<18}{o.passed:>8}{o.failed:>8}{o.skipped:>9}{o.seconds:>8.0f}s"
            + (f"  {o.note}" if o.note else ""))
    passed = sum(o.passed for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    say(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0
