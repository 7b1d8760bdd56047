"""Locks that keep two runs of the tooling from racing.

- The project lock: every command that writes build/, .cache/ or
  vllm_overlay/ holds it for its whole run, so two `make apply` in one clone
  take turns instead of deleting each other's work. It is a lock on the
  project folder itself; while it is held, `.k3-stack.running` names the run.
- A lock per file of the download cache (which K3_CACHE_DIR may share
  between clones), held while the file is checked or downloaded: a lock file
  in the cache's locks/ folder, naming its last holder.

A second run waits and says for whom. These are flock(2) locks: the kernel
drops them when their holder exits, however it exits, so a killed run never
leaves a lock held.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.common import Layout


@contextmanager
def project_lock(layout: Layout, command: str) -> Iterator[None]:
    fd = os.open(layout.root, os.O_RDONLY | os.O_DIRECTORY)
    note = layout.root / ".k3-stack.running"
    try:
        _lock(fd, note, f"`make {command}` in {layout.root}", "this project")
        try:
            yield
        finally:
            note.unlink(missing_ok=True)  # before the lock goes: the next holder writes its own
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def cache_lock(layout: Layout, filename: str) -> Iterator[None]:
    path = layout.locks_dir / f"{filename}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, path, f"a run in {layout.root}",
              f"{filename} in the download cache {layout.downloads_dir}")
        yield
    finally:
        os.close(fd)


def _lock(fd: int, note: Path, holder: str, what: str) -> None:
    """Take the lock on `fd`, waiting (and saying for whom) if another run has it;
    then write who holds it to `note`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            other = note.read_text().strip()
        except OSError:
            other = ""
        print(f"waiting for {other or 'another run'}, which is using {what} ...",
              file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    note.write_text(f"{holder} (pid {os.getpid()})\n")
