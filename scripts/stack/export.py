"""`make export SIGNOFF="Name <email>"`: the stack as vLLM pull requests, under build/export/.

patches/ keeps the project's identity. vLLM's DCO check needs the person who
submits, and it requires the Signed-off-by to match the commit's author, so
each exported patch is authored and signed off by SIGNOFF; the project's
sign-off is dropped and its identity kept as a Co-authored-by: trailer. The
diff, subject, body and author date are unchanged.

For patch k of the series, build/export/<kk>-<stem>/ holds
- <stem>.patch: re-signed, `git am --keep-non-patch`-able onto the pristine
  release after patches 1..k-1 (checked here: applied in a scratch index, the
  series gives the same tree as build/vllm);
- PR.md: the description in the PR template of the patched tree, filled from
  the commit message, patches/notes/<stem>.md (optional free sections such as
  "## Claims", "## Rationale", "## Hardware test plan") and the latest
  `make test` results of the vLLM test files for that patch's tree
  (build/test-results/summary.json). It cites what a reviewer can reproduce:
  the tree `git am` of patches 1..k onto the release gives (a commit id
  depends on who runs `git am`). A notes section headed "## History..." (the
  patch's revisions) stays in the notes, and a PR.md of more than 120 lines
  is named in a warning: vLLM's reviewers ask for descriptions of at most
  about that.
build/export/COVER.md lists the series: order, what each patch needs and why,
and which patches can go first. A patch needs the earlier ones whose modules,
functions or classes its code uses, those its notes declare (`Needs:` lines),
those without which its diff does not apply (tried: a patch that only changes
a file after another but applies without it does not need it), and what those
need in turn. What a patch uses is read from its code: the Python files it
changes are parsed as it leaves them, and only the imports and names of its
added lines count (a module named in a docstring, comment or string is no use
of it); other files, such as CI steps naming a test file, are read as text.

PR.md and COVER.md must not point into this project (`PROJECT_TEXT`, and ids
and paths no tree a reviewer has holds): the export names each such line and
writes nothing. All or nothing: the folder is staged next to build/export and
renamed into place.
"""

from __future__ import annotations

import ast
import bisect
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import (
    PROJECT_ROOT,
    Layout,
    StackError,
    read_regular,
    rel,
    say,
    shown,
    warn,
)
from scripts.stack.apply import guard_tree, render_commit
from scripts.stack.gitrepo import commits_since, git, is_stack_repo, read_state
from scripts.stack.pin import load_pin
from scripts.stack.series import Patch, read_series
from scripts.testing.testcache import FORMAT, RESULTS, shown_date

EXPORT = "export"
# vLLM's reviewers asked for PR descriptions of at most about this many lines
# (problem, design, tests, numbers); revision history stays in patches/notes.
PR_LINES = 120
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
NOTES = "notes"
_TRAILER = re.compile(r"^[A-Za-z][A-Za-z0-9-]*: \S")
# "Name <email>": a name without control or shell characters, a plausible address.
_SIGNOFF = re.compile(r"^(?P<name>[^<>\"\\$`;|&(){}\[\]*?!#~^]+?) "
                      r"<(?P<email>[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,})>$")
# Addresses nobody receives mail at (RFC 2606, RFC 6761).
_RESERVED_DOMAINS = re.compile(
    r"(^|\.)(example\.(com|net|org)|[^.]+\.(example|invalid|test|localhost))$",
    re.IGNORECASE)


@dataclass(frozen=True)
class Person:
    name: str
    email: str

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"


def parse_signoff(value: str) -> Person:
    usage = 'usage: make export SIGNOFF="Your Name <you@your.domain>"'
    if not value.strip():
        raise StackError("SIGNOFF is missing: the person who submits signs off each "
                         f"patch; {usage}")
    match = _SIGNOFF.match(value)
    shown = ascii(value) if len(value) <= 120 else ascii(value[:117] + "...")
    if (not match or not value.isprintable()  # no newline, tab or other control
            or not any(ch.isalpha() for ch in match.group("name"))):
        raise StackError(f"SIGNOFF {shown} is not `Name <email>` (a plain name, one "
                         f"address in angle brackets); {usage}")
    if _RESERVED_DOMAINS.search(match.group("email").split("@", 1)[1]):
        raise StackError(f"SIGNOFF {shown}: {match.group('email')} is a reserved example "
                         f"address, not one the DCO check can trust; {usage}")
    return Person(match.group("name").strip(), match.group("email"))


# --- the commit message and the notes file --------------------------------------


@dataclass
class Message:
    """A commit message or notes file: subject, text before the first `## `
    heading, and the sections under `## ` headings."""

    subject: str
    preamble: str
    sections: list[tuple[str, str]]
    needs: list[tuple[str, str]] = field(default_factory=list)  # (patch, reason): Needs: lines

    @classmethod
    def parse(cls, text: str) -> Message:
        subject, _, body = text.strip("\n").partition("\n")
        paragraphs = body.strip("\n").split("\n\n")
        if paragraphs and all(_TRAILER.match(ln) for ln in paragraphs[-1].splitlines()):
            paragraphs.pop()  # Signed-off-by and the like: not PR text
        return cls(subject.strip(), *split_sections("\n\n".join(paragraphs)))

    def take(self, *prefixes: str) -> list[tuple[str, str]]:
        """Remove and return the sections whose heading starts with one of `prefixes`."""
        taken = [s for s in self.sections if s[0].lower().startswith(prefixes)]
        self.sections = [s for s in self.sections if s not in taken]
        return taken


def split_sections(markdown: str) -> tuple[str, list[tuple[str, str]]]:
    """Text before the first `## ` heading, and (heading, text) per heading.

    Headings inside fenced code blocks are text."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return ("\n".join(preamble).strip("\n"),
            [(heading, "\n".join(lines).strip("\n")) for heading, lines in sections])


def read_notes(layout: Layout, patch: Patch) -> Message:
    """patches/notes/<patch>.md, if there is one. It goes into PR.md, which is
    pasted in public: only a regular file in patches/notes/ itself is read,
    never the target of a link (nor a FIFO, which would block)."""
    folder = layout.patches_dir / NOTES
    path = folder / f"{patch.path.stem}.md"
    fix = "notes must be plain files in patches/notes/; replace it with one"
    if folder.is_symlink():
        raise StackError(f"{rel(folder, layout)} is a symlink; {fix}")
    try:
        data = read_regular(path, fix)
    except FileNotFoundError:
        return Message("", "", [])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise StackError(f"{rel(path, layout)} is not UTF-8 text; save it as UTF-8 and "
                         "run `make export` again")
    kept, needs, fenced = [], [], False
    for number, line in enumerate(text.split("\n"), start=1):
        fenced ^= line.lstrip().startswith(("```", "~~~"))
        if fenced or not line.startswith("Needs:"):
            kept.append(line)
        elif match := _NEEDS.match(line):
            needs.append((match.group("patch"), match.group("reason").strip()))
        else:
            raise StackError(f"{rel(path, layout)}:{number}: {shown(line)}: write it as "
                             "`Needs: <earlier patch file in patches/series> -- <reason>`")
    return Message("", *split_sections("\n".join(kept)), needs)


# A need the diff cannot show, declared in the notes (kept out of PR.md).
_NEEDS = re.compile(r"^Needs:\s*(?P<patch>\S+\.patch)\s+--\s+(?P<reason>\S.*)$")


# --- re-signing -----------------------------------------------------------------


@contextmanager
def scratch_objects(tree: Path) -> Iterator[dict[str, str]]:
    """Git environment whose new objects go to a temporary store: nothing is
    written into build/vllm, which is read through it as an alternate. (The
    store is a `.export-*` folder in build/, which a killed run's successor
    removes.)"""
    with tempfile.TemporaryDirectory(prefix=".export-objects-", dir=tree.parent) as tmp:
        yield {"GIT_OBJECT_DIRECTORY": tmp,
               "GIT_ALTERNATE_OBJECT_DIRECTORIES": str((tree / ".git" / "objects").resolve())}


def resign(tree: Path, commit: str, parent: str, submitter: Person,
           objects: dict[str, str]) -> str:
    """A copy of `commit` on `parent`, authored and signed off by `submitter`."""
    author = git(tree, "log", "-1", "--format=%an <%ae>", commit).stdout.strip()
    date = git(tree, "log", "-1", "--format=%ad", "--date=raw", commit).stdout.strip()
    message = git(tree, "log", "-1", "--format=%B", commit).stdout
    kept = [ln for ln in message.rstrip("\n").split("\n")
            if ln.strip() != f"Signed-off-by: {author}"]
    trailers = ([] if author == str(submitter) else ["--trailer", f"Co-authored-by: {author}"])
    trailers += ["--trailer", f"Signed-off-by: {submitter}"]
    message = git(tree, "interpret-trailers", "--if-exists", "addIfDifferent", *trailers,
                  input="\n".join(kept).rstrip("\n") + "\n").stdout
    env = {**objects, "GIT_AUTHOR_NAME": submitter.name, "GIT_AUTHOR_EMAIL": submitter.email,
           "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    tree_id = git(tree, "rev-parse", f"{commit}^{{tree}}").stdout.strip()
    return git(tree, "commit-tree", tree_id, "-p", parent, "-F", "-", env=env,
               input=message).stdout.strip()


@contextmanager
def scratch_index(tree: Path, base: str, objects: dict[str, str]) -> Iterator[dict[str, str]]:
    """A temporary index holding `base`, for `git apply --cached` trials."""
    with tempfile.TemporaryDirectory(prefix=".export-index-", dir=tree.parent) as tmp:
        env = {**objects, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(tree, "read-tree", base, env=env)
        yield env


def applies(tree: Path, patch: Path, env: dict[str, str], check: bool = False) -> bool:
    args = ["apply", "--cached", "--whitespace=nowarn"] + (["--check"] if check else [])
    return git(tree, *args, str(patch), env=env, check=False).returncode == 0


# --- what each patch needs ----------------------------------------------------------

_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_NEW_FILE = re.compile(r"^diff --git a/\S+ b/(\S+)\nnew file mode", re.MULTILINE)
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")
_DEFINED = re.compile(r"^\s*(?:async\s+def|def|class)\s+([A-Za-z_]\w*)"
                      r"|^([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)", re.MULTILINE)
_WORD = re.compile(r"[A-Za-z_]\w*")
_BYTE_WORD = re.compile(rb"\w+")  # git grep -w's words: runs of [A-Za-z0-9_]


@dataclass
class PatchFacts:
    """What a patch adds and what its added lines use. Python files are read as
    code (the file as the patch leaves it, parsed), so a module or function
    named in a docstring, comment or string is no use of it; other files (a CI
    step naming a test file, say) are read as text."""

    files: set[str]
    modules: set[str]  # dotted names of the .py modules it adds
    defines: set[str]  # functions, classes and top-level names it adds
    imports: set[str]  # dotted names its added code imports or reads attributes of
    names: set[str]  # identifiers its added code uses, and the words of its added text
    text: str  # its added lines that are not read as code

    @classmethod
    def of(cls, text: str, sources: dict[str, bytes]) -> PatchFacts:
        """`sources`: the Python files the patch changes, as it leaves them."""
        files = {p for pair in _DIFF_FILE.findall(text) for p in pair}
        modules = {_module_of(path) for path in _NEW_FILE.findall(text) if path.endswith(".py")}
        facts = cls(files, modules, set(), set(), set(), "")
        prose: list[str] = []
        for path, added in added_lines(text).items():
            code = CodeFacts.of(sources[path], path, set(added)) if path in sources else None
            if code:
                facts.defines |= code.defines
                facts.imports |= code.imports
                facts.names |= code.names
            else:
                prose += added.values()
        facts.text = "\n".join(prose)
        facts.defines |= {a or b for a, b in _DEFINED.findall(facts.text)}
        facts.names |= set(_WORD.findall(facts.text))
        return facts

    def uses_module(self, module: str) -> bool:
        return (any(name == module or name.startswith(module + ".") for name in self.imports)
                or _imports(self.text, module))


def added_lines(text: str) -> dict[str, dict[int, str]]:
    """Per file of a diff (its path after the patch), its added lines by their
    number in the file as the patch leaves it."""
    added: dict[str, dict[int, str]] = {}
    lines: dict[int, str] = {}
    number = None  # the next line's number in the new file; None outside a hunk
    for line in text.split("\n"):  # not splitlines(): a form feed is no line break
        if match := _DIFF_FILE.match(line):
            lines = added.setdefault(match.group(2), {})
            number = None
        elif match := _HUNK.match(line):
            number = int(match.group(1))
        elif number is None or line.startswith(("-", "\\")):
            continue  # a file's header, a removed line, "\ No newline at end of file"
        elif line.startswith("+"):
            lines[number] = line[1:]
            number += 1
        else:
            number += 1
    return added


@dataclass
class CodeFacts:
    """What the added lines of one Python file define and use, read from its
    syntax tree: docstrings, comments and other strings are no part of it."""

    defines: set[str]
    imports: set[str]
    names: set[str]

    @classmethod
    def of(cls, source: bytes, path: str, added: set[int]) -> CodeFacts | None:
        """None for a file that does not parse (its added lines are then read as text)."""
        try:
            module = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError):
            return None
        facts = cls(set(), set(), set())
        for node in ast.walk(module):
            facts._read(node, path, added)
        for node in module.body:  # `X = ...` defines X at the top level only
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.lineno in added:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                facts.defines |= {n.id for t in targets for n in ast.walk(t)
                                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        return facts

    def _read(self, node: ast.AST, path: str, added: set[int]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.lineno in added:
                self.defines.add(node.name)
        elif isinstance(node, ast.Name):
            if node.lineno in added and not isinstance(node.ctx, ast.Store):
                self.names.add(node.id)
        elif isinstance(node, ast.Attribute):
            if node.end_lineno in added:  # the attribute's name ends the expression
                self.names.add(node.attr)
                if dotted := _dotted(node):
                    self.imports.add(dotted)  # `vllm.models.new.f()` uses vllm.models.new
        elif isinstance(node, ast.Import):
            self.imports |= {alias.name for alias in node.names if alias.lineno in added}
        elif isinstance(node, ast.ImportFrom):
            package = _absolute(node, path)
            for alias in (a for a in node.names if a.lineno in added):
                self.names.add(alias.name)
                self.imports |= {package, f"{package}.{alias.name}"}


def _module_of(path: str) -> str:
    """vllm/a/b.py -> vllm.a.b; vllm/a/__init__.py -> vllm.a."""
    return path[:-3].removesuffix("/__init__").replace("/", ".")


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for an attribute chain on a name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _absolute(node: ast.ImportFrom, path: str) -> str:
    """The module a `from ... import` reads, relative ones resolved from the file's place."""
    if not node.level:
        return node.module or ""
    package = path.split("/")[:-1]  # __init__.py's package is its own folder
    package = package[:max(0, len(package) - node.level + 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _new_sources(tree: Path, commit: str, text: str) -> dict[str, bytes]:
    """The Python files a patch changes, at `commit` (the patch applied); a file
    the patch deletes is not there."""
    paths = sorted({p for p in added_lines(text) if p.endswith(".py")})
    contents = _cat(tree, [f"{commit}:{p}" for p in paths])
    return {p: c for p, c in zip(paths, contents) if c is not None}


@dataclass
class Needs:
    """The earlier patches (1-based) one patch needs, and why."""

    patches: list[int]  # those it needs directly and theirs in turn
    reasons: dict[int, str]  # per patch it needs directly: why
    goes_first: bool = False  # needs none, and the rest of the series applies after it


def requirements(tree: Path, base: str, patch_files: list[Path], commits: list[str],
                 declared: list[dict[int, str]], objects: dict[str, str]) -> list[Needs]:
    """Per patch, the earlier ones it needs (0-based in `declared`, what each
    patch's notes declare, with the reason): those whose modules, functions or
    classes its code uses (`commits`: the patches applied, where their Python
    files are read), those declared, those whose files it changes and without
    which it does not apply (tried in a scratch index: one whose hunks apply
    without it is no need), and what those need in turn. A patch that does not
    apply on the release after those needs every patch before it."""
    texts = [p.read_text(errors="replace") for p in patch_files]
    facts = [PatchFacts.of(text, _new_sources(tree, commit, text))
             for text, commit in zip(texts, commits)]
    new_names = _names_new_to(tree, base, set().union(*(f.defines for f in facts)))
    result: list[Needs] = []

    def closure(direct: set[int]) -> set[int]:  # 0-based: these and what they need
        return direct.union(*({n - 1 for n in result[j].patches} for j in direct))

    def applies_after(k: int, direct: set[int]) -> bool:
        with scratch_index(tree, base, objects) as env:
            return (all(applies(tree, patch_files[j], env) for j in sorted(closure(direct)))
                    and applies(tree, patch_files[k], env, check=True))

    for k, mine in enumerate(facts):
        used_names = mine.names - mine.defines
        reasons = {j: [f"#{j + 1}, as declared: {why}"] for j, why in declared[k].items()}
        shared: dict[int, list[str]] = {}
        for j, theirs in enumerate(facts[:k]):
            if uses := sorted({m for m in theirs.modules if mine.uses_module(m)}
                              | (used_names & new_names & theirs.defines)):
                reasons.setdefault(j, []).append(f"it uses {_some(uses)} of #{j + 1}")
            if files := sorted(mine.files & theirs.files):
                shared[j] = files
        textual = set(shared)
        if applies_after(k, set(reasons) | textual):
            for j in sorted(textual, reverse=True):  # a later one may bring the earlier
                if applies_after(k, set(reasons) | textual - {j}):
                    textual.discard(j)  # only file overlap: its hunks apply without it
            for j in textual:
                reasons.setdefault(j, []).append(f"its diff of {_some(shared[j])} applies "
                                                 f"only after #{j + 1}")
            needed = closure(set(reasons))
        else:
            reasons = {k - 1: [f"it applies to {base} only after #1-#{k}"]}
            needed = set(range(k))
        result.append(Needs(sorted(j + 1 for j in needed),
                            {j + 1: " and ".join(reasons[j]) for j in sorted(reasons)}))
    for k, need in enumerate(result[1:], start=1):
        if not need.patches:  # the rest of the series still applies after it
            order = [k] + [j for j in range(len(patch_files)) if j != k]
            with scratch_index(tree, base, objects) as env:
                need.goes_first = all(applies(tree, patch_files[j], env) for j in order)
    return result


def _imports(text: str, module: str) -> bool:
    """Whether `text` (not code) names `module` (dotted, as a path, or `from
    package import leaf`)."""
    if module in text or module.replace(".", "/") + ".py" in text:
        return True
    package, _, leaf = module.rpartition(".")
    return bool(package) and re.search(
        rf"from\s+{re.escape(package)}\s+import\s+\(?[\w\s,]*\b{re.escape(leaf)}\b",
        text) is not None


def _names_new_to(tree: Path, base: str, names: set[str]) -> set[str]:
    """The names that appear nowhere in the pristine release (dunders are never new).

    The release is read once and split into words (as `git grep -w` sees them):
    a `git grep` of a few hundred names over it takes minutes, this seconds."""
    candidates = {n.encode() for n in names if not n.startswith("__")}
    if not candidates:
        return set()
    found: set[bytes] = set()
    for blob in _blobs(tree, base):
        found |= candidates.intersection(_BYTE_WORD.findall(blob))
    return {n.decode() for n in candidates - found}


def _blobs(tree: Path, rev: str) -> Iterator[bytes]:
    """The contents of every file of `rev` (all of them: `git archive` would honour
    export-ignore attributes)."""
    listing = git(tree, "ls-tree", "-r", "-z", rev).stdout
    ids = [entry.split(None, 3)[2] for entry in listing.split("\0")
           if entry and entry.split(None, 2)[1] == "blob"]
    yield from (blob for blob in _cat(tree, ids) if blob is not None)


def _cat(tree: Path, objects: list[str]) -> list[bytes | None]:
    """The contents of `objects` (ids or `<rev>:<path>`) in one `git cat-file`;
    None for one that does not exist."""
    if not objects:
        return []
    out = git(tree, "cat-file", "--batch", input=("\n".join(objects) + "\n").encode(),
              text=False).stdout
    contents: list[bytes | None] = []
    position = 0
    for _ in objects:  # each: "<id> <type> <size>\n<content>\n" or "<name> missing\n"
        header_end = out.index(b"\n", position)
        header = out[position:header_end].split()
        if header[-1] == b"missing":
            contents.append(None)
            position = header_end + 1
            continue
        size = int(header[2])
        contents.append(out[header_end + 1:header_end + 1 + size])
        position = header_end + 1 + size + 1
    return contents


# --- what a reviewer can follow ----------------------------------------------------

# Text of PR.md and COVER.md that points into this project, which upstream
# cannot follow: (pattern, what it is). `references` finds these, and the ids
# (`_HEX_ID`) and paths (`_PATH`) that no tree the reviewer has holds; `make
# export` refuses each. Documented in docs/maintaining.md ("Export for upstream").
PROJECT_TEXT = [
    (r"\bpython3?\s+-m\s+scripts\b", "this project's command line"),
    (r"\bmake\s+(?:{targets})\b", "a target of this project's Makefile"),
    (r"\bK3\s+DSpark\s+ROCm\s+project\b", "this project's name"),
    (r"\bpatch[\s-]stack\b", "this project"),
    (r"\breview\s+round\s+\d+", "this project's review"),
    (r"\b(?:in\s+)?the\s+PR's\s+notes\b|\bin\s+the\s+notes\b",
     "the notes, which PR.md leaves out"),
    (r"\bthis\s+PR\s+as\s+it\s+was\s+on\s+vLLM\s+\d+(?:\.\d+)*",
     "an earlier revision in this project"),
]
# A git id: 7-40 hex digits, with a digit and a letter (checked in
# `references`), backticked or after "commit", "tree" or "blob".
_HEX_ID = re.compile(r"`(?P<a>[0-9a-f]{7,40})`"
                     r"|\b(?:commit|tree|blob)s?\s+`?(?P<b>[0-9a-f]{7,40})\b", re.IGNORECASE)
# A relative path (checked in `references` if its first folder is a top-level
# one of vLLM's or this project's); one that a glob or placeholder continues
# is not a path.
_PATH = re.compile(r"(?<![\w./~-])((?:[\w.-]+/)+[\w.-]*)(?![\w./*{<\[-])")


@dataclass
class Reachable:
    """What a reviewer has after `git am` of some patches onto the release: the
    upstream commit, the trees, folders and files of the release and of each
    of those prefixes (sorted ids, for a look-up by prefix), and their paths."""

    ids: list[str]
    paths: set[str]

    @classmethod
    def of(cls, tree: Path, revs: list[str], upstream: str) -> list[Reachable]:
        """One per prefix of `revs` (the release, then the patches), cumulatively."""
        ids, paths, out = {upstream}, set(), []
        for rev in revs:
            ids.add(git(tree, "rev-parse", f"{rev}^{{tree}}").stdout.strip())
            for entry in git(tree, "ls-tree", "-r", "-t", "-z", rev).stdout.split("\0"):
                if entry:
                    meta, path = entry.split("\t", 1)
                    ids.add(meta.split()[2])
                    paths.add(path)
            out.append(cls(sorted(ids), set(paths)))
        return out

    def has_id(self, short: str) -> bool:
        at = bisect.bisect_left(self.ids, short.lower())
        return at < len(self.ids) and self.ids[at].startswith(short.lower())


def references(text: str, reach: Reachable) -> list[tuple[int, str, str]]:
    """(line, text, what it is) for each place `text` points into this project."""
    targets = "|".join(map(re.escape, _make_targets()))
    found = [(m.start(), m.group(0), why) for pattern, why in PROJECT_TEXT
             for m in re.finditer(pattern.format(targets=targets), text, re.IGNORECASE)]
    for m in _HEX_ID.finditer(text):
        hex_id = m.group("a") or m.group("b")
        if (re.search("[0-9]", hex_id) and re.search("[a-f]", hex_id, re.IGNORECASE)
                and not reach.has_id(hex_id)):
            found.append((m.start(), m.group(0).replace("`", ""),
                          "an id that is no commit, tree or file of vLLM's after this PR"))
    tops = {p for p in reach.paths if "/" not in p} | _PROJECT_TOPS
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip("./")
        if path.split("/")[0] in tops and path not in reach.paths:
            found.append((m.start(), path, "a path that is not in vLLM's tree after this PR"))
    return sorted((text.count("\n", 0, at) + 1, " ".join(cited.split()), why)
                  for at, cited, why in found)


_PROJECT_TOPS = {p.name for p in PROJECT_ROOT.iterdir() if not p.name.startswith(".")}


def _make_targets() -> list[str]:
    """The targets of this project's Makefile (its .PHONY list)."""
    text = (PROJECT_ROOT / "Makefile").read_text().replace("\\\n", " ")
    return [t for line in text.splitlines() if line.startswith(".PHONY:")
            for t in line.split(":", 1)[1].split()]


def tree_text(tree_id: str, k: int, release: str) -> str:
    """The line of PR.md that names the tree a reviewer can check (a commit id
    depends on who runs `git am`, the tree does not)."""
    applied = "this patch" if k == 1 else f"patches 1-{k} of the series"
    return (f"After `git am` of {applied} onto {release}, `git rev-parse HEAD^{{tree}}` "
            f"prints `{tree_id}`.")


# --- PR.md and COVER.md ---------------------------------------------------------------


def pr_description(template: str, message: Message, notes: Message,
                   validation: str) -> tuple[str, list[str]]:
    """The template with each known `## ` section filled, and the headings left as they are.

    Every section of the message and the notes lands somewhere (they are
    consumed), except the notes' history ("## History...", the revisions of
    the patch), which stays in patches/notes: reviewers read the change, not
    how it got there."""
    notes.take("history")
    opening = [message.preamble] if message.preamble else []
    purpose = "\n\n".join(opening + [text for _, text in message.take("purpose")])
    overview, background = _lead(purpose)
    claims = "\n\n".join(text for _, text in notes.take("claims"))
    if not claims:
        claims = f"- {_title(message.subject)}."
    plans = message.take("test plan")
    results = message.take("test result")
    hardware = message.take("hardware") + notes.take("hardware")
    details = ([("Background", background)] if background else []) + message.sections
    details += notes.sections
    filled = {
        "overview": overview or _title(message.subject),
        "claims": claims,
        "validation": _join(plans + results + [("Automated checks", validation)] + hardware),
        "details": _collapsed(_notes_lead(notes.preamble), _join(details)),
    }
    return _fill(template, filled)


def _lead(purpose: str) -> tuple[str, str]:
    """The purpose's first paragraph (with what it introduces, when it ends on a
    colon: a list is not cut from its lead-in), and the rest."""
    paragraphs = purpose.split("\n\n")
    n = 1
    while n < len(paragraphs) and paragraphs[n - 1].rstrip().endswith(":"):
        n += 1
    return "\n\n".join(paragraphs[:n]), "\n\n".join(paragraphs[n:])


def _notes_lead(preamble: str) -> str:
    """The notes' text before their first section, without a title line of
    their own (the PR has its title)."""
    return "\n".join(ln for ln in preamble.splitlines() if not ln.startswith("# ")).strip()


def _collapsed(*parts: str) -> str:
    """Background, design and evidence, folded away: the PR shows purpose,
    claims and validation first, as vLLM's reviewers read it."""
    text = "\n\n".join(p for p in parts if p)
    if not text:
        return ""
    return (f"<details>\n<summary>Background, design and evidence</summary>\n\n{text}\n\n"
            "</details>")


def _hex(commit: str) -> str:
    """A commit id as git takes it (setuptools-scm writes it with a "g" in front)."""
    return commit[1:] if re.fullmatch(r"g[0-9a-f]{7,40}", commit) else commit


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"`{n}`" for n in names[:shown]) + more


def _numbers(patches: list[int]) -> str:
    """[1, 2, 3, 5] -> "#1-#3, #5"."""
    runs: list[list[int]] = []
    for n in patches:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}-#{r[-1]}" for r in runs)


def _title(subject: str) -> str:
    return re.sub(r"^(\[[^][]+\])+ +", "", subject)


def _join(sections: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"### {heading}\n\n{text}" for heading, text in sections if text)


def _fill(template: str, filled: dict[str, str]) -> tuple[str, list[str]]:
    out: list[str] = []
    unfilled: list[str] = []
    section = None
    for line in template.splitlines():
        if line.startswith("## "):
            section = line[3:].strip().lower()
            if section in filled:
                out += [line, "", filled[section], ""]
                continue
            unfilled.append(line[3:].strip())
        if line.strip() == "---" or line.startswith("<details"):
            section = None  # the checklist: kept as it is, ticked by the submitter
        if section in filled:
            continue  # the template's guidance comment, replaced by the content
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n", unfilled


def validation_text(summary: dict | None, tree_of_patch: str) -> tuple[str, str | None]:
    """The latest `make test` results of the vLLM tree after patch k (what a
    reviewer can run there: vLLM's linters and test files; the project's own
    tests are left out), and what is missing if there are none."""
    untested = "_No test result is recorded for this tree._"
    if summary is None:
        return untested, "no `make test` result is recorded: run `make test`, then `make export`"
    rows = [r for r in summary["rows"] if r["vllm_tree"] == tree_of_patch]
    parts = _in_vllm(rows)
    if not parts:
        return untested, (f"the latest `make test` ({shown_date(summary['started'])}) did not "
                          "test this patch's tree: run `make test`, then `make export`")
    emulated = any(_ROCM_PLUGIN in p["command"] for p in parts)
    platforms = ("on CPU, and again under a CPU emulation of vLLM's RocmPlatform (gfx942), "
                 "where the ROCm-only tests that need no GPU run" if emulated else
                 "on CPU only, where the ROCm-only tests are skipped")
    lines = [(f"On that tree, with no GPU: vLLM's linters, and its test files with pytest "
              f"{platforms}; one line per check and platform:"), "",
             "| check | platform | commands | passed | failed | skipped | run |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    groups: dict[tuple[str, str], list[dict]] = {}
    files: dict[str, None] = {}  # the vLLM test files run, in order
    for part in parts:
        command, platform = _shown(part["command"])
        check = "pytest" if command.startswith("pytest ") else command.split(":")[0]
        groups.setdefault((check, platform), []).append(part)
        files.update(dict.fromkeys(_test_files(command)))
    for (check, platform), group in groups.items():
        dates = sorted(shown_date((p["reused"] or {}).get("date") or summary["started"])
                       for p in group)
        run = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        totals = [sum(p[key] for p in group) for key in ("passed", "failed", "skipped")]
        lines.append(f"| {check} | {platform} | {len(group)} | "
                     + " | ".join(map(str, totals)) + f" | {run} |")
    if files:
        lines += ["", f"vLLM test files run: {_some(list(files), shown=12)}."]
    failed = sum(r["failed"] for r in rows)
    return "\n".join(lines), (f"{failed} check(s) failed in the latest `make test` of its "
                              "tree" if failed else None)


_ROCM_PLUGIN = "-p rocm_emulation.plugin"


def _in_vllm(rows: list[dict]) -> list[dict]:
    """The commands of `rows` that ran in a vLLM tree (the project's own tests did not)."""
    return [p for r in rows for p in r["parts"] if p["where"].startswith("build/")]


def _test_files(command: str) -> list[str]:
    """The test files a shown pytest command names (a node id counts as its file)."""
    if not command.startswith("pytest "):
        return []
    found, words = [], iter(command.split()[1:])
    for word in words:
        if word in _OPTIONS_WITH_A_VALUE:
            next(words, None)  # e.g. the node id of a --deselect
        elif not word.startswith("-") and word.split("::")[0].endswith(".py"):
            found.append(word.split("::")[0])
    return found


_OPTIONS_WITH_A_VALUE = {"-p", "-k", "-m", "--deselect", "--ignore", "-o"}


def _shown(command: str) -> tuple[str, str]:
    """A recorded command as a PR quotes it: pytest and its arguments (the
    project's PYTHONPATH and venv are no business of upstream's), and its platform."""
    if " -m pytest " not in command:
        return command, "CPU"
    pytest = "pytest " + command.split(" -m pytest ", 1)[1].replace(" -p no:cacheprovider", "")
    if _ROCM_PLUGIN in pytest:
        return pytest.replace(" " + _ROCM_PLUGIN, ""), "emulated ROCm"
    return pytest, "CPU"


def cover(pin_version: str, pin_commit: str, submitter: Person, entries: list[dict],
          summary: dict | None) -> str:
    first = [e for e in entries if e["needs"].goes_first]
    lines = [f"# K3 DSpark drafter on ROCm: {len(entries)} pull requests for vLLM", "",
             (f"Base: vLLM {pin_version} (upstream commit `{_hex(pin_commit)}`). Every patch "
              f"is authored and signed off by {submitter}; the project's identity stays as "
              "`Co-authored-by:`."), "",
             ("Send them in this order: the tree after each prefix of it was tested (each "
              "PR.md says how). A patch needs the earlier ones whose modules, functions or "
              "classes its code uses (imports and names in code, not docstrings, comments or "
              "strings), those declared for a reason the diff cannot show, those without "
              "which its diff does not apply (tried: changing a file after another patch is "
              "no need if its hunks apply without it), and what those need in turn."), "",
             "| # | pull request | folder | needs |", "| ---: | --- | --- | --- |"]
    for e in entries:
        lines.append(f"| {e['k']} | {e['subject']} | `{e['folder']}/` | "
                     f"{_numbers(e['needs'].patches) or 'nothing'} |")
    lines.append("")
    why = []
    for e in (e for e in entries if e["needs"].patches):
        need = e["needs"]
        through = [n for n in need.patches if n not in need.reasons]
        why.append(f"- #{e['k']} needs {_numbers(need.patches)}: "
                   + "; ".join(need.reasons.values())
                   + (f"; and, through those, {_numbers(through)}" if through else "") + ".")
    if why:
        lines += ["Why:", "", *why, ""]
    if first:
        lines += [("Can go first, on the release alone (they need no earlier patch, and the "
                   "rest of the series still applies after them):"), ""]
        lines += [f"- #{e['k']} `{e['folder']}`" for e in first]
        lines.append("")
    else:
        lines += ["No patch after the first can go on the release alone.", ""]
    trees = {e["tree"] for e in entries}
    if parts := _in_vllm([r for r in (summary or {}).get("rows", []) if r["vllm_tree"] in trees]):
        totals = [sum(p[key] for p in parts) for key in ("passed", "failed", "skipped")]
        lines += [(f"Tested (latest run {shown_date(summary['started'])}, no GPU): vLLM's "
                   "linters and test files on the tree after each prefix, "
                   f"`{entries[-1]['tree']}` after all {len(entries)}: {totals[0]} passed, "
                   f"{totals[1]} failed, {totals[2]} skipped."), ""]
    lines += [("To open PR k: on a branch at the upstream commit (or at PR k-1), "
               "`git am --keep-non-patch <folder>/<name>.patch`, push, and paste "
               "`<folder>/PR.md` as the description."), "",
              ("The checklist at the end of each PR.md is left unticked: it asks for the "
               "submitter's own judgment. vLLM's contributing guide also asks to disclose "
               "AI assistance (a note in the PR and a `Co-authored-by:` trailer) where it "
               "applies.")]
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------


def export_for_upstream(layout: Layout, signoff: str) -> None:
    submitter = parse_signoff(signoff)
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    guard_tree(layout, "`make export`")
    patches = read_series(layout)
    base = read_state(tree)["base_tag"]
    commits = commits_since(tree, base)
    if len(commits) != len(patches) or any(
            render_commit(layout, c) != p.read() for c, p in zip(commits, patches)):
        raise StackError(f"{rel(tree, layout)} does not hold patches/series as it is now; "
                         "run `make apply` (or `make patches` to export your commits), "
                         "then `make export` again")
    for commit, patch in zip(commits, patches):
        _refuse_non_utf8(tree, commit, patch)
    template = git(tree, "show", f"HEAD:{TEMPLATE}", check=False)
    if template.returncode != 0:
        raise StackError(f"{rel(tree, layout)} has no {TEMPLATE} to fill; the PR "
                         "descriptions follow the template of the patched vLLM")
    pin = load_pin(layout.pin_file)
    summary = _latest_summary(layout)
    layout.build_dir.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=layout.build_dir))
    say(f"exporting {len(patches)} patch(es) for {submitter}")
    try:
        entries = _write_pr_folders(layout, staging, patches, commits, base, submitter,
                                    template.stdout, summary, f"vLLM {pin.version}")
        (staging / "COVER.md").write_text(cover(pin.version, pin.commit, submitter,
                                                entries, summary))
        _refuse_project_references(layout, staging, entries, [base, *commits],
                                   _hex(pin.commit))
        _replace(staging, layout.build_dir / EXPORT)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    say(f"exported {len(patches)} patch(es), signed off by {submitter}, to "
        f"{rel(layout.build_dir / EXPORT, layout)}/ (read COVER.md first)")


_ESCAPED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as common.run escapes it


def _refuse_non_utf8(tree: Path, commit: str, patch: Patch) -> None:
    """Author and message go into the PR as text: they must be UTF-8 (git keeps
    whatever bytes it was given; they arrive here surrogate-escaped)."""
    meta = git(tree, "log", "-1", "--format=%an <%ae>%n%B", commit).stdout
    if bad := next((ln for ln in meta.splitlines() if _ESCAPED.search(ln)), None):
        raise StackError(f"{patch.name}: the author or message of commit {commit[:12]} is "
                         f"not UTF-8 (in {shown(bad)}); fix it in build/vllm "
                         "(`git commit --amend` at that commit, in a `git rebase -i`), run "
                         "`make patches`, then `make export`")


def _latest_summary(layout: Layout) -> dict | None:
    """build/test-results/summary.json if it is in the current format; None if
    there is none (or an older `make test` wrote it). A damaged one is an error:
    PR.md must not say "no result is recorded" when one is, unreadable."""
    path = layout.build_dir / RESULTS / "summary.json"
    damaged = (f"{rel(path, layout)} is damaged ({{}}); run `make test` (it writes the "
               "file again), then `make export`")
    try:
        summary = json.loads(read_regular(path, "it is written by `make test`"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StackError(damaged.format(e))
    if not isinstance(summary, dict):
        raise StackError(damaged.format("not a JSON object"))
    if summary.get("format") != FORMAT:
        return None
    if problem := _summary_problem(summary):
        raise StackError(damaged.format(problem))
    return summary


def _summary_problem(summary: dict) -> str | None:
    """What is missing or mistyped among the fields PR.md and COVER.md read."""
    def typed(value, kind, where):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else
                                                      (kind,)))
            raise TypeError(f"{where} is {type(value).__name__}, not {names}")
        return value
    try:
        typed(summary.get("started"), str, "started")
        for n, row in enumerate(typed(summary.get("rows"), list, "rows")):
            typed(row, dict, f"rows[{n}]")
            typed(row.get("vllm_tree"), (str, type(None)), f"rows[{n}].vllm_tree")
            typed(row.get("failed"), int, f"rows[{n}].failed")
            for m, part in enumerate(typed(row.get("parts"), list, f"rows[{n}].parts")):
                typed(part, dict, f"rows[{n}].parts[{m}]")
                if (reused := part.get("reused")) is not None:
                    typed(typed(reused, dict, f"rows[{n}].parts[{m}].reused").get("date", ""),
                          str, f"rows[{n}].parts[{m}].reused.date")
                for key, kind in (("where", str), ("command", str), ("passed", int),
                                  ("failed", int), ("skipped", int)):
                    typed(part.get(key), kind, f"rows[{n}].parts[{m}].{key}")
    except TypeError as e:
        return str(e)
    return None


def _write_pr_folders(layout: Layout, staging: Path, patches: list[Patch],
                      commits: list[str], base: str, submitter: Person, template: str,
                      summary: dict | None, release: str) -> list[dict]:
    """One folder per patch under `staging`: the re-signed patch and its PR.md."""
    tree = layout.tree
    width = max(2, len(str(len(patches))))
    entries = []
    declared: list[dict[int, str]] = []  # per patch: the earlier ones its notes say it needs
    problems: dict[str, list[int]] = {}  # what the submitter must know -> patch numbers
    with scratch_objects(tree) as objects, scratch_index(tree, base, objects) as index:
        parent = git(tree, "rev-parse", base).stdout.strip()
        for k, (patch, commit) in enumerate(zip(patches, commits), start=1):
            folder = f"{k:0{width}d}-{patch.path.stem}"
            (staging / folder).mkdir()
            parent = resign(tree, commit, parent, submitter, objects)  # the next goes on it
            out = staging / folder / patch.name
            out.write_bytes(render_commit(layout, parent, objects))
            tree_of_patch = git(tree, "rev-parse", f"{commit}^{{tree}}").stdout.strip()
            # The file itself, applied after the ones before it, gives the patched tree.
            if not (applies(tree, out, index)
                    and git(tree, "write-tree", env=index).stdout.strip() == tree_of_patch):
                raise StackError(f"{patch.name}: the re-signed patch does not reproduce "
                                 f"commit {commit[:12]} of {rel(tree, layout)}; nothing "
                                 "was exported (please report this)")
            message = Message.parse(git(tree, "log", "-1", "--format=%B", commit).stdout)
            notes = read_notes(layout, patch)
            declared.append(_declared(layout, patches, k, notes))
            if not any(h.lower().startswith("claims") for h, _ in notes.sections):
                problems.setdefault(f"no '## Claims' in {rel(layout.patches_dir, layout)}/"
                                    f"{NOTES}/<patch>.md: PR.md claims the title only",
                                    []).append(k)
            validation, missing = validation_text(summary, tree_of_patch)
            if missing:
                problems.setdefault(missing, []).append(k)
            validation = f"{tree_text(tree_of_patch, k, release)}\n\n{validation}"
            description, unfilled = pr_description(template, message, notes, validation)
            for heading in unfilled:
                problems.setdefault(f"PR.md leaves the template's {heading!r} section "
                                    "for you to fill", []).append(k)
            if len(description.splitlines()) > PR_LINES:
                problems.setdefault(
                    f"PR.md is longer than {PR_LINES} lines, vLLM's reviewers ask for at "
                    "most about that (problem, design, tests, numbers): shorten the message "
                    f"or notes; a '## History' section of {rel(layout.patches_dir, layout)}/"
                    f"{NOTES}/<patch>.md stays out of PR.md", []).append(k)
            (staging / folder / "PR.md").write_text(description)
            entries.append({"k": k, "folder": folder, "subject": message.subject,
                            "file": out, "tree": tree_of_patch})
            say(f"  [{k}/{len(patches)}] {folder}/: re-signed, reproduces its commit, PR.md")
        say("  what each patch needs: each tried on the release")
        needs = requirements(tree, base, [e["file"] for e in entries], commits, declared,
                             objects)
    for problem, numbers in problems.items():
        warn(f"{problem} (patch {', '.join(map(str, numbers))})")
    for entry, need in zip(entries, needs):
        entry["needs"] = need
    return entries


def _declared(layout: Layout, patches: list[Patch], k: int, notes: Message) -> dict[int, str]:
    """The earlier patches (0-based) that patch k's notes say it needs, with the reason."""
    names = [p.name for p in patches]
    where = f"{rel(layout.patches_dir, layout)}/{NOTES}/{patches[k - 1].path.stem}.md"
    declared = {}
    for name, reason in notes.needs:
        if name not in names:
            raise StackError(f"{where}: `Needs: {name}`: no such patch in patches/series")
        if names.index(name) >= k - 1:
            raise StackError(f"{where}: `Needs: {name}`: that is patch {names.index(name) + 1}, "
                             f"not one before this one ({k}); a patch needs earlier ones only")
        declared[names.index(name)] = reason
    return declared


def _refuse_project_references(layout: Layout, staging: Path, entries: list[dict],
                               revs: list[str], upstream: str) -> None:
    """Refuse, naming each line, text of PR.md or COVER.md that points into this
    project. `revs`: the release and the patches; PR k is read against what
    `git am` of patches 1..k onto the release gives, COVER.md against all."""
    reach = Reachable.of(layout.tree, revs, upstream)
    hits = []
    for e, known in zip(entries, reach[1:]):
        text = (staging / e["folder"] / "PR.md").read_text()
        hits += [f"{e['folder']}/PR.md:{n}: {shown(found)} ({why})"
                 for n, found, why in references(text, known)]
    hits += [f"COVER.md:{n}: {shown(found)} ({why})"
             for n, found, why in references((staging / "COVER.md").read_text(), reach[-1])]
    if hits:
        for hit in hits:
            print(hit, file=sys.stderr)
        raise StackError(
            f"{len(hits)} place(s) in PR.md or COVER.md point into this project, which a vLLM "
            f"reviewer cannot follow; edit the commit message in {rel(layout.tree, layout)} "
            f"(`git rebase -i`, then `make patches`) or the notes file "
            f"{rel(layout.patches_dir, layout)}/{NOTES}/<name>.md, then `make export` again "
            "(nothing was exported)")


def _replace(staging: Path, target: Path) -> None:
    """Put `staging` at `target` by renames, so a reader sees the old or the new folder."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    if old:
        shutil.rmtree(old)
