"""The git repository in build/vllm: pristine release commit plus one commit per patch.

All commits the tooling makes use a fixed identity and dates taken from the
patches (or the release), so the same inputs always give the same commit ids.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from scripts.common import Layout, StackError, rel, run, say
from scripts.pin import Pin

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


def git(tree: Path, *args: str, env: dict | None = None, check: bool = True,
        input: str | None = None):
    # A fixed committer: the machine may have no git identity (CI), and commit
    # ids must not depend on who runs the tooling.
    return run(["git", "-C", str(tree), *args], env={**TOOL_IDENTITY, **(env or {})},
               check=check, input=input)


def state_path(tree: Path) -> Path:
    return tree / ".git" / "k3-stack.json"


def read_state(tree: Path) -> dict:
    try:
        return json.loads(state_path(tree).read_text())
    except FileNotFoundError:
        return {}


def write_state(tree: Path, **updates) -> None:
    state = {**read_state(tree), **updates}
    tmp = state_path(tree).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, state_path(tree))


def is_stack_repo(tree: Path) -> bool:
    return (tree / ".git").is_dir() and state_path(tree).exists()


def _unsafe(parts: tuple[str, ...]) -> bool:
    return not parts or ".." in parts or ".git" in parts


def release_members(archive: tarfile.TarFile, archive_name: str) -> list[tarfile.TarInfo]:
    """The members under the archive's single top folder, renamed relative to it.

    Every path, and every link target, must stay inside that folder and out of
    any .git folder (a .git/config could make later git commands run code).
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
        if m.issym():
            target = PurePosixPath(os.path.normpath(str(PurePosixPath(*parts).parent
                                                          / m.linkname)))
            if PurePosixPath(m.linkname).is_absolute() or _unsafe(target.parts):
                raise StackError(f"{archive_name}: link {m.name!r} -> {m.linkname!r} "
                                 "points outside the source tree; refusing to unpack")
        elif m.islnk():
            target = PurePosixPath(m.linkname)
            if not target.parts or target.parts[0] != top or _unsafe(target.parts[1:]):
                raise StackError(f"{archive_name}: hard link {m.name!r} -> {m.linkname!r} "
                                 "points outside the source tree; refusing to unpack")
            m.linkname = str(PurePosixPath(*target.parts[1:]))
        elif not (m.isfile() or m.isdir()):
            raise StackError(f"{archive_name}: member {m.name!r} is not a plain file")
        m.name = str(PurePosixPath(*parts))
        kept.append(m)
    return kept


def unpack_release(sdist: Path, dest: Path) -> int:
    """Unpack the sdist's top folder into `dest`; return the newest mtime in it."""
    try:
        with tarfile.open(sdist) as archive:
            members = [m for m in release_members(archive, sdist.name)
                       if PurePosixPath(m.name).parts[0] not in _SKIP_FROM_RELEASE]
            archive.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise StackError(f"{sdist.name}: cannot unpack: {e}")
    if not (dest / "vllm").is_dir():
        raise StackError(f"{sdist.name}: no vllm/ package in its top folder")
    return max((int(m.mtime) for m in members), default=0)


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
            shutil.rmtree(dest)  # callers pass only trees proven safe to replace
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def import_release(layout: Layout, pin: Pin, sdist: Path, parent: str) -> str:
    """Commit another release into build/vllm as a child of `parent`; tag it."""
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


def dirty_files(tree: Path) -> list[str]:
    out = git(tree, "status", "--porcelain", "--untracked-files=all").stdout
    return [line[3:] for line in out.splitlines()]


def commits_since(tree: Path, base: str) -> list[str]:
    out = git(tree, "rev-list", "--reverse", "--topo-order", f"{base}..HEAD").stdout
    return out.split()


def has_merges(tree: Path, base: str) -> bool:
    return bool(git(tree, "rev-list", "--merges", f"{base}..HEAD").stdout.strip())
