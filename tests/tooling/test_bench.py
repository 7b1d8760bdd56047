"""`make bench` prints each command's timing next to its goal, in a scratch copy."""

from __future__ import annotations

from tests.tooling.conftest import snapshot


def test_bench_prints_every_figure_and_leaves_the_project_alone(stacked):
    before = snapshot(stacked.root)
    out = stacked.ok("bench").stdout
    for row in ("make check, cold (no build/)", "make check, again",
                "make apply, cold (unpack + git am)", "make apply, again",
                "make patches, unchanged stack"):
        assert row in out
    assert out.count("within goal") + out.count("OVER GOAL") == 3
    assert "patches" in out and "2 files" in out
    # The fake project has no .venv: the kernel budget is skipped, not fatal.
    assert "kernel budget: skipped, .venv is missing" in out
    assert snapshot(stacked.root) == before


def test_bench_names_the_command_that_failed(stacked):
    (stacked.patches / "series").write_text("missing.patch\n")
    result = stacked.run("bench")
    assert result.returncode != 0
    assert "`make check` failed in the benchmark's scratch project" in result.stderr
