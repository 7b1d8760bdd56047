"""Access to the pristine vLLM release that the stack is applied to.

`make apply` keeps the release as the tagged first commit of `build/vllm`, so
tests can read any pristine file from git without unpacking the sdist again.
`K3_PRISTINE_GIT_DIR` points elsewhere (any git repo holding the base tag).
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def base_tag() -> str:
    with open(PROJECT_ROOT / "pin.toml", "rb") as f:
        return tomllib.load(f)["vllm"]["base_tag"]


def pristine_git_dir() -> Path:
    return Path(os.environ.get("K3_PRISTINE_GIT_DIR", PROJECT_ROOT / "build" / "vllm"))


def pristine_source(relpath: str) -> str:
    """Return the text of `relpath` (relative to the vLLM tree root) at the base tag."""
    repo = pristine_git_dir()
    result = subprocess.run(
        ["git", "-C", str(repo), "show", f"{base_tag()}:{relpath}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise FileNotFoundError(
            f"cannot read pristine {relpath} from {repo} at {base_tag()}: "
            f"{result.stderr.strip()} (run `make apply` first)"
        )
    return result.stdout
