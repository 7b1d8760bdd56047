"""`make rebase VLLM_VERSION=x.y.z`: move the stack onto another vLLM release.

Branch `rebase-<new>`, started at `stack`, is moved by `git rebase --onto` (with
rerere) onto the new release, committed in build/vllm as a child of the old one.
The state file's `rebase` entry holds what git cannot (the new pin, the release
commit, the project's files' digests, which git of ours runs). pin.toml,
patches/ and vllm_overlay/ change only once git is done, all or nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from scripts.common import Layout, StackError, rel, say, write_atomically
from scripts.stack import apply, overlay
from scripts.stack.fetch import IndexUnreachable, ensure_artifact, find_in_index, index_needed
from scripts.stack.gitrepo import (
    BRANCH,
    TOOL_IDENTITY,
    commits_since,
    dirty_files,
    git,
    head,
    import_release,
    is_stack_repo,
    read_state,
    rebase_in_progress,
    release_commit_id,
    remove_stale_git_locks,
    write_state,
)
from scripts.stack.pin import Artifact, Pin, check_version, load_pin, render_pin
from scripts.stack.series import read_series, series_digest, series_names, series_text

# A new release's files may be at most this many times the size of the pinned
# ones: their size comes from the index, which must not be able to fill the disk.
_MAX_GROWTH = 4
# What the finish writes, relative to the project root, all or nothing.
_PROJECT_FILES = ("pin.toml", "patches", "vllm_overlay")
# git's rebase runs without an editor; it comments out its notes on a conflict
# with core.commentChar, and "#" would strip a patch message's "## Purpose" too.
_GIT_REBASE_ENV = {"GIT_EDITOR": ":", "GIT_SEQUENCE_EDITOR": ":"}
_REBASE = ["-c", "core.commentChar=auto", "rebase"]
_REBASE_DIR = ".git/rebase-merge"  # git's rebase state, while a rebase is in progress


def rebase(layout: Layout, version: str) -> None:
    check_version(version, "VLLM_VERSION", "give a release, as in "
                  "`make rebase VLLM_VERSION=0.34.0`")
    if not is_stack_repo(layout.tree):
        raise StackError(f"{rel(layout.tree, layout)} does not exist; run `make apply` first")
    progress = _progress(layout)
    if progress and (progress["version"] != version or progress.get("git") == "abandon"):
        raise StackError(f"a rebase to vLLM {progress['version']} is in progress in "
                         f"{rel(layout.tree, layout)}: finish it with `make rebase VLLM_VERSION="
                         f"{progress['version']}`, or give it up with `make rebase-abandon` "
                         "(a killed `make rebase-abandon` is finished by running it again)")
    if progress is None:
        progress = _start(layout, version)
    elif progress.get("finishing"):
        return _complete_finish(layout, progress)
    elif progress.get("git"):
        _recover_killed_git(layout, progress)
    _check_branch(layout, progress)
    _drive(layout, progress)
    _finish(layout, progress)


def _progress(layout: Layout) -> dict | None:
    """The state file's rebase entry, or None; one line if it is damaged."""
    progress = read_state(layout.tree).get("rebase")
    keys = {"version": str, "pin": dict, "old_base": str, "old_branch": str,
            "release": str, "project": dict}
    if progress is None or isinstance(progress, dict) and all(
            isinstance(progress.get(k), t) for k, t in keys.items()):
        return progress
    raise StackError(f"{rel(layout.tree, layout)}/.git/k3-stack.json: its rebase entry is "
                     "damaged; give the rebase up with `make rebase-abandon` (git's own "
                     "state is kept as a branch), then start it again")


def _save(layout: Layout, progress: dict, **changes) -> None:
    progress.update(changes)
    write_state(layout.tree, rebase=progress)


def _branch(progress: dict) -> str:
    return f"rebase-{progress['version']}"


def _again(progress: dict) -> str:
    return f"then run `make rebase VLLM_VERSION={progress['version']}` again"


def _rebase_file(tree: Path, name: str) -> str:
    """A file of git's rebase state ("msgnum": the todo lines done), or ""."""
    path = tree / _REBASE_DIR / name
    return path.read_text().strip() if path.exists() else ""


def _listed(tree: Path, *args: str, **kwargs) -> list[str]:
    """The NUL-ended entries a `git ... -z` prints."""
    return git(tree, *args, **kwargs).stdout.split("\0")[:-1]


def _subject(tree: Path, rev: str) -> str:
    return git(tree, "log", "-1", "--format=%s", rev).stdout.strip()


def _check_branch(layout: Layout, progress: dict) -> None:
    """Once git's rebase has begun, go on only on branch rebase-<v> or in git's
    rebase of it. (A moved tag does no harm: git is given the release's commit.)"""
    tree, where, branch = layout.tree, rel(layout.tree, layout), _branch(progress)
    rebasing = _rebase_file(tree, "head-name").removeprefix("refs/heads/")
    on = rebasing or git(tree, "symbolic-ref", "-q", "--short", "HEAD",
                         check=False).stdout.strip() or "a detached HEAD"
    if progress.get("begun") and on != branch:
        fix = "rebase --abort" if rebasing else f"checkout {branch}"
        raise StackError(f"{where} is {'rebasing' if rebasing else 'on'} {on}, not on branch "
                         f"{branch} where the rebase to vLLM {progress['version']} is: `git -C "
                         f"{where} {fix}`, {_again(progress)} (or `make rebase-abandon`)")


def _start(layout: Layout, version: str) -> dict:
    old = load_pin(layout.pin_file)
    if version == old.version:
        raise StackError(f"the stack is already on vLLM {version} (pin.toml): nothing to do")
    tree, where, branch = layout.tree, rel(layout.tree, layout), f"rebase-{version}"
    apply.guard_tree(layout, "`make rebase`")
    old_base = read_state(tree)["base_tag"]
    # The finish replaces patches/: it must hold the stack, and nothing else edited.
    apply.refuse_overwriting_edits(layout, apply.rendered_stack(layout, old_base))
    # A branch left by an earlier rebase (given up by hand) may hold resolved patches
    # that no other branch has: starting again would reset it. (--exclude takes a
    # branch's name without refs/heads/, before --branches; no such branch: no commits)
    if commits := git(tree, "rev-list", f"refs/heads/{branch}", "--not", f"--exclude={branch}",
                      "--branches", "--tags", check=False).stdout.split():
        raise StackError(
            f"branch {branch} in {where} holds {len(commits)} commit(s) of an earlier rebase "
            f"that no other branch has, and a new rebase would reset it: rename it (`git -C "
            f"{where} branch -m {branch} <name>`) or delete it (`git -C {where} branch -D "
            f"{branch}`), then run `make rebase VLLM_VERSION={version}` again")
    new = pin_for(old, version)
    release = import_release(layout, new, ensure_artifact(layout, new.project, new.sdist),
                             parent=old_base)
    new = dataclasses.replace(new, commit=release_commit_id(tree, release) or "unknown")
    progress = {"version": version, "pin": dataclasses.asdict(new), "old_base": old_base,
                "old_branch": f"{BRANCH}-{old.version}", "release": release,
                "project": _project_digests(layout)}
    # Refs and settings only (git's rebase checks the branch out): done again after a kill.
    git(tree, "branch", "-f", progress["old_branch"], BRANCH)
    git(tree, "branch", "-f", branch, BRANCH)
    git(tree, "config", "rerere.enabled", "true")  # a recorded resolution is reused
    git(tree, "config", "rerere.autoUpdate", "true")
    _save(layout, progress)
    say(f"rebasing {len(read_series(layout))} patch(es) from vLLM {old.version} onto "
        f"{version} with `git rebase` (old stack kept as branch {progress['old_branch']})")
    return progress


def pin_for(old: Pin, version: str) -> Pin:
    """The pin of `version`: same artifact kinds, sizes and hashes from the index."""
    def artifact(old_art: Artifact) -> Artifact:
        filename = old_art.filename.replace(old.version, version)
        try:
            found = find_in_index(old.project, filename)
        except IndexUnreachable as e:
            raise index_needed(f"look up vLLM {version}'s files and their sha256", e)
        if not (found.sha256 and found.size):
            problem = "no size/sha256"
        elif found.size > _MAX_GROWTH * old_art.size:
            problem = (f"{found.size / 1e6:.1f} MB, larger than {_MAX_GROWTH} times the "
                       f"pinned {old_art.filename}")
        else:
            return Artifact(filename, found.size, found.sha256)
        raise StackError(
            f"the index lists {filename} with {problem}: refusing to download it. If that "
            "is right, write the new pin.toml by hand and run `make apply`")

    return Pin(version, "unknown", f"vllm-{version}", artifact(old.sdist), artifact(old.wheel))


def _drive(layout: Layout, progress: dict) -> None:
    """Run git's rebase until it is done or stops for the user: start it, go on
    after a stop (the user ran `make rebase` again), and fold `fixup!` commits
    made during it. A stop that `rerere` resolved in full is gone on from."""
    tree, release = layout.tree, progress["release"]
    gone_on_from: set[str] = set()
    while True:
        before = None
        if (tree / _REBASE_DIR).is_dir():
            _refuse_unfinished_stop(layout, progress)
            if (before := _rebase_file(tree, "msgnum")) in gone_on_from:
                raise _stop(layout, progress)  # went on from here in this run, stopped again
            gone_on_from.add(before)
            git(tree, "rerere", check=False)  # a kill inside git keeps the resolution
            args = ["--continue"]
        elif git(tree, "merge-base", "--is-ancestor", release, "HEAD",
                 check=False).returncode != 0:
            args = ["--committer-date-is-author-date", "--onto", release, progress["old_base"],
                    _branch(progress)]  # git checks the branch out first
        elif fixups := [s for s in (_subject(tree, c) for c in commits_since(tree, release))
                        if s.startswith(("fixup! ", "squash! ", "amend! "))]:
            say(f"  folding {len(fixups)} commit(s) made during the rebase into their "
                f"patches: {', '.join(fixups)}")
            args = ["-i", "--autosquash", "--committer-date-is-author-date", release]
        else:
            return
        # Marked in the state file while git runs: the next run undoes a kill inside it.
        _save(layout, progress, git=args[0], begun=True)
        result = git(tree, *_REBASE, *args, env=_GIT_REBASE_ENV, check=False)
        _save(layout, progress, git=None)
        if result.returncode == 0:
            continue
        if (tree / _REBASE_DIR).is_dir() and (_unmerged(tree) or _in_the_way(tree)):
            raise _stop(layout, progress)
        if not (tree / _REBASE_DIR).is_dir() or _rebase_file(tree, "msgnum") == before:
            # git did not move (unstaged changes, a `git am` in progress): its own words.
            output = (result.stdout + result.stderr).strip().splitlines()
            raise StackError(f"`git rebase {' '.join(args)}` stopped in {rel(tree, layout)}: "
                             + " ".join([ln for ln in output if ln.startswith(("error:", "fatal:"))]
                                        or output[-1:]) + f". Fix that there, {_again(progress)}")
        # git stopped at a new pick with nothing left unmerged: rerere resolved it all.
        say(f"  {_stopped_patch(tree)}: reused the recorded resolution of the same conflict")


def _unmerged(tree: Path) -> list[str]:
    return _listed(tree, "diff", "--name-only", "-z", "--diff-filter=U")


def _stopped_pick(tree: Path) -> str:
    return git(tree, "rev-parse", "-q", "--verify", "REBASE_HEAD", check=False).stdout.strip()


def _stopped_patch(tree: Path) -> str:
    pick = _stopped_pick(tree)
    return apply.patch_name(_subject(tree, pick)) if pick else "a patch"


def _in_the_way(tree: Path) -> list[str] | None:
    """None, unless git stopped before its pick merged anything (the pick is both
    the last line done and the first still to do: an untracked file in the way);
    then the untracked files where the pick writes."""
    done, todo = ([ln.split()[:2] for ln in _rebase_file(tree, name).splitlines()
                   if not ln.startswith("#")] for name in ("done", "git-rebase-todo"))
    if not (done and todo and done[-1] == todo[0] and (pick := _stopped_pick(tree))):
        return None
    paths = _listed(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "-z", pick)
    return _listed(tree, "ls-files", "--others", "-z", "--", *paths,
                   env={"GIT_LITERAL_PATHSPECS": "1"}) if paths else []


def _refuse_unfinished_stop(layout: Layout, progress: dict) -> None:
    """Before going on from a stop: what is left, or was done by hand, that
    `git rebase --continue` would turn into a wrong patch."""
    tree, where = layout.tree, rel(layout.tree, layout)
    if _in_the_way(tree) is not None and git(tree, "diff", "--cached", "--quiet",
                                             check=False).returncode != 0:
        raise StackError(
            f"git applied nothing of {_stopped_patch(tree)}, so what is staged in {where} "
            f"would be committed as that patch: unstage it (`git -C {where} restore --staged "
            f".`), move files of yours out of {where}, {_again(progress)}")
    stop, pick = progress.get("stop") or {}, _stopped_pick(tree)
    if pick and stop.get("pick") == pick and stop["head"] != head(tree):
        made = git(tree, "log", "--format=%s", f"{stop['head']}..HEAD").stdout.splitlines()
        if _subject(tree, pick) not in made:
            raise StackError(
                f"a commit made during the stop at {_stopped_patch(tree)} ({made[0]!r}) took "
                f"that patch's resolution along, and git would count it as the patch: undo "
                f"it keeping its changes (`git -C {where} reset --soft {stop['head'][:12]}`), "
                f"{_again(progress)}, and make the commit after the patch is applied")


def _stop(layout: Layout, progress: dict) -> StackError:
    """Record where git stopped (its pick, and HEAD: a commit made during the stop
    is told from it) and say what to do next."""
    tree, where, version = layout.tree, rel(layout.tree, layout), progress["version"]
    _save(layout, progress, stop={"pick": _stopped_pick(tree), "head": head(tree)})
    end, patch = _rebase_file(tree, "end"), _stopped_patch(tree)
    name = (f"[{_rebase_file(tree, 'msgnum')}/{end}] " if end else "") + patch
    skip = f"`git -C {where} rebase --skip`"
    conflicted = _unmerged(tree)
    deleted = [p for p in conflicted if git(tree, "cat-file", "-e", f"{progress['release']}:{p}",
                                            check=False).returncode != 0]
    if in_the_way := _in_the_way(tree):
        what = (f"{name}: untracked {', '.join(in_the_way)} in {where} stand where the patch "
                f"writes, so git applied nothing of it. Move them out of {where} (they are "
                "not the patch's: do not `git add` them)")
    elif deleted:
        what = (f"{name}: " + "; ".join(f"upstream deleted {p}" for p in deleted)
                + f" in vLLM {version}, and {patch} changes it: drop the patch ({skip}), or "
                f"re-home its change where the code went and `git -C {where} rm` the file "
                "(resolving it as a conflict would bring the deleted file back)")
    elif conflicted:
        what = (f"{name} conflicts with vLLM {version} in: {', '.join(conflicted)}. Resolve "
                f"them in {where}, then `git -C {where} add <files>` (or drop the patch: {skip})")
    else:
        what = (f"{name} stopped again after its resolution: see `git -C {where} status`; "
                f"if upstream has the patch, drop it ({skip})")
    return StackError(
        f"{what}; {_again(progress)} to go on. pin.toml and patches/ are unchanged and the "
        f"old stack is branch {progress['old_branch']}; to give up: `make rebase-abandon` "
        "(resolutions are recorded, a new `make rebase` reuses them)")


def _recover_killed_git(layout: Layout, progress: dict) -> None:
    """The last run was killed inside its git (the state's mark says which):
    that git's lock files are stale, as the project lock says no git of ours
    runs now. What it did is undone back to branch rebase-<v> (a resolution a
    killed `--continue` had not committed is kept as a branch), and rerere
    replays what was recorded before the kill."""
    tree, where, branch = layout.tree, rel(layout.tree, layout), _branch(progress)
    removed = remove_stale_git_locks(tree)
    kept = _go_back(layout, progress, branch, keep=progress["git"] == "--continue")
    _save(layout, progress, git=None)
    say(f"the last `make rebase` was killed inside git; undid what it half did in {where}"
        + (f" (removed {', '.join(removed)})" if removed else "")
        + (f", its work tree kept as branch {kept}" if kept else "")
        + f": going on from branch {branch}")


def abandon(layout: Layout) -> None:
    """`make rebase-abandon`: back to branch `stack`, losing nothing. What the
    rebase did is kept as branch `abandoned-rebase-<version>` (a begun resolution
    as its last commit); recorded resolutions stay, for the next rebase."""
    tree, where = layout.tree, rel(layout.tree, layout)
    if (version := rebase_in_progress(tree)) is None:
        raise StackError(f"no rebase is in progress in {where}: nothing to abandon")
    progress = read_state(tree).get("rebase")
    progress = {**(progress if isinstance(progress, dict) else {}), "version": version}
    if isinstance(progress.get("finishing"), dict):
        raise StackError(f"the rebase to vLLM {version} is being written into the project: "
                         f"complete it with `make rebase VLLM_VERSION={version}`")
    if progress.get("git"):
        remove_stale_git_locks(tree)  # our own git, killed
    if not _unmerged(tree):  # every conflict resolved and added: the next rebase reuses it
        git(tree, "rerere", check=False)
    kept = _go_back(layout, progress, BRANCH, keep=True, mark="abandon")
    git(tree, "branch", "-q", "-D", _branch(progress), check=False)  # if there is one
    write_state(tree, rebase=None, status="applied")
    say(f"abandoned the rebase to vLLM {version}: {where} is back on branch {BRANCH} "
        f"(pin.toml and patches/ unchanged)"
        + (f"; what the rebase did is kept as branch {kept}" if kept else ""))


def _go_back(layout: Layout, progress: dict, target: str, keep: bool,
             mark: str | None = None) -> str | None:
    """Give git's rebase up and check `target` out by force. The untracked files
    left are removed where they hold what git wrote (a blob of HEAD or of the
    release at their path); any other is the user's, and a forced checkout would
    overwrite it where `target` has a file: refused first. With `keep`, what the
    rebase did is kept as a branch: its name is returned."""
    tree, where, release = layout.tree, rel(layout.tree, layout), progress.get("release")
    revs = [head(tree)] + ([release] if isinstance(release, str) else [])
    entries = [e.split("\t", 1) for rev in revs for e in _listed(tree, "ls-tree", "-r", "-z", rev)]
    wrote = {(meta.split()[2], path) for meta, path in entries}  # (blob, path)
    untracked = _listed(tree, "ls-files", "--others", "-z")  # ignored ones too
    blobs = git(tree, "hash-object", "--no-filters", "--stdin-paths", input="".join(
        f"{p}\n" for p in untracked)).stdout.split() if untracked else []
    ours = {p for p, blob in zip(untracked, blobs) if (blob, p) in wrote}
    at_target = _listed(tree, "ls-tree", "-r", "-z", "--name-only", target)
    if yours := sorted(set(untracked).intersection(at_target) - ours):
        raise StackError(f"going back to branch {target} in {where} would overwrite "
                         f"untracked files of yours: {', '.join(yours[:5])}. Move them "
                         f"out of {where}, then run the same command again")
    if mark:
        _save(layout, progress, git=mark)  # a kill from here: the same command finishes it
    kept = _keep_rebase_work(layout, progress) if keep else None
    if (tree / _REBASE_DIR).is_dir() and git(tree, "rebase", "--abort",
                                             check=False).returncode != 0:
        git(tree, "rebase", "--quit")  # killed before its state was complete
    git(tree, "checkout", "-q", "-f", target)
    for path in ours.intersection(_listed(tree, "ls-files", "--others", "-z")):
        (tree / path).unlink()
    return kept


def _keep_rebase_work(layout: Layout, progress: dict) -> str | None:
    """Point a new branch at the rebase's commits, plus a commit of the work tree
    when it holds changes (a resolution begun); return its name."""
    tree, tip = layout.tree, head(layout.tree)
    index = tree / ".git" / "k3-keep-index"  # the work tree as a tree, via a copy of the index
    shutil.copyfile(tree / ".git" / "index", index)
    git(tree, "add", "-A", ".", env={"GIT_INDEX_FILE": str(index)})
    work = git(tree, "write-tree", env={"GIT_INDEX_FILE": str(index)}).stdout.strip()
    index.unlink()
    if work != git(tree, "rev-parse", f"{tip}^{{tree}}").stdout.strip():
        # The tool's identity as author too: a fresh machine may have none.
        identity = {**TOOL_IDENTITY, "GIT_AUTHOR_NAME": TOOL_IDENTITY["GIT_COMMITTER_NAME"],
                    "GIT_AUTHOR_EMAIL": TOOL_IDENTITY["GIT_COMMITTER_EMAIL"]}
        tip = git(tree, "commit-tree", work, "-p", tip, "-F", "-", env=identity,
                  input=f"Unfinished resolution of {_stopped_patch(tree)} (rebase "
                  "abandoned)\n").stdout.strip()
    if tip == progress.get("release") or git(tree, "merge-base", "--is-ancestor", tip, BRANCH,
                                             check=False).returncode == 0:
        return None  # nothing was done on the new release
    name, n = f"abandoned-rebase-{progress['version']}", 1
    while git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{name}",
              check=False).returncode == 0:
        n += 1
        name = f"abandoned-rebase-{progress['version']}-{n}"
    git(tree, "branch", name, tip)
    return name


def _project_digests(layout: Layout) -> dict[str, str]:
    """sha256 of pin.toml and of every file under patches/ and vllm_overlay/ (a
    marker for each of them that is no file: a link, a folder)."""
    tops = [layout.root / name for name in _PROJECT_FILES]
    paths = tops + [Path(d) / f for top in tops for d, _, files in os.walk(top) for f in files]
    return {p.relative_to(layout.root).as_posix(): digest for p in paths
            if (digest := apply.file_sha256(p))}


def _finish(layout: Layout, progress: dict) -> None:
    """git is done: refuse what the finish would lose or get wrong, then write its
    journal (the rebased head, the files patches/ loses) and complete it."""
    tree, where = layout.tree, rel(layout.tree, layout)
    if dirty := dirty_files(tree):
        raise StackError(f"{where} has uncommitted changes ({', '.join(dirty[:5])}): commit "
                         f"them (`git -C {where} commit --fixup=<patch's commit>` folds them "
                         f"into it) or stash them, {_again(progress)}")
    if git(tree, "rev-list", "--merges", f"{progress['release']}..HEAD").stdout.strip():
        raise StackError(f"{where} has merge commits on {_branch(progress)}; the stack "
                         "must be linear")
    if edited := set(_project_digests(layout).items()) ^ set(progress["project"].items()):
        raise StackError(
            "changed since `make rebase` began: " + ", ".join(sorted({p for p, _ in edited}))
            + ". The finish replaces them: put them back (`git checkout -- <file>` in the "
            f"project), or give the rebase up with `make rebase-abandon`; {_again(progress)}")
    rendered = apply.rendered_stack(layout, progress["release"])  # refused here, if at all
    old_names = set(series_names(layout))
    for name in sorted(dropped := old_names - rendered.keys()):
        say(f"  dropped {name}: git's rebase left nothing of it (upstream has it, or it "
            "was skipped)")
    notes = apply.notes_to_remove(layout, dropped, added=rendered.keys() - old_names)
    for note in notes:
        say(f"removed patches/{note}: its patch left the series (the project's git has it)")
    # From here the next run completes the finish: nothing before it changed the project.
    _save(layout, progress, finishing={"head": head(tree), "remove": [*dropped, *notes]})
    _complete_finish(layout, progress)


def _complete_finish(layout: Layout, progress: dict) -> None:
    """Make the rebased head `stack` and write pin.toml, patches/ and vllm_overlay/
    from it, as the journal says. Each step can be done again, each file is
    replaced whole: a killed finish is completed by the next run."""
    tree, journal, release = layout.tree, progress["finishing"], progress["release"]
    git(tree, "checkout", "-q", "-B", BRANCH, journal["head"])
    git(tree, "branch", "-q", "-D", _branch(progress), check=False)  # gone after a kill
    d = progress["pin"]
    pin = Pin(**{**d, "sdist": Artifact(**d["sdist"]), "wheel": Artifact(**d["wheel"])})
    write_atomically(layout.pin_file, render_pin(pin).encode())
    rendered = apply.rendered_stack(layout, release)
    for name, content in rendered.items():
        write_atomically(layout.patches_dir / name, content)
    write_atomically(layout.series_file, series_text(list(rendered)))
    for name in journal["remove"]:
        (layout.patches_dir / name).unlink(missing_ok=True)
    overlay.write(layout, overlay.render(tree, pin, release, "HEAD", list(rendered)))
    write_state(tree, base_tag=pin.base_tag, base_sdist_sha256=pin.sdist.sha256,
                base_commit=release, rebase=None, status="applied", applied_head=journal["head"],
                applied_digest=series_digest(read_series(layout)),
                synced=apply.patches_snapshot(layout), exporting=None)
    # A patch whose files upstream changed between the releases was really merged.
    changed = set(_listed(tree, "diff", "--name-only", "-z", progress["old_base"], release))
    review = [apply.patch_name(_subject(tree, c)) for c in commits_since(tree, release)
              if changed.intersection(_listed(tree, "diff-tree", "--no-commit-id", "--name-only",
                                              "-r", "-z", c))]
    say(f"rebased onto vLLM {pin.version}; pin.toml, patches/ ({len(rendered)} patch(es)) and "
        "vllm_overlay/ updated"
        + (f"; upstream changed files these patches change, review them: {', '.join(review)}"
           if review else "")
        + ". Next: `make lock`, `make test`, then commit pin.toml, requirements/, patches/ "
        "and vllm_overlay/.")
