"""`install-overlay`: copy vllm_overlay/ onto an installed vLLM only when it is safe."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.tooling.conftest import (
    FOO_PATCHED,
    FOO_V1,
    NEW_MODEL,
    TEST_FOO_PATCHED,
    TEST_FOO_V1,
    V1,
    release_files,
    snapshot,
)


def pristine_copy(dest: Path, site_packages: bool) -> Path:
    """The fake release as installed: site-packages (vllm/ only) or a source tree."""
    for path, data in release_files(V1).items():
        if site_packages and not path.startswith("vllm/"):
            continue
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dest


@pytest.fixture
def site(stacked, tmp_path):
    return pristine_copy(tmp_path / "site-packages", site_packages=True)


@pytest.fixture
def source(stacked, tmp_path):
    return pristine_copy(tmp_path / "src", site_packages=False)


@pytest.fixture
def overlay_copy(stacked, tmp_path) -> Path:
    """A copy of the project's overlay to tamper with (passed with --overlay)."""
    dest = tmp_path / "overlay-copy"
    shutil.copytree(stacked.overlay, dest)
    return dest


def edit_manifest(overlay: Path, edit) -> None:
    path = overlay / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def test_install_onto_site_packages_installs_only_vllm_files(stacked, site):
    result = stacked.ok("install-overlay", site)
    assert f"installed 2 file(s) into {site}" in result.stdout
    assert (site / "vllm/models/foo.py").read_text() == FOO_PATCHED
    assert (site / "vllm/models/new.py").read_text() == NEW_MODEL
    assert oct((site / "vllm/models/new.py").stat().st_mode & 0o777) == "0o644"
    assert not (site / "tests").exists()
    after = snapshot(site)
    # Installing again changes nothing and says so.
    result = stacked.ok("install-overlay", site)
    assert "overlay: already installed (2 file(s) in place" in result.stdout
    assert snapshot(site) == after


def test_reinstall_says_already_installed(stacked, site):
    stacked.ok("install-overlay", site)
    assert "already installed" in stacked.ok("install-overlay", site).stdout


def test_install_onto_a_source_tree_installs_everything(stacked, source):
    result = stacked.ok("install-overlay", source)
    assert "installed 3 file(s)" in result.stdout
    assert (source / "tests/test_foo.py").read_text() == TEST_FOO_PATCHED
    assert (source / "vllm/models/foo.py").read_text() == FOO_PATCHED
    assert (source / "vllm/models/new.py").read_text() == NEW_MODEL
    assert "already installed (3 file(s) in place" in \
        stacked.ok("install-overlay", source).stdout


def test_install_dry_run_writes_nothing(stacked, source):
    before = snapshot(source)
    result = stacked.ok("install-overlay", source, "--dry-run")
    assert "would install 3 file(s)" in result.stdout
    assert snapshot(source) == before


def test_install_refuses_a_modified_target_and_writes_nothing(stacked, source):
    # foo.py and tests/ are still pristine (they would be installed first), but
    # new.py already exists with other content.
    (source / "vllm/models/new.py").write_text("# someone else's new.py\n")
    before = snapshot(source)
    result = stacked.run("install-overlay", source)
    assert result.returncode == 1
    assert "nothing was written" in result.stderr
    assert "vllm/models/new.py: expected pristine absent" in result.stderr
    assert "vllm/models/foo.py" not in result.stderr
    assert snapshot(source) == before


def test_install_refuses_a_target_already_partly_different(stacked, site):
    (site / "vllm/models/foo.py").write_text(FOO_V1.replace("16", "17"))
    before = snapshot(site)
    result = stacked.run("install-overlay", site)
    assert result.returncode == 1
    assert "vllm/models/foo.py: expected pristine" in result.stderr
    assert snapshot(site) == before


def test_install_refuses_another_vllm_version(stacked, site):
    version = site / "vllm/_version.py"
    version.write_text(version.read_text().replace(V1, "0.0.9"))
    before = snapshot(site)
    result = stacked.run("install-overlay", site)
    assert result.returncode == 1
    assert f"holds vLLM 0.0.9, the overlay is for vLLM {V1}; nothing was written" \
        in result.stderr
    assert snapshot(site) == before


def test_install_accepts_a_local_version_suffix(stacked, site):
    version = site / "vllm/_version.py"
    version.write_text(version.read_text().replace(f"'{V1}'", f"'{V1}+rocm'"))
    stacked.ok("install-overlay", site)
    assert (site / "vllm/models/new.py").read_text() == NEW_MODEL


def test_install_refuses_a_folder_without_vllm(stacked, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = stacked.run("install-overlay", empty)
    assert result.returncode == 1
    assert "no vllm package here" in result.stderr
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("bad", ["../evil.py", "vllm/../../evil.py", "ABSOLUTE"])
def test_install_refuses_a_manifest_entry_outside_the_target(stacked, source, overlay_copy,
                                                            tmp_path, bad):
    outside = tmp_path / "evil.py"
    outside.write_text("untouched\n")
    if bad == "ABSOLUTE":
        bad = str(outside)
    (overlay_copy / "evil.py").write_text("pwned\n")

    def edit(manifest):
        import hashlib
        manifest["files"].append({"path": bad, "pristine_sha256": "added",
                                  "patched_sha256": hashlib.sha256(b"pwned\n").hexdigest()})
    edit_manifest(overlay_copy, edit)
    before, around = snapshot(source), snapshot(tmp_path)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert f"overlay entry {bad!r} would be written outside the target" in result.stderr
    assert snapshot(source) == before
    assert snapshot(tmp_path) == around
    assert outside.read_text() == "untouched\n"


@pytest.mark.parametrize("entry", [".git/hooks/post-checkout", "vllm/.GIT/config"])
def test_install_refuses_a_manifest_entry_in_a_git_folder(stacked, source, overlay_copy,
                                                          entry):
    (source / ".git" / "hooks").mkdir(parents=True)
    (overlay_copy / entry).parent.mkdir(parents=True)
    (overlay_copy / entry).write_text("#!/bin/sh\necho pwned\n")

    def edit(manifest):
        import hashlib
        manifest["files"].append({"path": entry, "pristine_sha256": "added", "patched_sha256":
                                  hashlib.sha256(b"#!/bin/sh\necho pwned\n").hexdigest()})
    edit_manifest(overlay_copy, edit)
    before = snapshot(source)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert f"overlay entry {entry!r} would be written into a .git folder" in result.stderr
    assert snapshot(source) == before


def test_install_refuses_a_symlink_in_the_overlay(stacked, source, overlay_copy, tmp_path):
    # Same bytes as the real file, so only the link itself is wrong.
    elsewhere = tmp_path / "new.py"
    elsewhere.write_text(NEW_MODEL)
    link = overlay_copy / "vllm/models/new.py"
    link.unlink()
    link.symlink_to(elsewhere)
    before = snapshot(source)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert "vllm/models/new.py is missing or a symlink" in result.stderr
    assert snapshot(source) == before


def test_install_refuses_an_extra_symlink_in_the_overlay(stacked, source, overlay_copy,
                                                         tmp_path):
    (overlay_copy / "vllm/escape").symlink_to(tmp_path)
    before = snapshot(source)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert "overlay holds a symlink vllm/escape" in result.stderr
    assert snapshot(source) == before


def test_install_refuses_a_file_not_in_the_manifest(stacked, source, overlay_copy):
    (overlay_copy / "vllm/models/stray.py").write_text("x = 1\n")
    before = snapshot(source)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert "overlay file vllm/models/stray.py is not in the manifest" in result.stderr
    assert snapshot(source) == before


def test_install_refuses_a_hand_edited_overlay_file(stacked, source, overlay_copy):
    (overlay_copy / "vllm/models/new.py").write_text(NEW_MODEL + "# tweak\n")
    before = snapshot(source)
    result = stacked.run("install-overlay", source, "--overlay", overlay_copy)
    assert result.returncode == 1
    assert "overlay file vllm/models/new.py does not match its manifest hash" in result.stderr
    assert snapshot(source) == before


def test_install_refuses_a_target_file_that_is_a_symlink_outside(stacked, site, tmp_path):
    # The link leads to a pristine-looking file outside the target.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "foo.py").write_text(FOO_V1)
    foo = site / "vllm/models/foo.py"
    foo.unlink()
    foo.symlink_to(outside / "foo.py")
    before, around = snapshot(site), snapshot(outside)
    result = stacked.run("install-overlay", site)
    assert result.returncode == 1
    assert "vllm/models/foo.py: resolves outside the target (symlink)" in result.stderr
    assert snapshot(site) == before and snapshot(outside) == around
    assert (outside / "foo.py").read_text() == FOO_V1


def test_install_refuses_a_target_folder_that_is_a_symlink_outside(stacked, site, tmp_path):
    outside = tmp_path / "outside-models"
    shutil.move(site / "vllm/models", outside)
    (site / "vllm/models").symlink_to(outside)
    before, around = snapshot(site), snapshot(outside)
    result = stacked.run("install-overlay", site)
    assert result.returncode == 1
    assert "resolves outside the target (symlink)" in result.stderr
    assert snapshot(site) == before and snapshot(outside) == around
    assert not (outside / "new.py").exists()


def test_install_through_a_symlinked_target_folder(stacked, site, tmp_path):
    """The target itself may be a symlink (e.g. a venv's site-packages)."""
    link = tmp_path / "site-link"
    link.symlink_to(site)
    stacked.ok("install-overlay", link)
    assert (site / "vllm/models/new.py").read_text() == NEW_MODEL


def test_a_deleting_patch_is_installed_as_a_removal(stacked, source):
    stacked.commit("[ROCm] Drop bar", {"vllm/models/bar.py": None})
    stacked.ok("patches")
    entries = {e["path"]: e for e in stacked.manifest()["files"]}
    assert entries["vllm/models/bar.py"]["patched_sha256"] == "deleted"
    assert not (stacked.overlay / "vllm/models/bar.py").exists()
    stacked.ok("check")
    stacked.ok("install-overlay", source)
    assert not (source / "vllm/models/bar.py").exists()
    assert (source / "tests/test_foo.py").read_text() == TEST_FOO_PATCHED
    assert "already installed (4 file(s) in place" in \
        stacked.ok("install-overlay", source).stdout


def test_tests_folder_untouched_in_site_packages(stacked, site):
    (site / "tests").mkdir()
    (site / "tests/test_foo.py").write_text(TEST_FOO_V1)
    stacked.ok("install-overlay", site)
    assert (site / "tests/test_foo.py").read_text() == TEST_FOO_V1
    assert os.path.exists(site / "vllm/models/new.py")


# --- interrupted installs: rolled back at once, or recovered by the next run ---------


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".k3-" in p.name)


@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_an_install_terminated_between_two_renames_puts_the_target_back(stacked, site,
                                                                        signal_name, code):
    before = snapshot(site)
    # The first rename moves foo.py aside; the signal comes before the new one is in.
    result = stacked.run("install-overlay", site, fault=f"{signal_name} os.rename 1 in {site}")
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(site) == before
    assert _leftovers(site) == []


def test_an_install_killed_between_two_renames_is_finished_by_the_next(stacked, site):
    result = stacked.run("install-overlay", site, fault=f"SIGKILL os.rename 2 in {site}")
    assert result.returncode == -9
    assert not (site / "vllm/models/foo.py").exists()  # moved aside, the new one not in
    result = stacked.ok("install-overlay", site)
    assert "was interrupted; restored 1 original file(s)" in result.stdout
    assert (site / "vllm/models/foo.py").read_text() == FOO_PATCHED
    assert (site / "vllm/models/new.py").read_text() == NEW_MODEL
    assert _leftovers(site) == []


def test_a_failed_rename_leaves_no_placeholder(stacked, site):
    before = snapshot(site)
    result = stacked.run("install-overlay", site, fault=f"EIO os.rename 1 in {site}")
    assert result.returncode == 1
    assert "the target was left as it was" in result.stderr
    assert snapshot(site) == before
    assert _leftovers(site) == []
