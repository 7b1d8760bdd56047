"""Paths, errors and subprocess helpers shared by the stack tooling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Files the prebuilt kernels of the pinned wheel are compiled from, plus the
# build definition. Touching them would make the python-only build invalid.
FORBIDDEN_PATHS = ("csrc/", "cmake/", "CMakeLists.txt", "pyproject.toml",
                   "vllm/_custom_ops.py")


class StackError(Exception):
    """An error the user can act on. The message names the file and the next step."""


@dataclass(frozen=True)
class Layout:
    """Where the tooling reads and writes. Tests point it at a temporary project."""

    root: Path

    @classmethod
    def default(cls) -> Layout:
        return cls(Path(os.environ.get("K3_PROJECT_ROOT", PROJECT_ROOT)))

    @property
    def pin_file(self) -> Path:
        return self.root / "pin.toml"

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def series_file(self) -> Path:
        return self.patches_dir / "series"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "vllm_overlay"

    @property
    def cache_dir(self) -> Path:
        # Survives `make clean`; K3_CACHE_DIR lets several clones share one.
        return Path(os.environ.get("K3_CACHE_DIR", self.root / ".cache"))

    @property
    def downloads_dir(self) -> Path:
        return self.cache_dir / "downloads"

    @property
    def quarantine_dir(self) -> Path:
        return self.cache_dir / "quarantine"

    @property
    def locks_dir(self) -> Path:
        """Locks of the download cache, shared by every clone that uses it."""
        return self.cache_dir / "locks"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def tree(self) -> Path:
        """The patched vLLM source tree (a git repository)."""
        return self.build_dir / "vllm"

    @property
    def gpu_benchmarks(self) -> Path:
        """The GPU benchmark runner and its cases (benchmarks/gpu/cases/)."""
        return self.root / "benchmarks" / "gpu"

    @property
    def gpubench_package(self) -> Path:
        """The runner plus each tree's kernel files, built by `make gpubench`."""
        return self.build_dir / "gpubench"

    @property
    def venv(self) -> Path:
        """The patched vLLM and its dependencies (requirements/venv.lock)."""
        return self.root / ".venv"

    @property
    def lint_venv(self) -> Path:
        """vLLM's pre-commit linters (requirements/lint.lock)."""
        return self.root / ".venv-lint"


def rel(path: Path, layout: Layout | None = None) -> str:
    """A path as the user would type it from the project root."""
    root = (layout or Layout.default()).root
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# Prefixes of folders that exist only while a command runs; a leftover is from a
# run that was killed, and the next run (or `make clean`) removes it.
SCRATCH_PREFIXES = (".vllm-unpacking-", ".removing-")


def discard(path: Path) -> None:
    """Delete a folder so that no interruption leaves it half deleted.

    It is first renamed away (one atomic step), then deleted; a killed run
    leaves a `.removing-*` folder, never a half-deleted tree in its place.
    """
    trash = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIXES[1]}{path.name}-",
                                  dir=path.parent))
    os.replace(path, trash / path.name)
    shutil.rmtree(trash)


def remove_leftovers(folder: Path) -> None:
    """Remove scratch folders that killed runs left in `folder` (call under the lock)."""
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.startswith(SCRATCH_PREFIXES) and path.is_dir():
                shutil.rmtree(path)


def say(message: str) -> None:
    print(message, flush=True)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    input: str | bytes | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; raise StackError with it on failure."""
    full_env = None
    if env is not None:
        full_env = {**os.environ, **env}
    result = subprocess.run(
        cmd,
        cwd=cwd,
        env=full_env,
        input=input,
        capture_output=True,
        text=text,
    )
    if check and result.returncode != 0:
        err = result.stderr if text else result.stderr.decode(errors="replace")
        out = result.stdout if text else result.stdout.decode(errors="replace")
        raise StackError(
            f"command failed ({result.returncode}): {' '.join(cmd)}\n"
            f"{(err or out).strip()}"
        )
    return result
