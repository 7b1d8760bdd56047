"""vllm_overlay/: the post-stack copy of every file the stack adds or changes.

MANIFEST.json lists, per file, the sha256 it has in the pristine release
("added" if the stack creates it) and after the stack ("deleted" if the stack
removes it). `install` copies the overlay onto an existing vLLM installation
or source tree, after checking every target file against the manifest.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scripts.common import (
    Layout,
    StackError,
    read_regular,
    real_folders,
    rel,
    say,
    warn,
    write_atomically,
)
from scripts.stack.gitrepo import git, read_state
from scripts.stack.pin import Pin

MANIFEST = "MANIFEST.json"
ADDED, DELETED = "added", "deleted"


@dataclass(frozen=True)
class Entry:
    path: str
    pristine_sha256: str  # or ADDED
    patched_sha256: str  # or DELETED


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stack_changes(tree: Path, base: str, result: str) -> dict[str, bytes | None]:
    """Files that differ between two commits/trees: path -> new content (None: deleted)."""
    out = git(tree, "diff", "--no-renames", "--name-status", "-z", base, result).stdout
    fields = out.split("\0")
    changes: dict[str, bytes | None] = {}
    for status, path in zip(fields[0::2], fields[1::2]):
        if status == "D":
            changes[path] = None
        else:
            changes[path] = _blob(tree, result, path)
    return changes


def _blob(tree: Path, rev: str, path: str) -> bytes:
    return git(tree, "cat-file", "blob", f"{rev}:{path}", text=False).stdout


def render(tree: Path, pin: Pin, base: str, result: str,
           patch_names: list[str]) -> dict[str, bytes]:
    """The overlay's files (relative path -> bytes), MANIFEST.json included."""
    files: dict[str, bytes] = {}
    entries = []
    for path, content in sorted(stack_changes(tree, base, result).items()):
        exists = git(tree, "cat-file", "-e", f"{base}:{path}", check=False).returncode == 0
        pristine = sha256_bytes(_blob(tree, base, path)) if exists else ADDED
        if content is None:
            entries.append(Entry(path, pristine, DELETED))
        else:
            files[path] = content
            entries.append(Entry(path, pristine, sha256_bytes(content)))
    manifest = {
        "vllm_version": pin.version,
        "base_tag": pin.base_tag,
        "base_sdist_sha256": pin.sdist.sha256,
        "patches": patch_names,
        "files": [e.__dict__ for e in entries],
    }
    files[MANIFEST] = (json.dumps(manifest, indent=2) + "\n").encode()
    return files


@dataclass(frozen=True)
class NotRegular:
    """What stands in vllm_overlay/ where a file belongs, if it is not a regular
    file (a symlink, say): never equal to any file's bytes."""

    kind: str


def current_files(overlay_dir: Path) -> dict[str, bytes | NotRegular]:
    """Every entry of the overlay below its folders: a regular file's bytes, else
    what it is. Links are never followed (a link to a file outside the project
    must not pass for the file it points to)."""
    if not overlay_dir.is_dir() or overlay_dir.is_symlink():
        return {}
    found: dict[str, bytes | NotRegular] = {}
    for folder, dirnames, filenames in os.walk(overlay_dir):
        for name in sorted(filenames + dirnames):
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                continue  # walked into (os.walk does not follow links to folders)
            relpath = path.relative_to(overlay_dir).as_posix()
            found[relpath] = (read_regular(path, _REGENERATE) if stat.S_ISREG(mode) else
                              NotRegular("symlink" if stat.S_ISLNK(mode) else "special file"))
    return found


def write(layout: Layout, files: dict[str, bytes]) -> bool:
    """Make vllm_overlay/ hold exactly `files`; return True if anything changed.

    Each file is replaced whole (written next to it, then renamed): a symlink
    in the overlay is replaced too, never written through.
    """
    old = current_files(layout.overlay_dir)
    if old == files:
        return False
    for path in old.keys() - files.keys():
        (layout.overlay_dir / path).unlink()
    for path, content in files.items():
        if old.get(path) != content:
            target = layout.overlay_dir / path
            real_folders(layout.root, target.parent)
            write_atomically(target, content)
    for d in sorted(layout.overlay_dir.rglob("*"), reverse=True):
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()
    return True


def regenerate(layout: Layout, pin: Pin, patch_names: list[str]) -> None:
    tree = layout.tree
    base = read_state(tree).get("base_tag", pin.base_tag)
    files = render(tree, pin, base, "HEAD", patch_names)
    changed = write(layout, files)
    count = len(files) - 1
    say(f"overlay: {rel(layout.overlay_dir, layout)}/ holds {count} file(s)"
        + ("" if changed else " (unchanged)"))


# --- installing the overlay -------------------------------------------------


_REGENERATE = "regenerate the overlay with `make apply` (or use it as `make apply` wrote it)"


def load_manifest(overlay_dir: Path) -> dict:
    path = overlay_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise StackError(f"{path}: no manifest; is this a vllm_overlay/ folder?")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StackError(f"{path}: not valid JSON: {e}; {_REGENERATE}")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", []), list):
        raise StackError(f"{path}: not an overlay manifest (an object with a list of "
                         f"files); {_REGENERATE}")
    return manifest


def _entry(manifest_path: Path, n: int, raw) -> Entry:
    fields = Entry.__dataclass_fields__.keys()
    if (not isinstance(raw, dict) or raw.keys() != fields
            or not all(isinstance(value, str) for value in raw.values())):
        raise StackError(f"{manifest_path}: files[{n}] is not an entry with the string "
                         f"fields {', '.join(fields)} (found {raw!r}); {_REGENERATE}")
    return Entry(**raw)


def _entries(overlay_dir: Path, manifest: dict) -> list[Entry]:
    entries = [_entry(overlay_dir / MANIFEST, n, e)
               for n, e in enumerate(manifest.get("files", []))]
    listed = set()
    for e in entries:
        parts = PurePosixPath(e.path).parts
        if (not parts or e.path.startswith("/") or ".." in parts or "\\" in e.path
                or parts[0] == MANIFEST):
            raise StackError(f"overlay entry {e.path!r} would be written outside "
                             "the target; refusing to install anything")
        # A .git folder's config and hooks run code; no vLLM file lives there
        # (file systems may fold case: .GIT is the same folder).
        if ".git" in (part.lower() for part in parts):
            raise StackError(f"overlay entry {e.path!r} would be written into a .git "
                             "folder; refusing to install anything")
        source = overlay_dir / e.path
        if e.patched_sha256 != DELETED:
            if source.is_symlink() or not source.is_file():
                raise StackError(f"overlay file {e.path} is missing or a symlink; "
                                 "refusing to install anything")
            if sha256_bytes(source.read_bytes()) != e.patched_sha256:
                raise StackError(f"overlay file {e.path} does not match its manifest "
                                 "hash (hand-edited?); regenerate it with `make apply`")
        listed.add(e.path)
    for p in overlay_dir.rglob("*"):
        relpath = p.relative_to(overlay_dir).as_posix()
        if p.is_symlink():
            raise StackError(f"overlay holds a symlink {relpath}; refusing to install")
        if p.is_file() and relpath != MANIFEST and relpath not in listed:
            raise StackError(f"overlay file {relpath} is not in the manifest; "
                             "refusing to install")
    return entries


def _target_version(target: Path) -> str | None:
    version_file = target / "vllm" / "_version.py"
    if not version_file.exists():
        return None
    m = re.search(r"__version__ = version = ['\"]([^'\"]+)", version_file.read_text())
    return m.group(1) if m else None


def _inside(target: Path, path: Path) -> bool:
    real_target = os.path.realpath(target)
    return os.path.realpath(path).startswith(real_target + os.sep)


def install(overlay_dir: Path, target: Path, dry_run: bool = False) -> None:
    """Install the overlay onto `target` (a folder holding the `vllm` package).

    In a site-packages folder only files under vllm/ apply; a source tree (with
    pyproject.toml) also gets the tests and CI files. Nothing is written unless
    every target file matches the manifest's pristine (or patched) hash.
    """
    manifest = load_manifest(overlay_dir)
    entries = _entries(overlay_dir, manifest)
    if not (target / "vllm" / "__init__.py").is_file():
        raise StackError(f"{target}: no vllm package here; give the folder that "
                         "contains vllm/ (site-packages or a vLLM source tree)")
    want = manifest.get("vllm_version")
    have = _target_version(target)
    if have is not None and want is not None and have.split("+")[0] != want:
        raise StackError(f"{target}: holds vLLM {have}, the overlay is for vLLM "
                         f"{want}; nothing was written")
    source_tree = (target / "pyproject.toml").is_file()
    entries = [e for e in entries if source_tree or PurePosixPath(e.path).parts[0] == "vllm"]
    _recover_interrupted_install(target, entries, dry_run)
    todo, done, problems = [], [], []
    for e in entries:
        dest = target / e.path
        if not _inside(target, dest):
            problems.append(f"{e.path}: resolves outside the target (symlink)")
            continue
        current = sha256_bytes(dest.read_bytes()) if dest.is_file() else None
        if dest.exists() and not dest.is_file():
            problems.append(f"{e.path}: exists but is not a regular file")
        elif current == (None if e.patched_sha256 == DELETED else e.patched_sha256):
            done.append(e)
        elif current == (None if e.pristine_sha256 == ADDED else e.pristine_sha256):
            todo.append(e)
        else:
            expected = "absent" if e.pristine_sha256 == ADDED else e.pristine_sha256[:12]
            found = "absent" if current is None else current[:12]
            problems.append(f"{e.path}: expected pristine {expected}, found {found}")
    if problems:
        raise StackError(
            f"{target} does not match the overlay's pristine vLLM {want} files "
            "(wrong vLLM version, or already modified); nothing was written:\n  "
            + "\n  ".join(problems))
    if not todo:
        say(f"overlay: already installed ({len(done)} file(s) in place in {target})")
        return
    if dry_run:
        say(f"overlay: would install {len(todo)} file(s); {len(done)} already in place")
        return
    _Install(overlay_dir, target).run(todo)
    say(f"overlay: installed {len(todo)} file(s) into {target}"
        + (f"; {len(done)} were already in place" if done else ""))


def _leftovers(dest: Path, role: str) -> list[Path]:
    """The `_sibling` files of `dest` with `role` that a killed install left."""
    pattern = f".{glob.escape(dest.name)}.*.k3-{role}"
    return sorted(dest.parent.glob(pattern)) if dest.parent.is_dir() else []


def _sha256_or_none(path: Path) -> str | None:
    return sha256_bytes(path.read_bytes()) if path.is_file() and not path.is_symlink() else None


def _recover_interrupted_install(target: Path, entries: list[Entry], dry_run: bool) -> None:
    """Undo what an install that was killed (SIGKILL, power loss) between its
    renames left: staged `.k3-new` files are removed, and an original kept
    aside as `.k3-old` goes back where its file is missing. Then the install
    proceeds from a target whose files are each pristine or already patched.
    Only files named like `_sibling`'s are touched, and an original only when
    it has the manifest's pristine hash."""
    restored, removed, unknown = [], [], []
    for e in entries:
        dest = target / e.path
        staged = _leftovers(dest, "new")
        kept = _leftovers(dest, "old")
        if dry_run:
            unknown += staged + kept
            continue
        for path in staged:
            path.unlink()
            removed.append(path)
        for path in kept:
            digest = _sha256_or_none(path)
            if digest == e.pristine_sha256 and not os.path.lexists(dest):
                os.replace(path, dest)
                restored.append(dest)
            elif digest == e.pristine_sha256 or path.stat().st_size == 0:
                # The original whose replacement was already in place, or the
                # empty placeholder of a rename that never happened.
                path.unlink()
                removed.append(path)
            else:
                unknown.append(path)
    if restored or removed:
        say(f"overlay: an earlier install into {target} was interrupted; restored "
            f"{len(restored)} original file(s), removed {len(removed)} leftover file(s)")
    if unknown:
        warn(f"{target} holds file(s) that an interrupted install left: "
             + ", ".join(str(p) for p in unknown[:5])
             + ("" if not dry_run else "; the install (without --dry-run) tidies them up"))


class _Install:
    """Write every overlay file or none.

    Each new file is first written in full next to its target (the step that
    fails on a full disk), then all are swapped in by renames, the replaced
    files kept aside until the end. On any error the target is put back
    exactly as it was: swapped files restored, staged files and new folders
    removed.
    """

    def __init__(self, overlay_dir: Path, target: Path) -> None:
        self.overlay_dir, self.target = overlay_dir, target
        self.made_dirs: list[Path] = []
        self.staged: dict[Path, Path | None] = {}  # destination -> new file (None: delete)
        self.swapped: list[tuple[Path, Path | None]] = []  # destination, what it replaced

    def run(self, entries: list[Entry]) -> None:
        current = None
        try:
            for e in entries:
                current = e.path
                self._stage(e)
            for dest, new in self.staged.items():
                current = dest.relative_to(self.target).as_posix()
                self._swap(dest, new)
        except BaseException as e:  # an interrupt too: never leave half an overlay
            trouble = self._roll_back()
            if not isinstance(e, OSError):
                raise
            raise StackError(
                f"{self.target}: cannot write {current} ({e.strerror or e}); "
                + ("the target was left as it was, nothing installed. Fix that (disk space, "
                   "permissions) and run the command again." if not trouble else
                   f"and putting the target back failed too: {trouble}"))
        for _, replaced in self.swapped:
            if replaced:
                replaced.unlink()

    def _stage(self, e: Entry) -> None:
        dest = self.target / e.path
        if e.patched_sha256 == DELETED:
            self.staged[dest] = None
            return
        self._make_folders(dest.parent)
        new = _sibling(dest, "new")
        self.staged[dest] = new
        new.write_bytes(read_regular(self.overlay_dir / e.path, _REGENERATE))
        if dest.exists():
            shutil.copymode(dest, new)
        else:
            os.chmod(new, 0o644)

    def _swap(self, dest: Path, new: Path | None) -> None:
        replaced = None
        if os.path.lexists(dest):
            replaced = _sibling(dest, "old")
            try:
                os.replace(dest, replaced)
            except BaseException:
                replaced.unlink()  # the empty placeholder: `dest` was not moved
                raise
        self.swapped.append((dest, replaced))
        if new is not None:
            os.replace(new, dest)

    def _make_folders(self, folder: Path) -> None:
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for path in reversed(missing):
            path.mkdir()
            self.made_dirs.append(path)

    def _roll_back(self) -> str:
        """Put the target back as it was; return what could not be (empty if all went well)."""
        trouble = []
        for dest, replaced in reversed(self.swapped):
            try:
                if replaced:
                    os.replace(replaced, dest)
                elif dest.exists():
                    dest.unlink()
            except OSError as e:
                trouble.append(f"{dest} (the original is {replaced}): {e.strerror}")
        for new in self.staged.values():
            if new:
                new.unlink(missing_ok=True)
        for path in reversed(self.made_dirs):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        return "; ".join(trouble)


def _sibling(dest: Path, role: str) -> Path:
    """A new, empty hidden file next to `dest` (same file system: renames are atomic)."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=f".k3-{role}", dir=dest.parent)
    os.close(fd)
    return Path(name)
