"""`make rebase VLLM_VERSION=x.y.z`: move the stack onto another vLLM release.

A thin layer over git's own rebase. The new release is committed in
build/vllm as a child of the old one (tag `vllm-<new>`); branch
`rebase-<new>`, started at `stack`, is moved onto it with `git rebase --onto`.
Git keeps the rebase's state (which patch is next, where it stopped) and
survives kills; `rerere` records every resolution, so a give-up and a restart
reuse them. What this module reports comes from git. What it must remember
beyond git (the new pin, what the project's files held when it began, the git
command it was running) is in the state file, and is checked against git
before anything is done.

Only when git's rebase is done are pin.toml, patches/ and vllm_overlay/
replaced, together: staged in full, then moved into place under a journal
that the next run completes after a kill. The old stack stays as branch
`stack-<old version>`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from scripts.common import Layout, StackError, discard, rel, say
from scripts.stack import apply, overlay
from scripts.stack.fetch import IndexUnreachable, ensure_artifact, find_in_index, index_needed
from scripts.stack.gitrepo import (
    BRANCH,
    TOOL_IDENTITY,
    dirty_files,
    git,
    head,
    import_release,
    is_stack_repo,
    read_state,
    release_commit_id,
    remove_stale_git_locks,
    rebase_in_progress,
    write_state,
)
from scripts.stack.pin import Artifact, Pin, check_version, load_pin, render_pin
from scripts.stack.series import read_series, series_digest, series_names, series_text

# A new release's files may be at most this many times the size of the pinned
# ones: their size comes from the index, which must not be able to fill the disk.
_MAX_GROWTH = 4
# What the finish writes, relative to the project root, all or nothing.
_PROJECT_FILES = ("pin.toml", "patches", "vllm_overlay")
# git's rebase, run without an editor; `rerere` replays a recorded resolution.
_GIT_REBASE_ENV = {"GIT_EDITOR": ":", "GIT_SEQUENCE_EDITOR": ":"}
_RERERE = ["-c", "rerere.enabled=true", "-c", "rerere.autoUpdate=true",
           # git comments out its notes on a conflict with this; "#" would strip
           # a patch message's own "## Purpose" headings too.
           "-c", "core.commentChar=auto"]


def rebase(layout: Layout, version: str) -> None:
    check_version(version, "VLLM_VERSION", "give a release, as in "
                  "`make rebase VLLM_VERSION=0.34.0`")
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    progress = _progress(layout)
    if progress and progress["version"] != version:
        raise StackError(f"a rebase to vLLM {progress['version']} is in progress in "
                         f"{rel(tree, layout)}; finish it with `make rebase VLLM_VERSION="
                         f"{progress['version']}` or give it up with `make rebase-abandon`")
    if progress and progress.get("git") == "abandon":
        raise StackError("the last `make rebase-abandon` was killed; run "
                         "`make rebase-abandon` again to finish giving the rebase up")
    if progress is None:
        progress = _start(layout, version)
    elif progress.get("finishing"):
        _complete_finish(layout, progress)
        return
    elif progress.get("git"):
        _recover_killed_git(layout, progress)
    _check_against_git(layout, progress)
    _drive(layout, progress)
    _finish(layout, progress)


# --- what the tool remembers, checked against git ------------------------------


def _progress(layout: Layout) -> dict | None:
    """The state file's rebase entry, or None; one line if it is damaged."""
    progress = read_state(layout.tree).get("rebase")
    if progress is None:
        return None
    keys = {"version": str, "pin": dict, "old_base": str, "old_branch": str,
            "release": str, "project": dict}
    if not isinstance(progress, dict) or any(
            not isinstance(progress.get(k), t) for k, t in keys.items()):
        raise StackError(f"{rel(layout.tree, layout)}/.git/k3-stack.json: its rebase entry "
                         "is damaged; give the rebase up with `make rebase-abandon` (git's "
                         "own state is kept as a branch), then start it again")
    return progress


def _save(layout: Layout, progress: dict) -> None:
    write_state(layout.tree, rebase=progress)


def _rebase_dir(tree: Path) -> Path:
    return tree / ".git" / "rebase-merge"


def _current_branch(tree: Path) -> str:
    return git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()


def rebase_branch(version: str) -> str:
    return f"rebase-{version}"


def _check_against_git(layout: Layout, progress: dict) -> None:
    """Refuse, naming the next step, when git's state is not the rebase's."""
    tree, where, version = layout.tree, rel(layout.tree, layout), progress["version"]
    branch, tag = rebase_branch(version), progress["pin"]["base_tag"]
    go_on = (f"then run `make rebase VLLM_VERSION={version}` (or give the rebase up "
             "with `make rebase-abandon`)")
    commit = git(tree, "rev-parse", "-q", "--verify", f"{tag}^{{commit}}",
                 check=False).stdout.strip()
    if commit != progress["release"]:
        raise StackError(f"{where}: tag {tag} is not the release commit this rebase imported; "
                         f"put it back with `git -C {where} tag -f {tag} "
                         f"{progress['release']}`, {go_on}")
    if git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{branch}",
           check=False).returncode != 0:
        raise StackError(f"{where} has no branch {branch}, which held the rebase to vLLM "
                         f"{version}; give it up with `make rebase-abandon`")
    if (tree / ".git" / "rebase-apply").exists():
        raise StackError(f"a `git am` is in progress in {where}; abort it "
                         f"(`git -C {where} am --abort`), {go_on}")
    if _rebase_dir(tree).is_dir():
        rebasing = (_rebase_dir(tree) / "head-name").read_text().strip()
        if rebasing != f"refs/heads/{branch}":
            raise StackError(f"a `git rebase` of {rebasing} is in progress in {where}, not "
                             f"the rebase of {branch}; finish or abort it (`git -C {where} "
                             f"rebase --abort`), {go_on}")
    elif (on := _current_branch(tree)) != branch:
        raise StackError(f"{where} is on {on or 'a detached HEAD'}, not on branch {branch} "
                         f"where the rebase to vLLM {version} is: `git -C {where} checkout "
                         f"{branch}`, {go_on}")


# --- start ------------------------------------------------------------------------


def _start(layout: Layout, version: str) -> dict:
    old = load_pin(layout.pin_file)
    if version == old.version:
        raise StackError(f"the stack is already on vLLM {version} (pin.toml): nothing to do")
    tree = layout.tree
    apply.guard_tree(layout, "`make rebase`")
    old_base = read_state(tree)["base_tag"]
    # The finish replaces patches/: it must hold the stack, and nothing else edited.
    apply.refuse_overwriting_edits(layout, apply.rendered_stack(layout, old_base))
    _refuse_resetting_work(layout, version)
    new = pin_for(old, version)
    sdist = ensure_artifact(layout, new.project, new.sdist)
    release = import_release(layout, new, sdist, parent=old_base)
    new = Pin(new.version, release_commit_id(tree, release) or "unknown",
              new.base_tag, new.sdist, new.wheel)
    progress = {"version": version, "pin": _pin_dict(new), "old_base": old_base,
                "old_branch": f"{BRANCH}-{old.version}", "release": release,
                "project": _project_digests(layout), "git": "start"}
    _save(layout, progress)  # from here a kill is undone by the next run
    git(tree, "branch", "-f", progress["old_branch"], BRANCH)
    git(tree, "checkout", "-q", "-B", rebase_branch(version), BRANCH)
    # Recorded resolutions are reused when the same conflict comes back.
    git(tree, "config", "rerere.enabled", "true")
    git(tree, "config", "rerere.autoUpdate", "true")
    progress["git"] = None
    _save(layout, progress)
    say(f"rebasing {len(read_series(layout))} patch(es) from vLLM {old.version} onto "
        f"{version} with `git rebase` (old stack kept as branch {progress['old_branch']})")
    return progress


def _commits_only_on(tree: Path, branch: str) -> list[str]:
    """The commits `branch` holds that no other branch or tag reaches."""
    ref = f"refs/heads/{branch}"
    if git(tree, "rev-parse", "-q", "--verify", ref, check=False).returncode != 0:
        return []
    # (--exclude takes a branch's name without refs/heads/ before --branches)
    return git(tree, "rev-list", ref, "--not", f"--exclude={branch}", "--branches",
               "--tags").stdout.split()


def _refuse_resetting_work(layout: Layout, version: str) -> None:
    """A branch left by an earlier rebase (given up by hand) may hold resolved
    patches: starting again would reset it and leave them to the reflog."""
    tree, where, branch = layout.tree, rel(layout.tree, layout), rebase_branch(version)
    if not (commits := _commits_only_on(tree, branch)):
        return
    newest = git(tree, "log", "-1", "--format=%s", commits[0]).stdout.strip()
    raise StackError(
        f"branch {branch} in {where} holds {len(commits)} commit(s) of an earlier rebase "
        f"to vLLM {version} (the newest: {newest!r}) that no other branch has; a new "
        f"rebase would reset it. Keep them under another name (`git -C {where} branch -m "
        f"{branch} <name>`) or delete the branch (`git -C {where} branch -D {branch}`), "
        f"then run `make rebase VLLM_VERSION={version}` again.")


def pin_for(old: Pin, version: str) -> Pin:
    """The pin of `version`: same artifact kinds, sizes and hashes from the index."""
    def artifact(old_art: Artifact) -> Artifact:
        filename = old_art.filename.replace(old.version, version)
        try:
            found = find_in_index(old.project, filename)
        except IndexUnreachable as e:
            raise index_needed(f"look up vLLM {version}'s files and their sha256", e)
        if not (found.sha256 and found.size):
            raise StackError(f"the index gives no size/sha256 for {filename}; "
                             "write the new pin.toml by hand and run `make apply`")
        if found.size > _MAX_GROWTH * old_art.size:
            raise StackError(
                f"the index lists {filename} at {found.size / 1e6:.1f} MB, more than "
                f"{_MAX_GROWTH} times larger than the pinned {old_art.filename} "
                f"({old_art.size / 1e6:.1f} MB); refusing to download it. If that size is "
                "right, write the new pin.toml by hand and run `make apply`.")
        return Artifact(filename, found.size, found.sha256)

    return Pin(version, "unknown", f"vllm-{version}", artifact(old.sdist), artifact(old.wheel))


# --- driving git's rebase ---------------------------------------------------------------


def _drive(layout: Layout, progress: dict) -> None:
    """Run git's rebase until it is done or stops for the user: start it, go on
    after a stop (the user ran `make rebase` again), and fold `fixup!` commits
    made during it. A stop that `rerere` resolved in full is gone on from."""
    tree, new_base = layout.tree, progress["pin"]["base_tag"]
    gone_on_from: set[str] = set()
    while True:
        if _rebase_dir(tree).is_dir():
            _refuse_unfinished_stop(layout, progress)
            position = _position(tree)
            if position in gone_on_from:  # went on from here in this run, and stopped again
                raise _stop(layout, progress, stuck=True)
            gone_on_from.add(position)
            git(tree, "rerere", check=False)  # a kill inside git keeps the resolution
            args = ["rebase", "--continue"]
        elif not _is_ancestor(tree, new_base, "HEAD"):
            args = ["rebase", "--committer-date-is-author-date", "--onto", new_base,
                    progress["old_base"]]
        elif fixups := _fixup_commits(tree, new_base):
            say(f"  folding {len(fixups)} commit(s) made during the rebase into their "
                f"patches: {', '.join(fixups)}")
            args = ["rebase", "-i", "--autosquash", "--committer-date-is-author-date",
                    new_base]
        else:
            return
        before = _position(tree) if _rebase_dir(tree).is_dir() else None
        result = _run_git(layout, progress, args)
        if result.returncode == 0:
            continue
        if _rebase_dir(tree).is_dir() and (_unmerged(tree) or _in_the_way(tree)):
            raise _stop(layout, progress)
        if not _rebase_dir(tree).is_dir() or _position(tree) == before:
            raise _git_refused(layout, progress, args, result.stdout + result.stderr)
        # git stopped at a new pick with nothing left unmerged: rerere resolved it all.
        say(f"  {_stopped_patch(tree)}: reused the recorded resolution of the same conflict")


def _run_git(layout: Layout, progress: dict, args: list[str]):
    """Run git's rebase, with a mark in the state file while it runs: after a
    kill inside it the next run undoes what it left (_recover_killed_git)."""
    progress["git"] = args[1]
    _save(layout, progress)
    result = git(layout.tree, *_RERERE, *args, env=_GIT_REBASE_ENV, check=False)
    progress["git"] = None
    _save(layout, progress)
    return result


def _is_ancestor(tree: Path, ancestor: str, rev: str) -> bool:
    return git(tree, "merge-base", "--is-ancestor", ancestor, rev, check=False).returncode == 0


def _fixup_commits(tree: Path, base: str) -> list[str]:
    subjects = git(tree, "log", "--reverse", "--format=%s", f"{base}..HEAD").stdout
    return [s for s in subjects.splitlines() if s.startswith(("fixup! ", "squash! ", "amend! "))]


def _unmerged(tree: Path) -> list[str]:
    return git(tree, "diff", "--name-only", "-z", "--diff-filter=U").stdout.split("\0")[:-1]


def _position(tree: Path) -> str:
    """Where git's rebase is: the number of its todo lines done."""
    return (_rebase_dir(tree) / "msgnum").read_text().strip() \
        if (_rebase_dir(tree) / "msgnum").exists() else "0"


def _stopped_pick(tree: Path) -> str | None:
    return git(tree, "rev-parse", "-q", "--verify", "REBASE_HEAD",
               check=False).stdout.strip() or None


def _stopped_patch(tree: Path) -> str:
    pick = _stopped_pick(tree)
    subject = git(tree, "log", "-1", "--format=%s", pick).stdout.strip() if pick else ""
    return apply.patch_name(subject) if subject else "a patch"


def _rescheduled(tree: Path) -> bool:
    """git stopped before its pick merged anything (an untracked file in the way):
    the pick is both the last line done and the first still to do."""
    def lines(name: str) -> list[str]:
        path = _rebase_dir(tree) / name
        text = path.read_text() if path.exists() else ""
        return [ln.split()[:2] for ln in text.splitlines() if ln and not ln.startswith("#")]
    done, todo = lines("done"), lines("git-rebase-todo")
    return bool(done and todo and done[-1] == todo[0])


def _in_the_way(tree: Path) -> list[str]:
    """The untracked files that stop the rescheduled pick (its paths that exist)."""
    if not _rescheduled(tree) or not (pick := _stopped_pick(tree)):
        return []
    paths = git(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "-z",
                pick).stdout.split("\0")[:-1]
    return [p for p in paths if os.path.lexists(tree / p)
            and git(tree, "ls-files", "--error-unmatch", "--", p, check=False,
                    env={"GIT_LITERAL_PATHSPECS": "1"}).returncode != 0]


def _refuse_unfinished_stop(layout: Layout, progress: dict) -> None:
    """Before going on from a stop: what is left, or was done by hand, that
    `git rebase --continue` would turn into a wrong patch."""
    tree, where = layout.tree, rel(layout.tree, layout)
    if _unmerged(tree) or _in_the_way(tree):
        raise _stop(layout, progress)
    staged = git(tree, "diff", "--cached", "--quiet", check=False).returncode != 0
    if _rescheduled(tree) and staged:
        raise StackError(
            f"git stopped before {_stopped_patch(tree)} (nothing of it is applied), so "
            f"what is staged in {where} would be committed as that patch: unstage it "
            f"(`git -C {where} restore --staged .`) and move files of your own out of "
            f"{where}, then run `make rebase VLLM_VERSION={progress['version']}` again")
    stop = progress.get("stop") or {}
    if stop.get("pick") and stop["pick"] == _stopped_pick(tree) and stop["head"] != head(tree):
        made = git(tree, "log", "--format=%s", f"{stop['head']}..HEAD").stdout.splitlines()
        picked = git(tree, "log", "-1", "--format=%s", stop["pick"]).stdout.strip()
        if picked not in made:
            raise StackError(
                f"a commit made during the stop at {_stopped_patch(tree)} ({made[0]!r}) took "
                f"that patch's resolution along, and git would count it as the patch: undo "
                f"it keeping its changes (`git -C {where} reset --soft {stop['head'][:12]}`), "
                f"run `make rebase VLLM_VERSION={progress['version']}` again, and make the "
                f"commit after the patch is applied")


def _git_refused(layout: Layout, progress: dict, args: list[str], output: str) -> StackError:
    """git did not move (unstaged changes, say): its own words, and the next step."""
    lines = [ln for ln in apply.git_advice_removed(output).splitlines()
             if ln.startswith(("error:", "fatal:"))] or output.strip().splitlines()[-1:]
    return StackError(f"`git {' '.join(args)}` stopped in {rel(layout.tree, layout)}: "
                      f"{' '.join(lines) or 'no reason given'}. Fix that there (`git -C "
                      f"{rel(layout.tree, layout)} status` shows what is left), then run "
                      f"`make rebase VLLM_VERSION={progress['version']}` again")


def _stop(layout: Layout, progress: dict, stuck: bool = False) -> StackError:
    """Record where git stopped (its pick, and HEAD: a commit made during the stop
    is told from it) and say what to do next."""
    tree, where, version = layout.tree, rel(layout.tree, layout), progress["version"]
    progress["stop"] = {"pick": _stopped_pick(tree), "head": head(tree)}
    _save(layout, progress)
    name = _stopped_patch(tree)
    rebase_dir = _rebase_dir(tree)
    count = f"[{_position(tree)}/{(rebase_dir / 'end').read_text().strip()}] " \
        if (rebase_dir / "end").exists() else ""
    skip = f"`git -C {where} rebase --skip`"
    conflicted = _unmerged(tree)
    if in_the_way := _in_the_way(tree):
        what = (f"{count}{name}: untracked {', '.join(in_the_way)} in {where} stand where "
                f"the patch writes, so git applied nothing of it. Move them out of {where} "
                "(they are not the patch's: do not `git add` them)")
    elif deleted := _deleted_upstream(layout, progress, conflicted):
        what = (f"{count}" + "; ".join(f"upstream deleted {path}" for path in deleted)
                + f" in vLLM {version}, and {name} changes it: drop the patch ({skip}) or "
                f"re-home its change where the code went (by hand, then `git -C {where} add` "
                f"what you changed and `git -C {where} rm` the deleted file). Resolving it as "
                "a conflict would bring the deleted file back")
    elif conflicted:
        what = (f"{count}{name} conflicts with vLLM {version} in: {', '.join(conflicted)}. "
                f"Resolve the files in {where}, then `git -C {where} add <files>` (to drop the "
                f"patch instead: {skip})")
    else:
        what = (f"{count}{name} stopped again after its resolution"
                + (" was reused" if stuck else "")
                + f": see `git -C {where} status`; if upstream has the patch, drop it ({skip})")
    return StackError(
        f"{what}; then run `make rebase VLLM_VERSION={version}` again to go on. pin.toml and "
        f"patches/ are unchanged and the old stack is branch {progress['old_branch']}; to "
        "give up: `make rebase-abandon` (resolutions are recorded, a new `make rebase` "
        "reuses them)")


def _deleted_upstream(layout: Layout, progress: dict, conflicted: list[str]) -> list[str]:
    """The conflicted files that the old release had and the new one lacks."""
    def in_tree(rev: str, path: str) -> bool:
        return git(layout.tree, "cat-file", "-e", f"{rev}:{path}", check=False).returncode == 0

    return sorted(path for path in conflicted if in_tree(progress["old_base"], path)
                  and not in_tree(progress["pin"]["base_tag"], path))


# --- a kill inside git ---------------------------------------------------------------------


def _recover_killed_git(layout: Layout, progress: dict) -> None:
    """The last run was killed inside its git (the state says which): take back
    what that git half did, so the rebase starts again from branch rebase-<v>
    as it was; rerere replays every resolution recorded before the kill.

    A git of ours ran (the state's mark, and the project lock says no command
    runs now): its lock files are stale. The work tree of a killed `--continue`
    may hold a resolution git had not committed: it is kept as a branch."""
    tree, where = layout.tree, rel(layout.tree, layout)
    removed = remove_stale_git_locks(tree)
    kept = _keep_rebase_work(layout, progress) if progress["git"] == "--continue" else None
    _undo_git_rebase(layout, progress)
    progress["git"] = None
    _save(layout, progress)
    say(f"the last `make rebase` was killed inside git; undid what it half did in {where}"
        + (f" (removed {', '.join(removed)})" if removed else "")
        + (f", its work tree kept as branch {kept}" if kept else "")
        + ": going on from branch " + rebase_branch(progress["version"]))


def _undo_git_rebase(layout: Layout, progress: dict) -> None:
    """Abort git's rebase (branch rebase-<v> back where it began, checked out) and
    remove the files git wrote that are now untracked: those whose bytes are a
    blob of the release or of the commits git was on. Any other file is kept."""
    tree = layout.tree
    was_at = git(tree, "rev-parse", "HEAD").stdout.strip()
    branch = rebase_branch(progress["version"])
    _refuse_clobbering(layout, branch, [was_at, progress["release"]])
    if _rebase_dir(tree).is_dir() and git(tree, "rebase", "--abort",
                                          check=False).returncode != 0:
        git(tree, "rebase", "--quit")  # killed before its state was complete
    git(tree, "checkout", "-q", "-f", branch)
    _remove_files_git_wrote(tree, [was_at, progress["release"]])


def _untracked_blobs(tree: Path) -> dict[str, str]:
    """Each untracked file (ignored ones too) with its blob id."""
    untracked = git(tree, "ls-files", "--others", "-z").stdout.split("\0")[:-1]
    if not untracked:
        return {}
    hashes = git(tree, "hash-object", "--no-filters", "--stdin-paths",
                 input="".join(f"{p}\n" for p in untracked)).stdout.split()
    return dict(zip(untracked, hashes))


def _tree_blobs(tree: Path, rev: str) -> set[tuple[str, str]]:
    """(blob id, path) of each file of `rev`."""
    found = set()
    for entry in git(tree, "ls-tree", "-r", "-z", rev).stdout.split("\0")[:-1]:
        meta, path = entry.split("\t", 1)
        found.add((meta.split()[2], path))
    return found


def _refuse_clobbering(layout: Layout, target: str, git_wrote: list[str]) -> None:
    """Going back to `target` with a forced checkout overwrites untracked files
    where it has files (git takes ignored ones as expendable): refuse while any
    of them is not a file git itself wrote (a blob of `git_wrote` there)."""
    tree, where = layout.tree, rel(layout.tree, layout)
    at_target = {path for _, path in _tree_blobs(tree, target)}
    ours = set().union(*(_tree_blobs(tree, rev) for rev in git_wrote))
    yours = sorted(p for p, blob in _untracked_blobs(tree).items()
                   if p in at_target and (blob, p) not in ours)
    if yours:
        raise StackError(f"going back to branch {target} in {where} would overwrite "
                         f"untracked files of yours: {', '.join(yours[:5])}. Move them out "
                         f"of {where}, then run the same command again")


def _remove_files_git_wrote(tree: Path, revs: list[str]) -> None:
    ours = set().union(*(_tree_blobs(tree, rev) for rev in revs))
    for path, blob in _untracked_blobs(tree).items():
        if (blob, path) in ours:
            (tree / path).unlink()


# --- give up --------------------------------------------------------------------


def abandon(layout: Layout) -> None:
    """`make rebase-abandon`: give up the rebase in progress, losing nothing.

    build/vllm goes back to branch `stack` on the old release (pin.toml and
    patches/ were never changed). What the rebase did is kept as branch
    `abandoned-rebase-<version>`, a begun resolution as its last commit; the
    resolutions git recorded stay, for the next `make rebase` to reuse.
    """
    tree, where = layout.tree, rel(layout.tree, layout)
    progress = read_state(tree).get("rebase") if is_stack_repo(tree) else None
    if not progress:
        raise StackError(f"no rebase is in progress in {where}: nothing to abandon")
    if not isinstance(progress, dict) or not isinstance(progress.get("version"), str):
        progress = {"version": _version_from_git(tree)}
    version = progress["version"]
    if isinstance(progress.get("finishing"), dict):
        raise StackError(f"the rebase to vLLM {version} is being written into the project "
                         f"(pin.toml, patches/); complete it with `make rebase "
                         f"VLLM_VERSION={version}`")
    if progress.get("git"):
        remove_stale_git_locks(tree)  # our own git, killed
    if isinstance(progress.get("release"), str):
        _refuse_clobbering(layout, BRANCH, [head(tree), progress["release"]])
    progress["git"] = "abandon"
    _save(layout, progress)
    if not _unmerged(tree):  # every conflict resolved and added: the next rebase reuses it
        git(tree, "rerere", check=False)
    kept = _keep_rebase_work(layout, progress)
    if _rebase_dir(tree).is_dir() and git(tree, "rebase", "--abort",
                                          check=False).returncode != 0:
        git(tree, "rebase", "--quit")
    was_at = head(tree)
    git(tree, "checkout", "-q", "-f", BRANCH)
    _remove_files_git_wrote(tree, [was_at] + ([progress["release"]]
                                              if isinstance(progress.get("release"), str)
                                              else []))
    if git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{rebase_branch(version)}",
           check=False).returncode == 0:
        git(tree, "branch", "-q", "-D", rebase_branch(version))
    write_state(tree, rebase=None, status="applied")
    say(f"abandoned the rebase to vLLM {version}: {where} is back on branch {BRANCH} "
        f"(pin.toml and patches/ unchanged)"
        + (f"; what the rebase did is kept as branch {kept}" if kept else ""))


def _version_from_git(tree: Path) -> str:
    """The version of the rebase git holds, when the state's entry is damaged."""
    head_name = _rebase_dir(tree) / "head-name"
    ref = head_name.read_text().strip() if head_name.exists() else \
        "refs/heads/" + _current_branch(tree)
    return ref.removeprefix("refs/heads/rebase-") if ref.startswith("refs/heads/rebase-") \
        else "unknown"


def _keep_rebase_work(layout: Layout, progress: dict) -> str | None:
    """Point a new branch at the rebase's commits, plus a commit of the work tree
    when it holds changes (a resolution begun); return its name."""
    tree, version = layout.tree, progress["version"]
    tip = head(tree)
    fd, index = tempfile.mkstemp(prefix="k3-abandon-index-")
    os.close(fd)
    try:
        shutil.copyfile(tree / ".git" / "index", index)
        env = {"GIT_INDEX_FILE": index}
        git(tree, "add", "-A", ".", env=env)
        work = git(tree, "write-tree", env=env).stdout.strip()
    finally:
        os.unlink(index)
    if work != git(tree, "rev-parse", f"{tip}^{{tree}}").stdout.strip():
        # The tool's identity as author too: a fresh machine may have none.
        identity = {**TOOL_IDENTITY, "GIT_AUTHOR_NAME": TOOL_IDENTITY["GIT_COMMITTER_NAME"],
                    "GIT_AUTHOR_EMAIL": TOOL_IDENTITY["GIT_COMMITTER_EMAIL"]}
        tip = git(tree, "commit-tree", work, "-p", tip, "-F", "-", env=identity,
                  input=f"Unfinished resolution of {_stopped_patch(tree)} (rebase "
                  "abandoned)\n").stdout.strip()
    if not progress.get("release") or _is_ancestor(tree, tip, BRANCH) or \
            tip == progress["release"]:
        return None  # nothing was done on the new release
    name, n = f"abandoned-rebase-{version}", 1
    while git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{name}",
              check=False).returncode == 0:
        n += 1
        name = f"abandoned-rebase-{version}-{n}"
    git(tree, "branch", name, tip)
    return name


# --- the finish: the project's files, all or nothing -------------------------------------


def _project_digests(layout: Layout) -> dict[str, str]:
    """sha256 of pin.toml and of every file under patches/ and vllm_overlay/."""
    found = {}
    for name in _PROJECT_FILES:
        top = layout.root / name
        paths = [top] if not top.is_dir() or top.is_symlink() else \
            [Path(d) / f for d, _, files in os.walk(top) for f in files]
        for path in paths:
            if digest := apply.file_sha256(path):
                found[path.relative_to(layout.root).as_posix()] = digest
    return found


def _staging(layout: Layout) -> Path:
    """Where the finish puts the new files, and the old ones once replaced (in
    build/, beside what they replace: moving them is a rename)."""
    return layout.build_dir / "rebase-finish"


def _finish(layout: Layout, progress: dict) -> None:
    tree, where, version = layout.tree, rel(layout.tree, layout), progress["version"]
    if dirty := dirty_files(tree):
        raise StackError(f"{where} has uncommitted changes ({', '.join(dirty[:5])}): commit "
                         f"them (`git -C {where} commit --fixup=<patch's commit>` folds them "
                         f"into it) or stash them, then run `make rebase VLLM_VERSION="
                         f"{version}` again")
    if git(tree, "rev-list", "--merges", f"{progress['pin']['base_tag']}..HEAD").stdout.strip():
        raise StackError(f"{where} has merge commits on {rebase_branch(version)}; the stack "
                         "must be linear")
    rendered = apply.rendered_stack(layout, progress["pin"]["base_tag"])
    if edited := sorted(set(_project_digests(layout).items()) ^ set(progress["project"].items())):
        raise StackError(
            "changed since `make rebase` began: " + ", ".join(sorted({p for p, _ in edited}))
            + f". The finish replaces them: put them back (`git checkout -- <file>` in the "
            f"project), or give the rebase up with `make rebase-abandon`; then run "
            f"`make rebase VLLM_VERSION={version}` again")
    staging = _staging(layout)
    if staging.exists():
        discard(staging)  # from a finish killed before its journal
    _stage(layout, progress, rendered, staging / "new")
    progress["finishing"] = {"head": head(tree), "patches": list(rendered)}
    _save(layout, progress)  # the journal: from here the next run completes it
    _complete_finish(layout, progress)


def _stage(layout: Layout, progress: dict, rendered: dict[str, bytes], new: Path) -> None:
    """The new pin.toml, patches/ and vllm_overlay/, complete, under `new`."""
    pin = _pin_from_dict(progress["pin"])
    new.mkdir(parents=True)
    (new / "pin.toml").write_bytes(render_pin(pin).encode())
    patches = new / "patches"
    shutil.copytree(layout.patches_dir, patches, symlinks=True)  # its other files stay
    old_names = set(series_names(layout))
    for name, content in rendered.items():
        (patches / name).write_bytes(content)
    (patches / "series").write_bytes(series_text(list(rendered)))
    dropped = old_names - rendered.keys()
    for name in dropped:
        (patches / name).unlink(missing_ok=True)
    for note in apply.notes_to_remove(layout, dropped, added=rendered.keys() - old_names):
        (patches / note).unlink()
        say(f"removed patches/{note}: its patch left the series (the project's git has it)")
    for name in sorted(dropped):
        say(f"  dropped {name}: git's rebase left nothing of it (upstream has it, or it "
            "was skipped)")
    files = overlay.render(layout.tree, pin, pin.base_tag, "HEAD", list(rendered))
    for path, content in files.items():
        (new / "vllm_overlay" / path).parent.mkdir(parents=True, exist_ok=True)
        (new / "vllm_overlay" / path).write_bytes(content)


def _complete_finish(layout: Layout, progress: dict) -> None:
    """Move the staged files into place, then make the rebased branch `stack`.
    Each step can be done again: a killed finish is completed by the next run."""
    tree, journal = layout.tree, progress["finishing"]
    staging = _staging(layout)
    for name in _PROJECT_FILES:
        new, current, old = staging / "new" / name, layout.root / name, staging / "old" / name
        if not os.path.lexists(new):
            continue  # moved into place already
        if os.path.lexists(current) and not os.path.lexists(old):
            old.parent.mkdir(exist_ok=True)
            os.replace(current, old)
        os.replace(new, current)
    git(tree, "checkout", "-q", "-B", BRANCH, journal["head"])
    if git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{rebase_branch(progress['version'])}",
           check=False).returncode == 0:
        git(tree, "branch", "-q", "-D", rebase_branch(progress["version"]))
    if staging.exists():
        discard(staging)  # the old pin.toml, patches/ and vllm_overlay/
    pin = _pin_from_dict(progress["pin"])
    write_state(tree, base_tag=pin.base_tag, base_sdist_sha256=pin.sdist.sha256,
                base_commit=progress["release"], rebase=None, status="applied",
                applied_head=journal["head"], applied_digest=series_digest(read_series(layout)),
                synced=apply.patches_snapshot(layout), exporting=None)
    review = _touched_upstream_changes(layout, progress)
    say(f"rebased onto vLLM {pin.version}; pin.toml, patches/ ({len(journal['patches'])} "
        "patch(es)) and vllm_overlay/ updated"
        + (f"; upstream changed files these patches change, review them: {', '.join(review)}"
           if review else "")
        + ". Next: `make lock`, `make test`, then commit pin.toml, requirements/, patches/ "
        "and vllm_overlay/.")


def _touched_upstream_changes(layout: Layout, progress: dict) -> list[str]:
    """The patches whose files upstream changed between the two releases: their
    rebase was a real merge, worth a review."""
    tree, new_base = layout.tree, progress["pin"]["base_tag"]
    changed = set(git(tree, "diff", "--name-only", "-z", progress["old_base"],
                      new_base).stdout.split("\0"))
    review = []
    for commit in git(tree, "rev-list", "--reverse", f"{new_base}..HEAD").stdout.split():
        touched = git(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "-z",
                      commit).stdout.split("\0")[:-1]
        if changed.intersection(touched):
            subject = git(tree, "log", "-1", "--format=%s", commit).stdout.strip()
            review.append(apply.patch_name(subject))
    return review


def _pin_dict(pin: Pin) -> dict:
    return {"version": pin.version, "commit": pin.commit, "base_tag": pin.base_tag,
            "sdist": pin.sdist.__dict__, "wheel": pin.wheel.__dict__}


def _pin_from_dict(d: dict) -> Pin:
    return Pin(d["version"], d["commit"], d["base_tag"], Artifact(**d["sdist"]),
               Artifact(**d["wheel"]))
