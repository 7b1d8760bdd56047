"""The git repository in build/vllm: pristine release commit plus one commit per patch.

All commits the tooling makes use a fixed identity and dates taken from the
patches (or the release), so the same inputs always give the same commit ids.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scripts.common import Layout, StackError, discard, rel, run, say
from scripts.stack.pin import Pin

BRANCH = "stack"
TOOL_IDENTITY = {
    "GIT_COMMITTER_NAME": "vLLM patch stack",
    "GIT_COMMITTER_EMAIL": "patch-stack@vllm.invalid",
}
RELEASE_AUTHOR = {
    "GIT_AUTHOR_NAME": "vLLM release",
    "GIT_AUTHOR_EMAIL": "release@vllm.invalid",
}
# Build outputs of a python-only install; never part of the tree's history.
_EXCLUDES = """\
*.so
*.egg-info/
__pycache__/
*.py[cod]
/build/
/.deps/
.pytest_cache/
"""
# Packaging metadata of the sdist, not source.
_SKIP_FROM_RELEASE = ("vllm.egg-info",)


class DamagedRepo(StackError):
    """A repository whose objects, refs or index git cannot read."""


# What git says when the repository itself is damaged (not the command).
_DAMAGE = re.compile(
    r"object file \S+ is empty|loose object \S+ .*is corrupt|packed object \S+ .*is corrupt"
    r"|inflate: data stream error|unable to (?:read|unpack) [0-9a-f]{40}"
    r"|index file (?:smaller than expected|corrupt)|bad index file|bad signature 0x"
    r"|bad object (?:HEAD|[0-9a-f]{40})|packfile \S+ cannot be accessed"
    r"|appears to be broken|unable to parse object")


def git(tree: Path, *args: str, env: dict | None = None, check: bool = True,
        input: str | None = None, text: bool = True):
    """Run git in `tree`, and only there.

    Git looks for a repository in the parent folders when `tree` has none (or
    a damaged one); the project itself is one. The ceiling stops that search,
    so a command meant for build/vllm can never run on the project's history.
    A damaged repository is reported as such (DamagedRepo), whatever the
    command and even where the caller takes a failure as an answer.
    """
    ceiling = {"GIT_CEILING_DIRECTORIES": str(Path(tree).resolve().parent)}
    # A fixed committer: the machine may have no git identity (CI), and commit
    # ids must not depend on who runs the tooling.
    result = run(["git", "-C", str(tree), *args], env={**TOOL_IDENTITY, **ceiling, **(env or {})},
                 check=False, input=input, text=text)
    err = result.stderr if text else result.stderr.decode(errors="replace")
    if result.returncode == 128 and "not a git repository" in err and (tree / ".git").exists():
        raise DamagedRepo(damaged_message(tree, err.strip()))
    if result.returncode != 0 and (damage := _DAMAGE.search(err)):
        line = next(ln for ln in err.splitlines() if damage.group() in ln)
        raise DamagedRepo(damaged_message(tree, line.strip()))
    if check and result.returncode != 0:
        out = result.stdout if text else result.stdout.decode(errors="replace")
        raise StackError(f"command failed ({result.returncode}): git -C {tree} "
                         f"{' '.join(args)}\n{(err or out).strip()}")
    return result


def damaged_message(tree: Path, detail: str) -> str:
    where = rel(tree)
    return (f"{where}/.git is damaged ({detail.splitlines()[0]}), so what it holds cannot "
            f"be checked. To keep what is left, move {where} away; to delete it, run "
            "`make clean FORCE=1`. Then run `make apply`.")


def state_path(tree: Path) -> Path:
    return tree / ".git" / "k3-stack.json"


def read_state(tree: Path) -> dict:
    try:
        state = json.loads(state_path(tree).read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StackError(damaged_message(tree, f"{state_path(tree).name}: {e}"))
    if not isinstance(state, dict):
        raise StackError(damaged_message(tree, f"{state_path(tree).name} is not an object"))
    return state


def release_commit(layout: Layout) -> str:
    """The commit of the pristine release tag, which must be the one `make apply`
    imported: a tag moved elsewhere would make every diff against it wrong
    (the stack's files and tests, the overlay)."""
    tree = layout.tree
    state = read_state(tree)
    tag, imported = state["base_tag"], state.get("base_commit")
    commit = git(tree, "rev-parse", "-q", "--verify", f"{tag}^{{commit}}",
                 check=False).stdout.strip()
    if imported and commit != imported:
        where = rel(tree, layout)
        raise StackError(f"{where}: tag {tag} points at {commit[:12] or 'nothing'}, not at the "
                         f"release commit {imported[:12]} that make apply imported; put it "
                         f"back with `git -C {where} tag -f {tag} {imported}`")
    return commit


def write_state(tree: Path, **updates) -> None:
    state = {**read_state(tree), **updates}
    tmp = state_path(tree).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, state_path(tree))


def is_stack_repo(tree: Path) -> bool:
    return (tree / ".git").is_dir() and state_path(tree).exists()


def rebase_in_progress(tree: Path) -> str | None:
    """The release a `make rebase` in progress in `tree` moves to: from the state
    file, or from git's own rebase of a `rebase-<version>` branch."""
    if not is_stack_repo(tree):
        return None
    progress = read_state(tree).get("rebase")
    version = progress.get("version") if isinstance(progress, dict) else None
    head_name = tree / ".git" / "rebase-merge" / "head-name"
    ref = head_name.read_text().strip() if head_name.is_file() else ""
    if not isinstance(version, str) and ref.startswith("refs/heads/rebase-"):
        version = ref.removeprefix("refs/heads/rebase-")
    return version if isinstance(version, str) else "?" if progress else None


def refuse_during_rebase(layout: Layout, command: str) -> None:
    """`command` writes what a rebase in progress owns (build/vllm, pin.toml,
    patches/, vllm_overlay/): refuse, naming the only two ways on."""
    if (version := rebase_in_progress(layout.tree)) is None:
        return
    go_on = f"`make rebase VLLM_VERSION={version}`" if version != "?" else "`make rebase`"
    raise StackError(f"a rebase to vLLM {version} is in progress in {rel(layout.tree, layout)}, "
                     f"so `make {command}` would undo or miss it: finish it with {go_on}, or "
                     "give it up with `make rebase-abandon`; then run the command again")


def _unsafe(parts: tuple[str, ...]) -> bool:
    return not parts or ".." in parts or ".git" in parts


# More links followed for one path than this is a loop.
_MAX_LINK_HOPS = 40


def _resolve(parts: tuple[str, ...], links: dict[tuple[str, ...], str]) -> tuple[str, ...] | None:
    """Where `parts` (relative to the top folder) leads once every symlink of the
    archive exists, whatever order they are unpacked in; None if it leaves the tree."""
    resolved: list[str] = []
    pending = list(parts)
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return None
            resolved.pop()
            continue
        resolved.append(part)
        target = links.get(tuple(resolved))
        if target is not None:
            hops += 1
            if hops > _MAX_LINK_HOPS or target.startswith("/"):
                return None
            resolved.pop()
            pending[:0] = target.split("/")
    return tuple(resolved)


def release_members(archive: tarfile.TarFile, archive_name: str) -> list[tarfile.TarInfo]:
    """The members under the archive's single top folder, renamed relative to it.

    Every path, and every link target, must stay inside that folder and out of
    any .git folder (a .git/config could make later git commands run code),
    also when resolved through the archive's other links.
    """
    members = archive.getmembers()
    if not members:
        raise StackError(f"{archive_name}: empty archive")
    top = PurePosixPath(members[0].name).parts[0]
    kept = []
    for m in members:
        path = PurePosixPath(m.name)
        if path.is_absolute() or not path.parts or path.parts[0] != top:
            raise StackError(f"{archive_name}: member {m.name!r} lies outside the top "
                             f"folder {top!r}; refusing to unpack")
        parts = path.parts[1:]
        if not parts:
            continue
        if _unsafe(parts):
            raise StackError(f"{archive_name}: member {m.name!r} would be written outside "
                             "the source tree or into a .git folder; refusing to unpack")
        if m.islnk():
            target = PurePosixPath(m.linkname)
            if not target.parts or target.parts[0] != top or _unsafe(target.parts[1:]):
                raise StackError(f"{archive_name}: hard link {m.name!r} -> {m.linkname!r} "
                                 "points outside the source tree; refusing to unpack")
            m.linkname = str(PurePosixPath(*target.parts[1:]))
        elif not (m.isfile() or m.isdir() or m.issym()):
            raise StackError(f"{archive_name}: member {m.name!r} is not a plain file")
        kept.append((m.name, m))
        m.name = str(PurePosixPath(*parts))
    _check_links(archive_name, kept)
    return [m for _, m in kept]


def _check_links(archive_name: str, members: list[tuple[str, tarfile.TarInfo]]) -> None:
    """Refuse a member whose folder or link target resolves outside the tree."""
    links = {PurePosixPath(m.name).parts: m.linkname for _, m in members if m.issym()}
    for original, m in members:
        parts = PurePosixPath(m.name).parts
        folder = _resolve(parts[:-1], links)
        if m.issym():
            target = None if m.linkname.startswith("/") else \
                _resolve(parts[:-1] + tuple(m.linkname.split("/")), links)
        elif m.islnk():
            target = _resolve(PurePosixPath(m.linkname).parts, links)
        else:
            target = folder
        if folder is None or target is None or ".git" in folder + target:
            raise StackError(f"{archive_name}: member {original!r}"
                             + (f" -> {m.linkname!r}" if m.issym() or m.islnk() else "")
                             + " resolves outside the source tree (or into .git) once "
                             "the archive's links exist; refusing to unpack")


def unpack_release(sdist: Path, dest: Path) -> int:
    """Unpack the sdist's top folder into `dest`; return the newest mtime in it.

    The whole archive is read, so a damaged one is caught here: a bad header
    or a failed gzip check, never a base with files quietly missing. `dest`
    is a scratch folder that callers discard when this fails.
    """
    try:
        with gzip.open(sdist) as stream, tarfile.open(fileobj=stream, mode="r:") as archive:
            members = [m for m in release_members(archive, sdist.name)
                       if PurePosixPath(m.name).parts[0] not in _SKIP_FROM_RELEASE]
            archive.extractall(dest, members=members, filter="data")
            _read_to_the_end(archive, stream)  # after: only a forward seek
    except tarfile.FilterError as e:
        raise StackError(f"{sdist.name}: {e}; refusing to unpack")
    except (tarfile.ReadError, tarfile.HeaderError, gzip.BadGzipFile, EOFError,
            zlib.error) as e:
        raise StackError(
            f"{sdist.name} is damaged: it does not unpack completely ({e}). It matches "
            "the sha256 it was checked against, so the published file itself is bad: "
            "check pin.toml (or the index) before going on.")
    except (tarfile.TarError, OSError) as e:
        raise StackError(f"{sdist.name}: cannot unpack: {e}")
    if not (dest / "vllm").is_dir():
        raise StackError(f"{sdist.name}: no vllm/ package in its top folder")
    return max((int(m.mtime) for m in members), default=0)


def _read_to_the_end(archive: tarfile.TarFile, stream: gzip.GzipFile) -> None:
    """After the last member only end-of-archive zeros may follow, up to a gzip end
    whose checksum and length match. tarfile stops quietly at a damaged header and
    never reads the gzip trailer, so both are checked here."""
    stream.seek(archive.offset)
    while chunk := stream.read(1 << 20):
        if chunk.count(0) != len(chunk):
            raise tarfile.ReadError(f"a damaged member header at byte {archive.offset} "
                                    "of the tar stream")


def create_base(layout: Layout, pin: Pin, sdist: Path, dest: Path | None = None) -> None:
    """Make `dest` (build/vllm) a git repo whose first commit is the pristine release."""
    dest = dest or layout.tree
    layout.build_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-unpacking-", dir=layout.build_dir))
    try:
        say(f"unpacking {sdist.name} into {rel(dest, layout)}")
        newest = unpack_release(sdist, tmp)
        git(tmp, "init", "-q", "-b", BRANCH)
        git(tmp, "config", "gc.auto", "0")  # no background repacking of a build tree
        (tmp / ".git" / "info" / "exclude").write_text(_EXCLUDES)
        git(tmp, "add", "-A", "-f")
        tree_id = git(tmp, "write-tree").stdout.strip()
        commit = _commit_release(tmp, pin, tree_id, newest, parent=None)
        git(tmp, "reset", "-q", commit)
        git(tmp, "tag", pin.base_tag, commit)
        write_state(tmp, base_sdist_sha256=pin.sdist.sha256, base_tag=pin.base_tag,
                    base_commit=commit, status="base")
        # Only a complete repository ever appears at build/vllm.
        if dest.exists():
            discard(dest)  # callers pass only scratch repositories (check/drift bases)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def import_release(layout: Layout, pin: Pin, sdist: Path, parent: str | None) -> str:
    """Commit another release into build/vllm (as a child of `parent`); tag it.

    With no parent the commit is the same as `create_base` makes: the same
    inputs give the same commit id, whichever way the base was built.
    """
    tree = layout.tree
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-unpacking-", dir=layout.build_dir))
    fd, index = tempfile.mkstemp(prefix="k3-release-index-")
    os.close(fd)
    os.unlink(index)
    try:
        say(f"unpacking {sdist.name}")
        newest = unpack_release(sdist, tmp)
        env = {"GIT_INDEX_FILE": index, "GIT_WORK_TREE": str(tmp)}
        git(tree, "add", "-A", "-f", ".", env=env)
        tree_id = git(tree, "write-tree", env=env).stdout.strip()
        commit = _commit_release(tree, pin, tree_id, newest, parent=parent)
        git(tree, "tag", "-f", pin.base_tag, commit)
        return commit
    finally:
        shutil.rmtree(tmp)
        if os.path.exists(index):
            os.unlink(index)


def _commit_release(repo: Path, pin: Pin, tree_id: str, mtime: int,
                    parent: str | None) -> str:
    date = f"{mtime} +0000"
    env = {**RELEASE_AUTHOR, **TOOL_IDENTITY,
           "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    message = (f"vLLM {pin.version} release\n\nUnpacked from {pin.sdist.filename} "
               f"(sha256 {pin.sdist.sha256}), upstream commit {pin.commit}.\n")
    args = ["commit-tree", tree_id, "-F", "-"] + (["-p", parent] if parent else [])
    return git(repo, *args, env=env, input=message).stdout.strip()


def release_commit_id(tree: Path, rev: str) -> str | None:
    """The upstream commit a release names in its vllm/_version.py."""
    text = git(tree, "show", f"{rev}:vllm/_version.py", check=False).stdout
    m = re.search(r"commit_id = ['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else None


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD").stdout.strip()


def am_in_progress(tree: Path) -> bool:
    return (tree / ".git" / "rebase-apply").exists()


def remove_stale_git_locks(tree: Path) -> list[str]:
    """Remove the lock files a killed git left in build/vllm; return their names.

    Only for a git the tooling started and that was killed: callers hold the
    project lock and have the state file's word that its own git was running.
    """
    git_dir = tree / ".git"
    stale = [*git_dir.glob("*.lock"), *(git_dir / "refs").rglob("*.lock")]
    for path in stale:
        path.unlink()
    return [path.relative_to(tree).as_posix() for path in stale]


def dirty_files(tree: Path) -> list[str]:
    # -z: paths as they are (no quoting), each entry ended by NUL; a rename
    # entry is followed by its source path.
    fields = git(tree, "status", "--porcelain", "-z", "--untracked-files=all").stdout.split("\0")
    paths, rest = [], iter(fields)
    for entry in rest:
        if entry:
            paths.append(entry[3:])
            if entry[0] in "RC":
                next(rest, None)
    return paths


def ignored_files(tree: Path) -> list[str]:
    """Untracked files that git ignores (vLLM's .gitignore and the tooling's
    excludes), each file listed, not their folders."""
    fields = git(tree, "status", "--porcelain", "-z", "--ignored",
                 "--untracked-files=all").stdout.split("\0")
    return [entry[3:] for entry in fields if entry.startswith("!! ")]


def record_build_outputs(tree: Path, before: dict[str, list[int]]) -> None:
    """Note in the state file the ignored files a build wrote (new, or changed
    since `before`, ignored_stats before it ran): `make clean` deletes those
    without asking while they are as the build left them."""
    after = ignored_stats(tree)
    made = {path: stat for path, stat in after.items() if before.get(path) != stat}
    kept = {path: stat for path, stat in read_state(tree).get("build_outputs", {}).items()
            if after.get(path) == stat}
    write_state(tree, build_outputs={**kept, **made})


def build_outputs(tree: Path) -> set[str]:
    """The ignored files a build wrote (record_build_outputs) that nobody has
    changed since: their size and modification time are as it left them."""
    recorded = read_state(tree).get("build_outputs", {})
    return {path for path, stat in recorded.items() if _stat(tree / path) == stat}


def ignored_stats(tree: Path) -> dict[str, list[int]]:
    """Each ignored file of `tree`, with its size and modification time."""
    found = {path: _stat(tree / path) for path in ignored_files(tree)}
    return {path: stat for path, stat in found.items() if stat is not None}


def _stat(path: Path) -> list[int] | None:
    try:
        stat = os.lstat(path)
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


@dataclass(frozen=True)
class Worktree:
    path: Path
    branch: str | None  # None: a detached HEAD
    missing: bool  # its folder is gone (moved, or deleted without `git worktree remove`)


def other_worktrees(tree: Path) -> list[Worktree]:
    """The worktrees of `tree` other than itself, from `git worktree list -z`
    (paths may hold any byte, newlines included)."""
    out = git(tree, "worktree", "list", "--porcelain", "-z").stdout
    found = []
    # One record per worktree, its lines ended by NUL, the record by one more NUL.
    for record in out.split("\0\0")[1:]:  # the first is `tree` itself
        fields = dict(line.partition(" ")[::2] for line in record.split("\0") if line)
        if "worktree" not in fields:
            continue
        branch = fields.get("branch", "").removeprefix("refs/heads/") or None
        path = Path(fields["worktree"])
        found.append(Worktree(path, branch, "prunable" in fields or not path.exists()))
    return found


def commits_since(tree: Path, base: str) -> list[str]:
    out = git(tree, "rev-list", "--reverse", "--topo-order", f"{base}..HEAD").stdout
    return out.split()


def has_merges(tree: Path, base: str) -> bool:
    return bool(git(tree, "rev-list", "--merges", f"{base}..HEAD").stdout.strip())
