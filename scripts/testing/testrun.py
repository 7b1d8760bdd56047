"""`make test`: every suite, against the patched vLLM installed in .venv.

Rows, in order:
- tooling: tests of this repository's scripts (tests/tooling/);
- lint: vLLM's pre-commit checks on the files the stack changes;
- recipes: hadolint on the project's container recipes (docker/Dockerfile*);
- prefix k/n: each shorter prefix of the stack, linted, with the vLLM test
  files it adds or changes, and with the check that its draft step launches
  no more kernels than the release's (tests/verification/
  test_kernel_budget_of_each_prefix.py), run in a worktree (scripts/testing/prefixes.py);
- stack: the vLLM test files the stack adds or changes, run in build/vllm;
- regression: vLLM's existing tests of the code the stack touches
  (tests/vllm_regression.txt), run in build/vllm, a pytest process per folder;
- verification: this project's end-to-end checks of both drafters on CPU
  (tests/verification/); the files that use its emulated-platform zygotes in
  one pytest process, where they share them (each imports torch and vLLM,
  ~13 s), the others one process each;
- stack (ROCm), regression (ROCm): the stack and regression rows again, in
  pytest processes under vLLM's RocmPlatform emulated on CPU
  (tests/rocm_emulation/), minus tests/vllm_regression_rocm.txt's deselects.

A row is a list of commands: a lint run, or a "unit" (one pytest process of
one test file, of one folder's regression entries, or of the verification
files that share zygotes). Every unit imports
vLLM from the tree it tests, under the read tracker (scripts/testing/testdeps.py).
A command whose key is that of an earlier green run is not run again
(scripts/testing/testcache.py): a unit's key is the digest of what it read, so a
test file runs again in a prefix only where a patch changed something it
reads, and after a change to one patch only what reads that change runs.
Commands run K3_TEST_JOBS at a time (default: the CPUs, at most 4); the runs
of one test file over several trees, oldest prefix first, one after another.
`make test FRESH=1` (or K3_TEST_FRESH=1) runs everything; `make test
ONLY=<row>[,<row>...]` runs only those rows, with the same reuse. A summary
table ends the run; any failure makes the exit status non-zero.
"""

from __future__ import annotations

import ast
import getpass
import os
import re
import shlex
import signal
import subprocess
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common import Layout, StackError, end_children, rel, say
from scripts.stack.gitrepo import git, read_state
from scripts.stack.lint import LintResult, print_results, run_hadolint, run_lints
from scripts.stack.lock import LINT
from scripts.stack.venv import venv_python
from scripts.testing.forkserver import UNPROVEN, ForkServers
from scripts.testing.prefixes import LINKED, PrefixTrees, prefix_commits
from scripts.testing.testcache import (
    FORMAT,
    NOT_PROJECT_INPUTS,
    KeyContext,
    ResultStore,
    now,
    shown_date,
    tree_id,
    trees_changed,
    unit_key,
    what_changed,
    working_tree_id,
)
from scripts.testing.testdeps import TRACKER_DIR, Reads, TreeIndex, tracker_env

REGRESSION_LIST = "tests/vllm_regression.txt"
ROCM_LIST = "tests/vllm_regression_rocm.txt"
VERIFICATION = "tests/verification"
# Run in each prefix row too, with that prefix on PYTHONPATH.
PREFIX_BUDGET = f"{VERIFICATION}/test_kernel_budget_of_each_prefix.py"
# Tooling tests that read prose, which is in no key (README.md, docs/), and
# the prose each reads: each is a unit of its own keyed by those files, so
# that an edit of them reruns it, not the whole tooling suite.
PROSE_TESTS = {"tests/tooling/test_code_map.py": ("docs/code-map.md",),
               "tests/tooling/test_gpu_tables.py": ("BENCHMARKS.md",)}
ROCM_PLUGIN = ("-p", "rocm_emulation.plugin")
JOBS_ENV = "K3_TEST_JOBS"
LOG_TAIL = 40  # lines of a failing command's output shown as it fails
_VALUED_OPTIONS = frozenset({"-p", "--deselect", "-k", "-m"})  # what the rows pass
# humming, which vLLM's quantization layers import, starts two Python builds of
# its CUDA helpers in the background at every import: 9 s of CPU each time a
# process imports vLLM, for kernels no CPU test loads.
# A value in the environment wins (and is in every key: testcache.py).
QUIET_BUILDS = {"HUMMING_DISABLE_PARALLEL_BUILD": "1"}


class Stopped(Exception):
    """A command that a stopped run ended (its thread's way out)."""


@dataclass
class Part:
    """One command of a row and its counts; `command` can be retyped in `where`."""

    command: str
    where: str
    title: str = ""  # what it runs, in short: a test file, a folder, "vLLM pre-commit"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    # The green run this part repeats ({"date", "key", "seconds"}); None if it ran now.
    reused: dict | None = None
    # Why it ran: what changed in its key's inputs since its last green run.
    changed: list[str] = field(default_factory=list)
    log: str = ""  # its output (a path relative to the project), if it ran
    note: str = ""


_PART_FIELDS = frozenset(Part.__dataclass_fields__)


@dataclass
class Outcome:
    suite: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""
    parts: list[Part] = field(default_factory=list)

    @classmethod
    def of(cls, suite: str, parts: list[Part], note: str = "") -> Outcome:
        outcome = cls(suite, note=note, parts=parts)
        for part in parts:
            outcome.passed += part.passed
            outcome.failed += part.failed
            outcome.skipped += part.skipped
            outcome.seconds += 0 if part.reused else part.seconds
        return outcome

    @property
    def reused(self) -> bool:
        """Every part repeats an earlier green run."""
        return bool(self.parts) and all(p.reused for p in self.parts)


@dataclass(frozen=True)
class Job:
    """One command of a row, and what decides its outcome (its key).

    Besides what every key holds (scripts/testing/testcache.py), a job names what it
    checks (`check`; the same check of different trees shares it), its
    command, the git tree id of the vLLM tree it tests (None: it reads none)
    and any other project path it reads. A job with `tracked` set runs under
    the read tracker in that folder and is keyed by what it reads there.
    """

    row: str
    title: str  # what the output calls it: a test file, "vLLM pre-commit"
    check: str
    command: tuple[str, ...]
    tree: str | None
    run: Callable[[Path], Part]  # given where its output goes
    tracked: Path | None = None
    inputs: tuple[str, ...] = ()
    where: str = ""  # the folder it runs in, as Part.where
    retype: str = ""  # its command line there, if known before it runs
    files: int = 1  # the test files it runs: its weight before it has run once
    # The checkout of `tree` an untracked command reads (a lint run): the Python
    # files git ignores there are in its key too (mypy follows imports into them).
    folder: Path | None = None

    @property
    def chain(self) -> tuple:
        """Jobs of one chain run one after another, in order (the same unit over
        several trees: each may reuse what the one before it found)."""
        return (self.check, self.command) if self.tracked else (self.check,)


@dataclass
class Row:
    name: str
    tree: str | None
    jobs: list[Job]
    note: str = ""  # said when the row has nothing to run


def run_all(layout: Layout, fresh: bool = False, only: str = "") -> int:
    for python in (venv_python(layout), LINT.python(layout)):
        if not python.exists():
            raise StackError(f"{python.parent.parent.name} is missing; run `make build` "
                             "(make test does it for you)")
    fresh = fresh or os.environ.get("K3_TEST_FRESH", "") not in ("", "0")
    started, start = now(), time.monotonic()
    base = read_state(layout.tree)["base_tag"]
    store = ResultStore(layout)
    if left := store.remove_leftovers():
        say(f"make test: removed {len(left)} files that a killed run left in "
            f"{rel(store.dir, layout)}/")
    context = KeyContext.of(layout, base)
    store.save_project_files(context)
    with (PrefixTrees(layout) as prefixes,
          ForkServers(venv_python(layout), store.dir / "servers") as servers):
        rows = chosen_rows(test_rows(layout, base, prefixes, servers), only)
        jobs = [job for row in rows for job in row.jobs]
        runner = Runner(layout, context, store, fresh)
        say(f"make test: {len(rows)} rows, {len(jobs)} commands, {runner.workers} at a time"
            + ("" if fresh else "; commands whose inputs passed before are reused"))
        parts = runner.run(jobs)
    results = []
    for row in rows:
        mine = [parts[id(job)] for job in row.jobs]
        results.append((row, Outcome.of(row.name, mine, note="" if mine else row.note)))
    wall = time.monotonic() - start
    store.write_summary(_summary(layout, base, started, wall, fresh, only, results))
    outcomes = [outcome for _, outcome in results]
    ran = sum(not p.reused for o in outcomes for p in o.parts)
    total = sum(len(o.parts) for o in outcomes)
    return _summarize(outcomes, footer=(
        f"{total} commands: {ran} run, {total - ran} reused"
        + (" (make test FRESH=1 runs them all)" if ran < total else "")
        + f"; {wall:.0f} s; {rel(store.dir / 'summary.json', layout)}"))


def chosen_rows(rows: list[Row], only: str) -> list[Row]:
    """The rows ONLY names (comma-separated, exactly as the summary names them)."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        return rows
    known = [row.name for row in rows]
    if unknown := [n for n in names if n not in known]:
        raise StackError(f"ONLY: no row named {', '.join(map(repr, unknown))}; the rows are "
                         + ", ".join(known))
    return [row for row in rows if row.name in names]


def test_rows(layout: Layout, base: str, prefixes: PrefixTrees,
              servers: ForkServers | None = None) -> list[Row]:
    """Every row of `make test`, in order. A new suite is one more Row here.
    vLLM's test files run in forks of `servers` (if given), each in its tree."""
    tree = working_tree_id(layout.tree)
    stack_tests = stack_test_files(layout.tree, base)
    regression = _regression_groups(layout, stack_tests)
    root = [layout.root]
    prose_tests = {f: prose for f, prose in PROSE_TESTS.items() if (layout.root / f).is_file()}
    rows = [
        # The tooling tests build fake releases of their own; they never read build/vllm.
        # test_runbook compares docs/runbook-example with what the runbook writes.
        Row("tooling", None, [_pytest_job(layout, "tooling", "tooling", "tests/tooling",
                                          ["tests/tooling",
                                           *(f"--ignore={f}" for f in prose_tests)],
                                          layout.root, root, tree=None,
                                          inputs=("docs/runbook-example",))]
            + [_pytest_job(layout, "tooling", "tooling", f, [f], layout.root, root, tree=None,
                           inputs=prose) for f, prose in prose_tests.items()]),
        Row("lint", tree, [_lint_job(layout, "lint", base, layout.tree, tree)]),
        # hadolint reads only the project's recipes (part of every key).
        Row("recipes", None, [Job("recipes", "hadolint docker/Dockerfile*", "recipes",
                                  ("hadolint", "docker/Dockerfile*"), None,
                                  lambda log: _hadolint(layout))]),
    ]
    rows += _prefix_rows(layout, base, prefixes, servers)
    in_tree = [layout.tree, layout.root]
    rows += [
        Row("stack", tree, [_vllm_unit(layout, "stack", f, [f], layout.tree, in_tree, tree,
                                       servers) for f in stack_tests],
            note="the stack adds or changes no vLLM tests"),
        Row("regression", tree, [_vllm_unit(layout, "regression", folder, args, layout.tree,
                                            in_tree, tree, servers)
                                 for folder, args in regression]),
        Row("verification", tree, [_pytest_job(layout, "verification", "verification",
                                               title, files, layout.root, in_tree, tree=tree,
                                               tracked=layout.tree)
                                   for title, files in verification_units(layout)]),
    ]
    # vLLM's own tests again, under the ROCm platform emulated on CPU.
    deselects, renamed = rocm_list(layout)
    emulated = [layout.tree, layout.root / "tests", layout.root]

    def rocm_unit(suite: str, title: str, args: list[str]) -> Job:
        return _vllm_unit(layout, suite, title, rocm_args(args, deselects, renamed),
                          layout.tree, emulated, tree, servers)

    rows += [
        Row("stack (ROCm)", tree, [rocm_unit("stack (ROCm)", f, [f])
                                   for f in rocm_files(stack_tests, deselects)],
            note="the stack adds or changes no vLLM tests"),
        Row("regression (ROCm)", tree, [rocm_unit("regression (ROCm)", folder, args)
                                        for folder, args in regression]),
    ]
    return rows


def verification_units(layout: Layout) -> list[tuple[str, list[str]]]:
    """tests/verification as units, (title, files): the files whose tests take
    one of its conftest's zygote fixtures in one pytest process, where they
    share the zygotes (each imports torch and vLLM, ~13 s); every other file
    alone, so that what it reads stays its own (one that runs a shell reads,
    for its key, the whole tree)."""
    folder = layout.root / VERIFICATION
    fixtures = _zygote_fixtures(folder / "conftest.py")
    files = sorted(p.relative_to(layout.root).as_posix() for p in folder.glob("test_*.py"))
    sharing = [f for f in files if _takes(layout.root / f, fixtures)]
    units = [(f, [f]) for f in files if f not in sharing]
    if sharing:
        units.insert(0, (f"{VERIFICATION} ({len(sharing)} files sharing zygotes)", sharing))
    return units


def _zygote_fixtures(conftest: Path) -> set[str]:
    """The fixtures of a conftest that return a Zygote (`def rocm() -> Zygote`)."""
    try:
        module = ast.parse(conftest.read_text())
    except (OSError, SyntaxError):
        return set()
    return {node.name for node in module.body if isinstance(node, ast.FunctionDef)
            and isinstance(node.returns, ast.Name) and node.returns.id == "Zygote"
            and node.decorator_list}


def _takes(test_file: Path, fixtures: set[str]) -> bool:
    """Whether a test of `test_file` takes one of `fixtures` as an argument."""
    try:
        module = ast.parse(test_file.read_text())
    except (OSError, SyntaxError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
               and fixtures & {a.arg for a in node.args.args} for node in ast.walk(module))


def stack_test_files(tree: Path, base: str, rev: str = "HEAD") -> list[str]:
    """The vLLM test files the stack adds or changes (up to `rev`)."""
    out = git(tree, "diff", "--no-renames", "--name-only", "--diff-filter=AM",
              base, rev, "--", "tests/").stdout.split()
    return vllm_test_files(out)


def vllm_test_files(paths: list[str]) -> list[str]:
    """Of a tree's paths, its pytest files: the one definition `make test` and the
    runbook's device tests share."""
    return sorted(p for p in paths if p.startswith("tests/") and Path(p).name.startswith(
        "test_") and p.endswith(".py"))


def _prefix_rows(layout: Layout, base: str, prefixes: PrefixTrees,
                 servers: ForkServers | None = None) -> list[Row]:
    """Lint and stack tests of each proper prefix of the stack, one row each."""
    commits = prefix_commits(layout.tree, base)
    total = len(commits) + 1
    rows = []
    for k, commit in enumerate(commits, start=1):
        suite = f"prefix {k}/{total}"
        tree = tree_id(layout.tree, commit)
        worktree = prefixes.path(k)

        def checkout(k: int = k, commit: str = commit) -> Path:
            return prefixes.at(k, commit)

        jobs = [_lint_job(layout, suite, base, worktree, tree, checkout)]
        jobs += [_vllm_unit(layout, suite, f, [f], worktree, [worktree, layout.root], tree,
                            servers, checkout)
                 for f in stack_test_files(layout.tree, base, commit)]
        # The prefix is a vLLM users run: its draft step launches no more than the release's.
        if (layout.root / PREFIX_BUDGET).exists():
            jobs.append(_pytest_job(layout, suite, "kernel budget", PREFIX_BUDGET,
                                    [PREFIX_BUDGET], layout.root, [worktree, layout.root],
                                    tree=tree, tracked=worktree, checkout=checkout))
        rows.append(Row(suite, tree, jobs))
    return rows


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


def _regression_groups(layout: Layout, already_run: list[str]) -> list[tuple[str, list[str]]]:
    """The regression entries as one pytest process per folder: (folder, its args).
    A folder whose files all run in the stack row keeps no process."""
    entries: dict[str, list[str]] = {}
    deselects: dict[str, list[str]] = {}
    args = iter(_regression_args(layout, already_run))
    for arg in args:
        target = deselects if arg == "--deselect" else entries
        node = next(args) if arg == "--deselect" else arg
        target.setdefault(str(Path(node.split("::")[0]).parent), []).append(node)
    return [(folder, [*nodes, *(a for d in deselects.get(folder, []) for a in ("--deselect", d))])
            for folder, nodes in entries.items()]


def rocm_list(layout: Layout) -> tuple[list[str], dict[str, str]]:
    """tests/vllm_regression_rocm.txt: what the (ROCm) rows deselect, and the node
    ids they rename (whose parameters depend on the platform). Every line must
    give its reason after `#`."""
    deselects: list[str] = []
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
            deselects.append(ids[0])
        else:
            renamed[ids[0]] = ids[1]
    return deselects, renamed


def rocm_files(files: list[str], deselects: list[str]) -> list[str]:
    """The test files a (ROCm) row runs: those the list does not deselect whole
    (`--deselect <file>`), of which pytest would collect nothing (exit 5)."""
    return [f for f in files if f not in deselects]


def rocm_args(args: list[str], deselects: list[str], renamed: dict[str, str]) -> list[str]:
    """pytest args that run `args` (vLLM test files and node ids) under vLLM's
    RocmPlatform emulated on CPU: the plugin (tests/rocm_emulation/plugin.py,
    imported from <project>/tests, as in the vLLM tree `tests` is vLLM's own
    package), the platform's node ids, and the list's deselects of these files."""
    args = [renamed.get(a, a) for a in args]
    mine = [a for d in deselects if _concerns(d, args) for a in ("--deselect", d)]
    return [*ROCM_PLUGIN, *args, *mine]


def _concerns(node_id: str, args: list[str]) -> bool:
    """Whether a deselect names a test of the files or folders `args` run."""
    file = node_id.split("::")[0]
    return any(file == a.split("::")[0] or file.startswith(a.rstrip("/") + "/")
               for a in args if not a.startswith("-"))


# --- jobs ------------------------------------------------------------------------


def _vllm_unit(layout: Layout, suite: str, title: str, args: list[str], cwd: Path,
               path: list[Path], tree: str, servers: ForkServers | None,
               checkout: Callable[[], Path] | None = None) -> Job:
    """vLLM's tests, run in (and tracked in) the tree they test, in a fork of a
    server there. The same test file in every tree is one check, so a prefix can
    reuse what another found."""
    return _pytest_job(layout, suite, "vllm tests", title, args, cwd, path, tree=tree,
                       tracked=cwd, checkout=checkout, servers=servers)


def _pytest_job(layout: Layout, suite: str, check: str, title: str, args: list[str],
                cwd: Path, path: list[Path], *, tree: str | None, tracked: Path | None = None,
                inputs: tuple[str, ...] = (), checkout: Callable[[], Path] | None = None,
                servers: ForkServers | None = None) -> Job:
    command = _retypable(layout, args, cwd, path)
    where = rel(cwd, layout)

    def run(log: Path, reads_log: Path | None = None) -> Part:
        if checkout:
            checkout()
        part = _pytest(layout, args, cwd, path, log, reads_log, tracked, servers)
        part.command, part.where = command, where
        return part

    # In the key, the tree's folder is a name: a prefix's worktree is another
    # folder for the same command, told apart by the tree id.
    names = {tracked: "<vllm tree>", layout.tree: "<vllm tree>", layout.root: "<project>",
             layout.root / "tests": "<project>/tests"}
    key_command = ("pytest", *args, "PYTHONPATH=" + os.pathsep.join(names[p] for p in path))
    return Job(suite, title, check, key_command, tree, run, tracked, inputs, where, command,
               files=_test_file_count(cwd, args))


def _test_file_count(cwd: Path, args: list[str]) -> int:
    """How many test files pytest's `args` name (a folder counts what it holds)."""
    count, words = 0, iter(args)
    for word in words:
        if word in _VALUED_OPTIONS:
            next(words)
        path = cwd / word.split("::")[0]
        if not word.startswith("-") and path.exists():
            count += len(list(path.rglob("test_*.py"))) if path.is_dir() else 1
    return max(count, 1)


def _retypable(layout: Layout, args: list[str], cwd: Path, path: list[Path]) -> str:
    """The command as a user types it in `cwd`: PYTHONPATH, interpreter, pytest."""
    python = os.path.relpath(venv_python(layout), cwd)
    return (f"PYTHONPATH={os.pathsep.join(os.path.relpath(p, cwd) for p in path)} {python} "
            f"-m pytest -q -p no:cacheprovider {shlex.join(args)}")


def _lint_job(layout: Layout, suite: str, base: str, tree_dir: Path, tree: str,
              checkout: Callable[[], Path] | None = None) -> Job:
    def run(log: Path) -> Part:
        if checkout:
            checkout()
        return _lint(layout, base, tree_dir)

    return Job(suite, "vLLM pre-commit", "vllm pre-commit", ("vllm pre-commit", base), tree,
               run, where=rel(tree_dir, layout), folder=tree_dir)


def _pytest(layout: Layout, args: list[str], cwd: Path, path: list[Path], log: Path,
            reads_log: Path | None, tracked: Path | None,
            servers: ForkServers | None = None) -> Part:
    xml = log.with_suffix(".xml")
    xml.unlink(missing_ok=True)
    env = {**QUIET_BUILDS, **_shared_caches(), **os.environ,
           "K3_PROJECT_ROOT": str(layout.root), "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    if tracked is not None and reads_log is not None:
        env["PYTHONPATH"] = f"{TRACKER_DIR}{os.pathsep}{env['PYTHONPATH']}"
        env.update(tracker_env(reads_log, tracked, [layout.root / p for p in sorted(
            NOT_PROJECT_INPUTS)], read_state(layout.tree)["base_tag"]))
    pytest_args = ["-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    start = time.monotonic()
    # The unit's temporary files go to a folder of its own, removed with it: a
    # test that never removes what it made (a mkdtemp) leaves nothing in /tmp.
    with tempfile.TemporaryDirectory(prefix="k3-unit-", ignore_cleanup_errors=True) as tmp:
        served, note = None, ""
        if servers is not None and reads_log is not None:
            served = servers.run(cwd, env, pytest_args, log, reads_log, tmp=tmp)
        if served is not None and served[0] == UNPROVEN:
            served, note = None, "run in a process of its own: a fork could have differed"
        if served is not None:
            code, server_reads = served
            with open(reads_log, "a") as reads:  # what the server read before the fork
                reads.write(server_reads.read_text(errors="replace"))
        else:
            with open(log, "w") as out:
                code = subprocess.run([str(venv_python(layout)), "-m", "pytest", *pytest_args],
                                      cwd=cwd, env={**env, "TMPDIR": tmp}, stdout=out,
                                      stderr=subprocess.STDOUT).returncode
    part = _read_junit(xml)
    part.seconds = time.monotonic() - start
    part.log = rel(log, layout)
    part.note = note
    skipped_whole = code == 5 and part.skipped  # a module-level skip: nothing to collect
    if (code not in (0, 1) and not skipped_whole) or (code == 1 and not part.failed):
        # Collection errors, usage errors, or no tests at all (exit 5).
        part.failed += 1
        part.note = f"pytest exited {code}"
    return part


def _shared_caches() -> dict[str, str]:
    """Caches that live in the temporary folder by default, kept where they were:
    with a TMPDIR of its own (_pytest), every unit would compile torch's inductor
    kernels from nothing. (A value in the environment wins.)"""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names it
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(),
                                                    f"torchinductor_{user}")}


def _read_junit(xml: Path) -> Part:
    part = Part("", "")
    if not xml.exists():
        return part
    try:
        for ts in ET.parse(xml).getroot().iter("testsuite"):
            tests, skipped = int(ts.get("tests", 0)), int(ts.get("skipped", 0))
            failed = int(ts.get("failures", 0)) + int(ts.get("errors", 0))
            part.passed += tests - skipped - failed
            part.failed += failed
            part.skipped += skipped
    except (ET.ParseError, ValueError):  # cut short (pytest killed as it wrote it)
        return Part("", "", failed=1, note=f"{xml.name} cannot be read: nothing is known")
    return part


def _lint(layout: Layout, base: str, tree: Path) -> Part:
    start = time.monotonic()
    results = run_lints(layout, base, tree)
    part = _checked(results, start)
    part.command = "vLLM pre-commit: " + ", ".join(r.name for r in results)
    part.where = rel(tree, layout)
    return part


def _hadolint(layout: Layout) -> Part:
    start = time.monotonic()
    part = _checked(run_hadolint(layout), start)
    part.command, part.where = "hadolint docker/Dockerfile*", "."
    return part


def _checked(results: list[LintResult], start: float) -> Part:
    """Checks that each pass or fail (lint.py's results), printed as they are."""
    print_results(results)
    return Part("", "", passed=sum(r.ok for r in results),
                failed=sum(not r.ok for r in results), seconds=time.monotonic() - start,
                note="" if results else "nothing to check")


# --- running them --------------------------------------------------------------------


class Runner:
    """Runs jobs, reusing green results: K3_TEST_JOBS chains at a time."""

    def __init__(self, layout: Layout, context: KeyContext, store: ResultStore, fresh: bool):
        self.layout, self.context, self.store, self.fresh = layout, context, store, fresh
        self.workers = max(1, int(os.environ.get(JOBS_ENV) or min(os.cpu_count() or 1, 4)))
        self._trees: dict[tuple[str | None, Path], TreeIndex] = {}
        self._digests: dict[str, str] = {}  # ignored files' contents, hashed once a run
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._stopping = threading.Event()

    def run(self, jobs: list[Job]) -> dict[int, Part]:
        chains: dict[tuple, list[Job]] = {}
        for job in jobs:
            chains.setdefault(job.chain, []).append(job)
        self._total = len(jobs)
        parts: dict[int, Part] = {}
        logs = self.store.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)

        def run_chain(chain: list[Job]) -> None:
            for job in chain:
                if self._stopping.is_set():
                    return
                parts[id(job)] = self._one(job, logs)

        # The longest chains first (by their last runs), so none is left alone at the end.
        order = sorted(chains.values(), key=self._expected_seconds, reverse=True)
        pool = ThreadPoolExecutor(self.workers)
        futures = [pool.submit(run_chain, c) for c in order]
        try:
            for future in futures:
                future.result()  # an error of the tooling ends the run, named
        except BaseException:  # SIGTERM, Ctrl-C, an error: stop every chain now
            self._stop(futures)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return parts

    def _stop(self, futures: list) -> None:
        """Start nothing more, and end what runs (test processes, fork servers and
        their children, a linter), SIGKILL after 5 s: the chains' threads then
        return at once, recording nothing (_one)."""
        self._stopping.set()
        for future in futures:
            future.cancel()
        deadline = time.monotonic() + 5
        while not all(future.done() for future in futures):
            end_children(signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL)
            wait(futures, timeout=0.2)

    def _expected_seconds(self, chain: list[Job]) -> float:
        """How long a chain takes, by its last run (or a minute per test file)."""
        last = self.store.latest_green(self._name(chain[0]))
        return len(chain) * (last["outcome"]["seconds"] if last else 60.0 * chain[0].files)

    def _one(self, job: Job, logs: Path) -> Part:
        """Reuse a green run of `job` under its key, or run it whole."""
        if job.tracked:
            identity, material = self.context.unit(check=job.check, command=job.command)
            index = self._index(job.tree, job.tracked)
            # A key per set of reads the unit has had: what each sees in this tree.
            keys = [unit_key(identity, reads, reads.digest(index, self.layout.root))
                    for reads in self.store.reads(identity)]
        else:
            ignored = (self._index(job.tree, job.folder).ignored_sources_id()
                       if job.folder is not None else None)
            key, material = self.context.key(self.layout.root, check=job.check,
                                             vllm_tree=job.tree, command=job.command,
                                             inputs=job.inputs, ignored=ignored)
            keys = [key]
        for record in ([] if self.fresh else map(self.store.green, keys)):
            if record:
                return self._reused(job, record)
        changed = self._why(job, material)
        self._say(job, "run ", "; ".join(changed) or "first run")
        log = self._log(logs, job)
        if job.tracked:
            part, reads = self._tracked_run(job, log, logs)
            self.store.add_reads(identity, reads)
            key = unit_key(identity, reads, reads.digest(index, self.layout.root))
        else:
            part = job.run(log)
            reads = None
        part.changed, part.title = changed, job.title
        if self._stopping.is_set():
            raise Stopped(job.title)  # ended by the stop: its outcome means nothing
        if part.failed:
            # It failed where these keys said green (FRESH=1, or a flaky outside
            # condition): none of them may be reused any more.
            self.store.forget_greens([*keys, key])
        self._finish(job, part, key, material, reads)
        return part

    def _log(self, logs: Path, job: Job) -> Path:
        log = logs / _slug(job.row) / f"{_slug(job.title)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        return log

    def _tracked_run(self, job: Job, log: Path, logs: Path) -> tuple[Part, Reads]:
        """Run a unit under the read tracker: its part and what it read."""
        with tempfile.NamedTemporaryFile(prefix="reads-", suffix=".log",
                                         dir=logs) as reads_log:
            part = job.run(log, Path(reads_log.name))
            reads = Reads.parse(Path(reads_log.name).read_text(errors="replace"),
                                job.tracked, self.layout.root)
        return part, reads

    def _finish(self, job: Job, part: Part, key: str, material: dict,
                reads: Reads | None) -> None:
        """Keep a part that passed under its key, and say how it ended."""
        part.where = job.where or part.where
        self.store.record_green(key, {
            "name": self._name(job), "row": job.row, "tree": job.tree,
            "material": material, "reads": reads.id if reads else None,
            "outcome": asdict(part)})
        counts = f"{part.passed} passed, {part.failed} failed, {part.skipped} skipped"
        self._say(job, "FAIL" if part.failed else "ok  ",
                  f"{counts}, {part.seconds:.0f} s" + (f"; {part.note}" if part.note else ""))
        if part.failed and part.log:
            lines = (self.layout.root / part.log).read_text(errors="replace").splitlines()
            say("    " + "\n    ".join(lines[-LOG_TAIL:]) + f"\n    (all of it: {part.log})")

    def _reused(self, job: Job, record: dict) -> Part:
        saved = {k: v for k, v in record["outcome"].items() if k in _PART_FIELDS}
        # The counts of the run it repeats (in whichever tree), as this row's command.
        part = Part(**{**saved, "reused": {"date": record["date"], "key": record["key"],
                                           "seconds": saved["seconds"], "row": record["row"]},
                       "changed": [], "title": job.title, "where": job.where or saved["where"],
                       "command": job.retype or saved["command"], "log": ""})
        self._say(job, "same", f"green at {shown_date(record['date'])} under key "
                  f"{record['key'][:12]}")
        return part

    def _why(self, job: Job, material: dict) -> list[str]:
        """What changed since this command's last green run (any tree), in words."""
        last = self.store.latest_green(self._name(job))
        if last is None:
            return []
        said = what_changed(last["material"], material, self.store)
        if not said and last["tree"] != job.tree and last["tree"] and job.tree:
            reads = self.store.reads_by_id(last["reads"]) if last.get("reads") else None
            paths = trees_changed(self.layout.tree, last["tree"], job.tree, reads,
                                  self.layout.root)
            shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4
                                           else "")
            said.append(f"changed since {last['row']}: {shown or 'its vLLM tree'}")
        return said[:6]

    def _name(self, job: Job) -> str:
        """A command's name over every tree and run: what it checks and how."""
        return " ".join([job.check, *job.command])

    def _index(self, tree: str | None, folder: Path) -> TreeIndex:
        """The tree `tree` as checked out in `folder`, ignored files included
        (once per run: the lookup of a unit's key and its record see the same).
        A prefix's worktree is made afresh by each run: its ignored files are
        build/vllm's under vllm/, linked in (prefixes.link_build_outputs)."""
        with self._lock:
            if (tree, folder) not in self._trees:
                within = "" if folder == self.layout.tree else LINKED
                self._trees[tree, folder] = TreeIndex(self.layout.tree, tree, self.layout.tree,
                                                      within, self._digests)
            return self._trees[tree, folder]

    def _say(self, job: Job, verdict: str, detail: str) -> None:
        with self._lock:
            if verdict != "run ":
                self._done += 1
            say(f"  {verdict} [{self._done}/{self._total}] {job.row}: {job.title}  ({detail})")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text).strip("-")


def _summarize(outcomes: list[Outcome], footer: str = "") -> int:
    say("\n=== summary")
    say(f"  {'suite':<20}{'passed':>8}{'failed':>8}{'skipped':>9}{'time':>9}")
    for o in outcomes:
        run = [p for p in o.parts if not p.reused]
        if o.reused:
            last = max(p.reused["date"] for p in o.parts)
            note = f"reused: green at {shown_date(last)}"
        elif o.parts and len(run) < len(o.parts):
            note = f"{len(run)} of {len(o.parts)} run, the others reused"
        else:
            note = ""
        note = "; ".join(n for n in (note, o.note) if n)
        say(f"  {o.suite:<20}{o.passed:>8}{o.failed:>8}{o.skipped:>9}{o.seconds:>8.0f}s"
            + (f"  {note}" if note else ""))
    failing = [(o.suite, p) for o in outcomes for p in o.parts if p.failed]
    for suite, part in failing:
        say(f"  FAIL {suite}: {part.command}  (in {part.where}"
            + (f"; output: {part.log}" if part.log else "") + ")")
    if footer:
        say(footer)
    passed = sum(o.passed for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    if not passed and not failed:
        # Nothing checked is no green: a release tag moved onto the stack, say,
        # leaves the stack row without a test file.
        say("make test: no test passed or failed in the rows run; nothing was checked")
    say(f"{passed} passed, {failed} failed, {skipped} skipped")  # the last line: CI reads it
    return 1 if failed or not passed else 0


def _summary(layout: Layout, base: str, started: str, wall: float, fresh: bool, only: str,
             results: list[tuple[Row, Outcome]]) -> dict:
    """build/test-results/summary.json (read by `make bench` and `make export`)."""
    tree = layout.tree
    rows = []
    for row, outcome in results:
        counts = asdict(outcome)
        del counts["suite"]  # the row's name
        rows.append({"name": row.name, **counts, "reused": outcome.reused,
                     "vllm_tree": row.tree})
    return {
        "format": FORMAT,
        "started": started,
        "wall_seconds": round(wall, 1),
        "fresh": fresh,
        "only": [r["name"] for r in rows] if only.strip() else None,
        "vllm": {
            "base": base,
            "head": git(tree, "rev-parse", "HEAD").stdout.strip(),
            "describe": git(tree, "describe", "--tags", "--always", "--dirty").stdout.strip(),
            "tree": working_tree_id(tree),
        },
        "rows": rows,
        "totals": {k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped")},
        "rows_run": sum(not r["reused"] for r in rows),
        "rows_reused": sum(r["reused"] for r in rows),
        "parts_run": sum(p["reused"] is None for r in rows for p in r["parts"]),
        "parts_reused": sum(p["reused"] is not None for r in rows for p in r["parts"]),
    }
