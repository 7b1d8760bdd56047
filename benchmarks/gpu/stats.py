"""Summaries and the result table of the GPU benchmark (plain Python, no torch).

Each tree's graph replays are interleaved with the baseline's, so replay r of
every tree ran under the same clocks and load; ratios are taken replay by
replay and summarized like the times.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

BASELINE = "pristine"


@dataclass(frozen=True)
class Summary:
    """Median and 10th/90th percentiles of a list of samples."""

    median: float
    p10: float
    p90: float
    count: int

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples to summarize")
        if len(samples) == 1:
            return cls(samples[0], samples[0], samples[0], 1)
        deciles = statistics.quantiles(samples, n=10, method="inclusive")
        return cls(statistics.median(samples), deciles[0], deciles[-1], len(samples))


@dataclass(frozen=True)
class Row:
    """One tree at one shape: microseconds per call, and how it compares."""

    shape: str
    tree: str
    micros: Summary | None  # None: the tree lacks what the case calls
    ratio: Summary | None  # against the baseline; None for the baseline itself
    same_output: bool | None  # None for the baseline and for unavailable trees
    note: str = ""


def paired_ratios(times: list[float], baseline: list[float]) -> list[float]:
    """Replay-by-replay ratios of a tree's times to the baseline's."""
    if len(times) != len(baseline):
        raise ValueError(f"{len(times)} replays against {len(baseline)} of the baseline")
    return [t / b for t, b in zip(times, baseline)]


def rows_for_shape(
    shape: str,
    times: dict[str, list[float] | None],
    same_output: dict[str, bool],
    notes: dict[str, str] | None = None,
) -> list[Row]:
    """Rows of one shape, the baseline first, trees in the order given."""
    notes = notes or {}
    baseline = times.get(BASELINE)
    rows = []
    for tree in sorted(times, key=lambda name: name != BASELINE):
        samples = times[tree]
        micros = Summary.of(samples) if samples else None
        ratio = None
        if tree != BASELINE and samples and baseline:
            ratio = Summary.of(paired_ratios(samples, baseline))
        same = None if tree == BASELINE or not samples else same_output.get(tree)
        rows.append(Row(shape, tree, micros, ratio, same, notes.get(tree, "")))
    return rows


def format_table(title: str, rows: list[Row]) -> str:
    """A fixed-width table: time per call in microseconds, ratio to the baseline."""
    shape_width = max([len("shape"), *(len(r.shape) for r in rows)])
    tree_width = max([len("tree"), *(len(r.tree) for r in rows)])
    header = (f"{'shape':<{shape_width}}  {'tree':<{tree_width}}  {'median':>8}"
              f"  {'p10':>8}  {'p90':>8}  {'/' + BASELINE:>10}  {'ratio p10-p90':>13}"
              f"  same output")
    lines = [title, header, "-" * len(header)]
    previous_shape = None
    for row in rows:
        shape = row.shape if row.shape != previous_shape else ""
        previous_shape = row.shape
        if row.micros is None:
            cells = f"{'n/a':>8}  {'':>8}  {'':>8}  {'':>10}  {'':>13}"
        else:
            m = row.micros
            cells = f"{m.median:>8.2f}  {m.p10:>8.2f}  {m.p90:>8.2f}"
            if row.ratio is None:
                cells += f"  {'1':>10}  {'':>13}"
            else:
                r = row.ratio
                cells += f"  {r.median:>10.3f}  {f'{r.p10:.3f}-{r.p90:.3f}':>13}"
        same = {None: "", True: "yes", False: "NO"}[row.same_output]
        line = f"{shape:<{shape_width}}  {row.tree:<{tree_width}}  {cells}  {same}"
        if row.note:
            line += f"  ({row.note})"
        lines.append(line.rstrip())
    return "\n".join(lines)
