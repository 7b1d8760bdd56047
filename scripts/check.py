"""`make check`: a fast self-check of the stack that needs no venv.

It proves, without touching build/vllm's branch or work tree, that
- patches/series and the patch files agree,
- every patch has a vLLM-style subject, a DCO sign-off and a rationale, and
  touches only safe paths outside the kernel sources,
- the series applies strictly to the pristine release, and
- vllm_overlay/ equals what the stack produces.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from scripts import overlay
from scripts.common import Layout, StackError, rel, say
from scripts.fetch import ensure_artifact
from scripts.gitrepo import create_base, git, is_stack_repo, read_state
from scripts.pin import Pin, load_pin
from scripts.series import Patch, check_patch_paths, metadata_problems, read_series

_ALLOWED_EXTRA_FILES = {"series", "README.md"}
# Per-patch PR notes (long rationale, hardware test plan) that `make export`
# folds into each PR description: patches/notes/<patch file stem>.md.
NOTES_DIR = "notes"


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
        repo = _base_repo(layout, pin)
        result_tree, apply_problems = _apply_in_index(repo, pin, patches)
        problems += apply_problems
        if result_tree:
            problems += _overlay_problems(layout, repo, pin, result_tree, patches)
    for msg in problems:
        say(f"FAIL {msg}")
    verdict = "FAILED" if problems else "OK"
    say(f"check {verdict}: {len(patches)} patch(es), {len(problems)} problem(s), "
        f"{time.monotonic() - start:.1f}s")
    return 1 if problems else 0


def _series_agreement(layout: Layout, patches: list[Patch]) -> list[str]:
    listed = {p.name for p in patches}
    problems = []
    for path in sorted(layout.patches_dir.iterdir()):
        if path.name in listed or path.name in _ALLOWED_EXTRA_FILES:
            continue
        if path.name == NOTES_DIR and path.is_dir() and not path.is_symlink():
            problems += _stray_notes(layout, path, listed)
        elif path.suffix == ".patch":
            problems.append(f"{rel(path, layout)} is not listed in patches/series")
        else:
            problems.append(f"{rel(path, layout)} does not belong in patches/")
    return problems


def _stray_notes(layout: Layout, notes_dir: Path, listed: set[str]) -> list[str]:
    stems = {Path(name).stem for name in listed}
    return [
        f"{rel(path, layout)} belongs to no patch in patches/series "
        "(rename it after its patch, or delete it with the patch)"
        for path in sorted(notes_dir.iterdir())
        if path.suffix != ".md" or path.stem not in stems or not path.is_file()
    ]


def _base_repo(layout: Layout, pin: Pin) -> Path:
    """A git repo holding the pristine release: build/vllm, or a check-only copy."""
    for repo in (layout.tree, layout.build_dir / "check-base"):
        if is_stack_repo(repo) and read_state(repo).get("base_sdist_sha256") == pin.sdist.sha256:
            return repo
    repo = layout.build_dir / "check-base"
    sdist = ensure_artifact(layout, pin.project, pin.sdist)
    create_base(layout, pin, sdist, dest=repo)
    return repo


def _apply_in_index(repo: Path, pin: Pin, patches: list[Patch]) -> tuple[str | None, list[str]]:
    """Apply the series strictly to the base in a scratch index; return the tree id."""
    fd, index = tempfile.mkstemp(prefix="k3-check-index-")
    os.close(fd)
    env = {"GIT_INDEX_FILE": index}
    try:
        git(repo, "read-tree", pin.base_tag, env=env)
        for p in patches:
            result = git(repo, "apply", "--cached", "--whitespace=nowarn",
                         str(p.path.resolve()), env=env, check=False)
            if result.returncode != 0:
                return None, [f"{p.name} does not apply strictly to {pin.base_tag} after "
                              f"the patches before it:\n{result.stderr.strip()}"]
        return git(repo, "write-tree", env=env).stdout.strip(), []
    finally:
        os.unlink(index)


def _overlay_problems(layout: Layout, repo: Path, pin: Pin, result_tree: str,
                      patches: list[Patch]) -> list[str]:
    expected = overlay.render(repo, pin, pin.base_tag, result_tree, [p.name for p in patches])
    actual = overlay.current_files(layout.overlay_dir)
    stale = sorted(path for path in expected.keys() | actual.keys()
                   if expected.get(path) != actual.get(path))
    if not stale:
        return []
    return [f"vllm_overlay/ differs from what the stack produces in: {', '.join(stale)} "
            "(it is generated: run `make apply` and commit the result)"]
