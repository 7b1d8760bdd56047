"""`make export SIGNOFF=...`: re-signed patches that `git am` on the release, PR.md, COVER.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.common import Layout
from scripts.testing import testrun
from scripts.testing.testcache import FORMAT
from tests.tooling.conftest import (
    AUTHOR,
    FOO_PATCHED,
    NEW_MODEL,
    PYTHON,
    REPO,
    SIGNOFF,
    SUBJECT_1,
    TEST_FOO_PATCHED,
    V1,
    release_files,
    snapshot,
)

SUBMITTER = "Ada Lovelace <ada@lovelace.dev>"
BASE = f"vllm-{V1}"
TEMPLATE = (Path(__file__).parent / "data" / "vllm-0.33.0-PULL_REQUEST_TEMPLATE.md").read_text()
MANY = "".join(f"A{i} = {i}\n" for i in range(1, 13))
BODY_1 = """\
## Purpose

Foo uses a larger block on ROCm.

The old block overflowed the shared memory of MI300.

## Design

BLOCK becomes 64, and helper() names it.

## Test Plan

    pytest tests/test_foo.py

## Test Result

1 passed.

## Hardware test plan (MI300/MI355 reviewers)

Run the foo benchmark on an MI300."""
NOTES_1 = """\
# Foo: notes for the PR

What the notes add to the message.

## Claims

- Foo is 4x faster on MI300.

## Rationale

64 and not 128: the register budget of gfx942.
"""
# (subject, files): patch 2 and 7 are independent of the patches before them;
# 3 imports a module 2 adds, 4 calls a function 1 adds, 5 does not apply
# without 1: each needs just that one. 6 changes a file 2 changes, but its
# hunk applies without 2's: it needs nothing.
PATCHES = [
    (SUBJECT_1, {"vllm/models/foo.py": FOO_PATCHED + "\n\ndef helper():\n    return BLOCK\n",
                 "tests/test_foo.py": TEST_FOO_PATCHED}),
    ("[ROCm] Add the new model", {"vllm/models/new.py": NEW_MODEL,
                                  "vllm/models/many.py": MANY.replace("A1 = 1", "A1 = 10")}),
    ("[ROCm] List the new model", {"vllm/models/user.py": (
        "from vllm.models import new\n\nMODELS = [new]\n")}),
    ("[ROCm] Bar calls the helper", {"vllm/models/bar.py": (
        "from vllm.models import foo\n\n\ndef bar():\n    return foo.helper()\n")}),
    ("[Doc] Say what foo is", {"vllm/models/foo.py": (
        FOO_PATCHED + "\n\ndef helper():\n    return BLOCK\n").replace(
        "Fake model", "Fake model with a block")}),
    ("[ROCm] Change the last constant", {"vllm/models/many.py": MANY.replace(
        "A1 = 1", "A1 = 10").replace("A12 = 12", "A12 = 120")}),
    ("[Bugfix] Describe vLLM", {"vllm/__init__.py": (
        "\"\"\"vLLM, described.\"\"\"\nfrom vllm._version import __version__\n")}),
]
STEMS = ["rocm-model-use-a-larger-block-in-foo", "rocm-add-the-new-model",
         "rocm-list-the-new-model", "rocm-bar-calls-the-helper", "doc-say-what-foo-is",
         "rocm-change-the-last-constant", "bugfix-describe-vllm"]

_TEMPLATE: dict[str, Path] = {}


@pytest.fixture
def series(project, tmp_path_factory):
    """Seven exported patches on a release that has vLLM 0.33.0's PR template."""
    if "series" in _TEMPLATE:
        shutil.rmtree(project.root)
        shutil.copytree(_TEMPLATE["series"], project.root, symlinks=True)
        return project
    files = {**release_files(V1), ".github/PULL_REQUEST_TEMPLATE.md": TEMPLATE.encode(),
             "vllm/models/many.py": MANY.encode()}
    project.use_release(V1, files=files)
    project.ok("apply")
    for k, (subject, changes) in enumerate(PATCHES):
        project.commit(subject, changes, body=BODY_1 if k == 0 else f"## Purpose\n\n{subject}.")
    project.ok("patches")
    (project.patches / "notes").mkdir()
    (project.patches / "notes" / f"{STEMS[0]}.md").write_text(NOTES_1)
    saved = tmp_path_factory.mktemp("export") / "proj"
    shutil.copytree(project.root, saved, symlinks=True)
    _TEMPLATE["series"] = saved
    return project


def export(project, signoff: str = SUBMITTER) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "scripts", "export"], cwd=REPO, check=False,
                          env={**project.env(), "K3_SIGNOFF": signoff},
                          capture_output=True, text=True, timeout=120)


def make_export(project, signoff: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO),
                           f"PYTHON={PYTHON}", "export", f"SIGNOFF={signoff}"],
                          env=project.env(), capture_output=True, text=True, timeout=120,
                          check=False)


def folder(project, k: int) -> Path:
    return project.root / "build" / "export" / f"{k:02d}-{STEMS[k - 1]}"


def trailers(project, repo: Path, rev: str, key: str) -> list[str]:
    out = project.git("log", "-1", f"--format=%(trailers:key={key},valueonly)", rev, cwd=repo)
    return [line for line in out.splitlines() if line]


def _release_clone(series, tmp_path):
    """A clone of build/vllm checked out at the release: where `git am` of the
    exported patches, in order, must reproduce the stack."""
    upstream = tmp_path / "upstream"
    series.git("clone", "-q", str(series.tree), str(upstream), cwd=tmp_path)
    series.git("checkout", "-q", "--detach", BASE, cwd=upstream)
    return upstream


def test_resigned_patches_apply_in_order_on_the_release_with_only_the_new_signoff(
        series, tmp_path):
    patches_before = snapshot(series.patches)
    result = export(series)
    assert result.returncode == 0, result.stderr
    assert snapshot(series.patches) == patches_before
    upstream = _release_clone(series, tmp_path)
    for k in range(1, len(PATCHES) + 1):
        patch = folder(series, k) / f"{STEMS[k - 1]}.patch"
        series.git("am", "--keep-non-patch", str(patch), cwd=upstream)
        assert series.git("log", "-1", "--format=%an <%ae>|%s", cwd=upstream) == (
            f"{SUBMITTER}|{PATCHES[k - 1][0]}")
        assert trailers(series, upstream, "HEAD", "Signed-off-by") == [SUBMITTER]
        assert trailers(series, upstream, "HEAD", "Co-authored-by") == [AUTHOR]
        # The same change as the project's commit: same tree, message, author date.
        ours = f"stack~{len(PATCHES) - k}"
        for fmt in ("%T", "%ad", "%s%n%n%b"):
            theirs = series.git("log", "-1", f"--format={fmt}", cwd=upstream)
            mine = series.git("log", "-1", f"--format={fmt}", ours)
            if fmt.startswith("%s"):
                mine = mine.replace(f"Signed-off-by: {AUTHOR}", "").strip()
                theirs = theirs.split("\n\nCo-authored-by:")[0].strip()
            assert theirs == mine


PYTEST = "PYTHONPATH=.:../.. ../../.venv/bin/python -m pytest -q -p no:cacheprovider"
ROCM = ("PYTHONPATH=.:../../tests:../.. ../../.venv/bin/python -m pytest -q "
        "-p no:cacheprovider -p rocm_emulation.plugin")


def _write_summary(project) -> None:
    """A `make test` summary in testrun's own format: prefix 1 and the full stack tested."""
    layout = Layout(project.root)
    tree_after = [project.git("rev-parse", f"stack~{len(PATCHES) - k}^{{tree}}")
                  for k in range(1, len(PATCHES) + 1)]
    earlier = {"date": "2026-01-02T03:04:05+00:00", "key": "k" * 64, "seconds": 1.0}

    def row(name, tree, parts):
        parts = [testrun.Part(command, where, passed=p, failed=f, skipped=s, reused=reused)
                 for command, where, p, f, s, reused in parts]
        return testrun.Row(name, tree, []), testrun.Outcome.of(name, parts)

    results = [
        row("tooling", None, [("PYTHONPATH=. .venv/bin/python -m pytest -q tests/tooling", ".",
                               50, 0, 0, None)]),
        row("prefix 1/7", tree_after[0], [
            ("vLLM pre-commit: ruff check", "build/prefix-trees/1", 9, 0, 0, earlier),
            (f"{PYTEST} tests/test_foo.py", "build/prefix-trees/1", 3, 0, 1, earlier)]),
        row("stack", tree_after[-1], [(f"{PYTEST} tests/test_foo.py", "build/vllm", 5, 0, 2,
                                       None)]),
        row("stack (ROCm)", tree_after[-1], [(f"{ROCM} tests/test_foo.py", "build/vllm",
                                              6, 0, 1, None)]),
    ]
    summary = testrun._summary(layout, BASE, "2026-02-03T04:05:06+00:00", 12.0, False, "",
                               results)
    testrun.ResultStore(layout).write_summary(summary)


def test_pr_md_fills_every_template_section_with_the_latest_test_counts(series):
    _write_summary(series)
    result = export(series)
    assert result.returncode == 0, result.stderr
    pr = (folder(series, 1) / "PR.md").read_text()
    headings = [ln for ln in pr.splitlines() if ln.startswith("## ")]
    assert headings == ["## Overview", "## Claims", "## Validation", "## Details"]
    sections = dict(zip(["head", *headings], pr.split("\n## ")))
    assert sections["## Overview"].split("\n\n")[1].strip() == "Foo uses a larger block on ROCm."
    assert "- Foo is 4x faster on MI300." in sections["## Claims"]
    validation = sections["## Validation"]
    for text in ("### Test Plan", "pytest tests/test_foo.py", "### Test Result",
                 "### Automated checks",
                 "on CPU only, where the ROCm-only tests are skipped",
                 "| vLLM pre-commit | CPU | 1 | 9 | 0 | 0 | 2026-01-02 03:04 UTC |",
                 "| pytest | CPU | 1 | 3 | 0 | 1 | 2026-01-02 03:04 UTC |",
                 "vLLM test files run: `tests/test_foo.py`.",
                 "### Hardware test plan (MI300/MI355 reviewers)", "foo benchmark on an MI300"):
        assert text in validation
    details = sections["## Details"]
    for text in ("### Background", "overflowed the shared memory", "### Design",
                 "### Rationale", "register budget of gfx942"):
        assert text in details
    # Folded away, after the sections reviewers read first; no heading of the
    # notes' own leaks into the PR.
    assert details.split("\n\n")[1].startswith("<details>\n<summary>")
    assert details.rstrip().endswith("</details>") or "</details>\n\n---" in details
    assert "What the notes add to the message." in details
    assert "### Notes" not in pr and "# Foo: notes" not in pr
    # The checklist is the template's, nothing ticked; no guidance comment is left.
    checklist = TEMPLATE[TEMPLATE.index("\n---\n"):]
    assert pr.endswith(checklist) and "[x]" not in pr
    assert "<!-- Summarize" not in pr and "<!-- Explain" not in pr
    last = (folder(series, 7) / "PR.md").read_text()
    assert "| pytest | CPU | 1 | 5 | 0 | 2 | 2026-02-03 04:05 UTC |" in last
    assert "| pytest | emulated ROCm | 1 | 6 | 0 | 1 | 2026-02-03 04:05 UTC |" in last
    assert "under a CPU emulation of vLLM's RocmPlatform (gfx942), where the ROCm-only" in last
    assert "- Describe vLLM." in last  # no notes file: the title is the claim
    untested = (folder(series, 2) / "PR.md").read_text()
    assert "_No test result is recorded for this tree._" in untested
    assert ("the latest `make test` (2026-02-03 04:05 UTC) did not test this patch's tree: "
            "run `make test`, then `make export`") in result.stderr
    assert "(patch 2, 3, 4, 5, 6)" in result.stderr



def test_automated_checks_are_one_line_per_check_and_platform(series):
    """A tree is tested by dozens of commands (every test file of the patches so
    far, and the linters); PR.md sums them per check and platform, so that the
    description stays readable, and names the vLLM test files once."""
    _write_summary(series)
    layout = Layout(series.root)
    summary_path = layout.build_dir / "test-results" / "summary.json"
    summary = json.loads(summary_path.read_text())
    (stack,) = [r for r in summary["rows"] if r["name"] == "stack"]
    part = stack["parts"][0]
    stack["parts"] = [{**part, "command": part["command"] + f"::test_{i}"} for i in range(30)]
    summary_path.write_text(json.dumps(summary))

    result = export(series)
    assert result.returncode == 0, result.stderr
    last = (folder(series, 7) / "PR.md").read_text()
    assert "| pytest | CPU | 30 | 150 | 0 | 60 | 2026-02-03 04:05 UTC |" in last
    assert sum(ln.startswith("| pytest") for ln in last.splitlines()) == 2  # and ROCm
    assert "vLLM test files run: `tests/test_foo.py`." in last


def test_cover_lists_the_order_and_which_patches_can_go_first(series):
    result = export(series)
    assert result.returncode == 0, result.stderr
    cover = (series.root / "build" / "export" / "COVER.md").read_text()
    needs = {}
    for line in cover.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            needs[int(cells[0])] = cells[3]
            assert cells[1] == PATCHES[int(cells[0]) - 1][0]
    # Each needs what it uses a name of or does not apply without, and no more.
    assert needs == {1: "nothing", 2: "nothing", 3: "#2", 4: "#1", 5: "#1", 6: "nothing",
                     7: "nothing"}
    assert "- #3 needs #2: it uses `vllm.models.new` of #2." in cover
    assert "- #4 needs #1: it uses `helper` of #1." in cover
    assert "- #5 needs #1: its diff of `vllm/models/foo.py` applies only after #1." in cover
    first = cover.split("Can go first")[1].split("\n\n", 2)[1].splitlines()
    assert first == [f"- #2 `02-{STEMS[1]}`", f"- #6 `06-{STEMS[5]}`", f"- #7 `07-{STEMS[6]}`"]
    assert "no `make test` result is recorded" in result.stderr


BAD_SIGNOFFS = ["", "Ada Lovelace", "Ada <ada>", "<ada@lovelace.dev>", "Ada <ada@example.com>",
                "Ada <ada@lovelace.invalid>", "Ada\n<ada@lovelace.dev>",
                "Ada\\n <ada@lovelace.dev>", "Ada $(id) <ada@lovelace.dev>",
                "Ada `id` <ada@lovelace.dev>", "Ada <ada@lovelace.dev>; rm -rf ~",
                "Ada <ada@lovelace.dev> <eve@evil.dev>"]


@pytest.mark.parametrize("signoff", BAD_SIGNOFFS, ids=range(len(BAD_SIGNOFFS)))
def test_a_bad_signoff_is_refused_in_one_line_and_writes_nothing(series, signoff):
    before = snapshot(series.root)
    result = export(series, signoff)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: SIGNOFF ")
    assert 'make export SIGNOFF="Your Name <you@your.domain>"' in result.stderr
    assert snapshot(series.root) == before


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_passes_signoff_verbatim_and_runs_nothing_in_it(series, tmp_path):
    marker = tmp_path / "ran"
    for trick in (f"Ada $(shell touch {marker}) <ada@lovelace.dev>",
                  f"Ada `touch {marker}` <ada@lovelace.dev>",
                  f"Ada '$$(touch {marker})' <ada@lovelace.dev>"):
        result = make_export(series, trick)
        assert result.returncode != 0 and "error: SIGNOFF " in result.stderr
        assert not marker.exists()
        assert not (series.root / "build" / "export").exists()
    result = make_export(series, "Ada O'Brien-Núñez <ada@obrien.dev>")
    assert result.returncode == 0, result.stderr
    patch = (folder(series, 1) / f"{STEMS[0]}.patch").read_text()
    assert "Signed-off-by: Ada O'Brien-Núñez <ada@obrien.dev>" in patch


def test_unexported_work_in_build_vllm_is_refused(series):
    (series.tree / "vllm/models/bar.py").write_text("# edited\n")
    result = export(series)
    assert result.returncode == 1
    assert "build/vllm has uncommitted changes" in result.stderr
    assert (series.tree / "vllm/models/bar.py").read_text() == "# edited\n"
    assert not (series.root / "build" / "export").exists()
    series.git("commit", "-q", "-a", "-m", "[ROCm] Not exported yet")
    result = export(series)
    assert result.returncode == 1
    assert "has commits that are not exported to patches/" in result.stderr
    assert not (series.root / "build" / "export").exists()


def test_a_new_export_replaces_the_old_one_whole_or_not_at_all(series):
    assert export(series).returncode == 0
    stale = series.root / "build" / "export" / "00-dropped-patch"
    stale.mkdir()
    assert export(series).returncode == 0
    assert not stale.exists()
    # A failing export leaves the previous one as it was, and no staging folder:
    # here patch 3's notes cannot be read, after patches 1 and 2 were written.
    before = snapshot(series.root / "build" / "export")
    notes = series.patches / "notes" / f"{STEMS[2]}.md"
    notes.write_bytes(b"## Claims\n\n- \xe9t\xe9\n")  # latin-1
    result = export(series)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: patches/notes/{STEMS[2]}.md is not UTF-8 "
                                     "text; save it as UTF-8 and run `make export` again")
    assert snapshot(series.root / "build" / "export") == before
    assert [p.name for p in (series.root / "build").iterdir() if p.name.startswith(".")] == []


def test_a_tree_without_the_pr_template_is_refused(series):
    series.git("rm", "-q", ".github/PULL_REQUEST_TEMPLATE.md")
    series.git("commit", "-q", "-m", "[CI] Drop the template")
    series.ok("patches")
    result = export(series)
    assert result.returncode == 1
    assert "has no .github/PULL_REQUEST_TEMPLATE.md to fill" in result.stderr
    assert not (series.root / "build" / "export").exists()


# --- nothing read through a link, nothing blocks, nothing left behind ----------------


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_notes_are_read_only_from_a_regular_file(series, tmp_path, kind):
    notes = series.patches / "notes" / f"{STEMS[0]}.md"
    notes.unlink()
    if kind == "symlink":
        secret = tmp_path / "secret.md"
        secret.write_text("## Claims\n\n- the private key\n")
        notes.symlink_to(secret)
    else:
        os.mkfifo(notes)  # nobody writes it: reading would block for ever
    result = export(series)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: patches/notes/{STEMS[0]}.md is {'a symlink' if kind == 'symlink' else 'a FIFO'}"
        ", not a regular file; notes must be plain files in patches/notes/; replace it with "
        "one")
    assert not (series.root / "build" / "export").exists()


@pytest.mark.parametrize("content", ["{", "[]", f'{{"format": {FORMAT}, "rows": 5}}', b"\xff"])
def test_a_damaged_test_summary_is_named(series, content):
    path = series.root / "build" / "test-results" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = export(series)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: build/test-results/summary.json is damaged")
    assert "run `make test`" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_terminated_export_leaves_nothing_behind(series, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    series.extra_env.update(TMPDIR=str(scratch), K3_SIGNOFF=SUBMITTER)
    result = series.run("export", fault="SIGTERM open 1 in /PR.md")
    assert result.returncode == 143, result.stderr
    assert "terminated (SIGTERM)" in result.stderr
    build = series.root / "build"
    assert [p.name for p in build.iterdir() if p.name.startswith(".")] == []
    assert list(scratch.iterdir()) == []
    assert not (series.root / ".k3-stack.running").exists()
    # What a SIGKILL leaves (it runs no cleanup), and a finished export, are the
    # tooling's own to `make clean`.
    (build / ".export-old-4242").mkdir()
    (build / "export").mkdir()
    result = series.ok("clean")
    assert "alone" not in result.stderr and not build.exists()


def test_a_commit_whose_author_is_not_utf8_is_named(series):
    # `git commit` would re-encode the name; a commit object written whole keeps it.
    raw = subprocess.run(["git", "cat-file", "commit", "HEAD"], cwd=series.tree,
                         capture_output=True, check=True).stdout
    raw = raw.replace(AUTHOR.split(" <")[0].encode(), b"D\xe9v", 1)
    commit = subprocess.run(["git", "hash-object", "-w", "-t", "commit", "--stdin"],
                            cwd=series.tree, input=raw, capture_output=True,
                            check=True).stdout.decode().strip()
    series.git("reset", "-q", "--soft", commit)
    series.ok("patches")
    result = export(series)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{STEMS[6]}.patch: the author or message of commit" in result.stderr
    assert "is not UTF-8 (in 'D\\udce9v <" in result.stderr


def test_an_overview_that_ends_on_a_colon_keeps_what_it_introduces(series):
    """The overview is the purpose's first paragraph; one that ends on a colon
    takes the list after it along, instead of leaving "Two paths stay open:"
    alone above the claims."""
    _write_summary(series)
    series.git("commit", "-q", "--amend", "-m", "[Bugfix] Describe vLLM", "-m",
               "## Purpose\n\nvLLM is undescribed. Two things go wrong:\n\n"
               "* one;\n* two.\n\nThe rest is background.", "-m", SIGNOFF)
    series.ok("patches")
    assert export(series).returncode == 0
    pr = (folder(series, 7) / "PR.md").read_text()
    overview = pr.split("## Overview", 1)[1].split("## Claims", 1)[0]
    assert "Two things go wrong:\n\n* one;\n* two." in overview
    assert "The rest is background." not in overview
    assert "The rest is background." in pr.split("## Details", 1)[1]


def _cover_needs(project) -> dict[int, str]:
    """COVER.md's "needs" column, by patch number."""
    cover = (project.root / "build" / "export" / "COVER.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in cover.splitlines()]
    return {int(r[0]): r[3] for r in rows if len(r) == 4 and r[0].isdigit()}


def test_a_name_in_a_docstring_comment_or_string_is_no_dependency(series):
    """Patch 8 names #2's module and #1's and #2's new functions only in a
    docstring, a comment and a string: it needs nothing. Patch 9 imports that
    module and calls those functions in code: it needs both. Patch 10, a CI
    step that names the module's file, is read as text: it needs #2."""
    series.commit("[Doc] Describe the models", {"vllm/models/doc.py": (
        '"""Built like vllm.models.new (vllm/models/new.py): new_model(), helper()."""\n'
        "\n"
        "# from vllm.models import new; new.new_model() and foo.helper() are the pattern\n"
        "\n"
        "\n"
        "def describe():\n"
        '    """import vllm.models.new"""\n'
        '    return "vllm.models.new.new_model and helper"\n')})
    series.commit("[ROCm] Use the new model", {"vllm/models/user2.py": (
        "import vllm.models.new\n"
        "from vllm.models.foo import helper as block_helper\n"
        "\n"
        "\n"
        "def use():\n"
        "    return vllm.models.new.new_model() + block_helper()\n")})
    series.commit("[CI] Test the new model", {".buildkite/new.yaml": (
        "steps:\n  - command: pytest vllm/models/new.py\n")})
    series.ok("patches")
    result = export(series)
    assert result.returncode == 0, result.stderr
    assert _cover_needs(series) == {1: "nothing", 2: "nothing", 3: "#2", 4: "#1", 5: "#1",
                                    6: "nothing", 7: "nothing", 8: "nothing", 9: "#1-#2",
                                    10: "#2"}
    cover = (series.root / "build" / "export" / "COVER.md").read_text()
    assert ("- #9 needs #1-#2: it uses `helper` of #1; it uses `new_model`, `vllm.models.new` "
            "of #2.") in cover
    assert "- #10 needs #2: it uses `vllm.models.new` of #2." in cover


def _reword_last(series, body: str) -> None:
    """Patch 7's message becomes `body`, its code unchanged."""
    series.git("commit", "-q", "--amend", "-m", "[Bugfix] Describe vLLM", "-m", body,
               "-m", SIGNOFF)
    series.ok("patches")


def test_pr_md_cites_the_tree_git_am_gives_and_no_commit_of_the_export(series, tmp_path):
    """A commit id depends on who runs `git am` (the committer, the date); the
    tree does not. PR.md names the tree `git am` of patches 1-k onto the
    release gives, and a file by its blob id, which the patch's `index` lines
    show; the exported commits are named nowhere."""
    _write_summary(series)
    blob = series.git("rev-parse", "stack~6:tests/test_foo.py")
    _reword_last(series, f"## Purpose\n\nvLLM is undescribed.\n\n## Test Result\n\n"
                         f"3.1 ms, measured with `tests/test_foo.py` at blob {blob[:10]}.")
    result = export(series)
    assert result.returncode == 0, result.stderr
    upstream = _release_clone(series, tmp_path)
    for k in range(1, len(PATCHES) + 1):
        patch = folder(series, k) / f"{STEMS[k - 1]}.patch"
        series.git("am", "--keep-non-patch", str(patch), cwd=upstream)
        tree = series.git("rev-parse", "HEAD^{tree}", cwd=upstream)
        pr = (folder(series, k) / "PR.md").read_text()
        applied = "this patch" if k == 1 else f"patches 1-{k} of the series"
        assert (f"After `git am` of {applied} onto vLLM 0.1.0, `git rev-parse HEAD^{{tree}}` "
                f"prints `{tree}`.") in pr
        assert "head commit" not in pr and series.git("rev-parse", "HEAD", cwd=upstream) not in pr
        assert patch.read_text().startswith("From " + "0" * 40 + " ")  # no id to cite
    assert f"3.1 ms, measured with `tests/test_foo.py` at blob {blob[:10]}." in pr
    assert f"..{blob} " in (folder(series, 1) / f"{STEMS[0]}.patch").read_text()  # `index`


def _hits(result) -> list[str]:
    """The lines of a refused export that name a place in PR.md or COVER.md."""
    return [ln for ln in result.stderr.splitlines() if not ln.startswith(("error:", "warning:"))]


def test_text_that_points_into_this_project_is_refused_line_by_line(series):
    """PR.md must not name what only this project has: its commits, its
    commands and Makefile targets, its name, its paths, its notes. Each hit is
    one line (folder, line of PR.md, the text), then what to edit; nothing is
    exported. Pointer values, hex-looking words and vLLM's own paths pass."""
    harmless = ("The pointer 140234567890123 (0x7f8a3c2b1d00) and the word `defaced` stay; "
                "see `tests/test_foo.py` and vllm/models/.")
    bad = ["Measured at project commit 26e3a24.", "Run `python3 -m scripts gpubench`.",
           "Then make test passes.", "As the K3 DSpark ROCm project found.",
           "The patch stack's CI.", "Asked in review round 4.", "Details in the notes.",
           "Unlike this PR as it was on vLLM 0.33.0.",
           "See benchmarks/gpu/cases/mla_decode.py.", "Measured at commit `ab12cd34ef`."]
    lines = [f"MARK{i} x." for i in range(len(bad))]
    _reword_last(series, "## Purpose\n\nvLLM is undescribed.\n\n## Test Result\n\n"
                 + harmless + "\n\n" + "\n".join(lines))
    assert export(series).returncode == 0
    pr = (folder(series, 7) / "PR.md").read_text().splitlines()
    at = [next(n for n, ln in enumerate(pr, 1) if ln.startswith(f"MARK{i} ")) for i in
          range(len(bad))]
    _reword_last(series, "## Purpose\n\nvLLM is undescribed.\n\n## Test Result\n\n"
                 + harmless + "\n\n" + "\n".join(bad))
    before = snapshot(series.root / "build" / "export")
    result = export(series)
    assert result.returncode == 1
    where = f"07-{STEMS[6]}/PR.md"
    unknown_id = "an id that is no commit, tree or file of vLLM's after this PR"
    assert _hits(result) == [f"{where}:{n}: {text}" for n, text in zip(at, [
        f"commit 26e3a24 ({unknown_id})",
        "python3 -m scripts (this project's command line)",
        "make test (a target of this project's Makefile)",
        "K3 DSpark ROCm project (this project's name)",
        "patch stack (this project)",
        "review round 4 (this project's review)",
        "in the notes (the notes, which PR.md leaves out)",
        "this PR as it was on vLLM 0.33.0 (an earlier revision in this project)",
        "benchmarks/gpu/cases/mla_decode.py (a path that is not in vLLM's tree after this PR)",
        f"commit ab12cd34ef ({unknown_id})"])]
    final = result.stderr.splitlines()[-1]
    assert final.startswith("error: 10 place(s) in PR.md or COVER.md point into this project")
    assert ("edit the commit message in build/vllm (`git rebase -i`, then `make patches`) or "
            "the notes file patches/notes/<name>.md") in final
    assert snapshot(series.root / "build" / "export") == before


def test_an_id_is_checked_against_the_trees_after_this_pr(series):
    """An id of build/vllm's own commits (which `git am` does not reproduce), or
    of a file only a later patch adds, is refused; the release's tree passes."""
    release_tree = series.git("rev-parse", f"{BASE}^{{tree}}")
    later_blob = series.git("rev-parse", "stack~5:vllm/models/new.py")  # patch 2 adds it
    (series.patches / "notes" / f"{STEMS[0]}.md").write_text(
        NOTES_1 + f"\n## Evidence\n\nOn tree `{release_tree[:12]}`, then blob {later_blob[:9]}; "
        f"built at commit {series.git('rev-parse', 'stack~6')[:8]}.\n")
    result = export(series)
    assert result.returncode == 1
    hits = _hits(result)
    assert len(hits) == 2, result.stderr
    assert "PR.md:" in hits[0] and f": blob {later_blob[:9]} (an id" in hits[0]
    assert f": commit {series.git('rev-parse', 'stack~6')[:8]} (an id" in hits[1]


def test_the_exports_own_text_passes_the_check(series):
    """What the export writes itself describes the tests in vLLM's terms: no
    Makefile target, no name of this project."""
    _write_summary(series)
    result = export(series)
    assert result.returncode == 0, result.stderr
    for path in (series.root / "build" / "export").rglob("*.md"):
        text = path.read_text()
        for pointer in ("make test", "patch stack", "patch-stack", "project commit"):
            assert pointer not in text, (path, pointer)
    cover = (series.root / "build" / "export" / "COVER.md").read_text()
    tree = series.git("rev-parse", "stack^{tree}")
    assert (f"on the tree after each prefix, `{tree}` after all 7: 23 passed, 0 failed, "
            "4 skipped.") in cover  # prefix 1, the stack on CPU and emulated ROCm


def test_a_need_declared_in_the_notes_is_listed_with_its_reason(series):
    """A need the diff cannot show (a feature must not reach users before what
    makes it correct) is declared in the notes, one `Needs:` line each; COVER.md
    lists it with the reason and PR.md does not show the line."""
    notes = series.patches / "notes" / f"{STEMS[6]}.md"
    notes.write_text(f"Needs: {STEMS[1]}.patch -- the new model must be listed first\n\n"
                     "## Claims\n\n- vLLM is described.\n")
    result = export(series)
    assert result.returncode == 0, result.stderr
    assert _cover_needs(series)[7] == "#2"
    cover = (series.root / "build" / "export" / "COVER.md").read_text()
    assert "- #7 needs #2: #2, as declared: the new model must be listed first." in cover
    assert "#7" not in cover.split("Can go first")[1]
    assert "Needs:" not in (folder(series, 7) / "PR.md").read_text()


@pytest.mark.parametrize("line, says", [
    ("Needs: no-such.patch -- a reason", "`Needs: no-such.patch`: no such patch in patches/"),
    (f"Needs: {STEMS[6]}.patch -- a reason", "that is patch 7, not one before this one (2)"),
    (f"Needs: {STEMS[0]}.patch", "write it as `Needs: <earlier patch file in patches/")])
def test_a_declared_need_on_an_unknown_or_later_patch_is_refused_in_one_line(series, line,
                                                                           says):
    (series.patches / "notes" / f"{STEMS[1]}.md").write_text(f"{line}\n")
    result = export(series)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: patches/notes/{STEMS[1]}.md")
    assert says in result.stderr
    assert not (series.root / "build" / "export").exists()


def test_a_history_section_of_the_notes_stays_out_of_pr_md(series):
    """A notes section headed "History..." (the patch's revisions) stays in the
    notes; the sections around it still land in PR.md."""
    notes = series.patches / "notes" / f"{STEMS[0]}.md"
    notes.write_text(NOTES_1 + "\n## History of revisions\n\n- v2: BLOCK 64, not 128.\n\n"
                     "## Risks\n\nNone known.\n")
    result = export(series)
    assert result.returncode == 0, result.stderr
    pr = (folder(series, 1) / "PR.md").read_text()
    assert "History" not in pr and "BLOCK 64, not 128" not in pr
    assert "### Rationale" in pr and "### Risks\n\nNone known." in pr
    assert "v2: BLOCK 64, not 128." in notes.read_text()


def test_a_pr_md_longer_than_120_lines_is_named_in_one_warning(series):
    """vLLM's reviewers read PR descriptions of at most about 120 lines: a longer
    one is named, a shorter one is not."""
    result = export(series)
    assert result.returncode == 0, result.stderr
    assert "longer than 120 lines" not in result.stderr
    steps = "\n".join(f"- step {i}." for i in range(1, 120))
    series.git("commit", "-q", "--amend", "-m", "[Bugfix] Describe vLLM", "-m",
               f"## Purpose\n\nvLLM is undescribed.\n\n## Design\n\n{steps}", "-m", SIGNOFF)
    series.ok("patches")
    result = export(series)
    assert result.returncode == 0, result.stderr
    assert len((folder(series, 7) / "PR.md").read_text().splitlines()) > 120
    long = [ln for ln in result.stderr.splitlines() if "longer than 120 lines" in ln]
    assert long == [("warning: PR.md is longer than 120 lines, vLLM's reviewers ask for at "
                     "most about that (problem, design, tests, numbers): shorten the message "
                     "or notes; a '## History' section of patches/notes/<patch>.md stays out "
                     "of PR.md (patch 7)")]
