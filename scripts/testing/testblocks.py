"""Which tests of a unit ran a changed function: kept for per-test narrowing.

`make test` does not use this module: the tests of a unit share one pytest
process, and a test can observe what another ran (a cache filled by the
first test that asked), so only a whole unit is carried over (README.md,
"A result is carried over only when..."). Narrowing with it is sound only
for tests that each run in a process of their own. What follows says what
it computes.

A unit (one pytest process of one test file, scripts/testing/testrun.py) is keyed by
what it reads of the vLLM tree (scripts/testing/testdeps.py). When a read file
changes, the unit would run whole; yet a patch that edits one function of
`dspark_mla.py` changes nothing for a test that never calls it. So each unit
also records, per test, which functions of the tree it ran
(scripts/testing/reads/k3_pertest.py). This module compares two versions of the
tree's Python files block by block and picks the tests that ran a block that
changed.

A file's blocks are its functions (a method is `Class.method`; what a
function nests, lambdas and comprehensions included, is part of it) and its
skeleton: everything but the functions' bodies, so imports, module and class
statements, decorators, signatures and defaults, and the names of every
function. A skeleton that changed (a new function, a new method overriding
an inherited one, a new parametrization) makes every test of the unit run.
So does anything the record cannot narrow down: a change to a file that is
not Python, a file read as text, a function run outside the tests (at
collection, in a fixture that outlives its test, during an import), a
decorated function (a cache may hand its old result to a test that never
calls it), or a test that ran code the recorder cannot follow (threads,
subprocesses, Dynamo's tracing, Triton's compiler).
"""

from __future__ import annotations

import ast
import copy
import hashlib

MODULE = "<module>"
# Decorators that keep no state between calls: a change to the body of a function
# they wrap matters only to the tests that call it.
_STATELESS_DECORATORS = frozenset({
    "staticmethod", "classmethod", "property", "setter", "getter", "deleter",
    "abstractmethod", "override", "wraps", "fixture", "inference_mode", "no_grad",
    "contextmanager", "overload"})


class Blocks:
    """The blocks of one Python source: MODULE (its skeleton) and each function
    by qualified name, with a digest each; and which functions carry state."""

    def __init__(self, source: str):
        tree = ast.parse(source)
        self.digests: dict[str, str] = {}
        self.stateful: set[str] = set()
        self._visit(tree.body, "")
        self.digests[MODULE] = _digest(_Skeleton().visit(tree))

    def _visit(self, body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + node.name
                # Two defs of one name (`if X: def f` / `else: def f`): both count.
                self.digests[name] = _digest(node, self.digests.get(name, ""))
                if any(_decorator_name(d) not in _STATELESS_DECORATORS
                       for d in node.decorator_list):
                    self.stateful.add(name)
            elif isinstance(node, ast.ClassDef):
                self._visit(node.body, f"{prefix}{node.name}.")
            else:
                # `if TYPE_CHECKING:`, `try: import x`, `for`, `while`, `with`,
                # `match ...: case _:`: definitions under any compound statement are
                # still the module's (or the class's). _Skeleton strips their bodies
                # too, so a def missed here would change no block at all.
                for block in _bodies(node):
                    self._visit(block, prefix)

    def block_of(self, qualname: str) -> str:
        """The block a code object of this file with `qualname` belongs to: the
        outermost function that holds it, else the skeleton (module and class
        bodies, module-level lambdas and comprehensions)."""
        parts = qualname.split(".<locals>.", 1)[0].split(".")
        for end in range(len(parts), 0, -1):
            name = ".".join(parts[:end])
            if name in self.digests:
                return name
        return MODULE


def changed_blocks(old: Blocks, new: Blocks) -> set[str]:
    return {name for name in old.digests.keys() | new.digests.keys()
            if old.digests.get(name) != new.digests.get(name)}


def affected_tests(coverage: dict, changes: dict[str, tuple[str, str]]) -> tuple[
        list[str] | None, str]:
    """The tests of a unit that can see `changes` ({path: (old source, new
    source)} of the tree's Python files), given its record `coverage`
    (k3_pertest's: "shared" and per test, in run order, "code" {path:
    [qualname]}, "data" [path] and "whole" [why]). None: every test, and why."""
    if not changes:
        return [], ""
    touched: dict[str, tuple[Blocks, set[str]]] = {}
    for path, (old_source, new_source) in changes.items():
        try:
            old, new = Blocks(old_source), Blocks(new_source)
        except (SyntaxError, ValueError):
            return None, f"{path} does not parse"
        names = changed_blocks(old, new)
        if MODULE in names:
            return None, f"{path}: more than function bodies changed"
        touched[path] = (old, names)

    def seen(bucket: dict) -> str:
        """What of the changes a record bucket saw ("" if nothing)."""
        for path in bucket.get("data", []):
            if path in changes:
                return f"{path} is read as text"
        for path, qualnames in bucket.get("code", {}).items():
            if path not in touched:
                continue
            old, names = touched[path]
            for qualname in qualnames:
                block = old.block_of(qualname)
                if block in names:
                    if block in old.stateful:
                        return f"{path}: {block} is decorated"
                    return f"{path}: {block}"
        return ""

    if why := seen(coverage.get("shared", {})):
        return None, f"{why} runs outside the tests"
    chosen = []
    for nodeid, bucket in coverage.get("tests", {}).items():
        if bucket.get("whole"):
            chosen.append(nodeid)
        elif why := seen(bucket):
            if why.endswith("is decorated"):
                return None, why
            chosen.append(nodeid)
    return chosen, ""


def _digest(node: ast.AST, before: str = "") -> str:
    return hashlib.sha256((before + ast.dump(node, include_attributes=False)).encode()
                          ).hexdigest()


def _bodies(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists a compound statement holds: its bodies, its `else` and
    `finally`, its handlers' (`except`, `except*`) and its cases' bodies."""
    bodies = [getattr(node, part) for part in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, part, None), list)]
    for holder in (*getattr(node, "handlers", []), *getattr(node, "cases", [])):
        bodies.append(holder.body)
    return bodies


def _decorator_name(node: ast.expr) -> str:
    """`functools.lru_cache(maxsize=2)` -> "lru_cache"."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


class _Skeleton(ast.NodeTransformer):
    """A module without its functions' bodies (their names, decorators and
    signatures stay: they are evaluated when the module runs)."""

    def visit_FunctionDef(self, node):  # noqa: N802 - ast's naming
        stub = copy.copy(node)
        stub.body = [ast.Pass()]
        return stub

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815
