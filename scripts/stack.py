"""Apply the series to the pinned release (`make apply`) and export it back (`make patches`).

Apply is strict: `git am` without 3-way merging, so a patch that does not
apply exactly stops the run. Nothing in build/vllm that is not in patches/
(uncommitted edits, commits not exported yet, an unfinished `git am`) is
ever thrown away: the tooling refuses and says how to save or discard it.
"""

from __future__ import annotations

import re

from scripts import overlay
from scripts.common import Layout, StackError, rel, say, warn
from scripts.fetch import ensure_artifact
from scripts.gitrepo import (
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
    remove_stale_git_locks,
    write_state,
)
from scripts.pin import Pin, load_pin
from scripts.series import (
    Patch,
    apply_to_index,
    check_patch_paths,
    read_series,
    series_digest,
    unlisted_files,
    write_series,
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


def recover_interrupted_apply(layout: Layout) -> None:
    """Undo what a killed `make apply` left: git's lock files and its `git am`.

    The state file says "applying" only while apply runs, and the project lock
    says no apply runs now: that git was ours, and the patch it stopped at
    came from patches/.
    """
    tree = layout.tree
    if read_state(tree).get("status") != "applying":
        return
    if removed := remove_stale_git_locks(tree):
        say(f"removed {', '.join(removed)} from {rel(tree, layout)}: left by a `make apply` "
            "that was killed")
    if am_in_progress(tree) and git(tree, "am", "--abort", check=False).returncode != 0:
        git(tree, "am", "--quit")  # killed before its state was complete


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


# --- apply --------------------------------------------------------------------


def apply(layout: Layout) -> None:
    pin = load_pin(layout.pin_file)
    patches = read_series(layout)
    for p in patches:
        check_patch_paths(p)
    for path in unlisted_files(layout, patches):
        if path.suffix == ".patch":
            warn(f"{rel(path, layout)} is not listed in patches/series, so it is not "
                 "applied; add it to the series or remove it")
    tree = layout.tree
    if tree.exists() and not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} exists but was not made by this tooling; "
                         "move it away (nothing in it was touched) and run `make apply` again")
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
        sdist = ensure_artifact(layout, pin.project, pin.sdist)
        create_base(layout, pin, sdist)
    _refuse_special_files(layout, pin, patches)
    _apply_series(layout, pin, patches)
    _finish(layout, pin, patches)


def _import_base(layout: Layout, pin: Pin) -> None:
    """After a pin change: the new release becomes the base in the same repository,
    so its branches, stashes, worktrees and history stay where they are."""
    tree = layout.tree
    say(f"{rel(tree, layout)} holds another vLLM release; rebuilding it for {pin.version} "
        "(its branches, stashes and history stay)")
    sdist = ensure_artifact(layout, pin.project, pin.sdist)
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
    overlay.regenerate(layout, pin, [p.name for p in patches])
    say(f"patched tree: {layout.tree}  (branch {BRANCH}, {len(patches)} patch(es) "
        f"on {pin.base_tag})")


# --- make patches: build/vllm's commits back to patches/ -------------------------


def export_patches(layout: Layout) -> None:
    """Write the commits on top of the base back to patches/ and the series file."""
    pin = load_pin(layout.pin_file)
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    _guard_exportable(layout)
    base = read_state(tree)["base_tag"]
    old_names = [p.name for p in read_series(layout)] if layout.series_file.exists() else []
    rendered: dict[str, bytes] = {}
    for commit in commits_since(tree, base):
        subject = git(tree, "log", "-1", "--format=%s", commit).stdout.strip()
        name = patch_name(subject)
        if name in rendered:
            raise StackError(f"two commits would both be exported as {name}; "
                             "give one of them a different subject")
        rendered[name] = render_commit(layout, commit)
    layout.patches_dir.mkdir(exist_ok=True)
    changed = 0
    for name, content in rendered.items():
        path = layout.patches_dir / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            changed += 1
    for name in set(old_names) - rendered.keys():
        (layout.patches_dir / name).unlink()  # still in the project's git history
    write_series(layout, list(rendered))
    patches = read_series(layout)
    write_state(tree, status="applied", applied_head=head(tree),
                applied_digest=series_digest(patches))
    dropped = len(set(old_names) - rendered.keys())
    say(f"exported {len(rendered)} patch(es) to {rel(layout.patches_dir, layout)}/ "
        f"({changed} written, {dropped} removed)")
    overlay.regenerate(layout, pin, list(rendered))


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
