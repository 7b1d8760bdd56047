"""`make test` reuses a green row whose inputs are unchanged, and only then.

A fake three-patch stack with real vLLM-style tests in its tree, the project's
own tooling and verification tests, and a .venv whose python logs every run:
the log, not the summary, says which rows really ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import testrun
from scripts.__main__ import main
from scripts.common import Layout
from tests.tooling.conftest import (
    FOO_PATCHED,
    NEW_MODEL,
    PYTHON,
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
# Fails while the file FAKE_VERIFY_NEEDS names is missing: an outside condition
# (a flaky machine) that is no input of the key.
VERIFY_TEST = """\
import os
from pathlib import Path


def test_verify():
    needed = os.environ.get("FAKE_VERIFY_NEEDS")
    assert needed is None or Path(needed).exists()
"""
ALL_ROWS = {"tooling", "lint", "recipes", "stack", "prefix 1/3", "prefix 2/3",
            "regression", "verification", "stack (ROCm)", "regression (ROCm)"}
FULL_STACK_ROWS = {"lint", "stack", "regression", "verification", "stack (ROCm)",
                   "regression (ROCm)"}

_TEMPLATE: dict[str, Path] = {}


def _fake_lint(layout, base, tree, suite="lint"):
    _log(f"lint {suite}")
    return testrun.Outcome(suite, passed=1, parts=[testrun.Part("fake lint", "build/vllm", 1)])


def _fake_hadolint(layout):
    _log("lint recipes")
    return testrun.Outcome("recipes", passed=1)


def _log(line: str) -> None:
    with open(os.environ["FAKE_RUN_LOG"], "a") as f:
        f.write(line + "\n")


def _make_suite_project(project) -> None:
    """Three patches (1 and 2 with tests), a regression list, the project's own suites."""
    project.use_release(V1, files={**release_files(V1), "tests/test_bar.py": TEST_BAR.encode()})
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
    monkeypatch.setenv("FAKE_RUN_LOG", str(tmp_path / "runs.log"))
    monkeypatch.delenv("K3_TEST_FRESH", raising=False)
    monkeypatch.delenv("FAKE_VERIFY_NEEDS", raising=False)
    if "suites" not in _TEMPLATE:
        _make_suite_project(project)
        assert _test(project) == 0
        assert _ran(project) == ALL_ROWS
        saved = tmp_path_factory.mktemp("suites") / "proj"
        shutil.copytree(project.root, saved, symlinks=True)
        _TEMPLATE["suites"] = saved
    else:
        shutil.rmtree(project.root)
        shutil.copytree(_TEMPLATE["suites"], project.root, symlinks=True)
    return project


def _test(project, fresh: bool = False) -> int:
    return testrun.run_all(Layout(project.root), fresh=fresh)


def _ran(project) -> set[str]:
    """The rows that really ran since the last call: pytest runs and fake lints."""
    log = Path(os.environ["FAKE_RUN_LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    ran = set()
    for line in lines:
        if line.startswith("lint "):
            ran.add(line[len("lint "):])
        for word in line.split():
            if word.startswith("--junitxml="):
                ran.add(Path(word).stem.replace("-of-", "/").replace("-", " "))
    return ran


def _summary(project) -> dict:
    return json.loads((project.root / "build/test-results/summary.json").read_text())


def _reused(project) -> set[str]:
    return {row["name"] for row in _summary(project)["rows"] if row["reused"]}


def _change_patch(project, k: int, path: str, text: str) -> None:
    """Edit patch k in build/vllm (the later ones rebuilt on it) and export."""
    commits = project.git("rev-list", "--reverse", f"vllm-{V1}..HEAD").split()
    project.git("reset", "-q", "--hard", commits[k - 1])
    (project.tree / path).write_text(text)
    project.git("commit", "-q", "-a", "--amend", "--no-edit")
    for later in commits[k:]:
        project.git("cherry-pick", later)
    project.ok("patches")


def test_a_second_run_with_nothing_changed_reuses_every_row(suites, capsys):
    totals = _summary(suites)["totals"]
    assert _test(suites) == 0
    assert _ran(suites) == set()
    assert _reused(suites) == ALL_ROWS
    out = capsys.readouterr().out
    assert out.count("reused: green at ") == len(ALL_ROWS)
    n = len(ALL_ROWS)
    assert f"{n} rows: 0 run, {n} reused (make test FRESH=1 runs them all)" in out
    # The closing line CI reads counts the reused results too.
    assert out.strip().splitlines()[-1] == (f"{totals['passed']} passed, 0 failed, "
                                            f"{totals['skipped']} skipped")
    assert not (suites.root / "build" / "prefix-tree").exists()


@pytest.mark.parametrize(("k", "path", "text"), [
    (1, "vllm/models/foo.py", FOO_PATCHED + "\n# patch 1, edited\n"),
    (2, "vllm/models/new.py", NEW_MODEL + "\n# patch 2, edited\n"),
], ids=["patch-1", "patch-2"])
def test_changing_patch_k_reruns_the_prefixes_from_k_and_the_full_stack(suites, k, path, text):
    _change_patch(suites, k, path, text)
    assert _test(suites) == 0
    later_prefixes = {f"prefix {j}/3" for j in range(k, 3)}
    assert _ran(suites) == FULL_STACK_ROWS | later_prefixes
    assert _reused(suites) == ALL_ROWS - FULL_STACK_ROWS - later_prefixes


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
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
        "2 failed, 0 skipped")


@pytest.mark.parametrize("path", ["tests/verification/test_verify.py",
                                  "requirements/venv.lock", "pytest.ini"],
                         ids=["project-test", "lock", "new-pytest-ini"])
def test_a_changed_project_test_or_lock_reruns_every_row(suites, path):
    target = suites.root / path
    target.write_text((target.read_text() if target.exists() else "[pytest]\n") + "\n# edited\n")
    assert _test(suites) == 0
    assert _ran(suites) == ALL_ROWS
    assert _reused(suites) == set()


def test_prose_and_the_exported_patches_are_no_inputs(suites):
    """patches/ is build/vllm exported (keyed by its tree ids); no test reads README.md."""
    (suites.root / "README.md").write_text("# fake, reworded\n")
    (suites.patches / "notes").mkdir()
    (suites.patches / "notes" / "x.md").write_text("## Rationale\n")
    assert _test(suites) == 0
    assert _ran(suites) == set()


def test_the_runbook_example_is_an_input_of_the_tooling_row_only(suites):
    """docs/ is prose, but tests/tooling compares docs/runbook-example with what
    the runbook writes: a hand edit there must rerun that row."""
    example = suites.root / "docs" / "runbook-example"
    example.mkdir(parents=True)
    (example / "summary.md").write_text("# edited by hand\n")
    assert _test(suites) == 0
    assert _ran(suites) == {"tooling"}


def test_in_a_git_checkout_ignored_files_are_no_inputs_and_new_ones_are(suites):
    """The project's files are what git lists: a cache folder the project
    ignores changes no key; a new test file nobody committed yet does."""
    (suites.root / ".gitignore").write_text("/build/\n/.venv*/\n/.my-cache/\n")
    suites.git("init", "-q", cwd=suites.root)
    suites.git("add", "-A", cwd=suites.root)
    suites.git("commit", "-q", "-m", "the project", cwd=suites.root)
    assert _test(suites) == 0
    assert _ran(suites) == ALL_ROWS  # .gitignore is a new file
    (suites.root / ".my-cache").mkdir()
    (suites.root / ".my-cache" / "mypy.json").write_text("{}")
    assert _test(suites) == 0
    assert _ran(suites) == set()
    (suites.root / "tests/tooling/test_more.py").write_text(TOOLING_TEST)
    assert _test(suites) == 0
    assert _ran(suites) == ALL_ROWS


def test_a_row_reruns_when_an_input_it_declares_changes(suites, monkeypatch):
    """A row from another suite declares what else it reads; only that row reruns."""
    def rows(layout, base, results_dir, prefixes):
        def run():
            _log("lint overlay")
            return testrun.Outcome("overlay", passed=1)
        return [*original(layout, base, results_dir, prefixes),
                testrun.Row("overlay", None, ("install-overlay",), run,
                            inputs=("vllm_overlay",))]

    original = testrun.test_rows
    monkeypatch.setattr(testrun, "test_rows", rows)
    assert _test(suites) == 0
    assert _ran(suites) == {"overlay"}
    assert _test(suites) == 0
    assert _ran(suites) == set()
    manifest = suites.overlay / "MANIFEST.json"
    manifest.write_text(manifest.read_text() + "\n")
    assert _test(suites) == 0
    assert _ran(suites) == {"overlay"}


def test_a_failed_row_is_never_reused(suites, tmp_path, monkeypatch):
    verify = suites.root / "tests/verification/test_verify.py"
    verify.write_text(verify.read_text() + "\n# a new key for every row\n")
    needed = tmp_path / "flaky-machine-is-ok"
    monkeypatch.setenv("FAKE_VERIFY_NEEDS", str(needed))
    assert _test(suites) == 1
    assert _ran(suites) == ALL_ROWS
    assert _test(suites) == 1  # still red: run again, not replayed
    assert _ran(suites) == {"verification"}
    needed.touch()
    assert _test(suites) == 0
    assert _ran(suites) == {"verification"}
    assert _reused(suites) == ALL_ROWS - {"verification"}


def test_an_uncommitted_edit_in_build_vllm_reruns_the_full_stack_rows(suites):
    head = suites.head()
    (suites.tree / "vllm/models/bar.py").write_text("def bar():\n    return 'bar'\n# edit\n")
    assert _test(suites) == 0
    assert _ran(suites) == FULL_STACK_ROWS
    # The tree id of the edit was taken without touching build/vllm's index or HEAD.
    assert suites.head() == head
    assert suites.git("diff", "--cached", "--name-only") == ""
    assert suites.git("status", "--porcelain", "--untracked-files=all") == (
        "M vllm/models/bar.py")  # " M", stripped


@pytest.mark.parametrize("how", ["argument", "environment", "command-line"])
def test_fresh_runs_every_row(suites, monkeypatch, how):
    if how == "argument":
        assert _test(suites, fresh=True) == 0
    elif how == "environment":
        monkeypatch.setenv("K3_TEST_FRESH", "1")
        assert _test(suites) == 0
    else:
        monkeypatch.setenv("K3_PROJECT_ROOT", str(suites.root))
        assert main(["test", "--fresh"]) == 0
    assert _ran(suites) == ALL_ROWS
    assert _reused(suites) == set()
    assert _summary(suites)["fresh"] is True


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize(("value", "flag"), [("1", True), ("", False), ("0", False)])
def test_make_test_fresh_passes_the_flag(value, flag):
    dry = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO),
                          f"PYTHON={PYTHON}", "test", f"FRESH={value}"],
                         capture_output=True, text=True, timeout=60)
    last = dry.stdout.strip().splitlines()[-1]
    assert last.endswith("-m scripts test --fresh" if flag else "-m scripts test")


def test_the_summary_records_counts_commands_and_reuse(suites):
    _change_patch(suites, 2, "vllm/models/new.py", NEW_MODEL + "\n# edited\n")
    assert _test(suites) == 0
    summary = _summary(suites)
    rows = {row["name"]: row for row in summary["rows"]}
    assert list(rows) == ["tooling", "lint", "recipes", "stack", "prefix 1/3",
                          "prefix 2/3", "regression", "verification", "stack (ROCm)",
                          "regression (ROCm)"]
    assert (summary["rows_run"], summary["rows_reused"]) == (7, 3)
    assert rows["stack"]["parts"] == [{
        "command": "pytest -q tests/test_foo.py tests/test_new.py", "where": "build/vllm",
        "passed": 2, "failed": 0, "skipped": 0}]
    assert rows["prefix 2/3"]["parts"][1]["command"] == (
        "pytest -q tests/test_foo.py tests/test_new.py")
    assert rows["prefix 1/3"]["reused"]["date"] < summary["started"]
    assert rows["stack"]["vllm_tree"] == summary["vllm"]["tree"]
    assert rows["tooling"]["vllm_tree"] is None
    assert summary["vllm"]["describe"].startswith(f"vllm-{V1}-3-g")
    assert summary["totals"]["passed"] == sum(r["passed"] for r in rows.values())
    runs = (suites.root / "build/test-results/runs.jsonl").read_text().splitlines()
    assert len(runs) == 2 and json.loads(runs[-1])["rows_reused"] == 3
