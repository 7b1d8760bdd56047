"""Nothing is trusted without checking, and nothing is written half.

A cached sdist is hashed whenever a base is built from it; an archive that
does not unpack completely is damaged, not a broken patch; install-overlay
writes all files or none; the quarantine keeps one copy per file.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

from tests.tooling.conftest import (
    FOO_V1,
    PATCH_1,
    PYTHON,
    REPO,
    V1,
    V2,
    pin_for,
    release_files,
    sha256_file,
    snapshot,
)
from scripts.stack.pin import render_pin
from tests.tooling.test_overlay import pristine_copy

FOO_MEMBER = "vllm/models/foo.py"  # the last member: damage to its header loses only it


def flip_header_bit(data: bytearray, member: str) -> None:
    """Flip one bit of the tar header checksum of `member` (found by its name field)."""
    at = data.index(member.encode() + b"\0")
    data[at + 148] ^= 1


def stored_gzip(path: Path) -> None:
    """Recompress without compression (stored blocks): the file's bytes hold the tar as is."""
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()), compresslevel=0,
                                   mtime=0))


def test_a_cached_sdist_damaged_in_place_is_never_unpacked(stacked, index):
    sdist, wheel = stacked.release(V1)
    stored_gzip(sdist)
    (stacked.root / "pin.toml").write_text(render_pin(pin_for(V1, sdist, wheel)))
    shutil.copyfile(sdist, stacked.downloads / sdist.name)
    index.add(sdist, wheel)
    stacked.index_url = index.url
    shutil.rmtree(stacked.root / "build")
    stacked.ok("apply")  # verifies and uses the cached file

    # One bit flips in the cached file; its size and mtime stay as they were.
    cached = stacked.downloads / sdist.name
    st = cached.stat()
    data = bytearray(cached.read_bytes())
    flip_header_bit(data, f"vllm-{V1}/{FOO_MEMBER}")
    cached.write_bytes(bytes(data))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.rmtree(stacked.root / "build")

    result = stacked.run("apply")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"cached {sdist.name} does not match pin.toml" in result.stderr
    assert index.downloads(sdist.name) == 1
    assert sha256_file(cached) == sha256_file(sdist)
    assert (stacked.tree / FOO_MEMBER).is_file()
    (moved,) = list(stacked.quarantine.iterdir())
    assert moved.read_bytes() == bytes(data)


def test_drift_reports_a_damaged_archive_not_a_broken_patch(stacked, index):
    """The index vouches for the bytes (its own sha256), but the tar is damaged inside."""
    index.add(*stacked.release(V1))
    sdist, wheel = stacked.release(V2, release_files(V2, "g7654321"), commit="g7654321")
    tar = bytearray(gzip.decompress(sdist.read_bytes()))
    flip_header_bit(tar, f"vllm-{V2}/{FOO_MEMBER}")
    sdist.write_bytes(gzip.compress(bytes(tar), mtime=0))
    index.add(sdist, wheel)
    stacked.index_url = index.url
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{sdist.name} is damaged" in result.stderr, result.stderr
    assert "does not apply" not in result.stdout
    assert PATCH_1 not in result.stdout


def test_a_truncated_gzip_stream_is_damaged(stacked, index):
    """A stream cut after the tar's end blocks: tarfile alone never reads that far."""
    index.add(*stacked.release(V1))
    sdist, wheel = stacked.release(V2, release_files(V2, "g7654321"), commit="g7654321")
    sdist.write_bytes(sdist.read_bytes()[:-8])  # without its CRC and length trailer
    index.add(sdist, wheel)
    stacked.index_url = index.url
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert f"{sdist.name} is damaged" in result.stderr, result.stderr


# --- install-overlay: all or nothing ----------------------------------------------------


def _limit_file_size(limit: int):
    def apply_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply_limit


def test_install_overlay_write_error_leaves_the_target_as_it_was(stacked, tmp_path):
    site = pristine_copy(tmp_path / "site-packages", site_packages=True)
    overlay = tmp_path / "overlay"
    shutil.copytree(stacked.overlay, overlay)
    # new.py becomes too large to write under the file size limit; foo.py comes first.
    big = "# padding\n" * 8000
    (overlay / "vllm/models/new.py").write_text(big)
    manifest = json.loads((overlay / "MANIFEST.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "vllm/models/new.py":
            entry["patched_sha256"] = hashlib.sha256(big.encode()).hexdigest()
    (overlay / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    before = snapshot(site)
    result = subprocess.run(
        [PYTHON, "-m", "scripts", "install-overlay", "--overlay", str(overlay), str(site)],
        cwd=REPO, env=stacked.env(), capture_output=True, text=True, timeout=60,
        preexec_fn=_limit_file_size(16 << 10))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert "vllm/models/new.py" in result.stderr
    assert "left as it was" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(site) == before  # foo.py untouched, no temporary file left
    assert (site / "vllm/models/foo.py").read_text() == FOO_V1
    stacked.ok("install-overlay", "--overlay", overlay, site)
    assert (site / "vllm/models/new.py").read_text() == big


# --- quarantine -------------------------------------------------------------------------


def test_quarantine_keeps_only_the_last_rejected_copy(project, index):
    shutil.rmtree(project.cache)
    sdist, wheel = project.release(V1)
    index.add(sdist, wheel)
    index.listed_sha256[sdist.name] = sha256_file(sdist)
    project.index_url = index.url
    for junk in (b"first", b"second"):
        index.files[sdist.name] = sdist.read_bytes()[:-1] + junk
        assert project.run("fetch").returncode == 1
    kept = [p.read_bytes()[-6:] for p in project.quarantine.iterdir()]
    assert kept == [b"second"]
