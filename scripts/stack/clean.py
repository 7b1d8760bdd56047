"""`make clean`: remove what the tooling built, keeping the download cache.

build/vllm is deleted only when nothing in it exists nowhere else, or when the
user says so with `make clean FORCE=1` (then each piece is named as it goes).
Kept are: uncommitted changes, ignored files that neither the release nor the
tooling made, an unfinished `git am`, stashes, other worktrees (also one whose
folder was moved), and every commit, on any branch or only in the reflog,
whose work is in no saved patch: neither in patches/ nor in the project's git
history. Anything in build/ that the tooling did not make is left alone.
"""

from __future__ import annotations

import hashlib
import zipfile
import zlib
from pathlib import Path

from scripts.common import (
    SCRATCH_PREFIXES,
    Layout,
    StackError,
    discard,
    rel,
    run,
    say,
    shown,
    warn,
)
from scripts.stack.apply import recover_interrupted_apply, render_commit
from scripts.stack.gitrepo import (
    RELEASE_AUTHOR,
    am_in_progress,
    build_outputs,
    dirty_files,
    git,
    ignored_files,
    is_stack_repo,
    other_worktrees,
)
from scripts.testing.prefixes import is_prefix_worktree

# What the tooling makes in build/ and can make again (build/vllm aside).
_GENERATED = ("check-base", "drift-base", "prefix-tree", "prefix-trees", "test-results",
              "export", "gpubench", "wheel-site", "rocm-source-context", "amd-resources",
              "mutate")
# Results only the hardware can make again: kept, and said so.
_RUNBOOK_RESULTS = "runbook-"
_SHOWN = 10  # items of one kind listed before "... and N more"


def force_typed(make_pid: int) -> bool:
    """Whether `FORCE=1` is on the command line of make (process `make_pid`).

    Make gives a variable from MAKEFLAGS (the environment, a parent make) the
    same origin as one typed on its command line, so only make's own argv
    tells them apart.
    """
    try:
        argv = Path(f"/proc/{make_pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        warn("FORCE=1 is ignored: make's command line cannot be read here, so it is not "
             "known whether FORCE was typed; run `python3 -m scripts clean --force`")
        return False
    if b"FORCE=1" in argv[1:]:
        return True
    warn("FORCE=1 is ignored: it reached make through MAKEFLAGS or the environment (a "
         "parent make, say), not its command line; it counts only when typed, as in "
         "`make clean FORCE=1`")
    return False


def clean(layout: Layout, force: bool = False) -> None:
    if is_stack_repo(layout.tree):
        _clean_tree(layout, force)
    if layout.build_dir.exists():
        for path in sorted(layout.build_dir.iterdir()):
            if path.name in _GENERATED or path.name.startswith(SCRATCH_PREFIXES):
                _remove(layout, path)
            elif path.name.startswith(_RUNBOOK_RESULTS) and path.is_dir():
                warn(f"kept {rel(path, layout)}: hardware runbook results, which only the "
                     "hardware can make again; delete it yourself when they are saved")
            else:
                warn(f"left {rel(path, layout)} alone: not made by this tooling")
        if not any(layout.build_dir.iterdir()):
            layout.build_dir.rmdir()
    for venv in (layout.venv, layout.lint_venv):
        if venv.exists():
            _remove(layout, venv)
    say(f"kept the download cache {rel(layout.cache_dir, layout)}/")


def _clean_tree(layout: Layout, force: bool) -> None:
    where = rel(layout.tree, layout)
    try:
        doomed = unsaved_work(layout)
    except StackError as e:  # a damaged repository: nothing in it can be checked
        if not force:
            raise
        doomed = [str(e).split("\n")[0]]
    if doomed and not force:
        raise StackError(
            f"`make clean` would delete work that exists only in {where}:\n  "
            + "\n  ".join(doomed)
            + f"\nSave it elsewhere first (`git -C {where} bundle create ../vllm-work.bundle "
            f"--all` keeps branches and stashes; `git -C {where} format-patch -1 <commit>` "
            "one commit), or delete it with `make clean FORCE=1`.")
    if doomed:
        say(f"FORCE=1: deleting work that exists only in {where}:\n  " + "\n  ".join(doomed))
    _remove(layout, layout.tree)


def unsaved_work(layout: Layout) -> list[str]:
    """What deleting build/vllm would lose, one line per piece; empty if nothing."""
    tree = layout.tree
    recover_interrupted_apply(layout)
    work = []
    if am_in_progress(tree):
        work.append("an unfinished `git am` (a rebase, or an edit by hand)")
    if dirty := dirty_files(tree):
        work.append("uncommitted changes: " + _listed(dirty))
    if ignored := _ignored_work(layout):
        work.append("ignored files that neither the release nor the tooling made: "
                    + _listed(ignored))
    work += [shown(line) for line in
             git(tree, "stash", "list", "-z", "--format=%gd: %gs").stdout.split("\0") if line]
    work += _other_worktrees(layout)
    work += _unsaved_commits(layout)
    return work


def _listed(items: list[str]) -> str:
    more = f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(shown(item) for item in items[:_SHOWN]) + more


def _ignored_work(layout: Layout) -> list[str]:
    """Ignored files in build/vllm that the tooling did not make, so someone's
    work, whatever their names (a `.so`, a `build/` or `.deps/` of one's own
    match the tooling's excludes all the same). Made by the tooling, and made
    again by it: what `make build` wrote there, unchanged since
    (gitrepo.build_outputs); a copy of a file of the pinned wheel; and the
    bytecode Python caches for a source beside it."""
    tree = layout.tree
    made = build_outputs(tree)
    candidates = [p for p in ignored_files(tree) if p not in made and not _bytecode_cache(tree, p)]
    if not candidates:
        return []
    from_wheel = _wheel_members(layout)
    return [p for p in candidates if not _same_file(tree / p, from_wheel.get(p))]


def _bytecode_cache(tree: Path, path: str) -> bool:
    """`pkg/__pycache__/mod.<tag>.pyc` of a `pkg/mod.py` that is there."""
    parts = path.split("/")
    if len(parts) < 2 or parts[-2] != "__pycache__" or not parts[-1].endswith(".pyc"):
        return False
    source = tree.joinpath(*parts[:-2], parts[-1].split(".", 1)[0] + ".py")
    return source.is_file()


def _wheel_members(layout: Layout) -> dict[str, zipfile.ZipInfo]:
    """The files of the pinned wheel in the download cache (none if it is not there)."""
    from scripts.stack.fetch import cached_path
    from scripts.stack.pin import load_pin

    try:
        wheel = cached_path(layout, load_pin(layout.pin_file).wheel)
        with zipfile.ZipFile(wheel) as archive:
            return {info.filename: info for info in archive.infolist()}
    except (StackError, OSError, zipfile.BadZipFile):
        return {}  # then the copies of its files count as work: better kept than lost


def _same_file(path: Path, member: zipfile.ZipInfo | None) -> bool:
    if member is None or path.is_symlink() or path.stat().st_size != member.file_size:
        return False
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc == member.CRC


def _other_worktrees(layout: Layout) -> list[str]:
    """Worktrees of build/vllm other than the tooling's own: their index and
    branch live in build/vllm, also when their folder was moved."""
    found = []
    for worktree in other_worktrees(layout.tree):
        if is_prefix_worktree(layout, worktree.path):
            continue
        branch = shown(worktree.branch) if worktree.branch else "a detached HEAD"
        where = shown(str(worktree.path))
        if worktree.missing:
            found.append(f"worktree {where} (on {branch}), whose folder is missing: if it was "
                         "moved, its index and HEAD still live in build/vllm (`git worktree "
                         "repair <new path>` records the move); if it was deleted, `git -C "
                         f"{rel(layout.tree, layout)} worktree prune` forgets it")
        else:
            found.append(f"worktree {where} (on {branch})")
    return found


def _unsaved_commits(layout: Layout) -> list[str]:
    """Commits reachable from any ref or reflog whose work no saved patch holds.

    A commit is saved when its export is a patch file that patches/ holds or the
    project's git history ever held, or when its tree equals the tree of a saved
    commit (a fixup folded into its patch, say). Release commits come from the
    cache or the index again; stash commits are listed as stashes.
    """
    tree = layout.tree
    algorithm, saved_patches = _saved_patch_ids(layout)
    stashed = set()
    for line in git(tree, "stash", "list", "--format=%H %P").stdout.splitlines():
        stash, _head, *parts = line.split()  # the stash, the commit it was made on, its parts
        stashed.update([stash, *parts])
    release = f"{RELEASE_AUTHOR['GIT_AUTHOR_NAME']} <{RELEASE_AUTHOR['GIT_AUTHOR_EMAIL']}>"
    log = git(tree, "log", "-z", "--all", "--reflog", "--format=%H%x00%T%x00%an <%ae>%x00%h %s")
    fields = log.stdout.split("\0")
    saved_trees, unknown = set(), []
    for commit, tree_id, author, title in zip(*[iter(fields)] * 4):
        if commit in stashed or author == release:
            continue
        if _blob_id(render_commit(layout, commit), algorithm) in saved_patches:
            saved_trees.add(tree_id)
        else:
            unknown.append((commit, tree_id, title))
    lost = [(commit, title) for commit, tree_id, title in unknown if tree_id not in saved_trees]
    listed = [f"commit {shown(title)} ({_holders(tree, commit)})"
              for commit, title in lost[:_SHOWN]]
    return listed + ([f"... and {len(lost) - _SHOWN} more commits"] if len(lost) > _SHOWN
                     else [])


def _holders(tree: Path, commit: str) -> str:
    refs = git(tree, "for-each-ref", "--contains", commit, "--format=%(refname:short)",
               "refs/heads", "refs/tags").stdout.splitlines()
    return f"on {', '.join(map(shown, refs))}" if refs else "only in the reflog"


def _saved_patch_ids(layout: Layout) -> tuple[str, set[str]]:
    """The git object ids of every patch file in patches/ or in the project's history."""
    root = layout.root
    found = run(["git", "-C", str(root), "rev-parse", "--show-object-format"], check=False)
    in_git = found.returncode == 0
    algorithm = found.stdout.strip() if in_git else "sha1"
    ids = {_blob_id(p.read_bytes(), algorithm) for p in layout.patches_dir.glob("*.patch")}
    if in_git:
        # Every version of every file under patches/ that a commit or the index holds.
        history = run(["git", "-C", str(root), "log", "--all", "--format=", "--raw",
                       "--no-abbrev", "--no-renames", "--", "patches/"]).stdout
        for line in history.splitlines():  # ":100644 100644 <old id> <new id> M\tpath"
            ids.update(line.split("\t")[0].split()[2:4])
        staged = run(["git", "-C", str(root), "ls-files", "-s", "--", "patches/"]).stdout
        ids.update(line.split()[1] for line in staged.splitlines())
    return algorithm, ids


def _blob_id(data: bytes, algorithm: str) -> str:
    """The id git gives a file with these bytes."""
    return hashlib.new(algorithm, b"blob %d\0" % len(data) + data).hexdigest()


def _remove(layout: Layout, path: Path) -> None:
    discard(path)
    say(f"removed {rel(path, layout)}/")
