"""`make test`: every suite, against the patched vLLM installed in .venv.

Rows, in order:
- tooling: tests of this repository's scripts (tests/tooling/);
- lint: vLLM's pre-commit checks on the files the stack changes;
- recipes: hadolint on the project's container recipes (docker/Dockerfile*);
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
Every row that reads vLLM imports it from the tree it tests. A row whose
inputs are the same as those of an earlier green run is not run again
(scripts/testcache.py): the summary says which rows were reused, from when.
`make test FRESH=1` (or K3_TEST_FRESH=1) runs every row. A summary table ends
the run; any failure makes the exit status non-zero.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common import Layout, StackError, rel, say
from scripts.gitrepo import git, read_state
from scripts.lint import LintResult, print_results, run_hadolint, run_lints
from scripts.lock import LINT
from scripts.prefixes import check_out, prefix_commits, prefix_worktree, python_path
from scripts.testcache import (
    FORMAT,
    KeyContext,
    ResultStore,
    now,
    shown_date,
    tree_id,
    working_tree_id,
)
from scripts.venv import venv_python

REGRESSION_LIST = "tests/vllm_regression.txt"
ROCM_LIST = "tests/vllm_regression_rocm.txt"


@dataclass
class Part:
    """One command of a row and its counts, as a reviewer would retype it in `where`."""

    command: str
    where: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0


@dataclass
class Outcome:
    suite: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""
    parts: list[Part] = field(default_factory=list)
    # The green run this outcome repeats ({"date", "key", "seconds"}); None if it ran now.
    reused: dict | None = None

    def add(self, other: Outcome) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.seconds += other.seconds
        self.parts += other.parts
        self.note = "; ".join(n for n in (self.note, other.note) if n)

    @classmethod
    def from_record(cls, suite: str, record: dict) -> Outcome:
        saved = record["outcome"]
        return cls(suite, passed=saved["passed"], failed=saved["failed"],
                   skipped=saved["skipped"], note=saved["note"],
                   parts=[Part(**p) for p in saved["parts"]],
                   reused={"date": record["date"], "key": record["key"],
                           "seconds": saved["seconds"]})


@dataclass(frozen=True)
class Row:
    """One row of the summary, and what decides its outcome (its cache key).

    Besides what every key holds (scripts/testcache.py: the project's scripts/,
    tests/ and locks, the venvs, the pristine base), a row names the git tree
    id of the vLLM tree it tests, the command it runs and any other project
    path it reads (e.g. "vllm_overlay"). `tree` has no default on purpose: a
    row that reads no vLLM tree says so with None.
    """

    name: str
    tree: str | None
    command: tuple[str, ...]
    run: Callable[[], Outcome]
    inputs: tuple[str, ...] = ()
    # The key's name for what the row checks; rows that are the same check of
    # different trees share it (a prefix keeps its green when patches are appended).
    check: str = ""


def run_all(layout: Layout, fresh: bool = False) -> int:
    for python in (venv_python(layout), LINT.python(layout)):
        if not python.exists():
            raise StackError(f"{python.parent.parent.name} is missing; run `make build` "
                             "(make test does it for you)")
    fresh = fresh or os.environ.get("K3_TEST_FRESH", "") not in ("", "0")
    started, start = now(), time.monotonic()
    base = read_state(layout.tree)["base_tag"]
    store = ResultStore(layout)
    context = KeyContext.of(layout, base)
    with ExitStack() as exits:
        rows = test_rows(layout, base, store.dir, PrefixCheckout(layout, exits))
        results = [(row, *_run_or_reuse(layout, row, context, store, fresh)) for row in rows]
    outcomes = [outcome for _, _, outcome in results]
    wall = time.monotonic() - start
    store.write_summary(_summary(layout, base, started, wall, fresh, results))
    reused = sum(o.reused is not None for o in outcomes)
    return _summarize(outcomes, footer=(
        f"{len(outcomes)} rows: {len(outcomes) - reused} run, {reused} reused"
        + (" (make test FRESH=1 runs them all)" if reused else "")
        + f"; {wall:.0f} s; {rel(store.dir / 'summary.json', layout)}"))


def test_rows(layout: Layout, base: str, results_dir: Path,
              prefixes: PrefixCheckout) -> list[Row]:
    """Every row of `make test`, in order. A new suite is one more Row here."""
    tree = working_tree_id(layout.tree)
    stack_tests = _stack_test_files(layout.tree, base)
    in_tree = python_path(layout, layout.tree)
    rows = [
        # The tooling tests build fake releases of their own; they never read build/vllm.
        # test_runbook compares docs/runbook-example with what the runbook writes.
        _pytest_row(layout, "tooling", ["tests/tooling"], layout.root, results_dir, tree=None,
                    inputs=("docs/runbook-example",)),
        Row("lint", tree, ("vllm pre-commit", base),
            lambda: _lint(layout, base, layout.tree)),
        # hadolint reads only the project's recipes (part of every row's key).
        Row("recipes", None, ("hadolint", "docker/Dockerfile*"), lambda: _hadolint(layout)),
    ]
    if stack_tests:
        rows.append(_pytest_row(layout, "stack", stack_tests, layout.tree, results_dir,
                                tree=tree, python_path=in_tree))
    else:
        rows.append(Row("stack", tree, (), lambda: Outcome(
            "stack", note="the stack adds or changes no vLLM tests")))
    rows += _prefix_rows(layout, base, results_dir, prefixes)
    rows += [
        _pytest_row(layout, "regression", _regression_args(layout, stack_tests), layout.tree,
                    results_dir, tree=tree, python_path=in_tree),
        _pytest_row(layout, "verification", ["tests/verification"], layout.root,
                    results_dir, tree=tree, python_path=in_tree),
    ]
    # vLLM's own tests again, under the ROCm platform emulated on CPU.
    if stack_tests:
        rows.append(_rocm_row(layout, "stack (ROCm)", stack_tests, results_dir, tree))
    rows.append(_rocm_row(layout, "regression (ROCm)",
                          _regression_args(layout, stack_tests), results_dir, tree))
    return rows


def _run_or_reuse(layout: Layout, row: Row, context: KeyContext, store: ResultStore,
                  fresh: bool) -> tuple[str, Outcome]:
    key, material = context.key(layout.root, check=row.check or row.name,
                                vllm_tree=row.tree, command=row.command, inputs=row.inputs)
    record = None if fresh else store.green(key)
    if record:
        say(f"\n=== {row.name}: reused, green at {shown_date(record['date'])} "
            f"under key {key[:12]}")
        return key, Outcome.from_record(row.name, record)
    outcome = row.run()
    outcome.suite = row.name
    store.record_green(key, material, asdict(outcome))
    return key, outcome


def _stack_test_files(tree: Path, base: str, rev: str = "HEAD") -> list[str]:
    out = git(tree, "diff", "--no-renames", "--name-only", "--diff-filter=AM",
              base, rev, "--", "tests/").stdout.split()
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
            os.pathsep.join([str(layout.tree), str(layout.root / "tests"),
                             str(layout.root)]))


def _rocm_row(layout: Layout, suite: str, args: list[str], results_dir: Path,
              tree: str) -> Row:
    rocm_args, path = _rocm_emulated(layout, args)
    return _pytest_row(layout, suite, rocm_args, layout.tree, results_dir, tree=tree,
                       python_path=path)




class PrefixCheckout:
    """build/prefix-tree, made on first use: a run whose prefix rows are all
    reused needs no worktree. Removed when the run ends."""

    def __init__(self, layout: Layout, exits: ExitStack):
        self.layout, self.exits = layout, exits
        self.path: Path | None = None

    def at(self, commit: str) -> Path:
        if self.path is None:
            self.path = self.exits.enter_context(prefix_worktree(self.layout))
        check_out(self.layout, self.path, commit)
        return self.path


def _prefix_rows(layout: Layout, base: str, results_dir: Path,
                 prefixes: PrefixCheckout) -> list[Row]:
    """Lint and stack tests of each proper prefix of the stack, one row each."""
    commits = prefix_commits(layout.tree, base)
    total = len(commits) + 1
    rows = []
    for k, commit in enumerate(commits, start=1):
        suite = f"prefix {k}/{total}"
        tests = _stack_test_files(layout.tree, base, commit)

        def run(suite: str = suite, commit: str = commit, tests: list[str] = tests) -> Outcome:
            subject = git(layout.tree, "log", "-1", "--format=%s", commit).stdout.strip()
            say(f"\n=== {suite}: the stack up to {subject!r}")
            worktree = prefixes.at(commit)
            outcome = _lint(layout, base, worktree, suite=suite)
            if tests:
                outcome.add(_pytest(layout, suite, tests, worktree, results_dir,
                                    python_path=python_path(layout, worktree)))
            return outcome

        rows.append(Row(suite, tree_id(layout.tree, commit), ("vllm pre-commit", base, *tests),
                        run, check="prefix"))
    return rows


def _pytest_row(layout: Layout, suite: str, args: list[str], cwd: Path, results_dir: Path,
                *, tree: str | None, python_path: str | None = None,
                inputs: tuple[str, ...] = ()) -> Row:
    return Row(suite, tree, ("pytest", rel(cwd, layout), *args),
               lambda: _pytest(layout, suite, args, cwd, results_dir, python_path),
               inputs=inputs)


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
    outcome.parts = [Part(f"pytest -q {shlex.join(args)}", rel(cwd, layout),
                          outcome.passed, outcome.failed, outcome.skipped)]
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
    scope = "the whole stack" if tree == layout.tree else "this prefix"
    say(f"\n=== {suite}: vLLM's pre-commit checks on the files {scope} changes "
        f"since {base}")
    start = time.monotonic()
    results = run_lints(layout, base, tree)
    outcome = _checked(suite, results, start, empty="the stack changes no files")
    outcome.parts = [Part("vLLM pre-commit: " + ", ".join(r.name for r in results),
                          rel(tree, layout), outcome.passed, outcome.failed, outcome.skipped)]
    return outcome


def _hadolint(layout: Layout) -> Outcome:
    say("\n=== recipes: hadolint on docker/Dockerfile*")
    start = time.monotonic()
    return _checked("recipes", run_hadolint(layout), start, empty="no recipes in docker/")


def _checked(suite: str, results: list[LintResult], start: float, empty: str) -> Outcome:
    """A row of checks that each pass or fail (lint.py's results), printed as they are."""
    print_results(results)
    outcome = Outcome(suite, passed=sum(r.ok for r in results),
                      failed=sum(not r.ok for r in results), note="" if results else empty)
    outcome.seconds = time.monotonic() - start
    return outcome


def _summarize(outcomes: list[Outcome], footer: str = "") -> int:
    say("\n=== summary")
    say(f"  {'suite':<20}{'passed':>8}{'failed':>8}{'skipped':>9}{'time':>9}")
    for o in outcomes:
        note = o.note
        if o.reused:
            note = (f"reused: green at {shown_date(o.reused['date'])} under key "
                    f"{o.reused['key'][:12]} (ran in {o.reused['seconds']:.0f}s)"
                    + (f"; {note}" if note else ""))
        say(f"  {o.suite:<20}{o.passed:>8}{o.failed:>8}{o.skipped:>9}{o.seconds:>8.0f}s"
            + (f"  {note}" if note else ""))
    if footer:
        say(footer)
    passed = sum(o.passed for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    say(f"{passed} passed, {failed} failed, {skipped} skipped")  # the last line: CI reads it
    return 1 if failed else 0


def _summary(layout: Layout, base: str, started: str, wall: float, fresh: bool,
             results: list[tuple[Row, str, Outcome]]) -> dict:
    """build/test-results/summary.json (read by `make bench` and `make export`)."""
    tree = layout.tree
    rows = []
    for row, key, outcome in results:
        counts = asdict(outcome)
        del counts["suite"]  # the row's name
        rows.append({"name": row.name, **counts, "key": key, "vllm_tree": row.tree})
    return {
        "format": FORMAT,
        "started": started,
        "wall_seconds": round(wall, 1),
        "fresh": fresh,
        "vllm": {
            "base": base,
            "head": git(tree, "rev-parse", "HEAD").stdout.strip(),
            "describe": git(tree, "describe", "--tags", "--always", "--dirty").stdout.strip(),
            "tree": working_tree_id(tree),
        },
        "rows": rows,
        "totals": {k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped")},
        "rows_run": sum(r["reused"] is None for r in rows),
        "rows_reused": sum(r["reused"] is not None for r in rows),
    }
