"""`python3 -m scripts gpu-tables`: BENCHMARKS.md's GPU tables, rendered from their logs.

Each GPU table of BENCHMARKS.md, with the figures quoted next to it (ranges,
counts, the run's bandwidth and peak), sits between

    <!-- generated from benchmarks/gpu/results/NAME.log -->
    <!-- end generated -->

and is rendered from that log alone, in the log's own format (run.py's table,
mla_decode.py's, aiter_rope_cache.py's, or mla_decode.py --check's line). One
more region, `<!-- generated summary of the GPU tables -->`, lists each of
them in a row. `gpu-tables` rewrites every region at once (temporary file +
rename); `make check` fails where the page and a log disagree (page_problems).

How a ratio is called faster or slower: where the log gives a p10-p90 band
(run.py), only where the band lies wholly below or above 1; where it gives a
summary (mla_decode.py), the summary's own counts (ratios of medians, its
1.03 threshold), never the per-row column; otherwise (aiter_rope_cache.py)
where the printed ratio is below or above 1.000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, say, write_atomically

PAGE = "BENCHMARKS.md"
BEGIN = re.compile(r"^<!-- generated from (?P<log>benchmarks/gpu/results/[\w.+-]+\.log) -->$")
SUMMARY = "<!-- generated summary of the GPU tables -->"
END = "<!-- end generated -->"
# mla_decode.py times 80 shapes; the page shows these (the log has every one):
# one per head count and batch kind, the widest and narrowest speed-ups.
MLA_SHOWN = ("16 x 32k q5 h8 bf16 p16", "32 ragged .5-100k q5 h8 bf16 p16",
             "16 x 32k q3 h32 bf16 p16", "1 x 32k q7 h64 bf16 p16",
             "16 ragged 1-64k q7 h64 bf16 p16", "1 x 32k q6 h16 bf16 p64",
             "16 x 32k q7 h64 bf16 p64", "64 ragged .1-32k q7 h64 bf16 p64",
             "16 x 32k q5 h8 fp8 p64")


@dataclass(frozen=True)
class Rendered:
    body: str  # the region's lines
    headline: str  # its row in the summary table


@dataclass(frozen=True)
class Region:
    log: str | None  # None: the summary region
    start: int  # index of the marker line
    end: int  # index of the END line
    section: str  # the ## heading above it


def gpu_tables(layout: Layout) -> None:
    """Rewrite every generated region of BENCHMARKS.md from its log."""
    page = layout.root / PAGE
    text = page.read_text()
    new = render_page(layout.root, text)
    if new == text:
        say(f"{PAGE}: every generated table matches its log")
        return
    write_atomically(page, new.encode())
    say(f"{PAGE}: rewrote {len(regions(text.splitlines()))} generated region(s) from their logs")


def page_problems(layout: Layout) -> list[str]:
    """One line per generated region of BENCHMARKS.md that its log does not give."""
    page = layout.root / PAGE
    if not page.is_file():
        return []
    lines = page.read_text().splitlines()
    try:
        bodies = expected_bodies(layout.root, lines)
    except StackError as e:
        return [str(e)]
    problems = []
    for region, want in bodies:
        have = lines[region.start + 1:region.end]
        if have != want:
            at, page_line, log_line = _first_difference(have, want)
            what = (f"the table generated from {region.log}" if region.log
                    else "the summary of the GPU tables")
            problems.append(
                f"{PAGE}:{region.start + 2 + at}: {what} (section \"{region.section}\") "
                f"disagrees with {region.log or 'their logs'}: the page has {page_line!r}, "
                f"the log gives {log_line!r}; run `make gpu-tables` (or fix the log)")
    return problems


def _first_difference(have: list[str], want: list[str]) -> tuple[int, str, str]:
    at = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b),
              min(len(have), len(want)))
    return (at, have[at] if at < len(have) else "(end of region)",
            want[at] if at < len(want) else "(end of region)")


def regions(lines: list[str]) -> list[Region]:
    found, section, fenced, i = [], "", False, 0
    while i < len(lines):
        line = lines[i]
        fenced ^= line.startswith("```")
        if line.startswith("## ") and not fenced:
            section = line[3:].strip()
        match = BEGIN.match(line)
        if match or line == SUMMARY:
            try:
                end = lines.index(END, i + 1)
            except ValueError:
                raise StackError(f"{PAGE}:{i + 1}: a generated region without its "
                                 f"closing {END}")
            inner = [n for n in range(i + 1, end) if BEGIN.match(lines[n]) or lines[n] == SUMMARY]
            if inner:
                raise StackError(f"{PAGE}:{inner[0] + 1}: a generated region opens inside "
                                 f"the one of line {i + 1}; close that one first with {END}")
            found.append(Region(match["log"] if match else None, i, end, section))
            i = end
        i += 1
    return found


def render_page(root: Path, text: str) -> str:
    """`text` with every generated region rendered from its log."""
    lines = text.splitlines()
    out, last = [], 0
    for region, body in expected_bodies(root, lines):
        out += lines[last:region.start + 1] + body
        last = region.end
    out += lines[last:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def expected_bodies(root: Path, lines: list[str]) -> list[tuple[Region, list[str]]]:
    """Each generated region of the page and the lines its log gives it."""
    found = regions(lines)
    rendered = {r.log: render(root, r.log) for r in found if r.log}
    return [(r, (rendered[r.log].body if r.log else _summary_table(found, rendered))
             .splitlines()) for r in found]


def render(root: Path, log: str) -> Rendered:
    path = root / log
    if not path.is_file():
        raise StackError(f"{PAGE}: a table is generated from {log}, which does not exist")
    text = path.read_text()
    link = f"[`{Path(log).name}`]({log})"
    for marker, renderer in ((re.compile(r"^case \w+$", re.MULTILINE), _run_table),
                             (re.compile(r"^production regime:", re.MULTILINE), _mla_table),
                             (re.compile(r"^ragged check:", re.MULTILINE), _mla_check),
                             (re.compile(r"^vllm/unfused:", re.MULTILINE), _rope_table)):
        if marker.search(text):
            try:
                return renderer(text, link)
            except (StopIteration, LookupError, TypeError, ValueError) as e:
                raise StackError(f"{log}: its {renderer.__name__[1:]} cannot be read "
                                 f"({type(e).__name__}: {e}); fix the log or "
                                 "scripts/perf/gpu_tables.py")
    raise StackError(f"{log}: not a log gpu-tables can read (run.py's table, or "
                     "mla_decode.py's or aiter_rope_cache.py's output)")


def _summary_table(found: list[Region], rendered: dict[str, Rendered]) -> str:
    rows = ["| table | log | GPU | figures |", "| --- | --- | --- | --- |"]
    for region in found:
        if region.log:
            figures = rendered[region.log].headline.replace("|", "\\|")
            rows.append(f"| [{region.section}](#{_anchor(region.section)}) | "
                        f"`{Path(region.log).name}` | {_device(region.log)} | {figures} |")
    return "\n".join(rows)


def _device(log: str) -> str:
    name = Path(log).stem.rsplit("-", 1)[-1]
    return {"h100": "NVIDIA H100", "h200": "NVIDIA H200"}.get(name, name)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _span(values: list[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


# --- benchmarks/gpu/run.py: median, p10, p90 and the ratio's p10-p90 band ---------------------

_RUN_ROW = re.compile(r"(?P<tree>\S+)\s+(?P<median>[\d.]+)\s+[\d.]+\s+[\d.]+\s+(?P<ratio>[\d.]+)"
                      r"(?:\s+(?P<low>[\d.]+)-(?P<high>[\d.]+)\s+(?P<same>\S+))?$")


def _run_table(text: str, link: str) -> Rendered:
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shape "))
    width = lines[head].index("tree")
    rows: dict[str, dict[str, re.Match]] = {}
    shape = ""
    for line in lines[head + 2:]:
        if not line.strip():
            break
        shape = line[:width].strip() or shape
        rows.setdefault(shape, {})[line[width:].split()[0]] = _RUN_ROW.match(line[width:])
    trees = list(next(iter(rows.values())))
    base, others = trees[0], trees[1:]
    table = [f"| shape | {' | '.join(f'{t} us' for t in trees)} | "
             + " | ".join(f"{t} / {base} (p10-p90)" for t in others) + " | same output |",
             "| --- " * (2 + len(trees) + len(others)) + "|"]
    for shape, by_tree in rows.items():
        same = all(by_tree[t]["same"] == "yes" for t in others)
        table.append(f"| {shape} | " + " | ".join(by_tree[t]["median"] for t in trees) + " | "
                     + " | ".join(f"{by_tree[t]['ratio']} ({by_tree[t]['low']}-"
                                  f"{by_tree[t]['high']})" for t in others)
                     + f" | {'yes' if same else 'no'} |")
    notes, heads = [], []
    for tree in others:
        faster = [s for s, r in rows.items() if float(r[tree]["high"]) < 1]
        slower = [s for s, r in rows.items() if float(r[tree]["low"]) > 1]
        ratios = [float(r[tree]["ratio"]) for r in rows.values()]
        band = len(rows) - len(faster) - len(slower)
        notes.append(f"- `{tree}` / `{base}`: {_span(ratios, '{:.3f}')} over {len(rows)} "
                     f"shapes; faster (p10-p90 band below 1) at {_listed(faster)}; slower "
                     f"(band above 1) at {_listed(slower)}; the band holds 1 (no measurable "
                     f"difference) at {band}.")
        heads.append(f"{tree} / {base} {_span(ratios, '{:.3f}')}: faster at {len(faster)} of "
                     f"{len(rows)}, slower at {len(slower)}")
    same = all(r[t]["same"] == "yes" for r in rows.values() for t in others)
    notes.append(f"- Same output as `{base}`: {'at every shape' if same else 'not everywhere'}.")
    body = [(f"Log {link}; median microseconds per call, ratios the median (and p10-p90) "
             "of the replay-by-replay ratios."), "", *table, "", *notes]
    return Rendered("\n".join(body), "; ".join(heads))


def _listed(shapes: list[str]) -> str:
    return f"{len(shapes)} ({'; '.join(shapes)})" if shapes else "none"


# --- benchmarks/gpu/cases/mla_decode.py: the production regime's table and summary ------------

_MLA_ROW = re.compile(r"^(?P<shape>\d.+? p\d+)\s+(?P<flat>[\d.]+)\s+(?P<rest>.*)$")
_MLA_TREE = re.compile(r"(?P<tree>[a-z]\w*)\s+(?P<ms>[\d.]+)\s+(?P<x>[\d.]+)x\s+[\d.]+%")
_MLA_CHECK = re.compile(r"(?P<tree>\w+) (?P<ok>\w+) o (?P<o>\S+) lse \S+")
_MLA_SHAPE = re.compile(r"^(?P<batch>.+) q(?P<q>\d+) h(?P<h>\d+) (?P<kv>\w+) p(?P<page>\d+)$")
_BANDWIDTH = re.compile(r"copy bandwidth (?P<bw>[\d.]+) TB/s .* bf16 peak (?P<peak>\d+) TFLOP/s")


@dataclass(frozen=True)
class _MlaRow:
    flat: str  # ms
    timed: dict[str, re.Match]  # tree -> ms, speed-up
    checks: dict[str, re.Match]  # tree -> ok, max |o diff|


def _mla_table(text: str, link: str) -> Rendered:
    rows: dict[str, _MlaRow] = {}  # shape, single-spaced -> row
    summary = []
    for line in text.splitlines():
        if (match := _MLA_ROW.match(line)) and _MLA_SHAPE.match(" ".join(match["shape"].split())):
            rest = match["rest"]
            rows[" ".join(match["shape"].split())] = _MlaRow(
                match["flat"], {m["tree"]: m for m in _MLA_TREE.finditer(rest)},
                {m["tree"]: m for m in _MLA_CHECK.finditer(rest)})
        elif re.match(r"^patched (/|fp8 /|% of bound)|^\w+ over flat ", line):
            summary.append(line.split("; worst:")[0])
    trees = list(next(iter(rows.values())).timed)
    missing = [s for s in MLA_SHOWN if s not in rows]
    if missing:
        raise StackError(f"{link}: no row {missing[0]!r} (scripts/perf/gpu_tables.py "
                         "MLA_SHOWN names the rows the page shows)")
    table = ["| batch, q x heads, KV, page | flat ms | "
             + " | ".join(f"{t} ms" for t in trees) + " | "
             + " | ".join(f"{t} over flat" for t in trees) + " |",
             "| --- " * (2 + 2 * len(trees)) + "|"]
    for shape in MLA_SHOWN:
        row, s = rows[shape], _MLA_SHAPE.match(shape)
        table.append(f"| {s['batch']}, {s['q']} x {s['h']}, {s['kv']}, {s['page']} | {row.flat} | "
                     + " | ".join(row.timed[t]["ms"] for t in trees) + " | "
                     + " | ".join(f"{row.timed[t]['x']}x" for t in trees) + " |")
    run = _BANDWIDTH.search(text)
    notes = [("- The log's summary (speed-ups as ratios of the medians, so a range can "
              "differ from the per-row column):")]
    notes += [f"  - {line}" for line in summary if "% of bound" not in line]
    bound = [line.split("patched % of bound, ")[1] for line in summary if "% of bound" in line]
    if bound:
        bound = "; ".join(bound).replace(", >= 16k", "")
        notes.append(f"  - patched % of bound at >= 16k: {bound}")
    for tree in trees:
        short = [float(r.timed[tree]["x"]) for s, r in rows.items()
                 if " 4k " in f" {s} " and _MLA_SHAPE.match(s)["q"] != "1"]
        single = [float(r.timed[tree]["x"]) for s, r in rows.items()
                  if _MLA_SHAPE.match(s)["q"] == "1"]
        notes.append(f"- {tree} over flat, per row: {_span(short, '{:.2f}')}x at 4k context; "
                     f"{_span(single, '{:.2f}')}x at query_len 1 ({len(single)} shapes)")
    for tree in trees:
        checks = [r.checks[tree] for r in rows.values() if tree in r.checks]
        bad = [c for c in checks if c["ok"] != "ok"]
        worst = max(float(c["o"]) for c in checks)
        notes.append(f"- {tree}'s output against flat's, first input set: "
                     + (f"{len(bad)} of {len(checks)} shapes out of tolerance" if bad
                        else f"all {len(checks)} shapes within tolerance")
                     + f", max |o diff| {worst:.1e}.")
    body = [(f"Log {link}: copy bandwidth {run['bw']} TB/s, bf16 peak {run['peak']} "
             f"TFLOP/s, measured in the same run; {len(MLA_SHOWN)} of its {len(rows)} shapes "
             "below (`scripts/perf/gpu_tables.py` MLA_SHOWN), speed-ups per row the median "
             "of the replay-by-replay ratios."), "", *table, "", *notes]
    head = [line for line in summary if " over flat " in line][:1] + [
        line for line in summary if line.startswith("patched / ")][:1]
    return Rendered("\n".join(body), "; ".join(head))


def _mla_check(text: str, link: str) -> Rendered:
    found = re.search(r"^ragged check: (.*)$", text, re.MULTILINE)[1]
    return Rendered(f"Ragged check ({link}): {found}.", f"ragged check: {found}")


# --- benchmarks/gpu/cases/aiter_rope_cache.py: three paths, page 16 and 64 --------------------

_ROPE_ROW = re.compile(r"^\s*(?P<req>\d+) req x (?P<tok>\d+) tok,\s+(?P<heads>\d+) heads, "
                       r"page (?P<page>\d+), (?P<kv>\w+)\s+(?P<unfused>[\d.]+)\s+(?P<vllm>[\d.]+)"
                       r"\s+(?P<aiter>[\d.]+)\s+(?P<vu>[\d.]+)\s+(?P<au>[\d.]+)\s+(?P<av>[\d.]+)"
                       r"\s+(?P<check>\w+)")
_ROPE_RATIOS = (("vu", "vllm-fused / unfused"), ("au", "aiter / unfused"),
                ("av", "aiter / vllm-fused"))


def _rope_table(text: str, link: str) -> Rendered:
    rows = [m for m in map(_ROPE_ROW.match, text.splitlines()) if m]
    shown = [m for m in rows if m["page"] == "16"]
    tokens = shown[0]["tok"]
    table = [f"| requests x {tokens} tokens | heads | KV | unfused us | vllm-fused us | aiter us | "
             + " | ".join(name for _, name in _ROPE_RATIOS) + " |", "| --- " * 9 + "|"]
    for m in shown:
        table.append(f"| {m['req']} | {m['heads']} | {m['kv']} | {m['unfused']} | {m['vllm']} | "
                     f"{m['aiter']} | {m['vu']} | {m['au']} | {m['av']} |")
    notes = []
    for key, name in _ROPE_RATIOS:
        values = [m[key] for m in rows]
        below = sum(float(v) < 1 for v in values)
        above = sum(float(v) > 1 for v in values)
        notes.append(f"- {name}: {_span([float(v) for v in values], '{:.3f}')} over "
                     f"{len(rows)} shapes; below 1.000 at {below}, above at {above}"
                     + (f", 1.000 at {len(values) - below - above}"
                        if below + above < len(values) else "") + ".")
    pages = {(m["req"], m["heads"], m["kv"], m["page"]): m for m in rows}
    apart = [abs(float(m[p]) / float(pages[k[:3] + ("16",)][p]) - 1)
             for k, m in pages.items() if k[3] != "16" for p in ("unfused", "vllm", "aiter")]
    if apart:
        notes.append(f"- Page 64 against page 16, same shape and path: within "
                     f"{100 * max(apart):.1f}% (the log has both).")
    failed = sum(m["check"] != "ok" for m in rows)
    notes.append(f"- Accuracy checks failed at {failed} of {len(rows)} shapes; against a "
                 "float64 rotation by the fp32 table:")
    notes += [f"  - {line}" for line in text.splitlines()
              if re.match(r"^(unfused|vllm-fused|aiter): q_pe", line)]
    body = [(f"Log {link}; page 16 below, microseconds per call (median), ratios the "
             "median of the replay-by-replay ratios (no p10-p90 band: a ratio is below "
             "or above 1 as printed)."), "", *table, "", *notes]
    head = "; ".join(f"{name} {_span([float(m[key]) for m in rows], '{:.3f}')}"
                     for key, name in _ROPE_RATIOS)
    return Rendered("\n".join(body), head)

