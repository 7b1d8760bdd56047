"""`make rebase VLLM_VERSION=x.y.z`: move the stack onto another vLLM release.

The new release is committed in build/vllm as a child of the old one, and
the patches are re-applied on it with 3-way merging allowed. At the first
conflict the run stops, names the patch and the files, and says how to go on;
pin.toml and patches/ change only once every patch is on the new release
(then the patches are re-exported, so no resolution stays unexported). The
old stack stays in build/vllm as branch `stack-<old version>`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from scripts.common import Layout, StackError, rel, say, write_atomically
from scripts.stack import apply
from scripts.stack.fetch import IndexUnreachable, ensure_artifact, find_in_index, index_needed
from scripts.stack.gitrepo import (
    BRANCH,
    TOOL_IDENTITY,
    am_in_progress,
    commits_since,
    dirty_files,
    git,
    head,
    import_release,
    is_stack_repo,
    read_state,
    release_commit_id,
    remove_stale_git_locks,
    write_state,
)
from scripts.stack.pin import Artifact, Pin, check_version, load_pin, render_pin
from scripts.stack.series import read_series, touched_paths

_AM_3WAY = [*apply.AM, "--3way"]
# A new release's files may be at most this many times the size of the pinned
# ones: their size comes from the index, which must not be able to fill the disk.
_MAX_GROWTH = 4


def rebase(layout: Layout, version: str) -> None:
    check_version(version, "VLLM_VERSION", "give a release, as in "
                  "`make rebase VLLM_VERSION=0.34.0`")
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    progress = read_state(tree).get("rebase")
    if progress and progress["pin"]["version"] != version:
        raise StackError(
            f"a rebase to vLLM {progress['pin']['version']} is in progress in "
            f"{rel(tree, layout)}; finish it with `make rebase VLLM_VERSION="
            f"{progress['pin']['version']}` or give it up with `make rebase-abandon`")
    if progress:
        _resume(layout, progress)
    else:
        progress = _start(layout, version)
    _apply_remaining(layout, progress)
    _finish(layout, progress)


def _start(layout: Layout, version: str) -> dict:
    old = load_pin(layout.pin_file)
    if version == old.version:
        raise StackError(f"the stack is already on vLLM {version}")
    apply.guard_tree(layout, "`make rebase`")
    _refuse_resetting_work(layout, version)
    new = pin_for(old, version)
    sdist = ensure_artifact(layout, new.project, new.sdist)
    tree = layout.tree
    old_base = read_state(tree)["base_tag"]
    commit = import_release(layout, new, sdist, parent=old_base)
    new = Pin(new.version, release_commit_id(tree, commit) or "unknown",
              new.base_tag, new.sdist, new.wheel)
    git(tree, "branch", "-f", f"{BRANCH}-{old.version}", BRANCH)
    git(tree, "checkout", "-q", "-B", rebase_branch(version), commit)
    progress = {"pin": _pin_dict(new), "patches": [p.name for p in read_series(layout)],
                "next": 0, "three_way": [], "old_branch": f"{BRANCH}-{old.version}",
                # patches/ as the rebase read it: what its export may overwrite
                "synced": apply.patches_snapshot(layout)}
    write_state(tree, rebase=progress, status="rebasing")
    say(f"rebasing {len(progress['patches'])} patch(es) from vLLM {old.version} onto "
        f"{version} (3-way merge allowed; old stack kept as {progress['old_branch']})")
    return progress


def rebase_branch(version: str) -> str:
    return f"rebase-{version}"


def _commits_only_on(tree, branch: str) -> list[str]:
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


def _reflog_length(tree) -> int:
    """How many times HEAD has moved or been reset (`git am --abort` counts too)."""
    return int(git(tree, "rev-list", "--walk-reflogs", "--count", "HEAD").stdout.strip() or 0)


def _resume(layout: Layout, progress: dict) -> None:
    """Go on after a stop: finish the resolved `git am`, or note a skipped patch.

    Only `git am --skip` drops a patch. It leaves HEAD and its reflog as they
    were at the stop; `git am --abort` (which `make apply` suggests) also
    leaves HEAD there but adds a reflog entry: then the patch is applied again.
    """
    tree, where = layout.tree, rel(layout.tree, layout)
    if progress.get("am_running"):
        _undo_killed_am(layout, progress)
        return
    if progress["next"] >= len(progress["patches"]):
        return  # every patch is on the new release; only the finish is left
    if am_in_progress(tree):
        result = git(tree, "am", "--continue", env=TOOL_IDENTITY, check=False)
        if result.returncode != 0:
            _stop(layout, progress, result.stdout + result.stderr)
    applied = len(commits_since(tree, progress["pin"]["base_tag"]))
    name = progress["patches"][progress["next"]]
    if applied == progress["next"] and (dirty := dirty_files(tree)):
        raise StackError(
            f"{where} has uncommitted changes but no `git am` in progress: "
            + ", ".join(dirty[:5]) + f". Discard them (`git -C {where} reset --hard`) "
            f"and run `make rebase VLLM_VERSION={progress['pin']['version']}` again: it "
            f"applies {name} again.")
    if applied == progress["next"] and _reflog_length(tree) != progress.get("stopped_reflog"):
        say(f"  the `git am` of {name} was undone (`git am --abort`, say), not skipped: "
            f"applying it again (to drop it, `git -C {where} am --skip` at its stop)")
    elif applied == progress["next"]:
        progress["patches"].pop(progress["next"])
        progress.setdefault("dropped", []).append(name)
        say(f"  dropped {name} (skipped with `git am --skip` during the rebase)")
    else:
        say(f"  [{applied}/{len(progress['patches'])}] resolved "
            f"{progress['patches'][applied - 1]}")
        progress["three_way"].append(progress["patches"][applied - 1])
        progress["next"] = applied
    write_state(tree, rebase=progress)


def _undo_killed_am(layout: Layout, progress: dict) -> None:
    """The last `make rebase` was killed inside its own `git am` (the state says
    it was running): remove the locks it left, undo that am, apply the patch again."""
    tree = layout.tree
    removed = remove_stale_git_locks(tree)
    if am_in_progress(tree) and git(tree, "am", "--abort", check=False).returncode != 0:
        git(tree, "am", "--quit")  # killed before its state was complete
    # The killed am may have created some of the patch's files: remove them if
    # untracked (only those: other untracked files may be the user's).
    name = progress["patches"][progress["next"]]
    if paths := touched_paths(name, (layout.patches_dir / name).read_bytes()):
        git(tree, "clean", "-q", "-f", "--", *paths, env={"GIT_LITERAL_PATHSPECS": "1"})
    progress["am_running"] = False
    write_state(tree, rebase=progress)
    say(f"  the last `make rebase` was killed while applying "
        f"{progress['patches'][progress['next']]}; undid that"
        + (f" (removed {', '.join(removed)})" if removed else "") + ", applying it again")


def _apply_remaining(layout: Layout, progress: dict) -> None:
    tree = layout.tree
    names = progress["patches"]
    while progress["next"] < len(names):
        name = names[progress["next"]]
        patch = layout.patches_dir / name
        # Its bytes as applied now: an edit made during the rebase is taken in.
        progress["synced"][name] = apply.patches_snapshot(layout).get(name)
        write_state(tree, rebase={**progress, "am_running": True})
        result = git(tree, *_AM_3WAY, str(patch.resolve()), env=TOOL_IDENTITY, check=False)
        write_state(tree, rebase=progress)
        output = result.stdout + result.stderr
        if result.returncode != 0:
            _stop(layout, progress, output)
        if "3-way merge" in output or "three-way merge" in output:
            progress["three_way"].append(name)
        say(f"  [{progress['next'] + 1}/{len(names)}] applied {name}"
            + (" (3-way merged: review it)" if name in progress["three_way"] else ""))
        progress["next"] += 1
        write_state(tree, rebase=progress)


def _stop(layout: Layout, progress: dict, output: str) -> None:
    tree, where = layout.tree, rel(layout.tree, layout)
    progress["stopped_reflog"] = _reflog_length(tree)
    write_state(tree, rebase=progress)
    name = progress["patches"][progress["next"]]
    version = progress["pin"]["version"]
    conflicted = git(tree, "diff", "--name-only", "--diff-filter=U").stdout.split()
    if "Patch is empty" in output or "patch is empty" in output.lower():
        what = (f"{name} changes nothing on vLLM {version}: it is probably upstream "
                f"already. Drop it with `git -C {where} am --skip`")
    elif deleted := _deleted_upstream(layout, progress, output, conflicted):
        what = "; ".join(f"upstream deleted {path}" for path in deleted) + (
            f" in vLLM {version}, and {name} changes it: drop the patch (`git -C {where} am "
            f"--skip`) or re-home its change where the code went (by hand, then `git -C "
            f"{where} add` what you changed and `git -C {where} rm` the deleted file). "
            f"Resolving it as a conflict would bring the deleted file back")
    else:
        files = conflicted or sorted(set(re.findall(r"(?:patch failed|conflict in) ?:? ?([^\s:]+)",
                                                    output, re.I)))
        what = (f"{name} conflicts with vLLM {version} in: {', '.join(files) or '(see below)'}"
                f"\n{apply.git_advice_removed(output)}\nResolve the files in {where}, then "
                f"`git -C {where} add <files>`")
    raise StackError(
        f"{what}; then run `make rebase VLLM_VERSION={version}` again to go on.\n"
        f"Nothing is lost: pin.toml and patches/ are unchanged, the old stack is "
        f"branch {progress['old_branch']} in {where}. To give up: `make rebase-abandon` "
        f"(it keeps what this rebase did as a branch).")


def abandon(layout: Layout) -> None:
    """`make rebase-abandon`: give up the rebase in progress, losing nothing.

    build/vllm goes back to branch `stack` on the old release (pin.toml and
    patches/ were never changed). What the rebase did is kept as branch
    `abandoned-rebase-<version>`: the patches it put on the new release and,
    as its last commit, the unfinished resolution of the patch it stopped at.
    """
    tree, where = layout.tree, rel(layout.tree, layout)
    if not is_stack_repo(tree) or not (progress := read_state(tree).get("rebase")):
        raise StackError(f"no rebase is in progress in {where}: nothing to abandon")
    version = progress["pin"]["version"]
    remove_stale_git_locks(tree)
    kept = _keep_rebase_work(layout, progress)
    if am_in_progress(tree) and git(tree, "am", "--abort", check=False).returncode != 0:
        git(tree, "am", "--quit")  # a killed am whose state was incomplete
    git(tree, "checkout", "-q", "-f", BRANCH)
    _remove_untracked_patch_files(layout, progress)
    if git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{rebase_branch(version)}",
           check=False).returncode == 0:
        git(tree, "branch", "-q", "-D", rebase_branch(version))
    write_state(tree, rebase=None, status="applied")
    say(f"abandoned the rebase to vLLM {version}: {where} is back on branch {BRANCH} "
        f"(pin.toml and patches/ unchanged)"
        + (f"; what the rebase did is kept as branch {kept}" if kept else ""))


def _keep_rebase_work(layout: Layout, progress: dict) -> str | None:
    """Point a new branch at the rebase's commits, plus a commit of the work tree
    when it holds changes (a resolution begun); return its name."""
    tree, version = layout.tree, progress["pin"]["version"]
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
        stopped_at = progress["patches"][progress["next"]] \
            if progress["next"] < len(progress["patches"]) else "the last patch"
        # The tool's identity as author too: a fresh machine may have none.
        identity = {**TOOL_IDENTITY, "GIT_AUTHOR_NAME": TOOL_IDENTITY["GIT_COMMITTER_NAME"],
                    "GIT_AUTHOR_EMAIL": TOOL_IDENTITY["GIT_COMMITTER_EMAIL"]}
        tip = git(tree, "commit-tree", work, "-p", tip, "-F", "-", env=identity,
                  input=f"Unfinished resolution of {stopped_at} (rebase abandoned)\n"
                  ).stdout.strip()
    if tip == git(tree, "rev-parse", progress["pin"]["base_tag"]).stdout.strip():
        return None  # nothing was done on the new release
    name, n = f"abandoned-rebase-{version}", 1
    while git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{name}",
              check=False).returncode == 0:
        n += 1
        name = f"abandoned-rebase-{version}-{n}"
    git(tree, "branch", name, tip)
    return name


def _remove_untracked_patch_files(layout: Layout, progress: dict) -> None:
    """Files the stopped `git am` created that `stack` does not track (they are
    kept in the abandoned branch): only the patch's own paths."""
    if progress["next"] >= len(progress["patches"]):
        return
    name = progress["patches"][progress["next"]]
    patch = layout.patches_dir / name
    if patch.is_file() and (paths := touched_paths(name, patch.read_bytes())):
        git(layout.tree, "clean", "-q", "-f", "--", *paths,
            env={"GIT_LITERAL_PATHSPECS": "1"})


def _deleted_upstream(layout: Layout, progress: dict, output: str,
                      conflicted: list[str]) -> list[str]:
    """The files the stopped patch changes that the old release had and the new
    one lacks (a modify/delete conflict, or "does not exist in index")."""
    tree = layout.tree
    candidates = set(conflicted) | set(re.findall(r"error: ([^:\s]+): does not exist in index",
                                                  output))
    old_base = read_state(tree)["base_tag"]

    def in_tree(rev: str, path: str) -> bool:
        return git(tree, "cat-file", "-e", f"{rev}:{path}", check=False).returncode == 0

    return sorted(path for path in candidates
                  if in_tree(old_base, path) and not in_tree(progress["pin"]["base_tag"], path))


def _finish(layout: Layout, progress: dict) -> None:
    tree = layout.tree
    new = _pin_from_dict(progress["pin"])
    # Before anything changes: the export at the end must not overwrite patches/
    # edited since the rebase read them.
    apply.refuse_overwriting_edits(layout, apply.rendered_stack(layout, new.base_tag),
                                   synced=progress.get("synced"))
    git(tree, "checkout", "-q", "-B", BRANCH, head(tree))
    git(tree, "branch", "-q", "-D", rebase_branch(new.version))
    write_atomically(layout.pin_file, render_pin(new).encode())
    write_state(tree, base_tag=new.base_tag, base_sdist_sha256=new.sdist.sha256,
                base_commit=git(tree, "rev-parse", new.base_tag).stdout.strip(),
                rebase=None, status="applied", synced=progress.get("synced"))
    apply.export_patches(layout)
    merged = progress["three_way"]
    say(f"rebased onto vLLM {new.version}; pin.toml updated"
        + (f"; review the 3-way merged patches: {', '.join(merged)}" if merged else "")
        + ". Next: `make test`, then commit pin.toml, patches/ and vllm_overlay/.")


def _pin_dict(pin: Pin) -> dict:
    return {"version": pin.version, "commit": pin.commit, "base_tag": pin.base_tag,
            "sdist": pin.sdist.__dict__, "wheel": pin.wheel.__dict__}


def _pin_from_dict(d: dict) -> Pin:
    return Pin(d["version"], d["commit"], d["base_tag"], Artifact(**d["sdist"]),
               Artifact(**d["wheel"]))
