"""Apply the series to the pinned release (`make apply`) and export it back (`make patches`).

Apply is strict: `git am` without 3-way merging, so a patch that does not
apply exactly stops the run. Nothing in build/vllm that is not in patches/
(uncommitted edits, commits not exported yet, an unfinished `git am`) is
ever thrown away: the tooling refuses and says how to save or discard it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from scripts.common import Layout, StackError, rel, run, say, shown, warn, write_atomically
from scripts.stack import overlay
from scripts.stack.gitrepo import (
    BRANCH,
    TOOL_IDENTITY,
    am_in_progress,
    commits_since,
    create_base,
    dirty_files,
    git,
    has_merges,
    head,
    import_release,
    is_stack_repo,
    read_state,
    release_commit,
    remove_stale_git_locks,
    write_state,
)
from scripts.stack.pin import Pin, load_pin
from scripts.stack.series import (
    NOTES_DIR,
    Patch,
    apply_to_index,
    check_patch_paths,
    check_paths,
    read_series,
    series_digest,
    series_names,
    series_text,
    unlisted_files,
)

# Byte-stable export: no commit ids, no diffstat, no git version footer.
FORMAT_PATCH = ["-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                "-c", "format.signOff=false", "format-patch", "--stdout",
                "--zero-commit", "--no-stat", "--no-signature", "--full-index",
                "--keep-subject", "--no-renames", "--encoding=UTF-8", "--no-color"]
AM = ["am", "--keep-non-patch", "--whitespace=nowarn", "--committer-date-is-author-date"]


def render_commit(layout: Layout, commit: str, env: dict[str, str] | None = None) -> bytes:
    """`commit` as its file in patches/ (`env`: e.g. a scratch object store to read from)."""
    return git(layout.tree, *FORMAT_PATCH, "-1", commit, env=env, text=False).stdout


def git_advice_removed(output: str) -> str:
    """git's output without its advice (`git am --continue` and the like): the
    tooling says itself what to do next, and has often done it already."""
    advice = re.compile(r"^(hint: |When you have resolved|If you prefer to skip|"
                        r"To restore the original branch)")
    return "\n".join(line for line in output.strip().splitlines() if not advice.match(line))


def patch_name(subject: str) -> str:
    """A stable file name from a subject: '[ROCm][Model] Add X' -> 'rocm-model-add-x.patch'."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    if len(slug) > 64:
        slug = slug[:64].rsplit("-", 1)[0]
    return f"{slug or 'patch'}.patch"


# --- guarding work in build/vllm -------------------------------------------


def unexported_commits(layout: Layout, base: str) -> list[str]:
    """Commits on the branch whose export would not equal a file in patches/."""
    exported = {p.read_bytes() for p in layout.patches_dir.glob("*.patch")}
    return [c for c in commits_since(layout.tree, base)
            if render_commit(layout, c) not in exported]


def series_differs(layout: Layout, base: str, partial: bool) -> bool:
    """Whether the branch, every commit of it exported, is not patches/series in
    order: patches reordered or dropped in build/vllm since the last export.
    `partial`: an apply stopped half-way (failed, or killed) made the branch, so
    the series' first patches, in order, are all it need hold."""
    commits = [render_commit(layout, c) for c in commits_since(layout.tree, base)]
    try:
        listed = [p.path.read_bytes() for p in read_series(layout)]
    except StackError:
        return True  # a series that cannot be read cannot show the branch is in it
    return commits != (listed[:len(commits)] if partial else listed)


def recover_interrupted_apply(layout: Layout) -> None:
    """Undo what a killed `make apply` left: git's lock files, its `git am`, and
    a half-done `git checkout` of the base.

    The state file says "applying" only while apply runs, and the project lock
    says no apply runs now: that git was ours. Before it wrote "applying",
    apply checked that build/vllm held nothing that patches/ does not (no
    uncommitted change, every commit exported), so whatever differs from the
    base now is apply's own half-done work: it is reset to the base, never
    mistaken for the user's uncommitted changes.
    """
    tree, where = layout.tree, rel(layout.tree, layout)
    state = read_state(tree)
    if state.get("status") != "applying":
        return
    if removed := remove_stale_git_locks(tree):
        say(f"removed {', '.join(removed)} from {where}: left by a `make apply` "
            "that was killed")
    if am_in_progress(tree) and git(tree, "am", "--abort", check=False).returncode != 0:
        git(tree, "am", "--quit")  # killed before its state was complete
    base = state["base_tag"]
    at_base = git(tree, "rev-parse", f"{base}^{{commit}}").stdout.strip() == head(tree)
    if dirty_files(tree) or not at_base:
        say(f"{where}: the last `make apply` was killed half-way; reset to {base}, from "
            "where the series is applied again")
    git(tree, "checkout", "-q", "-f", "-B", BRANCH, base)
    git(tree, "clean", "-q", "-f", "-d")  # files a killed git created; never ignored ones


def uncommitted_advice(where: str) -> str:
    return (f"To keep them: commit them there (`git -C {where} add -A && git -C {where} "
            f"commit`; `add -A` takes new files too) and run `make patches`.")


def guard_tree(layout: Layout, action: str) -> None:
    """Refuse when build/vllm holds work that `action` would lose."""
    tree, where = layout.tree, rel(layout.tree, layout)
    recover_interrupted_apply(layout)
    state = read_state(tree)
    if am_in_progress(tree):
        raise StackError(
            f"a `git am` is in progress in {where} (a rebase or an edit by hand). "
            f"Finish it (`git -C {where} am --continue`, then `make patches`) or "
            f"abort it (`git -C {where} am --abort`) before {action}.")
    branch = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()
    if branch != BRANCH:
        raise StackError(f"{where} is not on branch {BRANCH!r} (on {branch or 'a detached HEAD'}); "
                         f"`git -C {where} checkout {BRANCH}` before {action}.")
    if dirty := dirty_files(tree):
        shown = "\n  ".join(dirty[:10]) + ("\n  ..." if len(dirty) > 10 else "")
        raise StackError(
            f"{where} has uncommitted changes:\n  {shown}\n"
            + uncommitted_advice(where)
            + f" To set them aside: `git -C {where} stash -u` (`make clean` keeps "
            f"stashes). Then run {action} again.")
    base = state.get("base_tag")
    if base and has_merges(tree, base):
        raise StackError(f"{where} has merge commits on {BRANCH}; the stack must be linear")
    # Untouched since the last apply or export: every commit was in patches/,
    # even if patches/ has moved on since (a pull). Applying the new series
    # deletes nothing: the old commits stay in the reflog, and `make clean`
    # keeps any that no saved patch holds.
    untouched = state.get("status") == "applied" and state.get("applied_head") == head(tree)
    if base and not untouched and (lost := unexported_commits(layout, base)):
        subjects = [git(tree, "log", "-1", "--format=%h %s", c).stdout.strip() for c in lost]
        raise StackError(
            f"{where} has commits that are not exported to patches/:\n  "
            + "\n  ".join(subjects)
            + f"\nRun `make patches` to export them, or keep them on a branch "
            f"(`git -C {where} branch saved-work`; `make clean` keeps it) and reset with "
            f"`git -C {where} reset --hard {base}`; then run {action} again.")
    partial = state.get("status") in ("failed", "applying")
    if base and not untouched and series_differs(layout, base, partial):
        raise StackError(
            f"{where}'s commits are not patches/series in order (patches reordered or "
            f"dropped there): {action} would undo that. Run `make patches` to export "
            f"the new order, or reset with `git -C {where} reset --hard {base}`; then "
            f"run {action} again.")


# --- apply --------------------------------------------------------------------


def apply(layout: Layout) -> None:
    pin = load_pin(layout.pin_file)
    tree = layout.tree
    if tree.exists() and not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} exists but was not made by this tooling; "
                         "move it away (nothing in it was touched) and run `make apply` again")
    if tree.exists():
        finish_interrupted_export(layout)
        _follow_base_tag(layout, pin)
        release_commit(layout)  # a tag moved off the release: every diff would be wrong
    patches = read_series(layout)
    for p in patches:
        check_patch_paths(p)
    for path in unlisted_files(layout, patches):
        if path.suffix == ".patch":
            warn(f"{rel(path, layout)} is not listed in patches/series, so it is not "
                 "applied; add it to the series or remove it")
    if tree.exists():
        guard_tree(layout, "`make apply`")
        state = read_state(tree)
        if state.get("base_sdist_sha256") != pin.sdist.sha256:
            _import_base(layout, pin)
        elif (state.get("status") == "applied"
              and state.get("applied_digest") == series_digest(patches)
              and state.get("applied_head") == head(tree)):
            say(f"{len(patches)} patch(es) already applied")
            _finish(layout, pin, patches)
            return
    else:
        sdist = _sdist(layout, pin)
        create_base(layout, pin, sdist)
    _refuse_special_files(layout, pin, patches)
    _apply_series(layout, pin, patches)
    _finish(layout, pin, patches)


def _sdist(layout: Layout, pin: Pin) -> Path:
    # Imported here: most runs need no network code (urllib, http), which would
    # make every command start slower.
    from scripts.stack.fetch import ensure_artifact

    return ensure_artifact(layout, pin.project, pin.sdist)


def _follow_base_tag(layout: Layout, pin: Pin) -> None:
    """pin.toml names another tag for the release build/vllm holds: tag its
    release commit so, and record the tag, so no later command uses the old one."""
    tree = layout.tree
    state = read_state(tree)
    if (state.get("base_sdist_sha256") == pin.sdist.sha256 and state.get("base_commit")
            and state.get("base_tag") != pin.base_tag):
        git(tree, "tag", "-f", pin.base_tag, state["base_commit"])
        write_state(tree, base_tag=pin.base_tag)
        say(f"{rel(tree, layout)}: the release is now tagged {pin.base_tag} (pin.toml)")


def _import_base(layout: Layout, pin: Pin) -> None:
    """After a pin change: the new release becomes the base in the same repository,
    so its branches, stashes, worktrees and history stay where they are."""
    tree = layout.tree
    say(f"{rel(tree, layout)} holds another vLLM release; rebuilding it for {pin.version} "
        "(its branches, stashes and history stay)")
    sdist = _sdist(layout, pin)
    commit = import_release(layout, pin, sdist, parent=None)
    write_state(tree, base_sdist_sha256=pin.sdist.sha256, base_tag=pin.base_tag,
                base_commit=commit, status="base")


def _refuse_special_files(layout: Layout, pin: Pin, patches: list[Patch]) -> None:
    """Before any `git am`: refuse a patch that git would turn into a symlink or a
    submodule, judged from the tree git builds from it in a scratch index."""
    result = apply_to_index(layout.tree, pin.base_tag, patches)
    if result.special:
        raise StackError("\n".join(result.special) + "\nNothing was applied; fix the patch "
                         "in patches/ and run `make apply` again.")


def _apply_series(layout: Layout, pin: Pin, patches: list[Patch]) -> None:
    tree = layout.tree
    base = read_state(tree)["base_tag"]
    write_state(tree, status="applying")
    git(tree, "checkout", "-q", "-B", BRANCH, base)
    git(tree, "reset", "-q", "--hard", base)
    for n, patch in enumerate(patches, 1):
        result = git(tree, *AM, str(patch.path.resolve()), env=TOOL_IDENTITY, check=False)
        if result.returncode != 0:
            _report_failed_patch(layout, patch, result.stdout + result.stderr)
        say(f"  [{n}/{len(patches)}] applied {patch.name}")
    write_state(tree, status="applied", applied_head=head(tree),
                applied_digest=series_digest(patches))


def _report_failed_patch(layout: Layout, patch: Patch, output: str) -> None:
    tree = layout.tree
    git(tree, "am", "--abort")
    write_state(tree, status="failed", applied_head=head(tree), failed_patch=patch.name)
    files = sorted(set(re.findall(r"error: (?:patch failed: )?([^:\s]+)(?::\d+|: )", output)))
    raise StackError(
        f"{patch.name} does not apply to vLLM {load_pin(layout.pin_file).version}"
        + (f"; failing file(s): {', '.join(files)}" if files else "")
        + f"\n{git_advice_removed(output)}\n"
        f"The am was aborted; {rel(tree, layout)} holds the patches before it and "
        "the pristine base is intact. Fix or regenerate the patch (see README: "
        "'Edit a patch'), or after a vLLM bump use `make rebase`.")


def _finish(layout: Layout, pin: Pin, patches: list[Patch]) -> None:
    write_state(layout.tree, synced=patches_snapshot(layout))
    overlay.regenerate(layout, pin, [p.name for p in patches])
    say(f"patched tree: {layout.tree}  (branch {BRANCH}, {len(patches)} patch(es) "
        f"on {pin.base_tag})")


# --- make patches: build/vllm's commits back to patches/ -------------------------


SERIES = "series"  # the series file's entry in the state's snapshot of patches/


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str | None:
    """sha256 of the regular file at `path`; None if nothing is there; for anything
    else (a link, a folder) a marker that equals no file's sha256."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    return _sha256(path.read_bytes())


def patches_snapshot(layout: Layout) -> dict[str, str]:
    """sha256 of the series file and of each patch file it lists, as build/vllm
    holds them now (after apply or export): what a later `make patches` may
    overwrite without losing anything. (A patch file the series does not list
    is no part of it: someone's, kept.)"""
    found = {name: file_sha256(layout.patches_dir / name) for name in series_names(layout)}
    found[SERIES] = file_sha256(layout.series_file)
    return {name: digest for name, digest in found.items() if digest}


def rendered_stack(layout: Layout, base: str) -> dict[str, bytes]:
    """The commits on `base` as patch files: name -> bytes, in order."""
    tree = layout.tree
    rendered: dict[str, bytes] = {}
    for commit in commits_since(tree, base):
        subject = git(tree, "log", "-1", "--format=%s", commit).stdout.strip()
        name = patch_name(subject)
        if name in rendered:
            raise StackError(f"two commits would both be exported as {name}; "
                             "give one of them a different subject")
        content = render_commit(layout, commit)
        # What apply and check would refuse is not exported either.
        check_paths(f"{name} (commit {shown(subject)})", content)
        rendered[name] = content
    return rendered


def refuse_overwriting_edits(layout: Layout, rendered: dict[str, bytes],
                             synced: dict[str, str] | None = None) -> None:
    """Refuse when writing `rendered` would overwrite a change made in patches/
    since build/vllm last matched it (a hand edit, a pull): every file that
    would be rewritten or deleted must still be as `make apply` or
    `make patches` last left it. A missing file loses nothing."""
    state = read_state(layout.tree)
    if synced is None:
        synced = state.get("synced")
    old_names = series_names(layout) if layout.series_file.exists() else []
    if synced is None:  # a state from before snapshots: the series digest tells
        try:
            unchanged = state.get("applied_digest") == series_digest(read_series(layout))
        except StackError:  # a listed file deleted, say: then nothing counts as unchanged
            unchanged = False
        synced = patches_snapshot(layout) if unchanged else {}
    wanted = {name: _sha256(content) for name, content in rendered.items()}
    wanted[SERIES] = _sha256(series_text(list(rendered)))
    edited = []
    for name in sorted(wanted.keys() | set(old_names)):
        path = layout.series_file if name == SERIES else layout.patches_dir / name
        current = file_sha256(path)
        if current not in (None, wanted.get(name), synced.get(name)):
            edited.append(f"patches/{name}")
    if edited:
        raise StackError(
            "patches/ changed since build/vllm last matched it (a hand edit, or a pull): "
            + ", ".join(edited) + ". `make patches` would overwrite that, so nothing was "
            "written. To keep patches/ as it is: `make apply` (build/vllm then holds it). "
            "To keep build/vllm's commits instead: delete the files named (git keeps what "
            "was committed), then run `make patches` again.")


def export_patches(layout: Layout) -> None:
    """Write the commits on top of the base back to patches/ and the series file.

    Nothing is lost to a kill: each patch file is replaced whole, the new
    series goes in only after every file it names is written, and the files
    it drops are removed last, as a journal in the state file says (a killed
    run's journal is finished by the next `make patches` or `make apply`).
    """
    pin = load_pin(layout.pin_file)
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    finish_interrupted_export(layout)
    _guard_exportable(layout)
    rendered = rendered_stack(layout, read_state(tree)["base_tag"])
    refuse_overwriting_edits(layout, rendered)
    old_names = series_names(layout) if layout.series_file.exists() else []
    layout.patches_dir.mkdir(exist_ok=True)
    changed = 0
    for name, content in rendered.items():
        path = layout.patches_dir / name
        if file_sha256(path) != _sha256(content):
            write_atomically(path, content)
            changed += 1
    dropped = {name: file_sha256(layout.patches_dir / name)
               for name in set(old_names) - rendered.keys()}
    notes = notes_to_remove(layout, dropped, added=rendered.keys() - set(old_names))
    write_state(tree, exporting={"series": series_text(list(rendered)).decode(),
                                 "remove": {**dropped, **notes}})
    finish_interrupted_export(layout, quiet=True)
    patches = read_series(layout)
    write_state(tree, status="applied", applied_head=head(tree),
                applied_digest=series_digest(patches), synced=patches_snapshot(layout))
    say(f"exported {len(rendered)} patch(es) to {rel(layout.patches_dir, layout)}/ "
        f"({changed} written, {len(dropped)} removed)")
    overlay.regenerate(layout, pin, list(rendered))


def notes_to_remove(layout: Layout, dropped_patches, added) -> dict[str, str]:
    """The notes of the patches an export drops (`make check` refuses notes of no
    patch), by `notes/<stem>.md` and digest: each only if the project's git has
    it committed as it is, and only when no patch joins the series (a changed
    subject renames a patch: its notes are to be renamed, not lost). Any other
    is kept, and named."""
    remove = {}
    for name in dropped_patches:
        path = layout.patches_dir / NOTES_DIR / f"{Path(name).stem}.md"
        if path.is_symlink() or not path.is_file():
            continue
        if added:
            warn(f"kept {rel(path, layout)}: its patch left the series while "
                 f"{', '.join(sorted(added))} joined it; if one is the same patch renamed, "
                 "rename the notes to its stem, else delete them")
        elif _committed_as_is(layout, path):
            remove[f"{NOTES_DIR}/{path.name}"] = file_sha256(path)
        else:
            warn(f"kept {rel(path, layout)}: its patch left the series, but the file is not "
                 "committed as it is; move what it says elsewhere and delete it")
    return remove


def _committed_as_is(layout: Layout, path: Path) -> bool:
    """Whether the project's git holds `path` at HEAD with these bytes."""
    where = str(path.relative_to(layout.root))
    committed = run(["git", "rev-parse", "-q", "--verify", f"HEAD:./{where}"], cwd=layout.root,
                    check=False)
    if committed.returncode != 0:
        return False
    current = run(["git", "hash-object", "--", where], cwd=layout.root, check=False)
    return current.returncode == 0 and current.stdout.strip() == committed.stdout.strip()


def finish_interrupted_export(layout: Layout, quiet: bool = False) -> None:
    """Finish the last step of an export, as its journal in the state file says:
    write the new series, then remove the patch files it no longer lists (each
    only if it still has the bytes the export saw)."""
    tree = layout.tree
    journal = read_state(tree).get("exporting")
    if not journal:
        return
    write_atomically(layout.series_file, journal["series"].encode())
    listed = set(series_names(layout))
    for name, digest in journal["remove"].items():
        path = layout.patches_dir / name
        if name not in listed and digest and file_sha256(path) == digest:
            path.unlink()  # still in the project's git history, or in build/vllm's
            if name.startswith(f"{NOTES_DIR}/"):
                say(f"removed {rel(path, layout)}: its patch left the series "
                    "(the project's git still has it)")
    write_state(tree, exporting=None)
    if not quiet:
        say(f"finished the export to {rel(layout.patches_dir, layout)}/ that an earlier "
            "`make patches` began (it was interrupted)")


def _guard_exportable(layout: Layout) -> None:
    tree, where = layout.tree, rel(layout.tree, layout)
    recover_interrupted_apply(layout)
    if am_in_progress(tree):
        raise StackError(f"a `git am` is in progress in {where}; finish it "
                         f"(`git -C {where} am --continue`) or abort it first")
    branch = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()
    if branch != BRANCH:
        raise StackError(f"{where} is not on branch {BRANCH!r}; check it out first")
    if dirty := dirty_files(tree):
        raise StackError(f"{where} has uncommitted changes ({', '.join(dirty[:5])}). "
                         + uncommitted_advice(where))
    state = read_state(tree)
    if has_merges(tree, state["base_tag"]):
        raise StackError(f"{where} has merge commits; the stack must be linear")
    if state.get("status") in ("applying", "base"):
        raise StackError(f"the last `make apply` did not finish, so {where} may hold only "
                         "part of the series; exporting it would drop the rest from "
                         "patches/. Run `make apply` first.")
    if state.get("status") == "failed":
        failed = state.get("failed_patch", "a patch")
        names = [p.name for p in read_series(layout)]
        applied = len(commits_since(tree, state["base_tag"]))
        if applied < len(names):
            raise StackError(
                f"the last `make apply` stopped at {failed}; exporting now would drop "
                f"it and the {len(names) - applied - 1} patch(es) after it from patches/. "
                f"Apply them in {where} first (`git -C {where} am -3 <patch>`, resolve, "
                "`git am --continue`), then run `make patches`; or fix the patch file "
                "and run `make apply`.")
