"""Paths, errors and subprocess helpers shared by the stack tooling."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
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
        chosen = os.environ.get("K3_CACHE_DIR")
        if chosen is None:
            return self.root / ".cache"
        if not chosen.strip():
            # Path("") is the working folder: downloads would land unignored in it.
            raise StackError("K3_CACHE_DIR is set but empty; unset it (the cache is then "
                             ".cache/ in the project) or give it a folder")
        return Path(chosen)

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
    # The last part is not resolved: a symlink is named as itself, not as its target.
    try:
        return str((path.parent.resolve() / path.name).relative_to(root.resolve()))
    except ValueError:
        return str(path)


def shown(text: str) -> str:
    """`text` for a message: as it is, or quoted with escapes if it holds a
    newline, a control character or bytes that are not UTF-8."""
    return text if text.isprintable() else repr(text)


# Prefixes of folders that exist only while a command runs; a leftover is from a
# run that was killed, and the next run (or `make clean`) removes it.
SCRATCH_PREFIXES = (".vllm-unpacking-", ".removing-", ".export-")
# Suffix of the file `write_atomically` writes before renaming it into place.
SCRATCH_FILE_SUFFIX = ".k3-tmp"


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
    """Remove scratch folders and files that killed runs left in `folder` (call
    under the lock)."""
    if folder.is_dir() and not folder.is_symlink():
        for path in folder.iterdir():
            if path.is_symlink():
                continue
            if path.name.startswith(SCRATCH_PREFIXES) and path.is_dir():
                shutil.rmtree(path)
            elif path.name.endswith(SCRATCH_FILE_SUFFIX) and path.is_file():
                path.unlink()


# --- files: read only regular ones, write whole ones ---------------------------------


def read_regular(path: Path, fix: str, follow_links: bool = False) -> bytes:
    """The bytes of `path`, which must be a regular file.

    A FIFO would block the read forever and a symlink could make the tooling
    copy a file from outside the project into what it writes (a PR
    description, say): both are refused with one line that ends with `fix`.
    Opening is O_NONBLOCK, so a FIFO is refused, not waited on.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise StackError(f"{rel(path)} is a symlink, not a regular file; {fix}")
        raise
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                    else "a device or socket")
            raise StackError(f"{rel(path)} is {kind}, not a regular file; {fix}")
        return f.read()


def write_atomically(path: Path, data: bytes) -> None:
    """Make `path` a regular file holding `data`, or leave it as it was.

    The bytes go to a new file next to it, which is then renamed over it: a
    reader (or a killed run) sees the old file or the new one, never half of
    one, and a symlink at `path` is replaced, never written through.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=SCRATCH_FILE_SUFFIX,
                                dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), _mode_for(path))
        os.replace(name, path)
    except OSError as e:
        Path(name).unlink(missing_ok=True)
        if e.filename is None:  # a full disk fails the write, which names no file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _mode_for(path: Path) -> int:
    """The permissions `path` has (a regular file), else those of a new file."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        pass
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def real_folders(root: Path, folder: Path) -> None:
    """Make every folder from `root` (exclusive) down to `folder` a real folder.

    For generated trees only (vllm_overlay/): a symlink or file standing where
    a folder belongs is removed (the link itself, never what it points to), so
    nothing written below it can land outside `root`.
    """
    current = root
    for part in folder.relative_to(root).parts:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            current.mkdir()
            continue
        if not stat.S_ISDIR(st.st_mode):
            current.unlink()
            current.mkdir()


# --- signals -------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: handled like Ctrl-C, so cleanups and roll-backs run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, _frame) -> None:
    raise Terminated(signum)


def handle_termination() -> None:
    """Turn SIGTERM and SIGHUP (a `kill`, a closed terminal) into `Terminated`.

    Python's default for them is to die at once, skipping every `finally`:
    scratch folders, `.k3-stack.running` and half-installed overlays stayed.
    """
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)


def end_children(signum: int) -> int:
    """Send `signum` to every process this one started, and theirs (a fork
    server's children too): a run that was stopped leaves none running. Returns
    how many there were."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:  # Linux only
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        parents.setdefault(ppid, []).append(int(entry))
    found, waiting = [], list(parents.get(os.getpid(), []))
    while waiting:
        pid = waiting.pop()
        found.append(pid)
        waiting += parents.get(pid, [])
    for pid in found:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return len(found)


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
    """Run a command, capturing its output; raise StackError with it on failure.

    With `text`, output is decoded as UTF-8 with `surrogateescape`: git prints
    branch names, paths and messages as the bytes they are, which need not be
    UTF-8, and such bytes survive the round trip back to git unchanged.
    """
    full_env = None
    if env is not None:
        full_env = {**os.environ, **env}
    encoding = {"encoding": "utf-8", "errors": "surrogateescape"} if text else {}
    result = subprocess.run(
        cmd,
        cwd=cwd,
        env=full_env,
        input=input,
        capture_output=True,
        **encoding,
    )
    if check and result.returncode != 0:
        err = result.stderr if text else result.stderr.decode(errors="replace")
        out = result.stdout if text else result.stdout.decode(errors="replace")
        raise StackError(
            f"command failed ({result.returncode}): {' '.join(cmd)}\n"
            f"{(err or out).strip()}"
        )
    return result
