"""`make bench` prints each command's timing next to its goal, in a scratch copy."""

from __future__ import annotations

from scripts.common import Layout
from scripts.perf.bench import recorded_test_runs
from scripts.perf.code_size import rebase_code_size
from scripts.testing.testcache import ResultStore
from tests.tooling.conftest import snapshot


def test_bench_prints_every_figure_and_leaves_the_project_alone(stacked):
    before = snapshot(stacked.root)
    out = stacked.ok("bench").stdout
    for row in ("make check, cold (no build/)", "make check, again",
                "make apply, cold (unpack + git am)", "make apply, again",
                "make patches, unchanged stack", "make export (PR folders)"):
        assert row in out
    assert out.count("within goal") + out.count("OVER GOAL") == 5
    assert "make rebase code (lines / code lines)" in out
    assert "patches" in out and "2 files" in out
    # The fake project has no .venv: the venv's reports are skipped, not fatal.
    assert "kernel budget: skipped, .venv is missing" in out
    assert "AMD compile resources: skipped, .venv is missing" in out
    assert "make test: no run recorded yet in build/test-results/runs.jsonl" in out
    assert snapshot(stacked.root) == before


def test_bench_names_the_command_that_failed(stacked):
    (stacked.patches / "series").write_text("missing.patch\n")
    result = stacked.run("bench")
    assert result.returncode != 0
    assert "`make check` failed in the benchmark's scratch project" in result.stderr


def test_bench_prints_the_recorded_make_test_runs(tmp_path):
    """make test times itself; bench prints its latest runs against the warm goal."""
    layout = Layout(tmp_path)
    store = ResultStore(layout)
    for wall, run, reused in ((1236.0, 9, 0), (250.0, 4, 5), (420.0, 6, 3), (2.0, 0, 9)):
        store.write_summary({
            "started": "2026-03-04T05:06:07+00:00", "wall_seconds": wall, "fresh": False,
            "vllm": {"describe": "vllm-0.33.0-5-gabc"}, "rows_run": run, "rows_reused": reused,
            "totals": {"passed": 10, "failed": 0, "skipped": 1}})
    lines = recorded_test_runs(layout)
    assert "latest 4 run(s) of this project" in lines[0]
    rows = lines[2:]
    assert rows[0].split()[3:7] == ["1236s", "9", "0", "0"] and "goal" not in rows[0]
    assert rows[1].endswith("within goal (< 300 s with commands reused)")
    assert rows[2].endswith("OVER GOAL (< 300 s with commands reused)")
    assert "goal" not in rows[3]  # everything reused: not a run after a change


def test_rebase_code_size_counts_what_rebase_needs_and_only_code(tmp_path):
    """rebase.py whole, plus the helpers it reaches through other helpers; an
    unused helper, blank lines, comments and docstrings are not code."""
    (tmp_path / "rebase.py").write_text(
        '"""Doc."""\nfrom scripts.stack.gitrepo import git\n\n\n'
        "def rebase():\n    # why\n    return git()\n")
    (tmp_path / "gitrepo.py").write_text(
        'def git():\n    """Doc,\n    more."""\n    return head()\n\n\n'
        "def head():\n    return 1\n\n\ndef unused():\n    return 2\n")
    (tmp_path / "apply.py").write_text("def guard():\n    return git()\n")
    # rebase.py: 7 lines, 3 of code; git(): 4 and 2; head(): 2 and 2.
    assert rebase_code_size(tmp_path) == (13, 7)
