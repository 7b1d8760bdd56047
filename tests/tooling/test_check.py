"""`check` catches a series out of step with patches/ and patches unfit for upstream."""

from __future__ import annotations

import shutil

from tests.tooling.conftest import (
    PATCH_1,
    PATCH_2,
    RATIONALE,
    SIGNOFF,
    V1,
    release_files,
    write_patch,
)


def test_check_fails_on_a_patch_not_in_the_series(stacked):
    write_patch(stacked.patches, "stray.patch", "vllm/models/stray.py")
    result = stacked.run("check")
    assert result.returncode == 1
    assert "FAIL patches/stray.patch is not listed in patches/series" in result.stdout


def test_check_fails_on_a_series_entry_without_its_patch(stacked):
    (stacked.patches / PATCH_2).unlink()
    result = stacked.run("check")
    assert result.returncode == 1
    # Names the series line and the missing patch, and says what to do.
    assert "patches/series:4" in result.stderr
    assert f"{PATCH_2} does not exist in patches/" in result.stderr
    assert "restore it, or remove the line" in result.stderr
    # apply refuses the same way, before touching build/vllm.
    head = stacked.head()
    result = stacked.run("apply")
    assert result.returncode == 1 and PATCH_2 in result.stderr
    assert stacked.head() == head


def _commit_and_export(proj, subject, body, signoff=True):
    proj.commit(subject, {"vllm/models/bar.py": "def bar():\n    return 'BAR'\n"},
                body=body, signoff=signoff)
    proj.ok("patches")


def test_check_fails_on_a_patch_without_signoff(stacked):
    _commit_and_export(stacked, "[ROCm] Shout bar", body=RATIONALE, signoff=False)
    result = stacked.run("check")
    assert result.returncode == 1
    assert "FAIL rocm-shout-bar.patch: no Signed-off-by: line (DCO)" in result.stdout
    assert PATCH_1 not in result.stdout  # the good patches are not blamed


def test_check_fails_on_a_subject_without_a_tag(stacked):
    _commit_and_export(stacked, "Shout bar", body=RATIONALE)
    result = stacked.run("check")
    assert result.returncode == 1
    assert ("FAIL shout-bar.patch: subject 'Shout bar' lacks vLLM's [Tag] prefix"
            in result.stdout)


def test_check_fails_on_a_hand_written_patch_without_rationale(stacked):
    write_patch(stacked.patches, "terse.patch", "vllm/models/terse.py",
                subject="[ROCm] Add terse", body=SIGNOFF)
    (stacked.patches / "series").write_text(
        (stacked.patches / "series").read_text() + "terse.patch\n")
    result = stacked.run("check")
    assert result.returncode == 1
    assert ("FAIL terse.patch: no rationale in the message (say why the patch "
            "exists)" in result.stdout)


def test_check_fails_on_an_exported_patch_without_rationale(stacked):
    _commit_and_export(stacked, "[ROCm] Shout bar", body=None)
    result = stacked.run("check")
    assert result.returncode == 1
    assert ("FAIL rocm-shout-bar.patch: no rationale in the message (say why the patch "
            "exists)" in result.stdout)


def test_check_fails_on_a_signoff_by_someone_else(stacked):
    body = RATIONALE + "\n\nSigned-off-by: Someone Else <else@example.com>"
    _commit_and_export(stacked, "[ROCm] Shout bar", body=body, signoff=False)
    result = stacked.run("check")
    assert result.returncode == 1
    assert "rocm-shout-bar.patch: author Dev One <dev@example.com> has not signed off" \
        in result.stdout


def test_check_fails_on_a_patch_that_does_not_apply(stacked):
    # Make patch 1 expect context the release does not have.
    path = stacked.patches / PATCH_1
    path.write_text(path.read_text().replace(" BLOCK = 16\n", "-BLOCK = 16\n", 0)
                    .replace("def forward(x):", "def forward(y):"))
    result = stacked.run("check")
    assert result.returncode == 1
    assert f"FAIL {PATCH_1} does not apply strictly" in result.stdout
    assert "vllm/models/foo.py" in result.stdout


def test_check_fails_on_a_stray_file_in_patches(stacked):
    (stacked.patches / "notes.txt").write_text("todo\n")
    result = stacked.run("check")
    assert result.returncode == 1
    assert "FAIL patches/notes.txt does not belong in patches/" in result.stdout


def test_check_accepts_notes_of_listed_patches_only(stacked):
    notes = stacked.patches / "notes"
    notes.mkdir()
    (notes / PATCH_1.replace(".patch", ".md")).write_text("## Rationale\n")
    assert stacked.run("check").returncode == 0
    (notes / "dropped-patch.md").write_text("## Rationale\n")
    result = stacked.run("check")
    assert result.returncode == 1
    assert "FAIL patches/notes/dropped-patch.md belongs to no patch" in result.stdout


def test_check_does_not_touch_build_tree(stacked):
    head = stacked.head()
    (stacked.tree / "vllm/models/bar.py").write_text("# work in progress\n")
    stacked.ok("check")
    assert stacked.head() == head
    assert (stacked.tree / "vllm/models/bar.py").read_text() == "# work in progress\n"


def test_check_after_a_pin_change_rebuilds_its_base(project):
    """build/vllm absent, build/check-base left from an earlier pin (e.g. before a pull)."""
    project.ok("apply")
    shutil.rmtree(project.tree)
    project.ok("check")  # no build/vllm: check makes build/check-base
    assert (project.root / "build" / "check-base").is_dir()
    files = release_files(V1)
    files["vllm/models/bar.py"] = b"def bar():\n    return 'respun'\n"
    project.use_release(V1, files)
    project.ok("apply")  # the overlay for the new pin, as a pull would bring it
    shutil.rmtree(project.tree)
    result = project.run("check")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0


def test_check_says_when_build_vllm_holds_work_it_does_not_check(stacked):
    """make check checks patches/: edits and commits only build/vllm has pass it
    unseen, so it says they are there (and still passes)."""
    assert "note:" not in stacked.ok("check").stdout
    (stacked.tree / "vllm/models/bar.py").write_text("def bar():\n    return 'edited'\n")
    out = stacked.ok("check").stdout
    assert ("note: build/vllm holds 1 uncommitted change(s); this checks patches/, not them: "
            "run `make patches` to export them, then `make check` again") in out
    stacked.git("commit", "-q", "-a", "-m", "[ROCm] Not exported yet")
    out = stacked.ok("check").stdout
    assert "note: build/vllm holds 1 commit(s) not exported;" in out
