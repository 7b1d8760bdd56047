"""Access to the pristine vLLM release that the stack is applied to.

`make apply` keeps the release as the tagged first commit of `build/vllm`, so
tests can read any pristine file from git without unpacking the sdist again.
`K3_PRISTINE_GIT_DIR` points elsewhere (any git repo holding the base tag).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tomllib
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def base_tag() -> str:
    with open(PROJECT_ROOT / "pin.toml", "rb") as f:
        return tomllib.load(f)["vllm"]["base_tag"]


def pristine_git_dir() -> Path:
    return Path(os.environ.get("K3_PRISTINE_GIT_DIR", PROJECT_ROOT / "build" / "vllm"))


def _unreadable(
    relpath: str, repo: Path, stderr: str, rev: str | None = None
) -> FileNotFoundError:
    return FileNotFoundError(
        f"cannot read {relpath} from {repo} at {rev or base_tag()}: "
        f"{stderr.strip()} (run `make apply` first)"
    )


def extract_pristine_package(dest: Path, rev: str | None = None) -> Path:
    """Write the pristine release's ``vllm/`` package (or that of commit
    ``rev`` of the same repository, a prefix of the stack) under ``dest`` (a
    folder to put first on ``PYTHONPATH``) and return ``dest``."""
    repo = pristine_git_dir()
    result = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", rev or base_tag(), "vllm"],
        capture_output=True,
    )
    if result.returncode != 0:
        raise _unreadable("vllm/", repo, result.stderr.decode(errors="replace"), rev)
    with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
        archive.extractall(dest, filter="data")
    return dest


def pristine_source(relpath: str) -> str:
    """Return the text of `relpath` (relative to the vLLM tree root) at the base tag."""
    repo = pristine_git_dir()
    result = subprocess.run(
        ["git", "-C", str(repo), "show", f"{base_tag()}:{relpath}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise _unreadable(relpath, repo, result.stderr)
    return result.stdout
