"""`make test` runs each proper prefix of the stack on its own, in a worktree."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.common import Layout
from scripts.testing import testrun
from scripts.testing.prefixes import PrefixTrees
from tests.tooling.conftest import FOO_PATCHED, TEST_FOO_PATCHED, V1

BASE = f"vllm-{V1}"
TEST_NEW = """\
from vllm.models.new import new_model


def test_new():
    assert new_model() == 42
"""


@pytest.fixture
def runner(stacked, monkeypatch):
    """The stacked project with venvs whose python is this interpreter (which has
    pytest), the project files make test reads, and a lint that passes."""
    layout = Layout(stacked.root)
    for venv in (layout.venv, layout.lint_venv):
        python = venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
    for path in ("tests/vllm_regression.txt", "tests/vllm_regression_rocm.txt"):
        (stacked.root / path).parent.mkdir(parents=True, exist_ok=True)
        (stacked.root / path).write_text("")
    monkeypatch.setattr(testrun, "_lint", lambda layout, base, tree: testrun.Part("", ""))
    stacked.layout = layout
    return stacked


def _run_prefixes(project) -> dict[str, dict]:
    """Run the prefix rows; their rows of summary.json by name."""
    rows = testrun.test_rows(project.layout, BASE, PrefixTrees(project.layout))
    prefixes = [row.name for row in rows if row.name.startswith("prefix ")]
    testrun.run_all(project.layout, only=",".join(prefixes))
    summary = json.loads((project.layout.build_dir / "test-results/summary.json").read_text())
    return {row["name"]: row for row in summary["rows"]}


def test_each_prefix_runs_the_tests_it_has_against_its_own_tree(runner):
    runner.commit("[ROCm] Test the new model", {"tests/test_new.py": TEST_NEW})
    head = runner.head()
    rows = _run_prefixes(runner)
    # Three patches: prefixes 1 and 2 (the full stack is the stack suite's).
    assert list(rows) == ["prefix 1/3", "prefix 2/3"]
    assert [(r["passed"], r["failed"]) for r in rows.values()] == [(1, 0), (1, 0)]
    assert [p["where"] for p in rows["prefix 2/3"]["parts"]] == ["build/prefix-trees/2"] * 2
    # The worktrees are gone and build/vllm is as it was.
    assert not (runner.root / "build" / "prefix-trees").exists()
    assert runner.git("worktree", "list").count("\n") == 0
    assert runner.head() == head
    assert runner.git("status", "--porcelain") == ""


def test_a_test_that_needs_a_later_patch_fails_its_prefix(runner):
    """Patch 3 asserts BLOCK = 128, which only patch 4 sets: the tree after
    patch 3 is red although the full stack is green."""
    wide = TEST_FOO_PATCHED.replace("== 64", "== 128").replace("test_forward", "test_wide")
    runner.commit("[ROCm] Test a wider block", {"tests/test_wide.py": wide})
    runner.commit("[ROCm] Widen the block", {
        "vllm/models/foo.py": FOO_PATCHED.replace("BLOCK = 64", "BLOCK = 128"),
        "tests/test_foo.py": TEST_FOO_PATCHED.replace("== 64", "== 128")})
    rows = _run_prefixes(runner)
    assert rows["prefix 1/4"]["failed"] == 0
    assert rows["prefix 2/4"]["failed"] == 0
    assert rows["prefix 3/4"]["failed"] == 1  # test_wide
    assert rows["prefix 3/4"]["passed"] == 1  # test_foo, still 64 there


def test_a_stack_of_one_patch_has_no_proper_prefix(project):
    project.ok("apply")
    project.commit("[ROCm] Only patch", {"vllm/models/new.py": "X = 1\n"})
    layout = Layout(project.root)
    with PrefixTrees(layout) as prefixes:
        assert testrun._prefix_rows(layout, BASE, prefixes) == []


def test_each_prefix_row_runs_the_kernel_budget_check_on_its_own_tree(runner):
    """The project's per-prefix check (testrun.PREFIX_BUDGET) runs in every
    prefix row, with that prefix's worktree first on PYTHONPATH."""
    check = runner.root / testrun.PREFIX_BUDGET
    check.parent.mkdir(parents=True, exist_ok=True)
    check.write_text(
        "import vllm\n\n\ndef test_imports_vllm_from_the_prefix():\n"
        "    assert '/build/prefix-trees/' in vllm.__file__\n")
    runner.commit("[ROCm] Test the new model", {"tests/test_new.py": TEST_NEW})
    rows = _run_prefixes(runner)
    assert [(r["passed"], r["failed"]) for r in rows.values()] == [(2, 0), (2, 0)]
    assert [p["where"] for p in rows["prefix 2/3"]["parts"]] == [
        "build/prefix-trees/2", "build/prefix-trees/2", "."]
