"""Patch numbers in the prose agree with patches/series (part of `make check`).

The prose numbers the patches by the series, and the series changes (a patch
added, split out, dropped): nothing but this check ties the two together.

- README.md's stack table: the first markdown table under the heading
  `## The stack` whose header is `| # | patch | what |`. Row k is patch k of
  patches/series: `#` is k, `patch` that patch's subject as the `Subject:`
  line of its file gives it (in backticks or not), `what` a short description.
- Every "patch N", "patches N-M" (or "N..M", "N, M and K", "N/M") in
  README.md and docs/**/*.md: each N is a position in the series. Where a
  "patch N" is followed, in the same sentence or parenthesis, by a name of a
  patch (its file name, stem, subject or title), it is the name of patch N.
  A number qualified by a release ("0.33.0's patch 9") counts that
  release's stack, a record of the past: it is not checked.

A project without a README.md has no numbers to keep (the tooling's tests
build such projects).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, read_regular, rel
from scripts.stack.series import Patch, parse_header

STACK_HEADING = "## The stack"
TABLE_HEADER = ("#", "patch", "what")
_TABLE_FORMAT = ("a table `| # | patch | what |` under `## The stack`, one row per patch in "
                 "patches/series order: its number, its subject, a short description")
# "patch 5", "Patch 5's", "patches 1-4", "patches 5, 8 and 9", "patch 1/7". A
# number followed by `.digit` is a version ("patch 0.34.0"), not a position.
_MENTION = re.compile(
    r"\b(?P<word>[Pp]atch(?:es)?)\s+"
    r"(?P<numbers>\d+(?:(?:\s*(?:-|–|\.\.|/|,)\s*|,?\s+and\s+|\s+to\s+)\d+)*)(?![.\d]*\d)")
# "0.33.0's " before a mention: it numbers that release's stack.
_OTHER_RELEASE = re.compile(r"\bv?\d+\.\d+(?:\.\d+)*(?:rc\d+)?'s\s+$")
# What ends the text a "patch N" may name its patch in: the end of a sentence,
# a paragraph or a table cell. An unmatched ")" ends it too (see _tail).
_TAIL_END = re.compile(r"[.!?;](?=\s|$)|\n\s*\n|\|")
# A backticked patch file name or stem, e.g. `rocm-model-add-x` or `x-y-z-w.patch`.
_STEM = re.compile(r"`(?P<stem>[a-z0-9]+(?:-[a-z0-9]+){3,})(?:\.patch)?`")


@dataclass(frozen=True)
class Numbered:
    """A patch of the series: its position and the names prose gives it."""

    position: int
    name: str  # the file name
    subject: str

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".patch")

    def names(self) -> list[str]:
        """Its names as prose writes them: file, stem, subject, the subject
        without its [Tags], and that without a "Topic: " lead-in."""
        title = re.sub(r"^(\[[^][]+\])+ +", "", self.subject)
        names = [self.name, self.stem, self.subject, title]
        _, sep, rest = title.partition(": ")
        if sep and len(rest.split()) >= 3:
            names.append(rest)
        return names


def numbering_problems(layout: Layout, patches: list[Patch]) -> list[str]:
    """One line per stack-table row or patch number that the series contradicts."""
    readme = layout.root / "README.md"
    if not readme.is_file():
        return []
    series = [Numbered(k, p.name, parse_header(p).subject) for k, p in enumerate(patches, 1)]
    pages = [readme, *sorted((layout.root / "docs").rglob("*.md"))]
    problems = []
    for page in pages:
        text, problem = _read(page, layout)
        if problem:
            problems.append(problem)
            continue
        if page == readme:
            problems += stack_table_problems(rel(page, layout), text, series)
        problems += mention_problems(rel(page, layout), text, series)
    return problems


def _read(page: Path, layout: Layout) -> tuple[str, str | None]:
    """The page's text, or one line saying why it cannot be read. A FIFO is
    refused, not waited on; a link is read (the check only reads)."""
    fix = "make it a plain UTF-8 file so that its patch numbers can be checked"
    try:
        return read_regular(page, fix, follow_links=True).decode("utf-8"), None
    except StackError as e:
        return "", str(e)
    except UnicodeDecodeError as e:
        return "", (f"{rel(page, layout)}: not UTF-8 (byte {e.start}); save it as UTF-8 so "
                    "that its patch numbers can be checked against patches/series")


# The stack table.

def stack_table_problems(where: str, text: str, series: list[Numbered]) -> list[str]:
    lines = text.splitlines()
    heading = next((i for i, line in enumerate(lines) if line.rstrip() == STACK_HEADING), None)
    if heading is None:
        return [f"{where}: no `{STACK_HEADING}` section; the README lists the stack there "
                f"as {_TABLE_FORMAT}"]
    rows = _stack_rows(lines, heading)
    if rows is None:
        return [f"{where}:{heading + 1}: `{STACK_HEADING}` holds no stack table; add "
                f"{_TABLE_FORMAT}"]
    problems = [_row_problem(where, lineno, k, cells, series)
                for k, (lineno, cells) in enumerate(rows, 1)]
    end = rows[-1][0] if rows else heading + 1
    problems += [f"{where}:{end}: the stack table has no row {p.position}; patches/series has "
                 f"patch {p.position} `{p.subject}` ({p.name}): add its row"
                 for p in series[len(rows):]]
    return [p for p in problems if p]


def _stack_rows(lines: list[str], heading: int) -> list[tuple[int, list[str]]] | None:
    """(line number, cells) of each row of the section's stack table; None
    where the section has no table with its header."""
    i = heading + 1
    while i < len(lines) and not re.match(r"#{1,2} ", lines[i]):
        if lines[i].lstrip().startswith("|") and tuple(
                c.lower() for c in _cells(lines[i])) == TABLE_HEADER:
            rows = []
            i += 2  # the header and the |---| line under it
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append((i + 1, _cells(lines[i])))
                i += 1
            return rows
        i += 1
    return None


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row; a `|` in backticks or escaped is text."""
    body = line.strip().removeprefix("|")
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    cells, current, in_code, escaped = [], "", False, False
    for char in body:
        if char == "|" and not in_code and not escaped:
            cells.append(current.strip())
            current = ""
            continue
        in_code ^= char == "`" and not escaped
        escaped = char == "\\" and not escaped
        current += char
    cells.append(current.strip())
    return cells


def _row_problem(where: str, lineno: int, k: int, cells: list[str],
                 series: list[Numbered]) -> str | None:
    at = f"{where}:{lineno}: stack table row {k}"
    if len(cells) != len(TABLE_HEADER):
        return (f"{at} has {len(cells)} cells, not {len(TABLE_HEADER)}; write it as "
                f"{_TABLE_FORMAT}")
    number, subject, what = cells[0], _unquoted(cells[1]), cells[2]
    if k > len(series):
        return (f"{at} is `{subject}`, and patches/series lists {len(series)} patches: drop "
                "the row, or add the patch to the series")
    expected = series[k - 1]
    if subject != expected.subject:
        other = next((p for p in series if p.subject == subject), None)
        said = (f"`{subject}` (patch {other.position} in patches/series)" if other
                else f"`{subject}`, a subject no patch in patches/series has")
        return (f"{at} is {said}; patches/series has patch {k} `{expected.subject}` "
                f"({expected.name}): put the rows in patches/series order, each patch's "
                "subject as its Subject: line gives it")
    if number != str(k):
        return (f"{at} (`{subject}`) is numbered {number!r}; number it {k}, its place in "
                "patches/series")
    if not what:
        return f"{at} (`{subject}`) has no description; say in a few words what the patch does"
    return None


def _unquoted(cell: str) -> str:
    if len(cell) >= 2 and cell[0] == cell[-1] == "`" and "`" not in cell[1:-1]:
        return cell[1:-1]
    return cell


# "patch N" in the prose.

def mention_problems(where: str, text: str, series: list[Numbered]) -> list[str]:
    problems = []
    mentions = list(_MENTION.finditer(text))
    for i, mention in enumerate(mentions):
        if _OTHER_RELEASE.search(text[max(0, mention.start() - 40):mention.start()]):
            continue
        lineno = text.count("\n", 0, mention.start()) + 1
        said = " ".join(mention.group(0).split())
        numbers = [int(n) for n in re.findall(r"\d+", mention.group("numbers"))]
        if bad := [n for n in numbers if not 1 <= n <= len(series)]:
            problems.append(
                f"{where}:{lineno}: '{said}': patches/series has {len(series)} patches, "
                f"so no patch {bad[0]}: number by patches/series, or name the patch by its "
                "title")
            continue
        if mention.group("word").lower() == "patch" and len(numbers) == 1:
            stop = mentions[i + 1].start() if i + 1 < len(mentions) else len(text)
            tail = _tail(text[mention.end():stop])
            if problem := _named_problem(f"{where}:{lineno}", said, numbers[0], tail, series):
                problems.append(problem)
    return problems


def _tail(text: str) -> str:
    """The text after a mention that may still name its patch: up to the end
    of its sentence, or of the parenthesis the mention is in."""
    end = _TAIL_END.search(text)
    text = text[:end.start()] if end else text
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return text[:i]
    return text


def _named_problem(at: str, said: str, number: int, tail: str,
                   series: list[Numbered]) -> str | None:
    """The first patch `tail` names, if it is not patch `number`."""
    found = []  # (position in tail, name, the patch or None for an unknown stem)
    lowered = tail.lower()
    for patch in series:
        for name in patch.names():
            if (start := lowered.find(name.lower())) >= 0:
                found.append((start, name, patch))
    known = {p.stem for p in series}
    found += [(m.start(), m.group("stem"), None) for m in _STEM.finditer(tail)
              if m.group("stem") not in known]
    if not found:
        return None
    _, name, patch = min(found, key=lambda f: (f[0], -len(f[1])))
    expected = series[number - 1]
    if patch is None:
        return (f"{at}: '{said}' names {name}, which patches/series does not list (its patch "
                f"{number} is {expected.stem}): name a patch of the series, or say whose "
                f"stack the number counts (<version>'s patch {number})")
    if patch.position != number:
        return (f"{at}: '{said}' names {name}, which is patch {patch.position} in "
                f"patches/series (patch {number} is {expected.stem}): write patch "
                f"{patch.position}, or drop the number and keep the name")
    return None
