"""What a test file reads of the vLLM tree, so that `make test` reruns it only where that changed.

`make test` runs each of its test files (a "unit": one pytest process) with
the read tracker (scripts/testing/reads/sitecustomize.py) first on PYTHONPATH. Every
Python process of the run, subprocesses and forks included, appends to the
unit's log what it opens, lists and stats under the tree, which module
names it looks up in the tree's folders, and anything that could read the
tree unseen. That is the unit's `Reads`. The project's files that are in no
key (testcache.NOT_PROJECT_INPUTS: README.md, BENCHMARKS.md, docs/, and patches/ and
vllm_overlay/, which are the tree exported) are tracked the same way.

A unit's outcome is a function of what it reads, given what every key holds
(scripts/testing/testcache.py: the project's scripts and tests, the venvs, the
environment). So its key over a tree is a digest of those paths there: the
object id of each file read or stat'ed in that tree's git tree, the names in
each folder listed, the files each module lookup finds, the absence of what
was looked for and not found. Another tree with the same digest gives the
same bytes to every read, so the unit would run the same way there: `make
test` reuses its green result instead of running it again. That is how a
prefix row reruns an earlier patch's test only where a later patch changed
something the test reads.

What the tracker cannot follow (a subprocess that is not Python with the
tracker, nor git reading the pristine release, nor a system probe; a write
into the tree; a read of the tree's .git) makes the whole tree the unit's
input: its digest is then the tree id, as for a row without a tracker.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from scripts.stack.gitrepo import git

# The tracker's folder: it holds only sitecustomize.py, so putting it on
# PYTHONPATH loads the tracker and shadows nothing else.
TRACKER_DIR = Path(__file__).resolve().parent / "reads"
ABSENT = "absent"
PER_TEST_PLUGIN = "k3_pertest"  # reads/k3_pertest.py
# Paths outside the tree are named relative to the project, with this in front.
PROJECT = "project:"


def tracker_env(log: Path, tree: Path, project_paths: list[Path], base: str, *,
                per_test: bool = False) -> dict[str, str]:
    """The environment that makes the tracker record into `log` what is read
    under `tree` and `project_paths` (PYTHONPATH must start with TRACKER_DIR);
    with `per_test`, also which of the tree's functions each test of the
    pytest process runs (into `<log>.tests.json`, reads/k3_pertest.py)."""
    roots = os.pathsep.join(str(p) for p in [tree, *project_paths])
    env = {"K3_READS_LOG": str(log), "K3_READS_ROOT": roots, "K3_READS_BASE": base}
    if per_test:
        plugins = [p for p in os.environ.get("PYTEST_PLUGINS", "").split(",") if p]
        env.update(K3_TESTS_PROFILE="1", PYTEST_PLUGINS=",".join([*plugins, PER_TEST_PLUGIN]))
    return env


@dataclass(frozen=True)
class Reads:
    """What one unit read: `<kind> <path>` entries, kind r (read), s (stat),
    k (kind probe: exists, is a file...), l (listed), i (module lookup
    `<folder>/<name>`); paths relative to the tree, or PROJECT + a path
    relative to the project."""

    entries: frozenset[str]
    # Why the whole tree counts as read (empty: only the entries).
    opaque: tuple[str, ...] = ()

    @classmethod
    def parse(cls, log: str, tree: Path, project: Path) -> Reads:
        """The tracker's log lines (`<kind> <absolute path>`)."""
        places = [(p, "") for p in _spellings(tree)] + [(p, PROJECT) for p in _spellings(project)]
        places.sort(key=lambda place: len(place[0]), reverse=True)  # the tree is in the project
        entries: set[str] = set()
        opaque: set[str] = set()
        for line in log.splitlines():
            kind, _, what = line.partition(" ")
            if kind == "x":
                opaque.add(what)
                continue
            for prefix, label in places:
                if what == prefix or what.startswith(prefix + os.sep):
                    path = os.path.relpath(what, prefix)
                    break
            else:
                continue
            if label or not (path == ".git" or path.startswith(".git" + os.sep)):
                entries.add(f"{kind} {label}{path}")
            elif kind not in ("s", "k"):
                # In no git tree, and not the same in every one (HEAD). A stat there
                # is a probe for something else (a venv, a repository): not a read.
                opaque.add(f"reads {path}")
        return cls(frozenset(entries), tuple(sorted(opaque)))

    def to_json(self) -> dict:
        return {"entries": sorted(self.entries), "opaque": list(self.opaque)}

    @classmethod
    def from_json(cls, data: dict) -> Reads:
        return cls(frozenset(data["entries"]), tuple(data["opaque"]))

    @property
    def id(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json()).encode()).hexdigest()

    def digest(self, tree: TreeIndex, project: Path) -> str:
        """What these reads see in `tree` (and the project): equal digests, equal
        bytes read."""
        if self.opaque:
            return f"whole tree {tree.whole_id()}"
        return hashlib.sha256("\n".join(self._seen(tree, project)).encode()).hexdigest()

    def changed(self, before: TreeIndex, after: TreeIndex, project: Path) -> list[str]:
        """The paths these reads see differently in two trees (the project as it is)."""
        if self.opaque:
            return ["anything (" + "; ".join(self.opaque[:2]) + ")"]
        old = set(self._seen(before, project))
        paths = {line.split(" ", 2)[1] for line in set(self._seen(after, project)) ^ old}
        # A module lookup `pkg/mod` changes with its file `pkg/mod.py`: name the file.
        return sorted(p for p in paths if not any(q.startswith(p + ".") for q in paths))

    def _seen(self, tree: TreeIndex, project: Path) -> list[str]:
        seen = []
        for entry in sorted(self.entries):
            kind, path = entry.split(" ", 1)
            if path.startswith(PROJECT):
                state = _file_state(kind, project / path[len(PROJECT):])
            elif kind == "l":
                state = " ".join(tree.listing(path))
            elif kind == "i":
                state = " ".join(tree.module_files(path))
            else:
                state = tree.state(kind, path)
            seen.append(f"{kind} {path} {state}")
        return seen


def _spellings(path: Path) -> set[str]:
    return {os.path.abspath(path), os.path.realpath(path)}


def _file_state(kind: str, path: Path) -> str:
    """What a read (r), stat (s), kind probe (k), listing (l) or module lookup (i)
    sees of a project path on disk."""
    if kind == "l":
        return " ".join(sorted(os.listdir(path))) if path.is_dir() else ABSENT
    if kind == "i":
        folder, name = path.parent, path.name
        found = sorted(n for n in os.listdir(folder) if n == name or n.startswith(
            name + ".")) if folder.is_dir() else []
        return " ".join(f"{n}={_file_state('k', folder / n)}" for n in found)
    if path.is_symlink():
        return f"link {os.readlink(path)}"
    if path.is_dir():
        return "tree"
    if not path.is_file():
        return ABSENT
    mode = "100755" if os.access(path, os.X_OK) else "100644"
    if kind == "r":
        return f"blob {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return f"blob {mode}" + (f" {path.stat().st_size}" if kind == "s" else "")


def _content_digest(path: Path, known: dict[str, str]) -> str:
    """sha256 of a file's content, once per `known` (the indexes of one run share
    it: each prefix's index sees build/vllm's kernels, hundreds of MB, too)."""
    if str(path) not in known:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        known[str(path)] = digest.hexdigest()
    return known[str(path)]


class TreeIndex:
    """Every path of a git tree of `repo`: its mode, kind, object id and size, and
    each folder's names; with `ignored`, also the files git ignores in that
    checkout (those under `within`, if given), as the import system finds them:
    in the checkout of the tree itself, or linked into another one."""

    def __init__(self, repo: Path, tree_id: str, ignored: Path | None = None,
                 within: str = "", digests: dict[str, str] | None = None):
        self.tree_id = tree_id
        self._ignored: dict[str, Path] = {}  # path -> file on disk, hashed when read
        self._digests = {} if digests is None else digests  # file -> its content's sha256
        self._entries: dict[str, tuple[str, str, str, str]] = {
            ".": ("040000", "tree", tree_id, "-")}
        self._names: dict[str, list[str]] = {}
        out = git(repo, "ls-tree", "-r", "-t", "-l", "-z", "--full-tree", tree_id).stdout
        for record in out.split("\0"):
            if not record:
                continue
            meta, path = record.split("\t", 1)
            mode, kind, oid, size = meta.split()
            self._entries[path] = (mode, "link" if mode == "120000" else kind, oid, size)
            parent, _, name = path.rpartition("/")
            self._names.setdefault(parent or ".", []).append(name)
        if ignored is not None and ignored.is_dir():
            self._add_ignored(ignored, within)

    def _add_ignored(self, worktree: Path, within: str) -> None:
        """The ignored files in `worktree`, as entries of their own: Python imports
        them all the same (a junk `mod.abi3.so` shadows `mod.py`; a `.pyc`
        beside no source is a module; the wheel's copies under vllm/). Bytecode
        caches are left out: they stand for their sources, which are read."""
        out = git(worktree, "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                  *([within] if within else [])).stdout
        for path in out.split("\0"):
            if not path or "__pycache__" in path.split("/") or path in self._entries:
                continue
            file = worktree / path
            if file.is_symlink() and not file.is_file():
                entry = ("120000", "link", f"ignored {os.readlink(file)}", "-")
            elif file.is_file():
                mode = "100755" if os.access(file, os.X_OK) else "100644"
                entry = (mode, "blob", "", str(file.stat().st_size))
                self._ignored[path] = file
            else:
                continue
            self._entries[path] = entry
            parts = path.split("/")
            for depth in range(len(parts)):
                folder, name = "/".join(parts[:depth]) or ".", parts[depth]
                if name not in self._names.setdefault(folder, []):
                    self._names[folder].append(name)
                inner = "/".join(parts[:depth + 1])
                if depth < len(parts) - 1 and inner not in self._entries:
                    self._entries[inner] = ("040000", "tree", "ignored", "-")

    def state(self, kind: str, path: str) -> str:
        """What a read (r), a stat (s) or a kind probe (k) of `path` sees: a file's
        content, its mode and size, its mode; a link's target; a folder's kind (its
        names are what a listing sees); or ABSENT."""
        if path not in self._entries:
            return ABSENT
        mode, what, oid, size = self._entries[path]
        if path in self._ignored and kind == "r" and not oid:
            oid = "ignored " + _content_digest(self._ignored[path], self._digests)
            self._entries[path] = (mode, what, oid, size)
        if what in ("tree", "commit") and kind != "r":
            return what
        if what != "blob" or kind == "r":
            return f"{what} {oid}"
        return f"blob {mode}" + (f" {size}" if kind == "s" else "")

    def whole_id(self) -> str:
        """The tree id, and the content of each ignored file (for a unit whose
        reads could not be followed: it may have read anything)."""
        if not self._ignored:
            return self.tree_id
        ignored = "\n".join(f"{p} {self.state('r', p)}" for p in sorted(self._ignored))
        return f"{self.tree_id} {hashlib.sha256(ignored.encode()).hexdigest()}"

    def ignored_sources_id(self) -> str:
        """The content of each ignored Python source (.py, .pyi): what a linter
        that follows imports may read beyond the tree ("" if there is none)."""
        sources = sorted(p for p in self._ignored if p.endswith((".py", ".pyi")))
        if not sources:
            return ""
        listed = "\n".join(f"{p} {self.state('r', p)}" for p in sources)
        return hashlib.sha256(listed.encode()).hexdigest()

    def listing(self, path: str) -> list[str]:
        return sorted(self._names.get(path, []))

    def module_files(self, lookup: str) -> list[str]:
        """What an import of `name` finds in `folder` (lookup `<folder>/<name>`):
        the entries named `name` or `name.<suffix>` (a package, a source, a
        compiled module), each with its kind; a compiled module with its content
        too (the loader opens a source, so its read is recorded; dlopen is not)."""
        folder, _, name = lookup.rpartition("/")
        folder = folder or "."
        found = []
        for n in self.listing(folder):
            if n == name or n.startswith(name + "."):
                path = n if folder == "." else f"{folder}/{n}"
                compiled = not n.endswith(".py") and self._entries[path][1] == "blob"
                found.append(f"{n}={self.state('r' if compiled else 'k', path)}")
        return found
