"""Unsafe inputs are refused before anything is written: sdist members, patch paths."""

from __future__ import annotations

import shutil
import tarfile

import pytest

from tests.tooling.conftest import SERIES_HEADER, V1, release_files, snapshot, write_patch

TOP = f"vllm-{V1}"


def _link(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info


def _file(name: str, data: bytes = b"pwned\n"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _outside_untouched(proj, tmp_path, before):
    """Only the project's own folders changed; build/ holds no half-unpacked release."""
    after = snapshot(tmp_path)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    allowed = ("proj/build", "cache/")
    assert all(p.startswith(allowed) for p in changed), sorted(changed)
    assert not proj.tree.exists()
    leftovers = list((proj.root / "build").glob(".vllm-unpacking-*")) \
        if (proj.root / "build").exists() else []
    assert leftovers == []


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink-up", "symlink-absolute",
                                  "hardlink-up"])
def test_apply_refuses_an_sdist_member_outside_the_tree(project, tmp_path, kind):
    evil = tmp_path / "evil"
    member = {
        "dotdot": lambda: _file(f"{TOP}/../evil"),
        "absolute": lambda: _file(str(evil)),
        "symlink-up": lambda: _link(f"{TOP}/vllm/evil", "../../../../evil"),
        "symlink-absolute": lambda: _link(f"{TOP}/vllm/evil", str(evil)),
        "hardlink-up": lambda: _link(f"{TOP}/vllm/evil", "../evil", hard=True),
    }[kind]()
    project.use_release(V1, extra=[member])
    before = snapshot(tmp_path)
    result = project.run("apply")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "refusing to unpack" in result.stderr
    assert f"vllm-{V1}.tar.gz" in result.stderr
    assert not evil.exists()
    _outside_untouched(project, tmp_path, before)


def test_apply_refuses_a_top_level_symlink_leaving_the_tree_cleanly(project, tmp_path):
    project.use_release(V1, extra=[_link(f"{TOP}/link", "../sibling")])
    before = snapshot(tmp_path)
    result = project.run("apply")
    assert result.returncode == 1
    _outside_untouched(project, tmp_path, before)
    assert "Traceback" not in result.stderr
    assert "link" in result.stderr and "refusing to unpack" in result.stderr


def test_apply_refuses_a_device_member(project, tmp_path):
    info = tarfile.TarInfo(f"{TOP}/vllm/fifo")
    info.type = tarfile.FIFOTYPE
    project.use_release(V1, extra=[info])
    result = project.run("apply")
    assert result.returncode == 1
    assert "'vllm-0.1.0/vllm/fifo' is not a plain file" in result.stderr
    assert not project.tree.exists()


def test_apply_refuses_an_sdist_with_two_top_folders(project, tmp_path):
    project.use_release(V1, extra=[_file("other/evil.py")])
    result = project.run("apply")
    assert result.returncode == 1
    assert "lies outside the top folder" in result.stderr
    assert not project.tree.exists()


def test_apply_refuses_an_sdist_carrying_a_git_folder(project, tmp_path):
    marker = tmp_path / "PWNED"
    files = release_files(V1)
    files[".git/config"] = f'[core]\n\tfsmonitor = "touch {marker}; false"\n'.encode()
    files[".git/HEAD"] = b"ref: refs/heads/main\n"
    project.use_release(V1, files=files)
    result = project.run("apply")
    assert not marker.exists(), "a command from the sdist's .git/config ran"
    assert result.returncode == 1
    assert ".git" in result.stderr


# --- patch paths -------------------------------------------------------------------


def _series(proj, *names):
    (proj.patches / "series").write_text(SERIES_HEADER + "".join(f"{n}\n" for n in names))


OUTSIDE = ["../x.py", "vllm/../../x.py", ".git/hooks/post-checkout", "vllm/.git/config"]
KERNEL = ["csrc/attention.cu", "csrc/new_kernel.cu", "cmake/utils.cmake", "CMakeLists.txt",
          "pyproject.toml", "vllm/_custom_ops.py"]


@pytest.mark.parametrize("path", OUTSIDE + KERNEL)
def test_apply_and_check_refuse_a_patch_touching_an_unsafe_path(project, tmp_path, path):
    write_patch(project.patches, "good.patch", "vllm/models/ok.py")
    write_patch(project.patches, "evil.patch", path)
    _series(project, "good.patch", "evil.patch")
    before = snapshot(tmp_path)
    result = project.run("apply")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    if path in OUTSIDE:
        assert (f"evil.patch: path {path!r} would be written outside the vLLM tree"
                in result.stderr)
    else:
        assert f"evil.patch: touches {path}, which the prebuilt kernels" in result.stderr
    # Refused before anything was unpacked or applied.
    assert not (project.root / "build").exists()
    assert snapshot(tmp_path) == before
    if path in ("../x.py", "csrc/attention.cu"):  # check shares the code; sample it
        result = project.run("check")
        assert result.returncode == 1 and "FAIL evil.patch" in result.stdout
        assert "good.patch" not in result.stdout


def test_apply_refuses_a_patch_adding_a_symlink(project):
    diff = ("diff --git a/vllm/link b/vllm/link\nnew file mode 120000\n"
            "index 0000000000000000000000000000000000000000.."
            "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n"
            "--- /dev/null\n+++ b/vllm/link\n@@ -0,0 +1 @@\n+/etc/passwd\n"
            "\\ No newline at end of file\n")
    write_patch(project.patches, "link.patch", "vllm/link", diff=diff)
    _series(project, "link.patch")
    result = project.run("apply")
    assert result.returncode == 1
    assert "link.patch: creates vllm/link as a symlink" in result.stderr
    # Refused before any `git am`: build/vllm holds only the pristine release.
    assert not (project.tree / "vllm/link").is_symlink()
    assert project.git("rev-list", "--count", "HEAD") == "1"


def test_apply_refuses_a_bad_series_line(project):
    (project.patches / "series").write_text("../outside.patch\n")
    result = project.run("apply")
    assert result.returncode == 1
    assert "patches/series:1: '../outside.patch' is not a patch file name" in result.stderr


def test_a_traditional_diff_to_a_kernel_file_is_refused(project):
    diff = ("--- a/csrc/attention.cu\n+++ b/csrc/attention.cu\n"
            "@@ -1 +1 @@\n-// kernel\n+// patched kernel\n")
    write_patch(project.patches, "trad.patch", "csrc/attention.cu", diff=diff)
    _series(project, "trad.patch")
    result = project.run("apply")
    assert result.returncode == 1
    assert "trad.patch" in result.stderr and "csrc/attention.cu" in result.stderr


# git strips the first component of any prefix, not only a/ and b/.
PREFIXED = {
    "plain-diff-x-y": ("--- x/csrc/attention.cu\n+++ y/csrc/attention.cu\n"
                       "@@ -1 +1 @@\n-// kernel\n+// patched kernel\n"),
    "git-header-i-w": ("diff --git i/CMakeLists.txt w/CMakeLists.txt\n"
                       "--- i/CMakeLists.txt\n+++ w/CMakeLists.txt\n@@ -1 +1 @@\n"
                       "-cmake_minimum_required(VERSION 3.26)\n"
                       "+cmake_minimum_required(VERSION 3.27)\n"),
    "renamed-away": ("diff --git a/csrc/attention.cu b/vllm/attention.cu\n"
                     "similarity index 100%\nrename from csrc/attention.cu\n"
                     "rename to vllm/attention.cu\n"),
    "quoted": ('diff --git "a/csrc/na\\303\\257ve.cu" "b/csrc/na\\303\\257ve.cu"\n'
               "new file mode 100644\n--- /dev/null\n"
               '+++ "b/csrc/na\\303\\257ve.cu"\n@@ -0,0 +1 @@\n+// x\n'),
}


@pytest.mark.parametrize("kind", list(PREFIXED))
def test_a_kernel_path_behind_any_prefix_is_refused(project, kind):
    write_patch(project.patches, "kernel.patch", "csrc/attention.cu", diff=PREFIXED[kind])
    _series(project, "kernel.patch")
    for command in ("apply", "check"):
        result = project.run(command)
        assert result.returncode == 1, result.stdout
        assert "Traceback" not in result.stderr
        assert "kernel.patch: touches " in result.stdout + result.stderr
    assert not (project.root / "build" / "vllm").exists()


def test_patches_exports_no_kernel_change_and_any_other_name_round_trips(project):
    """What `make patches` writes, `make apply` and `make check` take: a non-ASCII
    file name is exported and applied; a kernel file is not exported at all."""
    project.ok("apply")
    project.commit("[ROCm] Add a naive model", {"vllm/models/naïve.py": "# x\n"})
    project.ok("patches")
    shutil.rmtree(project.root / "build")
    project.ok("apply")
    assert (project.tree / "vllm/models/naïve.py").read_text() == "# x\n"
    assert "check OK: 1 patch(es)" in project.ok("check").stdout
    project.commit("[ROCm] Add a naive kernel", {"csrc/naïve.cu": "// x\n"})
    patches = project.patch_bytes()
    result = project.run("patches")
    assert result.returncode == 1
    assert ("rocm-add-a-naive-kernel.patch (commit [ROCm] Add a naive kernel): touches "
            "csrc/naïve.cu") in result.stderr
    assert project.patch_bytes() == patches


def test_apply_unpacks_an_in_tree_hard_link(project):
    link = _link(f"{TOP}/vllm/copy.py", f"{TOP}/vllm/models/bar.py", hard=True)
    project.use_release(V1, extra=[link])
    result = project.run("apply")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0
    assert (project.tree / "vllm/copy.py").read_bytes() == release_files(V1)["vllm/models/bar.py"]
