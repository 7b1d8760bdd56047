"""`make check`: a fast self-check of the stack that needs no venv.

It proves, without touching build/vllm's branch or work tree, that
- patches/series and the patch files agree,
- every patch has a vLLM-style subject, a DCO sign-off and a rationale, and
  touches only safe paths outside the kernel sources,
- the series applies strictly to the pristine release and creates only
  regular files (no symlink or submodule, as git reads the patch), and
- vllm_overlay/ equals what the stack produces, and
- README.md's stack table and the patch numbers in README.md and docs/ agree
  with the series (scripts/stack/numbering.py), and
- BENCHMARKS.md's GPU tables are what their logs give (scripts/perf/gpu_tables.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from scripts.common import Layout, StackError, discard, rel, say, warn
from scripts.perf.gpu_tables import page_problems
from scripts.stack import overlay
from scripts.stack.apply import unexported_commits
from scripts.stack.gitrepo import DamagedRepo, create_base, dirty_files, is_stack_repo, read_state
from scripts.stack.numbering import numbering_problems
from scripts.stack.pin import Pin, load_pin
from scripts.stack.series import (
    Patch,
    apply_to_index,
    check_patch_paths,
    metadata_problems,
    read_series,
    stray_notes,
    unlisted_files,
)


def check(layout: Layout) -> int:
    start = time.monotonic()
    problems: list[str] = []
    pin = load_pin(layout.pin_file)
    patches = read_series(layout)
    problems += _series_agreement(layout, patches)
    for p in patches:
        problems += [f"{p.name}: {msg}" for msg in metadata_problems(p)]
        try:
            check_patch_paths(p)
        except StackError as e:
            problems.append(str(e))
    if not problems:
        problems += _stack_problems(layout, pin, patches)
    # Prose only: said whatever the patches are, and blocks no other check.
    problems += numbering_problems(layout, patches)
    problems += page_problems(layout)
    for msg in problems:
        say(f"FAIL {msg}")
    if note := _unchecked_work(layout):
        say(f"note: {note}")
    verdict = "FAILED" if problems else "OK"
    say(f"check {verdict}: {len(patches)} patch(es), {len(problems)} problem(s), "
        f"{time.monotonic() - start:.1f}s")
    return 1 if problems else 0


def _unchecked_work(layout: Layout) -> str | None:
    """What build/vllm holds that this check does not see (it checks patches/)."""
    tree = layout.tree
    if not is_stack_repo(tree) or not read_state(tree).get("base_tag"):
        return None
    try:
        edits = dirty_files(tree)
        commits = unexported_commits(layout, read_state(tree)["base_tag"])
    except DamagedRepo:
        return None  # the check has said so already, and read the release elsewhere
    if not edits and not commits:
        return None
    held = ", ".join(f"{n} {what}" for n, what in ((len(edits), "uncommitted change(s)"),
                                                   (len(commits), "commit(s) not exported"))
                     if n)
    return (f"{rel(tree, layout)} holds {held}; this checks patches/, not them: run "
            "`make patches` to export them, then `make check` again")


def _series_agreement(layout: Layout, patches: list[Patch]) -> list[str]:
    return [f"{rel(path, layout)} is not listed in patches/series" if path.suffix == ".patch"
            else f"{rel(path, layout)} does not belong in patches/"
            for path in unlisted_files(layout, patches)] + [
        f"{rel(path, layout)} belongs to no patch in patches/series (name it "
        "<patch file stem>.md, or delete it with its patch)"
        for path in stray_notes(layout, patches)]


def _stack_problems(layout: Layout, pin: Pin, patches: list[Patch]) -> list[str]:
    """Apply the series to the pristine release in a scratch index; compare the overlay.

    The release is read from build/vllm or build/check-base. A damaged
    build/vllm is named and passed over (check needs only the release, which
    check-base holds too); a damaged check-base, only the tooling's copy, is
    made again.
    """
    skip_tree, remade = False, False
    while True:
        repo = _base_repo(layout, pin, skip_tree)
        try:
            return _applied_problems(layout, repo, pin, patches)
        except DamagedRepo as e:
            if repo == layout.tree:
                warn(f"{e} (`make check` reads the release from "
                     f"{rel(layout.build_dir / 'check-base', layout)} instead)")
                skip_tree = True
            elif not remade:
                warn(f"{rel(repo, layout)}, the check's copy of the release, is damaged; "
                     "making it again")
                discard(repo)
                remade = True
            else:
                raise


def _applied_problems(layout: Layout, repo: Path, pin: Pin, patches: list[Patch]) -> list[str]:
    applied = apply_to_index(repo, pin.base_tag, patches)
    problems = applied.special + ([applied.failure] if applied.failure else [])
    if applied.tree and not applied.special:
        problems += _overlay_problems(layout, repo, pin, applied.tree, patches)
    return problems


def _base_repo(layout: Layout, pin: Pin, skip_tree: bool = False) -> Path:
    """A git repo holding the pristine release: build/vllm, or a check-only copy."""
    candidates = ([] if skip_tree else [layout.tree]) + [layout.build_dir / "check-base"]
    for repo in candidates:
        if is_stack_repo(repo) and read_state(repo).get("base_sdist_sha256") == pin.sdist.sha256:
            return repo
    from scripts.stack.fetch import ensure_artifact  # network code only when needed

    repo = layout.build_dir / "check-base"
    sdist = ensure_artifact(layout, pin.project, pin.sdist)
    create_base(layout, pin, sdist, dest=repo)
    return repo


def _overlay_problems(layout: Layout, repo: Path, pin: Pin, result_tree: str,
                      patches: list[Patch]) -> list[str]:
    expected = overlay.render(repo, pin, pin.base_tag, result_tree, [p.name for p in patches])
    actual = overlay.current_files(layout.overlay_dir)
    problems = [f"vllm_overlay/{path} is a {found.kind}, not a regular file (the overlay "
                "holds only files: `make apply` replaces it; commit the result)"
                for path, found in sorted(actual.items())
                if isinstance(found, overlay.NotRegular)]
    stale = sorted(path for path in expected.keys() | actual.keys()
                   if expected.get(path) != actual.get(path)
                   and not isinstance(actual.get(path), overlay.NotRegular))
    if stale:
        problems.append(f"vllm_overlay/ differs from what the stack produces in: "
                        f"{', '.join(stale)} (it is generated: run `make apply` and commit "
                        "the result)")
    return problems
