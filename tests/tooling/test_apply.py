"""`apply`, `patches` and `check` on a fake release: the pristine tree, idempotence, round trip."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

from tests.tooling.conftest import (
    FOO_PATCHED,
    NEW_MODEL,
    PATCH_1,
    PATCH_2,
    TEST_FOO_PATCHED,
    V1,
    release_files,
    snapshot,
)


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def test_empty_stack_gives_the_pristine_tree(project):
    result = project.ok("apply")
    assert "0 patch(es)" in result.stdout
    tag = f"vllm-{V1}"
    # One commit, tagged, on branch `stack`, nothing uncommitted.
    assert project.git("rev-list", "--count", "HEAD") == "1"
    assert project.head() == project.git("rev-parse", f"{tag}^{{commit}}")
    assert project.git("symbolic-ref", "--short", "HEAD") == "stack"
    assert project.git("status", "--porcelain", "--untracked-files=all") == ""
    # The tree is the release minus its packaging metadata.
    files = set(project.git("ls-files").splitlines())
    expected = {p for p in release_files(V1) if not p.startswith("vllm.egg-info/")}
    assert files == expected
    for path in expected:
        assert (project.tree / path).read_bytes() == release_files(V1)[path]
    # The overlay holds only the manifest, which lists no file.
    assert sorted(p.name for p in project.overlay.rglob("*")) == ["MANIFEST.json"]
    manifest = project.manifest()
    assert manifest["files"] == [] and manifest["patches"] == []
    assert manifest["vllm_version"] == V1 and manifest["base_tag"] == tag
    check = project.ok("check")
    assert "check OK" in check.stdout


def test_apply_twice_changes_nothing(stacked):
    head = stacked.head()
    overlay = snapshot(stacked.overlay)
    state = stacked.state_file.read_bytes()
    start = time.monotonic()
    result = stacked.ok("apply")
    elapsed = time.monotonic() - start
    assert "2 patch(es) already applied" in result.stdout
    assert "(unchanged)" in result.stdout
    assert stacked.head() == head
    assert snapshot(stacked.overlay) == overlay
    assert stacked.state_file.read_bytes() == state
    assert stacked.git("reflog", "-1", "--format=%H") == head
    assert elapsed < 10, f"a no-op apply took {elapsed:.1f}s"


def test_round_trip_apply_then_patches_is_byte_identical(stacked):
    proj = stacked
    assert proj.series() == [PATCH_1, PATCH_2]
    # Commit the project as a maintainer would, then rebuild build/vllm from scratch.
    (proj.root / ".gitignore").write_text("/build/\n")
    proj.git("init", "-q", "-b", "main", cwd=proj.root)
    proj.git("add", "-A", cwd=proj.root)
    proj.git("commit", "-q", "-m", "stack", cwd=proj.root)
    before = proj.patch_bytes()
    shutil.rmtree(proj.root / "build")

    result = proj.ok("apply")
    assert f"[1/2] applied {PATCH_1}" in result.stdout
    assert f"[2/2] applied {PATCH_2}" in result.stdout
    proj.ok("patches")
    assert proj.git("status", "--porcelain", "--untracked-files=all", cwd=proj.root) == ""
    assert proj.patch_bytes() == before
    assert proj.series() == [PATCH_1, PATCH_2]
    assert proj.git("status", "--porcelain", "--untracked-files=all") == ""

    # The overlay holds the post-stack files and the pristine/patched hashes.
    overlay_files = sorted(p.relative_to(proj.overlay).as_posix()
                           for p in proj.overlay.rglob("*") if p.is_file())
    assert overlay_files == ["MANIFEST.json", "tests/test_foo.py",
                             "vllm/models/foo.py", "vllm/models/new.py"]
    assert (proj.overlay / "vllm/models/foo.py").read_text() == FOO_PATCHED
    assert (proj.overlay / "vllm/models/new.py").read_text() == NEW_MODEL
    pristine = release_files(V1)
    manifest = proj.manifest()
    assert manifest["patches"] == [PATCH_1, PATCH_2]
    entries = {e["path"]: e for e in manifest["files"]}
    assert entries == {
        "tests/test_foo.py": {"path": "tests/test_foo.py",
                              "pristine_sha256": sha(pristine["tests/test_foo.py"]),
                              "patched_sha256": sha(TEST_FOO_PATCHED)},
        "vllm/models/foo.py": {"path": "vllm/models/foo.py",
                               "pristine_sha256": sha(pristine["vllm/models/foo.py"]),
                               "patched_sha256": sha(FOO_PATCHED)},
        "vllm/models/new.py": {"path": "vllm/models/new.py", "pristine_sha256": "added",
                               "patched_sha256": sha(NEW_MODEL)},
    }
    assert "check OK: 2 patch(es)" in proj.ok("check").stdout

    # A hand-edited overlay file is caught and named.
    (proj.overlay / "vllm/models/new.py").write_text(NEW_MODEL + "# local tweak\n")
    result = proj.run("check")
    assert result.returncode == 1
    assert "vllm/models/new.py" in result.stdout and "make apply" in result.stdout


def test_apply_rebuilds_from_the_cache_without_the_network(stacked):
    """build/vllm removed: apply recreates it from the cached sdist, same commit ids."""
    base = stacked.git("rev-parse", f"vllm-{V1}")
    shutil.rmtree(stacked.root / "build")
    stacked.ok("apply")  # PIP_INDEX_URL points at a closed port: no download
    head = stacked.head()
    assert stacked.git("rev-parse", f"vllm-{V1}") == base
    shutil.rmtree(stacked.root / "build")
    stacked.ok("apply")
    assert stacked.head() == head
    assert stacked.state()["status"] == "applied"


def test_check_passes_without_build_tree(stacked):
    """check builds its own pristine base when build/vllm is absent."""
    shutil.rmtree(stacked.root / "build" / "vllm")
    result = stacked.ok("check")
    assert "check OK: 2 patch(es)" in result.stdout
    assert not stacked.tree.exists()


def test_overlay_manifest_is_json_with_sorted_entries(stacked):
    manifest = json.loads((stacked.overlay / "MANIFEST.json").read_text())
    paths = [e["path"] for e in manifest["files"]]
    assert paths == sorted(paths)


def test_apply_and_check_on_a_machine_without_git_identity(stacked):
    """A fresh CI machine has no user.name/user.email: the happy path must not need one."""
    stacked.no_git_identity()
    shutil.rmtree(stacked.root / "build")
    result = stacked.ok("apply")
    assert f"[2/2] applied {PATCH_2}" in result.stdout
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout
    assert "already applied" in stacked.ok("apply").stdout


def test_apply_refuses_a_release_tag_moved_off_the_release(stacked):
    """`git tag -f vllm-X stack` would make the stack empty against its base: the
    overlay would be emptied and make test would check nothing (issue 31, case 7)."""
    overlay = snapshot(stacked.overlay)
    stacked.git("tag", "-f", f"vllm-{V1}", "stack")
    result = stacked.run("apply")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: build/vllm: tag vllm-{V1} points at ")
    assert f"put it back with `git -C build/vllm tag -f vllm-{V1} " in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(stacked.overlay) == overlay
