"""Bad input gets one line naming the file and the next step; advice is never wrong."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.tooling.conftest import REPO, V1, free_port, release_files, write_patch
from tests.tooling.test_overlay import pristine_copy


def one_clear_line(result, *named: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for text in named:
        assert text in lines[0], lines[0]


# --- malformed files ----------------------------------------------------------------

PIN_EDITS = {
    "size-not-a-number": ('size = ', 'size = "big" #'),
    "version-not-a-string": ('version = "0.1.0"', 'version = 1'),
    "version-not-a-version": ('version = "0.1.0"', 'version = "0.1.0; rm -rf"'),
    "sha256-not-a-string": ('sha256 = ', 'sha256 = 5 #'),
    "table-not-a-table": ('[artifacts.sdist]', '[artifacts]\nsdist = "x"\n[ignored]'),
    "nul-in-a-name": ('filename = "vllm-0.1.0.tar.gz"', 'filename = "vllm-0.1.0\\u0000.tar.gz"'),
    "negative-size": ('size = ', 'size = -5 #'),
    "base-tag-head": ('base_tag = "vllm-0.1.0"', 'base_tag = "HEAD"'),
    "base-tag-option": ('base_tag = "vllm-0.1.0"', 'base_tag = "-f"'),
}


@pytest.mark.parametrize("edit", list(PIN_EDITS))
def test_a_malformed_pin_value_is_named(project, edit):
    old, new = PIN_EDITS[edit]
    pin = project.root / "pin.toml"
    pin.write_text(pin.read_text().replace(old, new, 1))
    for command in ("apply", "check"):
        one_clear_line(project.run(command), "pin.toml", "fix")


MANIFEST_EDITS = {
    "entry-missing-key": lambda m: m["files"][0].pop("pristine_sha256"),
    "entry-extra-key": lambda m: m["files"][0].update(mode="0755"),
    "entry-not-an-object": lambda m: m["files"].__setitem__(0, "vllm/models/foo.py"),
    "hash-not-a-string": lambda m: m["files"][0].update(patched_sha256=7),
    "files-not-a-list": lambda m: m.update(files={"vllm/models/foo.py": "x"}),
}


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_a_malformed_manifest_entry_is_named(stacked, tmp_path, edit):
    site = pristine_copy(tmp_path / "site", site_packages=True)
    overlay = tmp_path / "overlay"
    shutil.copytree(stacked.overlay, overlay)
    manifest = json.loads((overlay / "MANIFEST.json").read_text())
    MANIFEST_EDITS[edit](manifest)
    (overlay / "MANIFEST.json").write_text(json.dumps(manifest))
    one_clear_line(stacked.run("install-overlay", "--overlay", overlay, site),
                   "MANIFEST.json", "make apply")


def test_a_manifest_that_is_not_an_object_is_named(stacked, tmp_path):
    site = pristine_copy(tmp_path / "site", site_packages=True)
    overlay = tmp_path / "overlay"
    shutil.copytree(stacked.overlay, overlay)
    (overlay / "MANIFEST.json").write_text("[]")
    one_clear_line(stacked.run("install-overlay", "--overlay", overlay, site), "MANIFEST.json")


def test_a_damaged_state_file_is_named(stacked):
    stacked.state_file.write_text("{not json")
    one_clear_line(stacked.run("apply"), "k3-stack.json")


# --- advice that fits what happened -------------------------------------------------


def test_a_failed_patch_gives_no_advice_for_the_aborted_am(stacked):
    files = release_files(V1)
    files["vllm/models/foo.py"] = b"BLOCK = 32\n"
    stacked.use_release(V1, files)
    result = stacked.run("apply")
    assert result.returncode == 1
    assert "does not apply" in result.stderr and "The am was aborted" in result.stderr
    for advice in ("am --continue", "am --skip", "am --abort", "--show-current-patch"):
        assert advice not in result.stderr, result.stderr


def test_offline_drift_says_what_it_needs(stacked):
    stacked.index_url = f"http://127.0.0.1:{free_port()}/simple"
    result = stacked.run("drift")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "cannot reach the package index" in result.stderr
    assert "make drift" in result.stderr and "PIP_INDEX_URL" in result.stderr


def test_a_release_that_does_not_exist_is_not_called_offline(stacked, index):
    index.add(*stacked.release(V1))
    stacked.index_url = index.url
    result = stacked.run("rebase", "0.9.0")
    assert result.returncode == 1
    assert "offline" not in result.stderr
    assert "no vLLM 0.9.0" in result.stderr and f"newest is {V1}" in result.stderr


def test_the_advice_for_uncommitted_work_covers_untracked_files(stacked):
    (stacked.tree / "vllm/models/wip.py").write_text("# new, untracked\n")
    for command in ("apply", "patches"):
        result = stacked.run(command)
        assert result.returncode == 1
        assert "add -A" in result.stderr, result.stderr
        assert "commit -a" not in result.stderr


def test_apply_names_a_patch_file_missing_from_the_series(stacked):
    write_patch(stacked.patches, "stray.patch", "vllm/models/stray.py")
    result = stacked.ok("apply")
    assert "patches/stray.patch is not listed in patches/series" in result.stderr
    assert "not applied" in result.stderr


def test_a_series_that_is_not_utf8_is_named_and_a_byte_order_mark_is_no_name(stacked):
    series = stacked.patches / "series"
    text = series.read_bytes()
    series.write_bytes(b"# r\xe9vis\xe9\n" + text)  # latin-1
    one_clear_line(stacked.run("apply"), "patches/series is not UTF-8 text")
    series.write_bytes(b"\xef\xbb\xbf" + text.split(b"\n", 2)[2])  # a BOM, then the names
    assert "2 patch(es) already applied" in stacked.ok("apply").stdout


def test_a_new_base_tag_in_pin_toml_is_followed(stacked):
    pin = stacked.root / "pin.toml"
    pin.write_text(pin.read_text().replace('base_tag = "vllm-0.1.0"',
                                           'base_tag = "vllm-0.1.0-release"'))
    assert "now tagged vllm-0.1.0-release" in stacked.ok("apply").stdout
    assert stacked.state()["base_tag"] == "vllm-0.1.0-release"
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout


def test_an_empty_cache_folder_setting_is_named(project):
    project.cache_env = False
    project.extra_env["K3_CACHE_DIR"] = ""
    one_clear_line(project.run("apply"), "K3_CACHE_DIR is set but empty")
    assert not (REPO / "downloads").exists() and not (REPO / "locks").exists()


def _bytes_git(proj, *args: bytes | str, cwd=None) -> None:
    """git with arguments that are not UTF-8 (bytes)."""
    env = {**proj.env(), "GIT_AUTHOR_NAME": "D\xe9v", "GIT_AUTHOR_EMAIL": "dev@example.com",
           "GIT_COMMITTER_NAME": "D\xe9v", "GIT_COMMITTER_EMAIL": "dev@example.com"}
    env = {k: v.encode("latin-1") if k.endswith("_NAME") else v for k, v in env.items()}
    subprocess.run([b"git", *(a if isinstance(a, bytes) else a.encode() for a in args)],
                   cwd=cwd or proj.tree, env=env, check=True, capture_output=True)


def test_git_output_that_is_not_utf8_gives_one_clear_line(stacked, tmp_path):
    """A branch, a stash message, an author and a worktree path in latin-1."""
    (stacked.tree / "vllm/models/wip.py").write_text("# wip\n")
    _bytes_git(stacked, "stash", "push", "-u", "-m", b"caf\xe9")
    _bytes_git(stacked, "worktree", "add", "-q", "-b", b"br\xe9", bytes(tmp_path) + b"/w\xe9")
    _bytes_git(stacked, "checkout", "-q", "-b", b"d\xe9v")
    (stacked.tree / "vllm/models/bar.py").write_text("# changed\n")
    _bytes_git(stacked, "commit", "-q", "-a", "-m", b"[ROCm] D\xe9j\xe0 vu")
    for command, named in (("apply", "is not on branch 'stack'"),
                           ("patches", "is not on branch 'stack'"),
                           ("clean", "stash@{0}")):
        result = stacked.run(command)
        assert result.returncode == 1, result.stdout
        assert "Traceback" not in result.stderr
        assert named in result.stderr
    assert "caf\\udce9" in result.stderr and "br\\udce9" in result.stderr
    assert "(on 'd\\udce9v')" in result.stderr


def _damage(repo, path: str) -> None:
    """Empty the object file of `path`'s blob in the release commit of `repo`."""
    blob = subprocess.run(["git", "-C", str(repo), "rev-parse", f"vllm-{V1}:{path}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    obj = repo / ".git" / "objects" / blob[:2] / blob[2:]
    obj.chmod(0o644)
    obj.write_bytes(b"")


def test_damaged_objects_are_reported_as_such(stacked):
    _damage(stacked.tree, "vllm/models/foo.py")
    one_clear_line(stacked.run("apply"), "build/vllm/.git is damaged", "is empty")
    # check needs only the release: it reads it from its own copy instead.
    result = stacked.run("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "build/vllm/.git is damaged" in result.stderr
    _damage(stacked.root / "build" / "check-base", "vllm/models/foo.py")
    result = stacked.run("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the check's copy of the release, is damaged; making it again" in result.stderr
