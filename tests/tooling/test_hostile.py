"""Hostile input gets nothing out: patch modes as git reads them, sdist links as they
resolve, make variables as data, downloads bounded in size."""

from __future__ import annotations

import os
import shutil
import tarfile

import pytest

from tests.tooling.conftest import (
    NEW_MODEL,
    SERIES_HEADER,
    V1,
    V2,
    needs_make,
    release_files,
    sha256_file,
    snapshot,
    write_patch,
)
from tests.tooling.test_overlay import pristine_copy

TOP = f"vllm-{V1}"


# --- what a patch may create: git decides, not a regex --------------------------

LINK_TARGET = "/etc/passwd"
NULL = "0" * 40


def _special_file_patch(mode: str, content: str) -> str:
    return (f"diff --git a/vllm/link b/vllm/link\nnew file mode {mode}\n"
            f"index {NULL}..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n"
            f"--- /dev/null\n+++ b/vllm/link\n@@ -0,0 +1 @@\n+{content}\n"
            "\\ No newline at end of file\n")


@pytest.mark.parametrize("mode, content", [
    ("0120000", LINK_TARGET),       # leading zero
    ("120644", LINK_TARGET),        # permission bits git drops for links
    ("120000 ", LINK_TARGET),       # trailing blank
    ("160000", f"Subproject commit {'1' * 40}"),  # a gitlink (submodule)
], ids=["leading-zero", "permission-bits", "trailing-blank", "gitlink"])
def test_apply_and_check_refuse_a_patch_creating_a_symlink_however_spelled(project, mode,
                                                                          content):
    write_patch(project.patches, "good.patch", "vllm/models/ok.py")
    write_patch(project.patches, "link.patch", "vllm/link", diff=_special_file_patch(mode, content))
    (project.patches / "series").write_text(SERIES_HEADER + "good.patch\nlink.patch\n")
    result = project.run("apply")
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr
    assert "link.patch: creates vllm/link as a" in result.stderr
    assert not os.path.lexists(project.tree / "vllm/link")
    # Nothing of the stack was applied: build/vllm holds the pristine release.
    if project.tree.exists():
        assert project.git("rev-list", "--count", "HEAD") == "1"
    result = project.run("check")
    assert result.returncode == 1
    assert "FAIL link.patch: creates vllm/link as a" in result.stdout


# --- sdist links resolved as the file system will resolve them -----------------------


def _link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def _links_through_links(top: str) -> list[tarfile.TarInfo]:
    # vllm/up reads as vllm/ (x/x/x/../../..), but once vllm/x -> . exists it
    # resolves three levels up: out of the tree. It comes first, before vllm/x.
    return [_link(f"{top}/vllm/up", "x/x/x/../../.."), _link(f"{top}/vllm/x", ".")]


def test_apply_refuses_a_link_that_escapes_through_another_link(project, tmp_path):
    project.use_release(V1, extra=_links_through_links(TOP))
    result = project.run("apply")
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr
    assert "vllm-0.1.0/vllm/up" in result.stderr and "refusing to unpack" in result.stderr
    assert not project.tree.exists()
    assert not list((project.root / "build").glob("**/up"))


def test_drift_refuses_such_an_sdist_from_the_index(stacked, index):
    """drift takes the expected hash from the index: any index can serve this archive."""
    index.add(*stacked.release(V1))
    index.add(*stacked.release(V2, release_files(V2), extra=_links_through_links(f"vllm-{V2}")))
    stacked.index_url = index.url
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert "refusing to unpack" in result.stderr
    assert not (stacked.root / "build" / "drift-base").exists()


# --- make variables are data --------------------------------------------------------


@needs_make
def test_make_install_overlay_takes_a_target_with_spaces(stacked, tmp_path):
    site = pristine_copy(tmp_path / "site packages", site_packages=True)
    result = stacked.make("install-overlay", f"TARGET={site}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "vllm/models/new.py").read_text() == NEW_MODEL


INJECTIONS = ["0.2.0; touch {marker}", "$(shell touch {marker})", "`touch {marker}`",
              "0.2.0 $$(touch {marker})", "--help"]


@needs_make
@pytest.mark.parametrize("target, variable", [("install-overlay", "TARGET"),
                                              ("rebase", "VLLM_VERSION"),
                                              ("drift", "VLLM_VERSION")])
@pytest.mark.parametrize("value", INJECTIONS, ids=["semicolon", "make-shell", "backticks",
                                                   "dollar-paren", "option"])
def test_make_variables_are_never_run(stacked, tmp_path, target, variable, value):
    marker = tmp_path / "ran"
    result = stacked.make(target, f"{variable}={value.format(marker=marker)}")
    assert not marker.exists(), "a command in a make variable ran"
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    if variable == "VLLM_VERSION":
        assert "is not a vLLM version" in result.stderr


# --- downloads are bounded ---------------------------------------------------------


def _stored_bytes(proj) -> int:
    return sum(p.stat().st_size for p in proj.cache.rglob("*") if p.is_file())


def test_a_download_larger_than_the_pin_is_cut_off(project, index):
    shutil.rmtree(project.cache)
    sdist, wheel = project.release(V1)
    index.add(sdist, wheel)
    junk = 32 << 20
    index.files[sdist.name] = sdist.read_bytes() + bytes(junk)
    index.listed_sha256[sdist.name] = sha256_file(sdist)  # the index claims the pinned file
    project.index_url = index.url
    result = project.run("fetch")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"more than the {sdist.stat().st_size} bytes pinned" in result.stderr
    assert _stored_bytes(project) < junk // 4


def test_drift_refuses_a_release_listed_far_larger_than_the_pinned_one(stacked, index):
    index.add(*stacked.release(V1))
    _, wheel_v2 = stacked.release(V2)
    huge = f"vllm-{V2}.tar.gz"
    index.files[huge] = bytes(32 << 20)  # listed with its true size and hash
    index.add(wheel_v2)
    stacked.index_url = index.url
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{huge}" in result.stderr and "larger than" in result.stderr
    assert index.downloads(huge) == 0


@needs_make
def test_make_expands_no_variable_given_on_its_command_line(stacked, tmp_path):
    """Make expands a command-line variable each time it exports it to a recipe,
    read by the Makefile or not (FRESH, say): all are taken literally."""
    markers = [tmp_path / name for name in ("fresh", "other", "python")]
    result = stacked.make("help", f"FRESH=$(shell touch {markers[0]})",
                          f"OTHER=$(shell touch {markers[1]})")
    assert result.returncode == 0, result.stderr
    assert not any(m.exists() for m in markers)


# --- nothing is written through a link, nothing is read through one -----------------


def test_apply_replaces_links_in_the_overlay_and_check_fails_on_them(stacked, tmp_path):
    outside = tmp_path / "outside.py"
    link = stacked.overlay / "vllm/models/new.py"
    outside.write_bytes(link.read_bytes())  # the same bytes: only the link is wrong
    link.unlink()
    link.symlink_to(outside)
    result = stacked.run("check")
    assert result.returncode == 1
    assert "FAIL vllm_overlay/vllm/models/new.py is a symlink" in result.stdout
    outside.write_text("# not the overlay's\n")
    stacked.ok("apply")
    assert outside.read_text() == "# not the overlay's\n"
    assert not link.is_symlink() and link.read_text() == NEW_MODEL


def test_apply_replaces_a_linked_overlay_folder_and_writes_nothing_through_it(stacked,
                                                                            tmp_path):
    outside = tmp_path / "elsewhere"
    folder = stacked.overlay / "vllm/models"
    shutil.copytree(folder, outside)
    shutil.rmtree(folder)
    folder.symlink_to(outside)
    assert stacked.run("check").returncode == 1
    (outside / "new.py").write_text("# changed outside\n")
    before = snapshot(outside)
    stacked.ok("apply")
    assert snapshot(outside) == before
    assert not folder.is_symlink() and (folder / "new.py").read_text() == NEW_MODEL
    assert "check OK" in stacked.ok("check").stdout
