"""The patch series: `patches/series` and the `git format-patch` files it lists."""

from __future__ import annotations

import email
import email.policy
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from scripts.common import FORBIDDEN_PATHS, Layout, StackError, rel
from scripts.gitrepo import git

SERIES_HEADER = """\
# The patch stack, in the order it is applied to the pinned vLLM release.
# One file name per line; `make patches` rewrites this file from build/vllm.
"""
# vLLM's PR title rule, e.g. "[ROCm][Model] Add ...".
TITLE_RE = re.compile(r"^(\[[^][]+\])+ +[^\s].*$")
_DIFF_PATH_RE = re.compile(r"^diff --git a/(.+) b/(.+)$")
_PATH_LINE_RE = re.compile(r"^(?:rename|copy) (?:from|to) (.+)$")
_MIN_RATIONALE_WORDS = 15
# What a patch may leave in the tree: regular files, executable or not.
_REGULAR_MODES = {"100644", "100755"}
_SPECIAL_MODES = {"120000": "symlink", "160000": "submodule (gitlink)"}
# Files in patches/ that are not patches.
NOT_PATCHES = {"series", "README.md"}
# Per-patch PR notes (long rationale, claims, hardware test plan) that
# `make export` folds into each PR description: patches/notes/<patch stem>.md.
NOTES_DIR = "notes"


@dataclass(frozen=True)
class Patch:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def read(self) -> bytes:
        return self.path.read_bytes()


def read_series(layout: Layout) -> list[Patch]:
    """The patches named by the series file, each checked to exist and be safe."""
    if not layout.series_file.exists():
        raise StackError(f"{rel(layout.series_file, layout)} is missing; create it "
                         "(an empty file is an empty stack)")
    names: list[str] = []
    for lineno, raw in enumerate(layout.series_file.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{rel(layout.series_file, layout)}:{lineno}"
        if "/" in line or line.startswith(".") or not line.endswith(".patch"):
            raise StackError(f"{where}: {line!r} is not a patch file name in patches/")
        if line in names:
            raise StackError(f"{where}: {line} is listed twice")
        if not (layout.patches_dir / line).is_file():
            raise StackError(f"{where}: {line} does not exist in patches/ "
                             "(restore it, or remove the line from the series)")
        names.append(line)
    return [Patch(layout.patches_dir / n) for n in names]


def unlisted_files(layout: Layout, patches: list[Patch]) -> list[Path]:
    """Files in patches/ that the series does not name (README.md, series and
    notes/ aside)."""
    listed = {p.name for p in patches} | NOT_PATCHES | {NOTES_DIR}
    return [p for p in sorted(layout.patches_dir.iterdir()) if p.name not in listed]


def stray_notes(layout: Layout, patches: list[Patch]) -> list[Path]:
    """Entries of patches/notes/ that are not `<stem of a listed patch>.md`."""
    notes = layout.patches_dir / NOTES_DIR
    if not notes.exists() and not notes.is_symlink():
        return []
    if notes.is_symlink() or not notes.is_dir():
        return [notes]
    stems = {Path(p.name).stem for p in patches}
    return [path for path in sorted(notes.iterdir())
            if path.suffix != ".md" or path.stem not in stems
            or path.is_symlink() or not path.is_file()]


def series_digest(patches: list[Patch]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read() + b"\0")
    return digest.hexdigest()


def write_series(layout: Layout, names: list[str]) -> None:
    layout.series_file.write_text(SERIES_HEADER + "".join(f"{n}\n" for n in names))


def touched_paths(patch_text: str) -> list[str]:
    """Every path a patch reads or writes: git headers and plain ---/+++ lines."""
    paths = []
    lines = patch_text.splitlines()
    for line, following in zip(lines, lines[1:] + [""]):
        if m := _DIFF_PATH_RE.match(line):
            paths += [m.group(1), m.group(2)]
        elif m := _PATH_LINE_RE.match(line):
            paths.append(m.group(1))
        elif line.startswith("--- ") and following.startswith("+++ "):
            for header in (line, following):
                path = header[4:].split("\t")[0]
                if path != "/dev/null":
                    paths.append(path[2:] if path[:2] in ("a/", "b/") else path)
    return paths


def check_patch_paths(patch: Patch) -> None:
    """Refuse paths outside the tree, into .git and the kernel sources.

    (What a patch creates, a symlink say, is judged by `apply_to_index` from
    what git makes of it.)
    """
    text = patch.read().decode("utf-8", "replace")
    if re.search(r'^(?:diff --git .*"|--- "|\+\+\+ "|(?:rename|copy) (?:from|to) ")',
                 text, re.M):
        raise StackError(f"{patch.name}: has a quoted (escaped) path; patches must "
                         "use plain ASCII paths")
    for path in touched_paths(text):
        parts = PurePosixPath(path).parts
        if path.startswith("/") or ".." in parts or ".git" in parts:
            raise StackError(f"{patch.name}: path {path!r} would be written outside "
                             "the vLLM tree; refusing to apply")
        if any(path == f or (f.endswith("/") and path.startswith(f))
               for f in FORBIDDEN_PATHS):
            raise StackError(
                f"{patch.name}: touches {path}, which the prebuilt kernels of the "
                "pinned wheel are built from; patches must not change it")


@dataclass
class IndexApply:
    """The series applied to a release in a scratch index (nothing else is touched)."""

    tree: str | None = None  # the resulting tree, when every patch applied
    failure: str | None = None  # why the first patch that does not apply fails
    special: list[str] = field(default_factory=list)  # symlinks, submodules made


def apply_to_index(repo: Path, base: str, patches: list[Patch]) -> IndexApply:
    """Apply `patches` strictly, in order, to `base` of `repo` in a scratch index.

    What each patch creates is read from the tree git builds, not from the
    patch text: git accepts many spellings of a mode (`0120000`, `120644`),
    and what it writes is what counts.
    """
    fd, index = tempfile.mkstemp(prefix="k3-scratch-index-")
    os.close(fd)
    env = {"GIT_INDEX_FILE": index}
    result = IndexApply()
    try:
        git(repo, "read-tree", base, env=env)
        tree = git(repo, "write-tree", env=env).stdout.strip()
        for p in patches:
            applied = git(repo, "apply", "--cached", "--whitespace=nowarn",
                          str(p.path.resolve()), env=env, check=False)
            if applied.returncode != 0:
                result.failure = (f"{p.name} does not apply strictly to {base} after the "
                                  f"patches before it:\n{applied.stderr.strip()}")
                return result
            after = git(repo, "write-tree", env=env).stdout.strip()
            result.special += _special_files(repo, p, tree, after)
            tree = after
        result.tree = tree
        return result
    finally:
        os.unlink(index)


def _special_files(repo: Path, patch: Patch, before: str, after: str) -> list[str]:
    # -z: ":<old mode> <new mode> <old id> <new id> <status>" NUL "<path>" NUL ...
    fields = git(repo, "diff-tree", "-r", "-z", "--no-renames", before, after).stdout.split("\0")
    problems = []
    for meta, path in zip(fields[0::2], fields[1::2]):
        mode = meta.split()[1]
        if mode != "000000" and mode not in _REGULAR_MODES:
            kind = _SPECIAL_MODES.get(mode, f"mode {mode} entry")
            problems.append(f"{patch.name}: creates {path} as a {kind}; patches may only "
                            "add, change or delete regular files")
    return problems


@dataclass(frozen=True)
class Header:
    author: str
    subject: str
    body: str


def parse_header(patch: Patch) -> Header:
    text = patch.read().decode("utf-8", "replace")
    # The message ends at the diffstat separator or, without a stat, at the diff.
    message_part = re.split(r"^(?:---$|diff --git )", text, maxsplit=1, flags=re.M)[0]
    msg = email.message_from_string(message_part, policy=email.policy.default)
    subject = " ".join(str(msg.get("Subject", "")).split())
    body = msg.get_payload()
    if not isinstance(body, str):
        body = ""
    return Header(str(msg.get("From", "")), subject, body)


def metadata_problems(patch: Patch) -> list[str]:
    """What a patch lacks to become an upstream vLLM PR."""
    header = parse_header(patch)
    problems = []
    if not header.subject:
        problems.append("no subject")
    elif not TITLE_RE.match(header.subject):
        problems.append(f"subject {header.subject!r} lacks vLLM's [Tag] prefix")
    signoffs = re.findall(r"^Signed-off-by: (.+)$", header.body, re.M)
    if not signoffs:
        problems.append("no Signed-off-by: line (DCO)")
    elif header.author and header.author not in [s.strip() for s in signoffs]:
        problems.append(f"author {header.author} has not signed off")
    prose = [ln for ln in header.body.splitlines()
             if ln.strip() and not re.match(r"^[\w-]+: ", ln)]
    if sum(len(ln.split()) for ln in prose) < _MIN_RATIONALE_WORDS:
        problems.append("no rationale in the message (say why the patch exists)")
    return problems
