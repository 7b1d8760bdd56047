"""`make rebase VLLM_VERSION=x.y.z`: move the stack onto another vLLM release.

The new release is committed in build/vllm as a child of the old one, and
the patches are re-applied on it with 3-way merging allowed. At the first
conflict the run stops, names the patch and the files, and says how to go on;
pin.toml and patches/ change only once every patch is on the new release
(then the patches are re-exported, so no resolution stays unexported). The
old stack stays in build/vllm as branch `stack-<old version>`.
"""

from __future__ import annotations

import re

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
            f"{progress['pin']['version']}` or abandon it (see README)")
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
    new = pin_for(old, version)
    sdist = ensure_artifact(layout, new.project, new.sdist)
    tree = layout.tree
    old_base = read_state(tree)["base_tag"]
    commit = import_release(layout, new, sdist, parent=old_base)
    new = Pin(new.version, release_commit_id(tree, commit) or "unknown",
              new.base_tag, new.sdist, new.wheel)
    git(tree, "branch", "-f", f"{BRANCH}-{old.version}", BRANCH)
    git(tree, "checkout", "-q", "-B", f"rebase-{version}", commit)
    progress = {"pin": _pin_dict(new), "patches": [p.name for p in read_series(layout)],
                "next": 0, "three_way": [], "old_branch": f"{BRANCH}-{old.version}",
                # patches/ as the rebase read it: what its export may overwrite
                "synced": apply.patches_snapshot(layout)}
    write_state(tree, rebase=progress, status="rebasing")
    say(f"rebasing {len(progress['patches'])} patch(es) from vLLM {old.version} onto "
        f"{version} (3-way merge allowed; old stack kept as {progress['old_branch']})")
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
    else:
        files = conflicted or sorted(set(re.findall(r"(?:patch failed|conflict in) ?:? ?([^\s:]+)",
                                                    output, re.I)))
        what = (f"{name} conflicts with vLLM {version} in: {', '.join(files) or '(see below)'}"
                f"\n{apply.git_advice_removed(output)}\nResolve the files in {where}, then "
                f"`git -C {where} add <files>`")
    raise StackError(
        f"{what}; then run `make rebase VLLM_VERSION={version}` again to go on.\n"
        f"Nothing is lost: pin.toml and patches/ are unchanged, the old stack is "
        f"branch {progress['old_branch']} in {where}. To give up: "
        f"`git -C {where} am --abort && git -C {where} checkout {BRANCH}`, then "
        f"remove the \"rebase\" entry from {where}/.git/k3-stack.json.")


def _finish(layout: Layout, progress: dict) -> None:
    tree = layout.tree
    new = _pin_from_dict(progress["pin"])
    # Before anything changes: the export at the end must not overwrite patches/
    # edited since the rebase read them.
    apply.refuse_overwriting_edits(layout, apply.rendered_stack(layout, new.base_tag),
                                   synced=progress.get("synced"))
    git(tree, "checkout", "-q", "-B", BRANCH, head(tree))
    git(tree, "branch", "-q", "-D", f"rebase-{new.version}")
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
