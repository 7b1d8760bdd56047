"""`make test` reuses a green command whose inputs are unchanged, and only then.

A fake three-patch stack with real vLLM-style tests in its tree, the project's
own tooling and verification tests, and a .venv whose python logs every run:
the log, not the summary, says which commands really ran. Each unit (a pytest
process of a test file) is keyed by what it read of the tree it tests, so a
change to one patch reruns just the units that read the change, in the trees
that hold it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from scripts.__main__ import main
from scripts.common import Layout, StackError
from scripts.testing import testrun
from tests.tooling.conftest import (
    FOO_PATCHED,
    NEW_MODEL,
    REPO,
    SUBJECT_1,
    SUBJECT_2,
    TEST_FOO_PATCHED,
    V1,
    release_files,
)

TEST_BAR = "from vllm.models.bar import bar\n\n\ndef test_bar():\n    assert bar() == 'bar'\n"
TEST_NEW = ("from vllm.models.new import new_model\n\n\n"
            "def test_new():\n    assert new_model() == 42\n")
TOOLING_TEST = "def test_tool():\n    assert True\n"
# The fake vLLM's tests say that they run, however they are started (a pytest
# process, or a fork of make test's server for the tree).
TREE_CONFTEST = """\
import os


def pytest_configure(config):
    with open(os.environ["FAKE_RUN_LOG"], "a") as f:
        f.write(f"pytest --junitxml={config.option.xmlpath}\\n")
"""
# Fails while the file FAKE_VERIFY_NEEDS names is missing: an outside condition
# (a flaky machine) that is no input of the key.
VERIFY_TEST = """\
import os
from pathlib import Path


def test_verify():
    needed = os.environ.get("FAKE_VERIFY_NEEDS")
    assert needed is None or Path(needed).exists()
"""
FOO, NEW, BAR = "tests/test_foo.py", "tests/test_new.py", "tests"
VERIFY = "tests/verification/test_verify.py"  # it takes no zygote: a unit of its own
LINT = "vLLM pre-commit"
ROWS = ["tooling", "lint", "recipes", "prefix 1/3", "prefix 2/3", "stack", "regression",
        "verification", "stack (ROCm)", "regression (ROCm)"]
# Every command, as (row, what it runs).
ALL = {("tooling", "tests/tooling"), ("lint", LINT), ("recipes", "hadolint docker/Dockerfile*"),
       ("prefix 1/3", LINT), ("prefix 1/3", FOO),
       ("prefix 2/3", LINT), ("prefix 2/3", FOO), ("prefix 2/3", NEW),
       ("stack", FOO), ("stack", NEW), ("regression", BAR), ("verification", VERIFY),
       ("stack (ROCm)", FOO), ("stack (ROCm)", NEW), ("regression (ROCm)", BAR)}
LINTS = {("lint", LINT), ("prefix 1/3", LINT), ("prefix 2/3", LINT)}
# A first run runs each test file once per tree content it reads: the stack's
# test_foo reads the same in all three trees, test_new in the last two.
FIRST = ALL - {("prefix 2/3", FOO), ("stack", FOO), ("stack", NEW)}

_TEMPLATE: dict[str, Path] = {}


def _fake_lint(layout, base, tree):
    _log(f"lint {testrun.rel(tree, layout)}")
    return testrun.Part("fake lint", "", passed=1)


def _fake_hadolint(layout):
    _log("hadolint")
    return testrun.Part("hadolint docker/Dockerfile*", ".", passed=1)


def _log(line: str) -> None:
    with open(os.environ["FAKE_RUN_LOG"], "a") as f:
        f.write(line + "\n")


def _make_suite_project(project) -> None:
    """Three patches (1 and 2 with tests), a regression list, the project's own suites."""
    project.use_release(V1, files={**release_files(V1), "tests/test_bar.py": TEST_BAR.encode(),
                                   "tests/conftest.py": TREE_CONFTEST.encode()})
    project.ok("apply")
    project.commit(SUBJECT_1, {"vllm/models/foo.py": FOO_PATCHED,
                               "tests/test_foo.py": TEST_FOO_PATCHED})
    project.commit(SUBJECT_2, {"vllm/models/new.py": NEW_MODEL, "tests/test_new.py": TEST_NEW})
    project.commit("[ROCm] Name the bar model", {
        "vllm/models/bar.py": "def bar():\n    return 'bar'\n\n\nNAME = 'bar'\n"})
    project.ok("patches")
    root = project.root
    for path, text in {"tests/tooling/test_tool.py": TOOLING_TEST,
                       "tests/verification/test_verify.py": VERIFY_TEST,
                       "tests/vllm_regression.txt": "tests/test_bar.py\n",
                       # The (ROCm) rows' plugin and list; the fake plugin emulates nothing.
                       "tests/rocm_emulation/__init__.py": "",
                       "tests/rocm_emulation/plugin.py": "",
                       "tests/vllm_regression_rocm.txt": "# nothing to leave out\n",
                       "requirements/venv.lock": "pytest==8.0.0 --hash=sha256:00\n",
                       "README.md": "# fake\n"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    layout = Layout(root)
    for venv in (layout.venv, layout.lint_venv):
        python = venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text('#!/bin/sh\necho "$*" >> "$FAKE_RUN_LOG"\n'
                          f'exec "{sys.executable}" "$@"\n')
        python.chmod(0o755)


@pytest.fixture
def suites(project, tmp_path_factory, tmp_path, monkeypatch):
    """The suite project after one green `make test` (built once, copied per test)."""
    monkeypatch.setattr(testrun, "_lint", _fake_lint)
    monkeypatch.setattr(testrun, "_hadolint", _fake_hadolint)
    # One path for every test: each environment variable is part of every key.
    monkeypatch.setenv("FAKE_RUN_LOG", str(tmp_path_factory.getbasetemp() / "fake-runs.log"))
    Path(os.environ["FAKE_RUN_LOG"]).unlink(missing_ok=True)
    monkeypatch.setenv(testrun.JOBS_ENV, "2")
    for name in ("K3_TEST_FRESH", "FAKE_VERIFY_NEEDS", "PYTHONDONTWRITEBYTECODE"):
        monkeypatch.delenv(name, raising=False)
    if "suites" not in _TEMPLATE:
        _make_suite_project(project)
        assert _test(project) == 0
        assert _ran(project) == FIRST
        saved = tmp_path_factory.mktemp("suites") / "proj"
        shutil.copytree(project.root, saved, symlinks=True)
        _TEMPLATE["suites"] = saved
    else:
        shutil.rmtree(project.root)
        shutil.copytree(_TEMPLATE["suites"], project.root, symlinks=True)
        # The copy's worktree records name the template's folders.
        project.git("worktree", "prune")
    return project


def _test(project, fresh: bool = False, only: str = "") -> int:
    return testrun.run_all(Layout(project.root), fresh=fresh, only=only)


def _ran(project) -> set[tuple[str, str]]:
    """The commands that really ran since the last call: pytest runs and fake lints."""
    log = Path(os.environ["FAKE_RUN_LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    rows = {testrun._slug(name): name for name in ROWS}
    titles = {testrun._slug(title): title
              for _, title in ALL | {("tooling", t) for t in testrun.PROSE_TESTS}}
    where = {"build/vllm": "lint", **{f"build/prefix-trees/{k}": f"prefix {k}/3"
                                      for k in (1, 2)}}
    ran = set()
    for line in lines:
        if line == "hadolint":
            ran.add(("recipes", "hadolint docker/Dockerfile*"))
        elif line.startswith("lint "):
            ran.add((where[line[len("lint "):]], LINT))
        elif "--junitxml=" in line:
            xml = Path(line.split("--junitxml=")[1].split()[0])
            ran.add((rows[xml.parent.name], titles[xml.stem]))
    return ran


def _summary(project) -> dict:
    return json.loads((project.root / "build/test-results/summary.json").read_text())


def _parts(project) -> dict[tuple[str, str], dict]:
    """Every command of the latest run by (row, what it runs), as summary.json has it."""
    return {(row["name"], part["title"]): part for row in _summary(project)["rows"]
            for part in row["parts"]}


def _change_patch(project, k: int, path: str, text: str) -> None:
    """Edit patch k in build/vllm (the later ones rebuilt on it) and export."""
    commits = project.git("rev-list", "--reverse", f"vllm-{V1}..HEAD").split()
    project.git("reset", "-q", "--hard", commits[k - 1])
    (project.tree / path).write_text(text)
    project.git("commit", "-q", "-a", "--amend", "--no-edit")
    for later in commits[k:]:
        project.git("cherry-pick", later)
    project.ok("patches")


def test_a_second_run_with_nothing_changed_reuses_every_command(suites, capsys):
    totals = _summary(suites)["totals"]
    assert _test(suites) == 0
    assert _ran(suites) == set()
    assert all(row["reused"] for row in _summary(suites)["rows"])
    out = capsys.readouterr().out
    n = len(ALL)
    assert out.count("reused: green at ") == len(ROWS)
    assert f"{n} commands: 0 run, {n} reused (make test FRESH=1 runs them all)" in out
    # The closing line CI reads counts the reused results too.
    assert out.strip().splitlines()[-1] == (f"{totals['passed']} passed, 0 failed, "
                                            f"{totals['skipped']} skipped")
    assert not (suites.root / "build" / "prefix-trees").exists()


@pytest.mark.parametrize(("k", "path", "text", "reads_it"), [
    (1, "vllm/models/foo.py", FOO_PATCHED.replace("x * BLOCK", "BLOCK * x"),
     {("prefix 1/3", FOO), ("stack (ROCm)", FOO)}),
    (2, "vllm/models/new.py", NEW_MODEL.replace("42", "40 + 2"),
     {("prefix 2/3", NEW), ("stack (ROCm)", NEW)}),
    (3, "vllm/models/bar.py", "def bar():\n    return 'bar'\n\n\nNAME = 'Bar'\n",
     {("regression", BAR), ("regression (ROCm)", BAR)}),
], ids=["patch-1", "patch-2", "patch-3"])
def test_changing_patch_k_reruns_what_reads_the_change_where_it_is(suites, k, path, text,
                                                                  reads_it, capsys):
    """Each test file runs once per tree content it reads: the edit of patch k is in
    every tree from prefix k on, and a later prefix reuses the first one's run."""
    _change_patch(suites, k, path, text)
    assert _test(suites) == 0
    lints = {("lint", LINT)} | {(f"prefix {j}/3", LINT) for j in range(k, 3)}
    assert _ran(suites) == lints | reads_it
    # A rerun says what changed since its last green run.
    out = capsys.readouterr().out
    row, test = sorted(reads_it)[0]
    said = out.split("run  [")[1:]
    line = next(line.splitlines()[0] for line in said if f"] {row}: {test}  (" in line)
    assert "changed since " in line and path in line


TEST_BACKWARD = ("\n\ndef test_backward():\n    from vllm.models.foo import backward\n\n"
                 "    assert backward(64) == 1\n")


def _tests_run(project, row: str, title: str) -> list[str]:
    """The tests the latest run of a unit ran, as its junit file names them."""
    xml = (project.root / _parts(project)[(row, title)]["log"]).with_suffix(".xml")
    return sorted(case.get("name") for case in ET.parse(xml).getroot().iter("testcase"))


def test_a_change_inside_a_function_reruns_every_test_of_the_unit(suites):
    """Patch 1 gets a second test; an edit of backward(), which test_forward never
    calls, still runs test_forward again: the tests of a unit share a process,
    and what one ran can change what another sees (test_testsound.py). A
    comment is a change too: a unit is keyed by the bytes it read."""
    _change_patch(suites, 1, "tests/test_foo.py", TEST_FOO_PATCHED + TEST_BACKWARD)
    assert _test(suites) == 0
    _ran(suites)
    for edit in ("x / BLOCK / 1", "x / BLOCK / 1  # ok"):
        _change_patch(suites, 1, "vllm/models/foo.py", FOO_PATCHED.replace("x / BLOCK", edit))
        assert _test(suites) == 0
        assert {row for row, title in _ran(suites) if title == FOO} == {
            "prefix 1/3", "stack (ROCm)"}
        assert _tests_run(suites, "prefix 1/3", FOO) == ["test_backward", "test_forward"]
        part = _parts(suites)[("prefix 1/3", FOO)]
        assert (part["passed"], part["note"]) == (2, "")
        # A second tree with the same edit reuses the first's result whole.
        assert _parts(suites)[("prefix 2/3", FOO)]["reused"]


def test_a_changed_patch_that_breaks_its_prefixes_is_caught(suites, capsys):
    """Patch 2 now returns 41 and a new patch 4 puts 42 back: the full stack is
    green, the trees after patches 2 and 3 are red, the one after patch 1 is reused."""
    _change_patch(suites, 2, "vllm/models/new.py", NEW_MODEL.replace("42", "41"))
    suites.commit("[ROCm] Put the answer back", {"vllm/models/new.py": NEW_MODEL})
    suites.ok("patches")
    assert _test(suites) == 1
    rows = {row["name"]: row for row in _summary(suites)["rows"]}
    assert [rows[f"prefix {k}/4"]["failed"] for k in (1, 2, 3)] == [0, 1, 1]
    assert rows["prefix 1/4"]["reused"]  # the tree of prefix 1/3 before
    assert rows["stack"]["failed"] == 0
    out = capsys.readouterr().out
    assert "  FAIL prefix 2/4: PYTHONPATH=" in out and "tests/test_new.py" in out
    assert out.strip().splitlines()[-1].endswith("2 failed, 0 skipped")


@pytest.mark.parametrize("path", ["tests/verification/test_verify.py",
                                  "requirements/venv.lock", "pytest.ini"],
                         ids=["project-test", "lock", "new-pytest-ini"])
def test_a_changed_project_test_or_lock_reruns_every_command(suites, path, capsys):
    target = suites.root / path
    target.write_text((target.read_text() if target.exists() else "[pytest]\n") + "\n# edited\n")
    assert _test(suites) == 0
    assert _ran(suites) == FIRST
    assert sum(row["reused"] for row in _summary(suites)["rows"]) == 1  # the stack row
    how = "changed" if path != "pytest.ini" else "added"
    assert f"({path} {how})" in capsys.readouterr().out


def test_prose_and_the_exported_patches_are_no_inputs(suites):
    """patches/ is build/vllm exported (keyed by its tree ids); no test reads
    README.md or BENCHMARKS.md."""
    (suites.root / "README.md").write_text("# fake, reworded\n")
    (suites.root / "BENCHMARKS.md").write_text("# figures, measured again\n")
    (suites.patches / "notes").mkdir()
    (suites.patches / "notes" / "x.md").write_text("## Rationale\n")
    assert _test(suites) == 0
    assert _ran(suites) == set()


def test_a_tooling_test_that_reads_prose_is_a_unit_keyed_by_it(suites):
    """docs/ is prose, but the code map test compares docs/code-map.md with
    `make help`: that test is a unit of its own, which an edit of the page
    reruns alone (and an edit of other prose does not)."""
    code_map, (page,) = next(iter(testrun.PROSE_TESTS.items()))
    (suites.root / page).parent.mkdir(parents=True, exist_ok=True)
    (suites.root / page).write_text("# the code map\n")
    (suites.root / code_map).write_text("def test_map():\n    pass\n")
    assert _test(suites) == 0
    assert ("tooling", code_map) in _ran(suites)  # a new project file: every key changed
    commands = {p["title"]: p["command"] for p in _parts(suites).values()
                if p["title"].startswith("tests/tooling")}
    assert commands["tests/tooling"].endswith(f"tests/tooling --ignore={code_map}")
    (suites.root / "README.md").write_text("# fake, reworded\n")
    assert _test(suites) == 0
    assert _ran(suites) == set()
    (suites.root / page).write_text("# the code map, reworded\n")
    assert _test(suites) == 0
    assert _ran(suites) == {("tooling", code_map)}


def test_the_runbook_example_is_an_input_of_the_tooling_row_only(suites):
    """docs/ is prose, but tests/tooling compares docs/runbook-example with what
    the runbook writes: a hand edit there must rerun that row."""
    example = suites.root / "docs" / "runbook-example"
    example.mkdir(parents=True)
    (example / "summary.md").write_text("# edited by hand\n")
    assert _test(suites) == 0
    assert _ran(suites) == {("tooling", "tests/tooling")}


def test_in_a_git_checkout_ignored_files_are_no_inputs_and_new_ones_are(suites):
    """The project's files are what git lists: a cache folder the project
    ignores changes no key; a new test file nobody committed yet does."""
    (suites.root / ".gitignore").write_text("/build/\n/.venv*/\n/.my-cache/\n")
    suites.git("init", "-q", cwd=suites.root)
    suites.git("add", "-A", cwd=suites.root)
    suites.git("commit", "-q", "-m", "the project", cwd=suites.root)
    assert _test(suites) == 0
    assert _ran(suites) == FIRST  # .gitignore is a new file
    (suites.root / ".my-cache").mkdir()
    (suites.root / ".my-cache" / "mypy.json").write_text("{}")
    assert _test(suites) == 0
    assert _ran(suites) == set()
    (suites.root / "tests/tooling/test_more.py").write_text(TOOLING_TEST)
    assert _test(suites) == 0
    assert _ran(suites) == FIRST


def test_a_command_reruns_when_an_input_it_declares_changes(suites, monkeypatch):
    """A command from another suite declares what else it reads; only it reruns."""
    def rows(layout, base, prefixes, servers):
        def run(log):
            _log("hadolint")
            return testrun.Part("install-overlay", ".", passed=1)
        job = testrun.Job("overlay", "install-overlay", "overlay", ("install-overlay",), None,
                          run, inputs=("vllm_overlay",))
        return [*original(layout, base, prefixes, servers),
                testrun.Row("overlay", None, [job])]

    original = testrun.test_rows
    monkeypatch.setattr(testrun, "test_rows", rows)
    assert _test(suites) == 0
    assert len(_ran(suites)) == 1
    assert _test(suites) == 0
    assert _ran(suites) == set()
    manifest = suites.overlay / "MANIFEST.json"
    manifest.write_text(manifest.read_text() + "\n")
    assert _test(suites) == 0
    assert len(_ran(suites)) == 1


def test_a_failed_command_is_never_reused(suites, tmp_path, monkeypatch):
    verify = suites.root / "tests/verification/test_verify.py"
    verify.write_text(verify.read_text() + "\n# a new key for every command\n")
    needed = tmp_path / "flaky-machine-is-ok"
    monkeypatch.setenv("FAKE_VERIFY_NEEDS", str(needed))
    assert _test(suites) == 1
    assert _ran(suites) == FIRST
    assert _test(suites) == 1  # still red: run again, not replayed
    assert _ran(suites) == {("verification", VERIFY)}
    needed.touch()
    assert _test(suites) == 0
    assert _ran(suites) == {("verification", VERIFY)}


def test_an_uncommitted_edit_in_build_vllm_reruns_what_reads_it(suites):
    head = suites.head()
    (suites.tree / "vllm/models/bar.py").write_text("def bar():\n    return 'bar'\n# edit\n")
    assert _test(suites) == 0
    assert _ran(suites) == {("lint", LINT), ("regression", BAR), ("regression (ROCm)", BAR)}
    # The tree id of the edit was taken without touching build/vllm's index or HEAD.
    assert suites.head() == head
    assert suites.git("diff", "--cached", "--name-only") == ""
    assert suites.git("status", "--porcelain", "--untracked-files=all") == (
        "M vllm/models/bar.py")  # " M", stripped


def test_a_new_module_a_test_looked_for_reruns_it(suites):
    """test_bar tries `import vllm.models.extra` and passes without it: a patch that
    adds that module can change its outcome, so it runs again (a module it never
    looked for would not)."""
    (suites.tree / "tests/test_bar.py").write_text(
        TEST_BAR + "\n\ndef test_extra():\n    try:\n        import vllm.models.extra\n"
        "    except ImportError:\n        return\n    assert vllm.models.extra.OK\n")
    assert _test(suites) == 0
    _ran(suites)
    (suites.tree / "vllm/models/unrelated.py").write_text("X = 1\n")
    assert _test(suites) == 0
    assert _ran(suites) == {("lint", LINT)}
    (suites.tree / "vllm/models/extra.py").write_text("OK = False\n")
    assert _test(suites) == 1
    assert _ran(suites) == {("lint", LINT), ("regression", BAR), ("regression (ROCm)", BAR)}


def test_vllm_variables_are_keys_but_the_makefiles_are_not(suites, monkeypatch):
    monkeypatch.setenv("VLLM_VERSION", "")  # what make exports to `make test`
    assert _test(suites) == 0
    assert _ran(suites) == set()
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert _test(suites) == 0
    assert _ran(suites)


@pytest.mark.parametrize("how", ["argument", "environment", "command-line"])
def test_fresh_runs_every_command(suites, monkeypatch, how):
    if how == "argument":
        assert _test(suites, fresh=True) == 0
    elif how == "environment":
        monkeypatch.setenv("K3_TEST_FRESH", "1")
        assert _test(suites) == 0
    else:
        monkeypatch.setenv("K3_PROJECT_ROOT", str(suites.root))
        assert main(["test", "--fresh"]) == 0
    assert _ran(suites) == ALL
    assert not any(row["reused"] for row in _summary(suites)["rows"])
    assert _summary(suites)["fresh"] is True


def test_only_runs_the_rows_it_names_with_the_same_reuse(suites, capsys):
    _change_patch(suites, 1, "vllm/models/foo.py", FOO_PATCHED.replace("x * BLOCK", "BLOCK * x"))
    assert _test(suites, only="prefix 2/3, stack (ROCm)") == 0
    assert _ran(suites) == {("prefix 2/3", LINT), ("prefix 2/3", FOO), ("stack (ROCm)", FOO)}
    summary = _summary(suites)
    assert [r["name"] for r in summary["rows"]] == ["prefix 2/3", "stack (ROCm)"]
    assert summary["only"] == ["prefix 2/3", "stack (ROCm)"]
    assert _test(suites, only="prefix 2/3") == 0
    assert _ran(suites) == set()
    with pytest.raises(StackError, match=r"^ONLY: no row named 'prefix 9/3'; the rows are "
                                         r"tooling, lint, recipes, prefix 1/3, "):
        _test(suites, only="stack,prefix 9/3")


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize(("variables", "args"), [
    (["FRESH=1"], ["--fresh", "--only", ""]), (["FRESH="], ["--only", ""]),
    (["FRESH=0"], ["--only", ""]),
    (["ONLY=prefix 3/7,stack (ROCm)"], ["--only", "prefix 3/7,stack (ROCm)"]),
    (["ONLY=$(shell echo no)`echo no`$$(echo no)"],
     ["--only", "$(shell echo no)`echo no`$$(echo no)"])],
    ids=["fresh", "not-fresh", "fresh-0", "only", "only-taken-literally"])
def test_make_test_passes_fresh_and_only_as_given(tmp_path, variables, args):
    """The recipe, run by a shell that prints its arguments instead of testing."""
    printer = tmp_path / "print-args"
    printer.write_text('#!/bin/sh\nshift 2\nfor a in "$@"; do printf "%s\\n" "[$a]"; done\n')
    printer.chmod(0o755)
    # Not the variables of a make this runs under (`make test FRESH=1` passes
    # FRESH on in MAKEFLAGS and the environment).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "FRESH", "ONLY")}
    result = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "-o", "build",
                             f"PYTHON={printer}", "test", *variables],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-len(args) - 1:] == ["[test]", *[f"[{a}]" for a in args]]


def test_the_summary_records_counts_retypable_commands_and_reuse(suites):
    _change_patch(suites, 2, "vllm/models/new.py", NEW_MODEL.replace("42", "40 + 2"))
    assert _test(suites) == 0
    summary = _summary(suites)
    rows = {row["name"]: row for row in summary["rows"]}
    assert list(rows) == ROWS
    assert summary["rows_reused"] == 7 and summary["parts_run"] == 4
    parts = _parts(suites)
    stack = parts[("stack", NEW)]
    assert stack["command"] == ("PYTHONPATH=.:../.. ../../.venv/bin/python -m pytest -q "
                                "-p no:cacheprovider tests/test_new.py")
    assert stack["where"] == "build/vllm" and stack["passed"] == 1
    # Reused from prefix 2/3, which ran it on the same reads.
    assert stack["reused"]["date"] >= summary["started"]
    assert parts[("prefix 2/3", NEW)]["reused"] is None
    assert parts[("prefix 1/3", FOO)]["reused"]["date"] < summary["started"]
    assert parts[("stack (ROCm)", NEW)]["command"] == (
        "PYTHONPATH=.:../../tests:../.. ../../.venv/bin/python -m pytest -q "
        "-p no:cacheprovider -p rocm_emulation.plugin tests/test_new.py")
    assert rows["stack"]["vllm_tree"] == summary["vllm"]["tree"]
    assert rows["tooling"]["vllm_tree"] is None
    assert summary["vllm"]["describe"].startswith(f"vllm-{V1}-3-g")
    assert summary["totals"]["passed"] == sum(r["passed"] for r in rows.values())
    runs = (suites.root / "build/test-results/runs.jsonl").read_text().splitlines()
    assert len(runs) == 2 and json.loads(runs[-1])["rows_reused"] == 7


def test_every_recorded_command_can_be_retyped_where_it_ran(suites):
    """Each pytest command of the summary, typed in a shell in its folder, gives
    the counts make test recorded (the prefix rows' worktrees are made again)."""
    parts = {k: p for k, p in _parts(suites).items() if "pytest" in p["command"]}
    assert len(parts) == len(ALL) - len(LINTS) - 1  # every pytest command
    suites.git("worktree", "add", "-q", "--detach", str(suites.root / "build/prefix-trees/2"),
               "HEAD~1")
    for (row, test), part in parts.items():
        if row in ("tooling", "prefix 1/3"):
            continue  # tooling: the fake project has no tooling of its own to test
        result = subprocess.run(part["command"], shell=True, cwd=suites.root / part["where"],
                                capture_output=True, text=True,
                                env={**os.environ, "FAKE_RUN_LOG": os.devnull})
        assert result.returncode == 0, (row, test, result.stdout, result.stderr)
        assert f"{part['passed']} passed" in result.stdout.splitlines()[-1]
