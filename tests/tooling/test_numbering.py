"""`make check` fails when README.md's stack table, or a "patch N" in README.md
or docs/, disagrees with patches/series (scripts/stack/numbering.py).

Most tests call the check on a project of nine hand-written patches (only
their Subject: lines count); the last one runs `check` as a user would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.common import Layout
from scripts.stack.apply import patch_name
from scripts.stack.numbering import numbering_problems
from scripts.stack.series import read_series, series_text
from tests.tooling.conftest import PATCH_1, PATCH_2, SUBJECT_1, SUBJECT_2, write_patch

ORDINALS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SUBJECTS = [f"[Kernel] Tune the kernel for case {word}" for word in ORDINALS]
NAMES = [patch_name(s) for s in SUBJECTS]
STEMS = [n.removesuffix(".patch") for n in NAMES]


def stack_table(subjects: list[str]) -> str:
    rows = "".join(f"| {k} | `{s}` | tunes case {k}. |\n" for k, s in enumerate(subjects, 1))
    return "| # | patch | what |\n| --- | --- | --- |\n" + rows


def readme(subjects: list[str], prose: str = "") -> str:
    return ("# The project\n\nIntro.\n\n## The stack\n\nIn order:\n\n"
            + stack_table(subjects) + "\n### Releases\n\nText.\n\n## Next\n\n" + prose)


@pytest.fixture
def nine(tmp_path) -> Layout:
    """A project of nine patches whose README lists them in order."""
    patches = tmp_path / "patches"
    patches.mkdir()
    for k, (subject, name) in enumerate(zip(SUBJECTS, NAMES), 1):
        write_patch(patches, name, f"vllm/kernels/case_{k}.py", subject=subject)
    (patches / "series").write_bytes(series_text(NAMES))
    (tmp_path / "README.md").write_text(readme(SUBJECTS))
    (tmp_path / "docs").mkdir()
    return Layout(tmp_path)


def problems(layout: Layout) -> list[str]:
    return numbering_problems(layout, read_series(layout))


def test_a_readme_and_docs_that_agree_with_the_series_pass(nine):
    (nine.root / "README.md").write_text(readme(SUBJECTS, (
        f"Patch 5 (`{STEMS[4]}`) reads the KV once; patches 1-9 land in order, and\n"
        f"patches 5, 8 and 9 have kernels. See patch 6, `{SUBJECTS[5]}`, and patch 6 of\n"
        "the stack. Version 0.34.0 is not a patch number: patch 0.34.0.\n")))
    page = nine.root / "docs" / "deep" / "page.md"
    page.parent.mkdir()
    page.write_text(f"## Patch 2: tune the kernel for case two\n\nPatch 9 (`{NAMES[8]}`).\n")
    assert problems(nine) == []



def test_a_page_that_is_a_fifo_is_named_not_waited_on(nine):
    """A FIFO under docs/ would block a plain read forever."""
    os.mkfifo(nine.root / "docs" / "pipe.md")
    (only,) = problems(nine)
    assert "docs/pipe.md is a FIFO, not a regular file" in only

def test_two_rows_swapped_fail_naming_both(nine):
    swapped = SUBJECTS[:2] + [SUBJECTS[3], SUBJECTS[2]] + SUBJECTS[4:]
    (nine.root / "README.md").write_text(readme(swapped))
    # Row k of the table is line 10 + k.
    assert problems(nine) == [
        f"README.md:13: stack table row 3 is `{SUBJECTS[3]}` (patch 4 in patches/series); "
        f"patches/series has patch 3 `{SUBJECTS[2]}` ({NAMES[2]}): put the rows in "
        "patches/series order, each patch's subject as its Subject: line gives it",
        f"README.md:14: stack table row 4 is `{SUBJECTS[2]}` (patch 3 in patches/series); "
        f"patches/series has patch 4 `{SUBJECTS[3]}` ({NAMES[3]}): put the rows in "
        "patches/series order, each patch's subject as its Subject: line gives it"]


def test_a_table_missing_a_patch_or_with_one_too_many_fails(nine):
    (nine.root / "README.md").write_text(readme(SUBJECTS[:8]))
    assert problems(nine) == [
        f"README.md:18: the stack table has no row 9; patches/series has patch 9 "
        f"`{SUBJECTS[8]}` ({NAMES[8]}): add its row"]
    (nine.root / "README.md").write_text(readme(SUBJECTS + ["[Kernel] Dropped"]))
    assert problems(nine) == [
        "README.md:20: stack table row 10 is `[Kernel] Dropped`, and patches/series lists 9 "
        "patches: drop the row, or add the patch to the series"]


def test_a_readme_without_the_table_fails_saying_its_format(nine):
    (nine.root / "README.md").write_text(
        "# The project\n\n## The stack\n\n" + "".join(f"{k}. {s}\n" for k, s in
                                                     enumerate(SUBJECTS, 1)))
    assert problems(nine) == [
        "README.md:3: `## The stack` holds no stack table; add a table `| # | patch | what |` "
        "under `## The stack`, one row per patch in patches/series order: its number, its "
        "subject, a short description"]


@pytest.mark.parametrize("prose, line", [
    ("As patch 10 does.\n", "'patch 10': patches/series has 9 patches, so no patch 10"),
    ("Patches 8-10 land last.\n", "'Patches 8-10': patches/series has 9 patches, so no patch 10"),
], ids=["patch", "range"])
def test_a_patch_number_past_the_series_fails(nine, prose, line):
    (nine.root / "docs" / "page.md").write_text("# Page\n\n" + prose)
    assert problems(nine) == [f"docs/page.md:3: {line}: number by patches/series, or name "
                              "the patch by its title"]


@pytest.mark.parametrize("prose, named", [
    (f"patch 5 (`{STEMS[5]}`)", STEMS[5]),
    (f"patch 5 (`{NAMES[5]}`)", NAMES[5]),
    (f"patch 5, `{SUBJECTS[5]}`", SUBJECTS[5]),
    ("patch 5: tune the kernel for case six", "Tune the kernel for case six"),
], ids=["stem", "file", "subject", "title"])
def test_a_number_followed_by_another_patchs_name_fails(nine, prose, named):
    # (A title is found whatever its case.)
    (nine.root / "README.md").write_text(readme(SUBJECTS, f"As {prose}.\n"))
    assert problems(nine) == [
        f"README.md:27: 'patch 5' names {named}, which is patch 6 in patches/series (patch 5 "
        f"is {STEMS[4]}): write patch 6, or drop the number and keep the name"]


def test_the_name_counts_only_in_the_same_sentence_or_parenthesis(nine):
    (nine.root / "docs" / "page.md").write_text(
        f"Case five is patch 5. Then `{STEMS[5]}`.\n\n(see patch 5) and `{STEMS[5]}`.\n"
        f"Patch 5; `{STEMS[5]}`. Patch 5 | `{STEMS[5]}` |\n")
    assert problems(nine) == []


def test_a_dropped_patchs_stem_fails_unless_its_release_is_named(nine):
    gone = "bugfix-recover-from-the-old-sampler"
    page = nine.root / "docs" / "page.md"
    page.write_text(f"## 3. Patch 9: `{gone}.patch`\n")
    assert problems(nine) == [
        f"docs/page.md:1: 'Patch 9' names {gone}, which patches/series does not list (its "
        f"patch 9 is {STEMS[8]}): name a patch of the series, or say whose stack the number "
        "counts (<version>'s patch 9)"]
    page.write_text(f"## 3. 0.33.0's patch 9: `{gone}.patch`; 0.33.0's patches 5-12.\n")
    assert problems(nine) == []


def test_make_check_fails_on_a_readme_out_of_series_order(stacked):
    readme_file = stacked.root / "README.md"
    readme_file.write_text(readme([SUBJECT_2, SUBJECT_1], f"See patch 2 (`{PATCH_1}`).\n"))
    result = stacked.run("check")
    assert result.returncode == 1
    failures = [ln for ln in result.stdout.splitlines() if ln.startswith("FAIL ")]
    assert failures == [
        f"FAIL README.md:11: stack table row 1 is `{SUBJECT_2}` (patch 2 in patches/series); "
        f"patches/series has patch 1 `{SUBJECT_1}` ({PATCH_1}): put the rows in "
        "patches/series order, each patch's subject as its Subject: line gives it",
        f"FAIL README.md:12: stack table row 2 is `{SUBJECT_1}` (patch 1 in patches/series); "
        f"patches/series has patch 2 `{SUBJECT_2}` ({PATCH_2}): put the rows in "
        "patches/series order, each patch's subject as its Subject: line gives it",
        f"FAIL README.md:20: 'patch 2' names {PATCH_1}, which is patch 1 in patches/series "
        f"(patch 2 is {Path(PATCH_2).stem}): write patch 1, or drop the number and keep the "
        "name"]
    readme_file.write_text(readme([SUBJECT_1, SUBJECT_2], f"See patch 1 (`{PATCH_1}`).\n"))
    result = stacked.run("check")
    assert result.returncode == 0, result.stdout
    assert "check OK: 2 patch(es)" in result.stdout
