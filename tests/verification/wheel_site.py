"""The pinned vLLM wheel's `vllm/` package as a ROCm image's site-packages holds it.

The wheel (~336 MB) is unpacked once, `vllm/` members only, into
build/wheel-site/<sha256 of the wheel>/ and kept there; each test gets its own
site-packages folder of hard links to it (a copy where links are impossible).
The overlay installer replaces files (write to a temporary file, then rename),
so installing into a linked folder never changes the cached extraction.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from scripts.common import Layout
from scripts.stack.fetch import ensure_artifact
from scripts.stack.pin import load_pin

_COMPLETE = ".complete"


def pristine_site(layout: Layout) -> Path:
    """The cached extraction of the pinned wheel's vllm/ (a folder holding vllm/)."""
    pin = load_pin(layout.pin_file)
    wheel = ensure_artifact(layout, pin.project, pin.wheel)
    cache = layout.build_dir / "wheel-site" / pin.wheel.sha256
    if (cache / _COMPLETE).exists():
        return cache
    partial = cache.with_name(cache.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith("vllm/")]
        # Member names come from a wheel whose sha256 is pinned; still refuse escapes.
        assert not [m for m in members if ".." in Path(m).parts], "unsafe wheel member"
        archive.extractall(partial, members)
    (partial / _COMPLETE).write_text(f"{wheel.name}\n")
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(partial, cache)
    return cache


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def scratch_site(pristine: Path, dest: Path) -> Path:
    """A site-packages folder of its own for one test (hard links to the cache)."""
    shutil.copytree(pristine / "vllm", dest / "vllm", copy_function=_link_or_copy)
    return dest


def replace_file(path: Path, data: bytes) -> None:
    """Change a file in a scratch site without touching the cached extraction."""
    path.unlink()
    path.write_bytes(data)


def tree_state(site: Path) -> dict[str, tuple[int, int, int]]:
    """Every file's (inode, size, mtime): any write or replacement changes it."""
    state = {}
    for root, _dirs, files in os.walk(site):
        for name in files:
            st = os.stat(os.path.join(root, name))
            state[os.path.relpath(os.path.join(root, name), site)] = (
                st.st_ino, st.st_size, st.st_mtime_ns)
    return state
