"""Every prefix of the stack is a green vLLM tree.

Each patch is a future upstream PR that lands on its own, so the tree after
patch k must pass the lint checks and the vLLM tests of patches 1..k without
the patches after it. The full stack is what the other suites test; this tests
each shorter prefix k in a detached git worktree of build/vllm
(build/prefix-trees/<k>), with the compiled kernels of the .venv install
linked in, and vLLM imported from the worktree. A worktree is made when a
test first needs it (a prefix whose tests are all reused needs none) and
removed when `make test` ends.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from scripts.common import Layout, StackError, rel, run
from scripts.stack.gitrepo import commits_since, git

WORKTREES = "prefix-trees"


def prefix_commits(tree: Path, base: str) -> list[str]:
    """The stack's commits but the last, oldest first: the proper prefixes."""
    return commits_since(tree, base)[:-1]


class PrefixTrees:
    """build/prefix-trees/<k>: one worktree per prefix, made on first use (by
    several threads at once, if need be), all removed on leaving."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.folder = layout.build_dir / WORKTREES
        self._made: set[Path] = set()
        self._lock = threading.Lock()

    def path(self, k: int) -> Path:
        """Where prefix k is checked out (it need not exist yet)."""
        return self.folder / str(k)

    def at(self, k: int, commit: str) -> Path:
        """The worktree of prefix k, at `commit`."""
        path = self.path(k)
        with self._lock:
            if path not in self._made:
                self.folder.mkdir(parents=True, exist_ok=True)
                git(self.layout.tree, "worktree", "add", "--quiet", "--detach", str(path), commit)
                self._made.add(path)
                link_build_outputs(self.layout.tree, path)
                _verify_import(self.layout, path)
        return path

    def __enter__(self) -> PrefixTrees:
        self._remove()  # left over from an interrupted run
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        tree = self.layout.tree
        if self.folder.is_dir():
            for path in sorted(self.folder.iterdir()):
                if (path / ".git").is_file():
                    git(tree, "worktree", "remove", "--force", str(path), check=False)
            shutil.rmtree(self.folder, ignore_errors=True)
        old = self.layout.build_dir / "prefix-tree"  # where earlier versions kept one
        if (old / ".git").is_file():
            git(tree, "worktree", "remove", "--force", str(old), check=False)
        if tree.exists():
            git(tree, "worktree", "prune")
        self._made.clear()


def is_prefix_worktree(layout: Layout, path: Path) -> bool:
    """Whether `path` is one of make test's prefix worktrees (they come and go)."""
    folders = {(layout.build_dir / name).resolve() for name in (WORKTREES, "prefix-tree")}
    resolved = path.resolve()
    # build/prefix-tree: where earlier versions kept their one worktree
    return resolved.parent in folders or resolved in folders


def python_path(layout: Layout, worktree: Path) -> str:
    # The worktree comes before .venv's editable finder, which points at build/vllm.
    return os.pathsep.join([str(worktree), str(layout.root)])


# Where link_build_outputs links build/vllm's ignored files from (what a unit
# in a worktree finds there: scripts/testing/testrun.py keys it).
LINKED = "vllm/"


def link_build_outputs(tree: Path, worktree: Path) -> None:
    """Link what the editable install put into build/vllm (kernels, vendored
    packages): git ignores it, so a checkout does not bring it along."""
    out = git(tree, "ls-files", "--others", "--ignored", "--exclude-standard",
              "--directory", LINKED).stdout
    for entry in sorted(out.splitlines()):
        relative = entry.rstrip("/")
        if "__pycache__" in relative or relative.endswith(".pyc"):
            continue
        link = worktree / relative
        if not link.parent.is_dir() or link.exists() or link.is_symlink():
            continue
        link.symlink_to(tree / relative)


def _verify_import(layout: Layout, worktree: Path) -> None:
    from scripts.stack.venv import venv_python

    probe = "import importlib.util as u, os; print(os.path.realpath(u.find_spec('vllm').origin))"
    where = run([str(venv_python(layout)), "-c", probe], cwd=worktree,
                env={"PYTHONPATH": python_path(layout, worktree)}).stdout.strip()
    if not where.startswith(str(worktree.resolve()) + os.sep):
        raise StackError(f"with {rel(worktree, layout)} first on PYTHONPATH, vllm still "
                         f"imports from {where}; the prefix tests would test the wrong tree")
