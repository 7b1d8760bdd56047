"""apply/clean never lose work in build/vllm; a failing patch stops cleanly; recovery."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.tooling.conftest import (
    PATCH_1,
    PATCH_2,
    SUBJECT_1,
    SUBJECT_2,
    V1,
    release_files,
    snapshot,
)

PATCH_3 = "rocm-shout-bar.patch"
BASE = f"vllm-{V1}"


def subjects(proj) -> list[str]:
    return proj.git("log", "--reverse", "--format=%s", f"{BASE}..HEAD").splitlines()


@pytest.fixture
def broken(stacked):
    """A third patch on bar.py, then a pin to a release whose bar.py changed."""
    stacked.commit("[ROCm] Shout bar", {"vllm/models/bar.py": "def bar():\n    return 'BAR'\n"})
    stacked.ok("patches")
    assert stacked.series() == [PATCH_1, PATCH_2, PATCH_3]
    files = release_files(V1)
    files["vllm/models/bar.py"] = b"def bar():\n    return 'bar, upstream'\n"
    stacked.pin = stacked.use_release(V1, files)
    return stacked


def test_a_patch_that_no_longer_applies_stops_cleanly(broken):
    patches = broken.patch_bytes()
    result = broken.run("apply")
    assert result.returncode == 1
    assert f"{PATCH_3} does not apply to vLLM {V1}" in result.stderr
    assert "failing file(s): vllm/models/bar.py" in result.stderr
    assert "Traceback" not in result.stderr
    # The am was aborted, the base is intact, the patches before it are applied.
    assert not (broken.tree / ".git" / "rebase-apply").exists()
    assert broken.git("symbolic-ref", "--short", "HEAD") == "stack"
    assert broken.git("status", "--porcelain", "--untracked-files=all") == ""
    base = broken.git("rev-parse", BASE)
    assert base == broken.state()["base_commit"]
    upstream_bar = "def bar():\n    return 'bar, upstream'"
    assert broken.git("show", f"{BASE}:vllm/models/bar.py") == upstream_bar
    assert broken.git("rev-list", "--count", BASE) == "1"
    assert subjects(broken) == [SUBJECT_1, SUBJECT_2]
    assert broken.state()["status"] == "failed"
    assert broken.patch_bytes() == patches
    # A second run fails the same way (no half state carried over).
    again = broken.run("apply")
    assert again.returncode == 1 and PATCH_3 in again.stderr
    assert subjects(broken) == [SUBJECT_1, SUBJECT_2]


def test_patches_after_a_failed_apply_keeps_the_unapplied_patches(broken):
    patches = broken.patch_bytes()
    assert broken.run("apply").returncode == 1
    broken.run("patches")
    assert broken.series() == [PATCH_1, PATCH_2, PATCH_3]
    assert broken.patch_bytes() == patches


def test_a_failing_patch_is_aborted_on_a_machine_without_git_identity(broken):
    broken.no_git_identity()
    result = broken.run("apply")
    assert result.returncode == 1 and PATCH_3 in result.stderr
    assert not (broken.tree / ".git" / "rebase-apply").exists()
    again = broken.run("apply")
    assert f"{PATCH_3} does not apply" in again.stderr


def test_apply_refuses_uncommitted_changes_and_keeps_them(stacked):
    head = stacked.head()
    foo = stacked.tree / "vllm/models/foo.py"
    foo.write_text(foo.read_text() + "# wip\n")
    (stacked.tree / "vllm/models/wip.py").write_text("# new, untracked\n")
    result = stacked.run("apply")
    assert result.returncode == 1
    assert "has uncommitted changes" in result.stderr
    assert "vllm/models/foo.py" in result.stderr and "vllm/models/wip.py" in result.stderr
    assert "stash -u" in result.stderr and "make patches" in result.stderr
    assert foo.read_text().endswith("# wip\n")
    assert (stacked.tree / "vllm/models/wip.py").read_text() == "# new, untracked\n"
    assert stacked.head() == head
    # clean refuses too.
    result = stacked.run("clean")
    assert result.returncode == 1 and "vllm/models/wip.py" in result.stderr
    assert foo.read_text().endswith("# wip\n")


def test_apply_and_clean_refuse_a_commit_not_exported(stacked):
    stacked.commit("[ROCm] Shout bar", {"vllm/models/bar.py": "def bar():\n    return 'BAR'\n"})
    head = stacked.head()
    patches = stacked.patch_bytes()
    result = stacked.run("apply")
    assert result.returncode == 1
    assert "commits that are not exported to patches/" in result.stderr
    assert "[ROCm] Shout bar" in result.stderr
    assert "make patches" in result.stderr
    assert stacked.head() == head
    result = stacked.run("clean")
    assert result.returncode == 1 and "[ROCm] Shout bar" in result.stderr
    assert stacked.tree.is_dir() and stacked.head() == head
    assert stacked.patch_bytes() == patches
    # Once exported, apply is happy and clean removes build/ but keeps the cache.
    stacked.ok("patches")
    assert PATCH_3 in stacked.series()
    assert "3 patch(es) already applied" in stacked.ok("apply").stdout
    stacked.ok("clean")
    assert not (stacked.root / "build").exists()
    assert (stacked.downloads / f"vllm-{V1}.tar.gz").exists()


def test_apply_refuses_patches_reordered_or_dropped_in_build_vllm(stacked):
    """Every commit exported, but in another order than patches/series (or one
    dropped): apply would put the series' order back, so it refuses."""
    base = f"vllm-{V1}"
    first, second = stacked.git("rev-list", "--reverse", f"{base}..HEAD").split()
    stacked.git("reset", "-q", "--hard", base)
    stacked.git("cherry-pick", second, first)  # patch 2, then patch 1
    head = stacked.head()
    result = stacked.run("apply")
    assert result.returncode == 1, result.stdout
    assert "not patches/series in order" in result.stderr
    assert "make patches" in result.stderr and "Traceback" not in result.stderr
    assert stacked.head() == head and stacked.series() == [PATCH_1, PATCH_2]
    stacked.ok("patches")
    assert stacked.series() == [PATCH_2, PATCH_1]
    assert "2 patch(es) already applied" in stacked.ok("apply").stdout
    stacked.git("reset", "-q", "--hard", "HEAD~1")  # drop patch 1
    result = stacked.run("apply")
    assert result.returncode == 1 and "not patches/series in order" in result.stderr


def test_apply_leaves_a_foreign_build_tree_alone(project):
    project.tree.mkdir(parents=True)
    (project.tree / "mine.txt").write_text("hand made\n")
    before = snapshot(project.root / "build")
    result = project.run("apply")
    assert result.returncode == 1
    assert "build/vllm exists but was not made by this tooling" in result.stderr
    assert snapshot(project.root / "build") == before
    result = project.ok("clean")
    assert "left build/vllm alone" in result.stderr
    assert snapshot(project.root / "build") == before


def test_apply_refuses_another_branch(stacked):
    stacked.git("checkout", "-q", "-b", "experiment")
    result = stacked.run("apply")
    assert result.returncode == 1
    assert "not on branch 'stack'" in result.stderr and "checkout stack" in result.stderr
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "experiment"


def _stop_git_am_mid_way(proj) -> None:
    """Reset to the base and run a `git am` of two mails that stops at the second."""
    proj.git("reset", "-q", "--hard", BASE)
    p1 = str(proj.patches / PATCH_1)
    result = proj.git("am", p1, p1, check=False)  # the second one cannot apply again
    assert (proj.tree / ".git" / "rebase-apply").exists(), result


def _set_status(proj, status: str) -> None:
    state = proj.state()
    state["status"] = status
    proj.state_file.write_text(json.dumps(state))


def test_an_interrupted_apply_is_recovered(stacked):
    tree_id = stacked.git("rev-parse", "HEAD^{tree}")
    _stop_git_am_mid_way(stacked)
    _set_status(stacked, "applying")  # what apply writes before its first `git am`
    result = stacked.ok("apply")
    assert f"[2/2] applied {PATCH_2}" in result.stdout
    assert not (stacked.tree / ".git" / "rebase-apply").exists()
    assert subjects(stacked) == [SUBJECT_1, SUBJECT_2]
    assert stacked.git("rev-parse", "HEAD^{tree}") == tree_id
    assert stacked.state()["status"] == "applied"
    assert stacked.git("status", "--porcelain", "--untracked-files=all") == ""


def test_an_interrupted_apply_is_recovered_without_git_identity(stacked):
    _stop_git_am_mid_way(stacked)
    _set_status(stacked, "applying")
    stacked.no_git_identity()
    stacked.ok("apply")
    assert subjects(stacked) == [SUBJECT_1, SUBJECT_2]


def test_a_git_am_the_tooling_did_not_start_makes_apply_refuse(stacked):
    _stop_git_am_mid_way(stacked)
    head = stacked.head()
    result = stacked.run("apply")  # status is still "applied"
    assert result.returncode == 1
    assert "a `git am` is in progress in build/vllm" in result.stderr
    assert "am --continue" in result.stderr and "am --abort" in result.stderr
    assert (stacked.tree / ".git" / "rebase-apply").exists()
    assert stacked.head() == head
    # patches and clean refuse too.
    assert stacked.run("patches").returncode == 1
    assert stacked.run("clean").returncode == 1
    assert (stacked.tree / ".git" / "rebase-apply").exists()


def test_patches_refuses_uncommitted_changes(stacked):
    (stacked.tree / "vllm/models/bar.py").write_text("# wip\n")
    patches = stacked.patch_bytes()
    result = stacked.run("patches")
    assert result.returncode == 1
    assert "vllm/models/bar.py" in result.stderr and "commit" in result.stderr
    assert stacked.patch_bytes() == patches


def test_a_new_pin_rebuilds_an_exported_tree(stacked):
    """After a pin change (everything exported), apply rebuilds build/vllm on the new release."""
    files = release_files(V1)
    files["vllm/models/bar.py"] = b"def bar():\n    return 'bar, respun'\n"
    pin = stacked.use_release(V1, files)
    result = stacked.ok("apply")
    assert "holds another vLLM release; rebuilding it" in result.stdout
    assert stacked.state()["base_sdist_sha256"] == pin.sdist.sha256
    respun = "def bar():\n    return 'bar, respun'\n"
    assert (stacked.tree / "vllm/models/bar.py").read_text() == respun
    assert subjects(stacked) == [SUBJECT_1, SUBJECT_2]
    shutil.rmtree(stacked.overlay)
    stacked.ok("apply")
    assert (stacked.overlay / "MANIFEST.json").exists()


def test_apply_after_a_pull_that_changed_a_patch(stacked):
    shutil.rmtree(stacked.root / "build")
    stacked.ok("apply")  # build/vllm now holds exactly what apply made
    pulled = stacked.patches / PATCH_2
    pulled.write_text(pulled.read_text().replace("return 42", "return 43"))
    result = stacked.run("apply")
    assert result.returncode == 0, result.stderr
    assert "return 43" in (stacked.tree / "vllm/models/new.py").read_text()


def test_patches_never_overwrites_an_edit_made_in_patches(stacked):
    """`make patches` writes only files that are as the last apply or export left
    them: a hand edit or a pull is named, and either side can be taken."""
    edited = stacked.patches / PATCH_1
    edited.write_text(edited.read_text().replace("default block size", "default tile size"))
    series = stacked.patches / "series"
    series.write_text(series.read_text() + "# reviewed\n")
    stacked.commit("[ROCm] Shout bar", {"vllm/models/bar.py": "def bar():\n    return 'BAR'\n"})
    before = stacked.patch_bytes()
    result = stacked.run("patches")
    assert result.returncode == 1
    assert f"patches/{PATCH_1}, patches/series. `make patches` would overwrite" in result.stderr
    assert "`make apply`" in result.stderr and "delete the files named" in result.stderr
    assert stacked.patch_bytes() == before
    # build/vllm's side: the edited files deleted, the export writes them again.
    edited.unlink()
    series.unlink()
    stacked.ok("patches")
    assert stacked.series() == [PATCH_1, PATCH_2, PATCH_3]
    assert "default block size" in edited.read_text()
    # patches/' side: `make apply` takes the edit into build/vllm.
    edited.write_text(edited.read_text().replace("default block size", "default tile size"))
    stacked.ok("apply")
    assert "default tile size" in stacked.git("log", "-1", "--format=%B", "HEAD~2")
    assert stacked.run("patches").returncode == 0
