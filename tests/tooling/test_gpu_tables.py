"""BENCHMARKS.md's GPU tables are generated from their logs (`make gpu-tables`),
and `make check` fails where the page and a log disagree.

Some tests here read the real page and logs, so `make test` runs this file as
a unit of its own keyed by BENCHMARKS.md (scripts/testing/testrun.py
PROSE_TESTS); the logs under benchmarks/ are project inputs anyway.
"""

from __future__ import annotations

import shutil

from scripts.common import Layout
from tests.tooling.conftest import REPO

RESULTS = "benchmarks/gpu/results"
PRODUCTION = f"{RESULTS}/mla_decode-production-465f925-h100.log"
# The block decode's table on the real page: one run of flat, patched, before, reshape.
ON_PAGE = f"{RESULTS}/mla_decode-production-a9a8bca-h100.log"


def _page(*logs: str, tail: str = "What the page says after it.\n") -> str:
    regions_text = "".join(f"<!-- generated from {log} -->\nstale\n<!-- end generated -->\n\n"
                           for log in logs)
    return f"# Benchmarks\n\n## A kernel\n\n{regions_text}{tail}"


def _run_log() -> str:
    """A log of benchmarks/gpu/run.py: 'one' 0.990 with a band holding 1,
    'two' 0.980 with a band below it."""
    rows = [("one", "pristine", "10.00", "1", ""),
            ("", "patched", "9.90", "0.990", "0.980-1.010  yes"),
            ("two", "pristine", "10.00", "1", ""),
            ("", "patched", "9.80", "0.980", "0.970-0.990  yes")]
    header = f"{'shape':<13}{'tree':<9}median  p10  p90  /pristine  ratio p10-p90  same output"
    lines = ["case demo", header, "-" * 60]
    lines += [f"{shape:<13}{tree:<9}{median}  9.00  11.00  {ratio}  {band}".rstrip()
              for shape, tree, median, ratio, band in rows]
    return "\n".join(lines) + "\n\nreal 0m1s\n"


def test_a_ratio_is_faster_only_where_its_band_lies_below_1(project):
    log = project.root / RESULTS / "demo-h100.log"
    log.parent.mkdir(parents=True)
    log.write_text(_run_log())
    page = project.root / "BENCHMARKS.md"
    page.write_text(_page(f"{RESULTS}/demo-h100.log"))
    project.ok("gpu-tables")
    text = page.read_text()
    assert "stale" not in text and text.endswith("What the page says after it.\n")
    assert "| one | 10.00 | 9.90 | 0.990 (0.980-1.010) | yes |" in text
    assert ("faster (p10-p90 band below 1) at 1 (two); slower (band above 1) at none; the "
            "band holds 1 (no measurable difference) at 1." in text)
    assert project.ok("gpu-tables").stdout.strip().endswith("matches its log")


def test_the_mla_figures_are_the_logs_summary_and_the_runs_own_peaks(project):
    """The per-row speed-up (median of the replay ratios) says 3.02x at its
    lowest; the log's summary (ratio of the medians) 3.03x: the page quotes
    the summary, its fp8 count (31, at > 1.03) and this run's bandwidth."""
    (project.root / RESULTS).mkdir(parents=True)
    shutil.copy2(REPO / PRODUCTION, project.root / PRODUCTION)
    page = project.root / "BENCHMARKS.md"
    page.write_text(_page(PRODUCTION))
    project.ok("gpu-tables")
    text = page.read_text()
    assert "copy bandwidth 3.02 TB/s, bf16 peak 778 TFLOP/s, measured in the same run" in text
    assert "| 16 x 32k, 3 x 32, bf16, 16 | 2.152 | 0.711 | 0.706 | 3.02x | 3.03x |" in text
    assert "patched over flat at >= 16k context: 3.03-15.03x over 72 shapes, 0 under 3x" in text
    assert "patched / before: 0.98-1.01 over 76 shapes, slower (> 1.03) at 0" in text
    assert "fp8 slower (> 1.03) at 31" in text


def test_gpu_tables_writes_nothing_when_a_log_is_missing(project):
    (project.root / RESULTS).mkdir(parents=True)
    shutil.copy2(REPO / PRODUCTION, project.root / PRODUCTION)
    page = project.root / "BENCHMARKS.md"
    page.write_text(_page(PRODUCTION, f"{RESULTS}/gone-h100.log"))
    before = page.read_bytes()
    result = project.run("gpu-tables")
    assert result.returncode == 1
    assert f"{RESULTS}/gone-h100.log, which does not exist" in result.stderr
    assert page.read_bytes() == before  # the first region was not written either
    assert not [p for p in project.root.iterdir() if p.name.startswith(".BENCHMARKS.md")]


def test_check_names_the_table_and_the_log_that_disagree(stacked):
    """A figure edited by hand in a copy of the real page fails `make check`,
    which names the table's log and section; `make gpu-tables` puts it back."""
    shutil.copy2(REPO / "BENCHMARKS.md", stacked.root / "BENCHMARKS.md")
    shutil.copytree(REPO / RESULTS, stacked.root / RESULTS)
    stacked.ok("check")
    page = stacked.root / "BENCHMARKS.md"
    good = page.read_text()
    assert good.count("3.02-14.71x") == 2  # the summary table and the section
    page.write_text(good.replace("0 under 3x\n", "0 under 3x (3.03-15.03x)\n"))
    result = stacked.run("check")
    assert result.returncode == 1
    assert (f"the table generated from {ON_PAGE} (section \"Triton MLA decode of a "
            "non-causal draft block\") disagrees with" in result.stdout)
    assert "run `make gpu-tables`" in result.stdout
    stacked.ok("gpu-tables")
    assert page.read_text() == good
    stacked.ok("check")


def test_the_page_agrees_with_its_logs():
    """The real BENCHMARKS.md: every GPU table is generated, and from its log."""
    from scripts.perf.gpu_tables import page_problems, regions

    logs = {r.log for r in regions((REPO / "BENCHMARKS.md").read_text().splitlines())}
    assert {f"{RESULTS}/rejection_sample-465f925-h100.log", ON_PAGE,
            f"{RESULTS}/rope_cache-9cdfbba-h100.log"} <= logs
    assert None in logs  # the summary of the GPU tables
    assert page_problems(Layout(REPO)) == []
