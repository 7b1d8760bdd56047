"""Every prefix of the stack is a green vLLM tree.

Each patch is a future upstream PR that lands on its own, so the tree after
patch k must pass the lint checks and the vLLM tests of patches 1..k without
the patches after it. The full stack is what the other suites test; this runs
each shorter prefix in a detached git worktree of build/vllm
(build/prefix-tree), with the compiled kernels of the .venv install linked in,
and vLLM imported from the worktree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.common import Layout, StackError, rel, run
from scripts.gitrepo import commits_since, git

WORKTREE = "prefix-tree"


def prefix_commits(tree: Path, base: str) -> list[str]:
    """The stack's commits but the last, oldest first: the proper prefixes."""
    return commits_since(tree, base)[:-1]


def worktree_path(layout: Layout) -> Path:
    return layout.build_dir / WORKTREE


@contextmanager
def prefix_worktree(layout: Layout) -> Iterator[Path]:
    """A detached worktree of build/vllm, removed afterwards."""
    path = worktree_path(layout)
    _remove_worktree(layout)  # left over from an interrupted run
    git(layout.tree, "worktree", "add", "--quiet", "--detach", str(path), "HEAD")
    try:
        yield path
    finally:
        _remove_worktree(layout)


def check_out(layout: Layout, worktree: Path, commit: str) -> None:
    git(worktree, "checkout", "--quiet", "--detach", commit)
    _link_build_outputs(layout.tree, worktree)
    _verify_import(layout, worktree)


def python_path(layout: Layout, worktree: Path) -> str:
    # The worktree comes before .venv's editable finder, which points at build/vllm.
    return os.pathsep.join([str(worktree), str(layout.root)])


def _remove_worktree(layout: Layout) -> None:
    path = worktree_path(layout)
    if path.exists():
        git(layout.tree, "worktree", "remove", "--force", str(path))
    git(layout.tree, "worktree", "prune")


def _link_build_outputs(tree: Path, worktree: Path) -> None:
    """Link what the editable install put into build/vllm (kernels, vendored
    packages): git ignores it, so a checkout does not bring it along."""
    out = git(tree, "ls-files", "--others", "--ignored", "--exclude-standard",
              "--directory", "vllm/").stdout
    for entry in sorted(out.splitlines()):
        relative = entry.rstrip("/")
        if "__pycache__" in relative or relative.endswith(".pyc"):
            continue
        link = worktree / relative
        if not link.parent.is_dir() or link.exists() or link.is_symlink():
            continue
        link.symlink_to(tree / relative)


def _verify_import(layout: Layout, worktree: Path) -> None:
    from scripts.venv import venv_python

    probe = "import importlib.util as u, os; print(os.path.realpath(u.find_spec('vllm').origin))"
    where = run([str(venv_python(layout)), "-c", probe], cwd=worktree,
                env={"PYTHONPATH": python_path(layout, worktree)}).stdout.strip()
    if not where.startswith(str(worktree.resolve()) + os.sep):
        raise StackError(f"with {rel(worktree, layout)} first on PYTHONPATH, vllm still "
                         f"imports from {where}; the prefix tests would test the wrong tree")
