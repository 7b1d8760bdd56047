"""`make clean`: remove what the tooling built, keeping the download cache.

Refuses while build/vllm holds work that is not exported to patches/, and
leaves alone anything in build/ that the tooling did not make.
"""

from __future__ import annotations

import shutil

from scripts.common import Layout, rel, say, warn
from scripts.gitrepo import is_stack_repo
from scripts.stack import guard_tree

_GENERATED = ("check-base", "drift-base", "prefix-tree", "test-results")


def clean(layout: Layout) -> None:
    if is_stack_repo(layout.tree):
        guard_tree(layout, "`make clean`")
        _remove(layout, layout.tree)
    if layout.build_dir.exists():
        for path in sorted(layout.build_dir.iterdir()):
            if path.name in _GENERATED or path.name.startswith(".vllm-unpacking-"):
                _remove(layout, path)
            else:
                warn(f"left {rel(path, layout)} alone: not made by this tooling")
        if not any(layout.build_dir.iterdir()):
            layout.build_dir.rmdir()
    for venv in (layout.venv, layout.lint_venv):
        if venv.exists():
            _remove(layout, venv)
    say(f"kept the download cache {rel(layout.cache_dir, layout)}/")


def _remove(layout: Layout, path) -> None:
    shutil.rmtree(path)
    say(f"removed {rel(path, layout)}/")
