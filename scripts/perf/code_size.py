"""The size of `make rebase`'s code, for `make bench`: rebase.py whole, plus the
functions of apply.py and gitrepo.py it needs (those it names, and those they
name in turn), in lines and in code lines (no blank, comment-only or docstring
lines). Other modules it uses (fetch, pin, series, overlay) are shared with
every command and not counted, as in the count the goal comes from.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

STACK = Path(__file__).resolve().parents[1] / "stack"
HELPER_MODULES = ("apply", "gitrepo")
# The same count of the tooling before the redesign on git's own rebase
# (project commit cec141f^1): the goal is to be smaller.
GOAL_LINES, GOAL_CODE_LINES = 891, 710


def rebase_code_size(stack: Path = STACK) -> tuple[int, int]:
    """(lines, code lines) of rebase.py and the helper functions it needs."""
    texts = {m: (stack / f"{m}.py").read_text() for m in ("rebase", *HELPER_MODULES)}
    trees = {m: ast.parse(text) for m, text in texts.items()}
    functions = {(m, node.name): node for m in HELPER_MODULES
                 for node in trees[m].body if isinstance(node, ast.FunctionDef)}

    def named(node: ast.AST, module: str) -> set[tuple[str, str]]:
        return _named(node, module, _imported(trees[module])) & functions.keys()

    needed, todo = set(), list(named(trees["rebase"], "rebase"))
    while todo:
        if (key := todo.pop()) not in needed:
            needed.add(key)
            todo += named(functions[key], key[0])
    spans = [("rebase", 1, len(texts["rebase"].splitlines()))] + [
        (m, _first_line(functions[m, name]), functions[m, name].end_lineno)
        for m, name in needed]
    code = {m: _code_lines(text) for m, text in texts.items()}
    return (sum(last - first + 1 for _, first, last in spans),
            sum(len([n for n in code[m] if first <= n <= last]) for m, first, last in spans))


def _imported(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Name -> (module, name) for the module's `from ... import` names."""
    return {a.asname or a.name: (n.module.rsplit(".", 1)[-1], a.name) for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module for a in n.names}


def _named(node: ast.AST, module: str, imported: dict) -> set[tuple[str, str]]:
    """(module, name) of every plain name `node` uses (imported, or else taken as
    its own module's) and of every `module.name` attribute."""
    found = set()
    for x in ast.walk(node):
        if isinstance(x, ast.Name):
            found.add(imported.get(x.id, (module, x.id)))
        elif isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name):
            found.add((x.value.id, x.attr))
    return found


def _first_line(node: ast.FunctionDef) -> int:
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _code_lines(text: str) -> set[int]:
    """The line numbers holding code: a token other than a comment, not a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER}
    lines = {n for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type not in skip for n in range(tok.start[0], tok.end[0] + 1)}
    return lines - docstrings


def rebase_code_row() -> str:
    lines, code = rebase_code_size()
    verdict = "within goal" if lines < GOAL_LINES and code < GOAL_CODE_LINES else "OVER GOAL"
    return (f"  {'make rebase code (lines / code lines)':<38}{lines:>5} / {code:<5}"
            f"goal < {GOAL_LINES} / {GOAL_CODE_LINES} (before the redesign)  {verdict}")
