"""`make test` runs each proper prefix of the stack on its own, in a worktree."""

from __future__ import annotations

import sys
from contextlib import ExitStack

import pytest

from scripts import testrun
from scripts.common import Layout
from tests.tooling.conftest import FOO_PATCHED, TEST_FOO_PATCHED, V1

BASE = f"vllm-{V1}"
TEST_NEW = """\
from vllm.models.new import new_model


def test_new():
    assert new_model() == 42
"""


@pytest.fixture
def runner(stacked, monkeypatch):
    """The stacked project with a .venv whose python is this interpreter
    (which has pytest); the lint suite needs .venv-lint, which is not here."""
    layout = Layout(stacked.root)
    python = layout.venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(testrun, "_lint",
                        lambda layout, base, tree, suite="lint": testrun.Outcome(suite))
    stacked.layout = layout
    return stacked


def _run_prefixes(project) -> list[testrun.Outcome]:
    results = project.layout.build_dir / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    with ExitStack() as exits:
        rows = testrun._prefix_rows(project.layout, BASE, results,
                                    testrun.PrefixCheckout(project.layout, exits))
        return [row.run() for row in rows]


def test_each_prefix_runs_the_tests_it_has_against_its_own_tree(runner):
    runner.commit("[ROCm] Test the new model", {"tests/test_new.py": TEST_NEW})
    head = runner.head()
    outcomes = _run_prefixes(runner)
    # Three patches: prefixes 1 and 2 (the full stack is the stack suite's).
    assert [o.suite for o in outcomes] == ["prefix 1/3", "prefix 2/3"]
    assert [(o.passed, o.failed) for o in outcomes] == [(1, 0), (1, 0)]
    # The worktree is gone and build/vllm is as it was.
    assert not (runner.root / "build" / "prefix-tree").exists()
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
    outcomes = {o.suite: o for o in _run_prefixes(runner)}
    assert outcomes["prefix 1/4"].failed == 0
    assert outcomes["prefix 2/4"].failed == 0
    assert outcomes["prefix 3/4"].failed == 1  # test_wide
    assert outcomes["prefix 3/4"].passed == 1  # test_foo, still 64 there


def test_a_stack_of_one_patch_has_no_proper_prefix(project):
    project.ok("apply")
    project.commit("[ROCm] Only patch", {"vllm/models/new.py": "X = 1\n"})
    layout = Layout(project.root)
    with ExitStack() as exits:
        assert testrun._prefix_rows(layout, BASE, layout.build_dir,
                                    testrun.PrefixCheckout(layout, exits)) == []
