"""What `make test` remembers, so that it never repeats a run whose inputs are identical.

Each command of `make test` (scripts/testing/testrun.py: a lint run, or a "unit",
one pytest process of one test file) has a key: a sha256 over everything
that decides its outcome. Part of it is the same for every command and
cannot be left out:
- the project's files, except those made from build/vllm (patches/,
  vllm_overlay/) and prose (README.md, BENCHMARKS.md, docs/): so scripts/, tests/,
  requirements/*.lock, pin.toml (hence the wheel's kernels), pytest.ini;
- the pristine release's git tree id and commit, the two venvs (pyvenv.cfg,
  the build stamp recording the installed lock and tree, and the name, size
  and modification time of each installed file), the interpreter,
  platform and git version, and every environment variable but those that
  change no test's outcome (_UNKEYED_ENV: the terminal's, make's).
A command adds what it checks and how (its command line), and what it
reads of the vLLM tree it tests: a unit the digest of the paths it read
there (scripts/testing/testdeps.py), any other command that tree's git tree id;
and any other project path it reads.

A command that passed is recorded under build/test-results/green/<key>.json;
a later run with the same key reuses it and says so. A failed one is never
recorded, so it always runs again, and it removes the greens under its keys
(a FRESH=1 run that fails where one passed). Any doubt is a new key: a cache
miss costs minutes, a stale green would hide a failure. A command that runs
again says which of its key's inputs changed since its last green run.
Every file here is a shortcut: one that is damaged is said in one line,
removed and taken as missing; what a killed run left goes at the next run.

A result is reused whole or not at all: a unit whose inputs changed runs
every one of its tests again. Its tests share one process, so any of them
can observe what another ran (a cache filled by the first test that asked);
only a run of the whole unit equals a fresh one.

build/test-results/summary.json describes the latest run (rows, counts,
commands, what was reused, wall time): `make bench` prints it and `make
export` quotes it in the PR descriptions. runs.jsonl keeps one line per run;
reads/ what each unit read, logs/ and junit/ the output of each command.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from scripts.common import SCRATCH_FILE_SUFFIX, Layout, rel, run, warn, write_atomically
from scripts.stack.gitrepo import git, release_commit
from scripts.stack.lock import ENVIRONMENTS
from scripts.testing.testdeps import Reads, TreeIndex

FORMAT = 2
RESULTS = "test-results"
# Made from build/vllm (keyed by its tree id instead) or prose no test reads.
# A row that does read one of them lists it in Row.inputs.
NOT_PROJECT_INPUTS = frozenset({"patches", "vllm_overlay", "docs", "README.md",
                                "BENCHMARKS.md"})
# Never inputs: outputs, caches and the environments (keyed by their stamps).
# (.k3-stack.running: the project lock's note, git-ignored in a checkout.)
_NEVER = frozenset({"build", ".cache", ".venv", ".venv-lint", ".git", "__pycache__",
                    ".pytest_cache", ".mypy_cache", ".ruff_cache", ".k3-stack.running"})
# What Python imports (or loads as a module) by its name: see _ignored_importable.
_IMPORTABLE = (".py", ".pyc", ".pyo", ".so", ".pyd")
# Environment variables that change no test's outcome; every other one is in
# every key, as a digest of its value (a test may read any: K3_ROCM_ARCH,
# K3_PRISTINE_GIT_DIR, HOME, PATH; and the values, tokens among them, stay
# off the disk). Named here: the terminal's and the login session's, make's
# own and the variables typed on its command line (exported, FRESH and ONLY
# among them; VLLM_VERSION exported empty to every recipe), how many commands
# run at once, and what make test (K3_PROJECT_ROOT: the project, which the
# key holds), pyenv's python3 shim (PYENV_DIR: the folder it was started in,
# the project again; the version it chose is PYENV_VERSION, keyed) and pytest
# set in each test process themselves.
_UNKEYED_ENV = frozenset({
    "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR",
    "FRESH", "ONLY", "FORCE", "VLLM_VERSION", "K3_TEST_FRESH", "K3_TEST_JOBS",
    "K3_PROJECT_ROOT", "PYENV_DIR", "PYTEST_CURRENT_TEST",
    "PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLORTERM", "COLUMNS", "LINES", "LS_COLORS",
    "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "TERM_SESSION_ID", "WINDOWID", "DISPLAY",
    "XAUTHORITY", "TMUX", "TMUX_PANE", "STY", "WINDOW", "MAIL", "PS1", "PS2",
    "PROMPT_COMMAND", "HISTSIZE", "HISTFILESIZE", "HISTCONTROL", "SSH_AUTH_SOCK",
    "SSH_AGENT_PID", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "GPG_AGENT_INFO",
    "DBUS_SESSION_BUS_ADDRESS", "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS",
    "XDG_SEAT", "XDG_VTNR", "EDITOR", "VISUAL", "PAGER", "LESS", "LESSOPEN", "LESSCLOSE"})


def keyed_environment(environ: dict[str, str]) -> dict[str, str]:
    """Each variable that may change a test's outcome, with a digest of its value."""
    return {k: hashlib.sha256(v.encode("utf-8", "surrogateescape")).hexdigest()[:16]
            for k, v in sorted(environ.items()) if k not in _UNKEYED_ENV}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def shown_date(iso: str) -> str:
    return iso[:16].replace("T", " ") + " UTC"


# --- what a key is made of ----------------------------------------------------


def digest_paths(root: Path, paths: list[str] | None = None) -> str:
    """sha256 over the names, exec bits and contents of files under `root`.

    `paths` (files or folders relative to root) default to the whole project
    but NOT_PROJECT_INPUTS. A deleted tracked file counts as "missing".
    """
    return _digest(file_digests(root, paths))


def file_digests(root: Path, paths: list[str] | None = None) -> dict[str, str]:
    """Per file of digest_paths, the sha256 of its kind and content."""
    digests = {}
    for relpath in _input_files(root, paths):
        path = root / relpath
        if path.is_symlink():
            kind, data = "link", os.readlink(path).encode()
        elif path.is_file():
            kind, data = ("exec" if os.access(path, os.X_OK) else "file"), path.read_bytes()
        else:
            kind, data = "missing", b""
        digests[relpath] = hashlib.sha256(f"{kind}\0{len(data)}\0".encode() + data).hexdigest()
    return digests


def _digest(digests: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for relpath, content in sorted(digests.items()):
        digest.update(f"{relpath}\0{content}\0".encode())
    return digest.hexdigest()


def _input_files(root: Path, paths: list[str] | None) -> list[str]:
    if paths is None:
        return [f for f in project_files(root) if f.split("/", 1)[0] not in NOT_PROJECT_INPUTS]
    files = []
    for top in sorted(paths):
        start = root / top
        if not start.is_dir() or start.is_symlink():
            files.append(top)
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if d not in _NEVER)
            base = Path(dirpath).relative_to(root)
            files += [(base / f).as_posix() for f in filenames]  # __pycache__/ is _NEVER's
    return sorted(files)


def project_files(root: Path) -> list[str]:
    """The project's files as git sees them (tracked, or new and not ignored), so
    that outputs and editor or cache folders never change a key; every file when
    the project is not a git checkout. Never what _NEVER names (a venv linked in)."""
    top = run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], check=False)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return _input_files(root, [p.name for p in root.iterdir() if p.name not in _NEVER])
    listed = run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                  "--exclude-standard"]).stdout
    found = {f for f in listed.split("\0") if f and f.split("/", 1)[0] not in _NEVER}
    return sorted(found | _ignored_importable(root))


def _ignored_importable(root: Path) -> set[str]:
    """The files of the project git ignores that Python could import (a `.pyc`
    beside no source, a compiled module that shadows one): inputs all the same.
    Bytecode caches and what _NEVER names are not; nor editor or cache folders."""
    out = run(["git", "-C", str(root), "ls-files", "-z", "--others", "--ignored",
               "--exclude-standard", "--directory"]).stdout
    found = set()
    for entry in filter(None, out.split("\0")):
        if any(part in _NEVER for part in entry.rstrip("/").split("/")):
            continue
        inside = _input_files(root, [entry.rstrip("/")]) if entry.endswith("/") else [entry]
        found.update(f for f in inside if f.endswith(_IMPORTABLE))
    return found


def tree_id(tree: Path, rev: str) -> str:
    return git(tree, "rev-parse", f"{rev}^{{tree}}").stdout.strip()


def working_tree_id(tree: Path) -> str:
    """The git tree id of what is checked out in `tree`, uncommitted edits included.

    Written through a scratch copy of the index: the repository's index, HEAD
    and branch are untouched (the blobs of edited files are added to its
    object store, as `git stash` would).
    """
    with tempfile.TemporaryDirectory(prefix="k3-test-index-") as tmp:
        index = Path(tmp) / "index"
        shutil.copyfile(tree / ".git" / "index", index)
        env = {"GIT_INDEX_FILE": str(index)}
        git(tree, "add", "--all", env=env)
        return git(tree, "write-tree", env=env).stdout.strip()


@dataclass(frozen=True)
class KeyContext:
    """The inputs every command shares: computed once per run."""

    material: dict
    project_files: dict[str, str]  # what material["project"] digests, file by file

    @classmethod
    def of(cls, layout: Layout, base: str) -> KeyContext:
        venvs = {}
        for env in ENVIRONMENTS:
            folder = env.path(layout)
            venvs[env.name] = {name: _read_or_none(folder / name)
                               for name in ("pyvenv.cfg", "k3-stack-build.json")}
            venvs[env.name]["files"] = installed_files_digest(folder)
        files = file_digests(layout.root)
        return cls({
            "format": FORMAT,
            "project": _digest(files),
            "base_tree": tree_id(layout.tree, base),
            "base_commit": release_commit(layout),
            "venvs": venvs,
            "platform": [platform.platform(), platform.machine(), sys.version,
                         git(layout.tree, "--version").stdout.strip()],
            "environment": keyed_environment(dict(os.environ)),
        }, files)

    def key(self, root: Path, *, check: str, vllm_tree: str | None,
            command: tuple[str, ...], inputs: tuple[str, ...],
            ignored: str | None = None) -> tuple[str, dict]:
        """A command's key: what every key holds, its check and command, the tree
        it reads (and the Python files git ignores in its checkout), the project
        paths it reads."""
        material = {**self.material, "check": check, "vllm_tree": vllm_tree,
                    "command": list(command), "ignored_sources": ignored,
                    "inputs": digest_paths(root, list(inputs)) if inputs else None}
        return _hash(material), material

    def unit(self, *, check: str, command: tuple[str, ...]) -> tuple[str, dict]:
        """A unit's identity (its key but for what it reads) and its material."""
        material = {**self.material, "check": check, "command": list(command)}
        return _hash(material), material


def unit_key(identity: str, reads: Reads, digest: str) -> str:
    """The key of a unit whose `reads` see `digest` in the tree it tests."""
    return _hash({"unit": identity, "reads": reads.id, "digest": digest})


def _hash(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def what_changed(before: dict, after: dict, store: ResultStore) -> list[str]:
    """Which of the shared inputs differ between two keys' materials, in words."""
    said = []
    if before.get("project") != after.get("project"):
        old, new = store.project_files(before.get("project")), store.project_files(
            after.get("project"))
        if old is None or new is None:
            said.append("the project's files")
        else:
            for path in sorted(old.keys() | new.keys()):
                if old.get(path) != new.get(path):
                    how = "added" if path not in old else "removed" if path not in new else (
                        "changed")
                    said.append(f"{path} {how}")
    names = {"base_tree": "the pristine release", "base_commit": "the release tag's commit",
             "venvs": "the venvs (.venv, .venv-lint)",
             "platform": "the interpreter, platform or git", "command": "its command",
             "check": "its check", "inputs": "the project paths it reads",
             "ignored_sources": "the Python files git ignores in its tree",
             "format": "the result format of make test"}
    said += [names[k] for k in names if before.get(k) != after.get(k)]
    if before.get("environment") != after.get("environment"):
        old, new = (e if isinstance(e, dict) else {} for e in (before.get("environment"),
                                                               after.get("environment")))
        said.append("environment " + ", ".join(sorted(
            k for k in old.keys() | new.keys() if old.get(k) != new.get(k))))
    return said


def installed_files_digest(folder: Path) -> str:
    """sha256 over the name, size and modification time of every file in a venv:
    an edit to an installed file (a hand fix in site-packages, a package
    installed by hand) changes it, and a walk of stats costs a third of a second
    for .venv's 60,000 files where hashing its 9 GB would cost a minute.
    Bytecode caches are left out: Python writes them as the tests run."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                stat = os.lstat(path)
            except FileNotFoundError:
                continue  # removed while walking
            digest.update(f"{os.path.relpath(path, folder)}\0{stat.st_mode}\0{stat.st_size}\0"
                          f"{stat.st_mtime_ns}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


# --- where results are kept -----------------------------------------------------


class ResultStore:
    """build/test-results/: green records by key, what each unit read, the project's
    file digests, junit files and logs, summary.json, runs.jsonl. Safe to use from
    several threads: every file is written whole, under a name of its own."""

    def __init__(self, layout: Layout):
        self.dir = layout.build_dir / RESULTS
        self.dir.mkdir(parents=True, exist_ok=True)

    def remove_leftovers(self) -> list[Path]:
        """Remove what killed runs left (call under the project lock): the read
        logs of the units that were running, the fork servers' logs, files
        half written. Returns them."""
        found = [path for pattern in ("logs/reads-*", "servers/server-*.reads",
                                      f"*/.*{SCRATCH_FILE_SUFFIX}")
                 for path in self.dir.glob(pattern) if path.is_file() and not path.is_symlink()]
        for path in found:
            path.unlink(missing_ok=True)
        return found

    def green(self, key: str) -> dict | None:
        """The record of a green run under `key`, if there is one."""
        return _read_json(self.dir / "green" / f"{key}.json",
                          lambda record: _is_green(record, key))

    def record_green(self, key: str, record: dict) -> None:
        """Keep `record` (its "outcome" passed) under `key`, and as the latest
        green of its "name" (what a rerun compares its inputs with)."""
        if record["outcome"]["failed"]:
            return  # a failure is never reused: the next run tries again
        record = {**record, "key": key, "date": now()}
        _write_json(self.dir / "green" / f"{key}.json", record)
        _write_json(self.dir / "latest" / f"{_slug(record['name'])}.json", {"key": key})

    def forget_greens(self, keys: list[str]) -> None:
        """Drop the green records under `keys`: a run under them failed."""
        for key in keys:
            (self.dir / "green" / f"{key}.json").unlink(missing_ok=True)

    def latest_green(self, name: str) -> dict | None:
        """The latest green record of `name`, in any row."""
        pointer = _read_json(self.dir / "latest" / f"{_slug(name)}.json",
                             lambda data: _has(data, key=str))
        return self.green(pointer["key"]) if pointer else None

    # What units read: each Reads once (by id), and per unit the ids it has had.

    def reads(self, identity: str) -> list[Reads]:
        found = (self.reads_by_id(i) for i in self._reads_ids(identity))
        return [r for r in found if r is not None]

    def _reads_ids(self, identity: str) -> list[str]:
        index = _read_json(self.dir / "reads" / f"{identity}.json",
                           lambda data: _has(data, reads=list) and all(
                               isinstance(i, str) for i in data["reads"]))
        return index["reads"] if index else []

    def reads_by_id(self, reads_id: str) -> Reads | None:
        data = _read_json(self.dir / "reads" / f"{reads_id}.json.gz", _is_reads)
        return Reads.from_json(data) if data else None

    def add_reads(self, identity: str, reads: Reads, keep: int = 8) -> None:
        # Written every time: one there may be damaged.
        _write_bytes(self.dir / "reads" / f"{reads.id}.json.gz",
                     gzip.compress(json.dumps(reads.to_json()).encode(), mtime=0))
        ids = [reads.id] + [i for i in self._reads_ids(identity) if i != reads.id]
        _write_json(self.dir / "reads" / f"{identity}.json", {"reads": ids[:keep]})

    # The project's files per digest, to say which changed.

    def save_project_files(self, context: KeyContext) -> None:
        # Written every time: one there may be damaged.
        _write_json(self.dir / "projects" / f"{context.material['project']}.json",
                    context.project_files)

    def project_files(self, digest: str | None) -> dict | None:
        return _read_json(self.dir / "projects" / f"{digest}.json", lambda data: isinstance(
            data, dict) and all(isinstance(v, str) for v in data.values())) if digest else None

    def write_summary(self, summary: dict) -> None:
        _write_json(self.dir / "summary.json", summary)
        line = {k: summary.get(k) for k in ("started", "wall_seconds", "fresh", "vllm", "totals",
                                            "rows_run", "rows_reused", "parts_run",
                                            "parts_reused", "only")}
        runs = self.dir / "runs.jsonl"
        try:
            with open(runs, "a") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(runs)) from e


def trees_changed(repo: Path, before: str, after: str, reads: Reads | None,
                  project: Path) -> list[str]:
    """The paths that differ between two git trees of `repo`: those `reads` sees
    differently, or (no reads) every file; [] if a tree is gone from the repository."""
    try:
        if reads is not None:
            return reads.changed(TreeIndex(repo, before), TreeIndex(repo, after), project)
        out = git(repo, "diff", "--no-renames", "--name-only", before, after).stdout
    except Exception:  # noqa: BLE001 - an old tree pruned by git gc: nothing to compare
        return []
    return out.split()


def _slug(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def read_runs(layout: Layout) -> list[dict]:
    try:
        lines = (layout.build_dir / RESULTS / "runs.jsonl").read_text(
            errors="replace").splitlines()
    except FileNotFoundError:
        return []
    runs = []
    for line in lines:
        try:
            run = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted write
        if isinstance(run, dict):
            runs.append(run)
    return runs


def _read_json(path: Path, valid: Callable[[object], bool] = lambda data: isinstance(
        data, dict)) -> dict | None:
    """The JSON object in `path` (gzip'd if it ends in .gz), or None if there is
    none. One that cannot be read, or is not what make test writes there (`valid`
    says), is said in one line, removed and taken as missing: every file here
    is a shortcut, and a missing one costs only a rerun."""
    try:
        data = path.read_bytes()
        data = json.loads((gzip.decompress(data) if path.suffix == ".gz" else data).decode())
    except FileNotFoundError:
        return None
    except (OSError, EOFError, zlib.error, ValueError) as e:  # ValueError: UTF-8 and JSON
        return _damaged(path, f"cannot be read ({type(e).__name__})")
    return data if valid(data) else _damaged(path, "is not what make test writes there")


def _damaged(path: Path, why: str) -> None:
    warn(f"{rel(path)} {why}; removed, and taken as missing (what it recorded runs again)")
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # a folder, or no permission: taken as missing all the same


def _has(data: object, **fields: type | tuple[type, ...]) -> bool:
    """Whether `data` is an object whose `fields` have these types."""
    return isinstance(data, dict) and all(isinstance(data.get(k), t) for k, t in fields.items())


def _is_green(record: object, key: str) -> bool:
    """A green record under `key` as record_green writes it (what reusing it reads)."""
    return (_has(record, key=str, date=str, row=str, name=str, material=dict, outcome=dict,
                 tree=(str, type(None)), reads=(str, type(None)))
            and record["key"] == key and _has(record["outcome"], passed=int, failed=int,
                                              skipped=int, seconds=(int, float),
                                              command=str, where=str, note=str))


def _is_reads(data: object) -> bool:
    """What Reads.to_json writes: `<kind> <path>` entries, and why it is opaque."""
    return (_has(data, entries=list, opaque=list)
            and all(isinstance(e, str) and " " in e for e in data["entries"])
            and all(isinstance(o, str) for o in data["opaque"]))


def _write_json(path: Path, data: dict) -> None:
    _write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """All or nothing, and safe from several threads at once (a scratch file of
    its own, renamed into place); a full disk names the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data)
