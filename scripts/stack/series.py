"""The patch series: `patches/series` and the `git format-patch` files it lists."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from scripts.common import FORBIDDEN_PATHS, Layout, StackError, read_regular, rel, run, shown
from scripts.stack.gitrepo import git

SERIES_HEADER = """\
# The patch stack, in the order it is applied to the pinned vLLM release.
# One file name per line; `make patches` rewrites this file from build/vllm.
"""
# vLLM's PR title rule, e.g. "[ROCm][Model] Add ...".
TITLE_RE = re.compile(r"^(\[[^][]+\])+ +[^\s].*$")
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
        # Not through a link: a patch file's bytes are applied and exported for
        # upstream, so they must be the file in patches/, not one it points to.
        return read_regular(self.path, "patches/ must hold the patch files themselves")


def series_names(layout: Layout) -> list[str]:
    """The file names the series lists, checked for form only (see read_series)."""
    return [name for _, name in _series_lines(layout)]


def _series_lines(layout: Layout) -> list[tuple[int, str]]:
    """(line number, file name) per patch line of the series file."""
    series = layout.series_file
    if not series.exists():
        raise StackError(f"{rel(series, layout)} is missing; create it "
                         "(an empty file is an empty stack)")
    data = read_regular(series, "it must be a text file naming the patches", follow_links=True)
    try:
        text = data.decode("utf-8-sig")  # an editor's byte order mark is not a name
    except UnicodeDecodeError as e:
        raise StackError(f"{rel(series, layout)} is not UTF-8 text (byte {e.start} is "
                         f"{data[e.start:e.start + 1]!r}); save it as UTF-8 (patch file "
                         "names are ASCII) and run the command again")
    lines: list[tuple[int, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{rel(series, layout)}:{lineno}"
        if ("/" in line or line.startswith(".") or not line.endswith(".patch")
                or not line.isprintable()):
            raise StackError(f"{where}: {line!r} is not a patch file name in patches/")
        if line in (name for _, name in lines):
            raise StackError(f"{where}: {line} is listed twice")
        lines.append((lineno, line))
    return lines


def read_series(layout: Layout) -> list[Patch]:
    """The patches named by the series file, each checked to exist as a regular file."""
    patches = []
    for lineno, name in _series_lines(layout):
        path = layout.patches_dir / name
        if not path.is_file() or path.is_symlink():
            what = ("is a symlink" if path.is_symlink() else "is not a regular file"
                    if os.path.lexists(path) else "does not exist")
            raise StackError(f"{rel(layout.series_file, layout)}:{lineno}: {name} {what} in "
                             "patches/ (restore it, or remove the line from the "
                             "series)")
        patches.append(Patch(path))
    return patches


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


def series_text(names: list[str]) -> bytes:
    """The series file listing `names` (what `make patches` writes)."""
    return (SERIES_HEADER + "".join(f"{n}\n" for n in names)).encode()


def touched_paths(name: str, patch: bytes) -> list[str]:
    """Every path `patch` changes, as `git am` reads it.

    git decides, not a pattern: it strips the first component of any prefix
    (`x/`, `i/`, `w/`, not only `a/` and `b/`), unquotes escaped names and
    takes a plain `---`/`+++` diff as well. `git apply --numstat` names one
    path per file (the new one); reversed, it names the old one, which a
    rename or deletion also changes.
    """
    paths: list[str] = []
    with tempfile.TemporaryDirectory(prefix="k3-patch-paths-") as outside_any_repo:
        # Run outside every repository: inside one, git apply reads paths
        # relative to the folder it runs in.
        env = {"GIT_CEILING_DIRECTORIES": str(Path(outside_any_repo).parent)}
        for direction in ([], ["-R"]):
            result = run(["git", "apply", "--numstat", "-z", "--allow-empty", *direction],
                         cwd=Path(outside_any_repo), env=env, input=patch, text=False,
                         check=False)
            if result.returncode != 0:
                detail = result.stderr.decode("utf-8", "replace").strip()
                raise StackError(f"{name}: git cannot read it as a patch ({detail}); fix "
                                 "or regenerate it (`make patches`)")
            # "<added>\t<deleted>\t<path>" NUL per file
            for entry in filter(None, result.stdout.split(b"\0")):
                path = entry.split(b"\t", 2)[2].decode("utf-8", "surrogateescape")
                if path not in paths:
                    paths.append(path)
    return paths


def check_patch_paths(patch: Patch) -> None:
    check_paths(patch.name, patch.read())


def check_paths(name: str, patch: bytes) -> None:
    """Refuse paths outside the tree, into .git, in the kernel sources, or not UTF-8.

    (What a patch creates, a symlink say, is judged by `apply_to_index` from
    what git makes of it.)
    """
    for path in touched_paths(name, patch):
        if problem := path_problem(path):
            raise StackError(f"{name}: {problem}")


def path_problem(path: str) -> str | None:
    """Why a patch may not change `path` (relative to the vLLM tree), or None."""
    parts = PurePosixPath(path).parts
    if path.startswith("/") or ".." in parts or ".git" in (p.lower() for p in parts):
        return f"path {path!r} would be written outside the vLLM tree; refusing to apply"
    if any(path == f or (f.endswith("/") and path.startswith(f)) for f in FORBIDDEN_PATHS):
        return (f"touches {shown(path)}, which the prebuilt kernels of the pinned wheel are "
                "built from; patches must not change it")
    if not path.isprintable():  # a control character, or bytes that are not UTF-8
        return (f"path {shown(path)} is not printable UTF-8; name the file in UTF-8 "
                "without control characters")
    return None


@dataclass
class IndexApply:
    """The series applied to a release in a scratch index (nothing else is touched)."""

    tree: str | None = None  # the resulting tree, when every patch applied
    failure: str | None = None  # why the first patch that does not apply fails
    stopped_at: str | None = None  # the name of that patch
    special: list[str] = field(default_factory=list)  # symlinks, submodules made


def apply_to_index(repo: Path, base: str, patches: list[Patch],
                   git_env: dict[str, str] | None = None) -> IndexApply:
    """Apply `patches` strictly, in order, to `base` of `repo` in a scratch index.

    What each patch creates is read from the tree git builds, not from the
    patch text: git accepts many spellings of a mode (`0120000`, `120644`),
    and what it writes is what counts. `git_env` may send the objects git
    writes to a folder of their own (GIT_OBJECT_DIRECTORY).
    """
    fd, index = tempfile.mkstemp(prefix="k3-scratch-index-")
    os.close(fd)
    env = {**(git_env or {}), "GIT_INDEX_FILE": index}
    result = IndexApply()
    try:
        git(repo, "read-tree", base, env=env)
        tree = git(repo, "write-tree", env=env).stdout.strip()
        for p in patches:
            applied = git(repo, "apply", "--cached", "--whitespace=nowarn",
                          str(p.path.resolve()), env=env, check=False)
            if applied.returncode != 0:
                result.stopped_at = p.name
                result.failure = (f"{p.name} does not apply strictly to {base} after the "
                                  f"patches before it:\n{applied.stderr.strip()}")
                return result
            after = git(repo, "write-tree", env=env).stdout.strip()
            result.special += _special_files(repo, p, tree, after, env)
            tree = after
        result.tree = tree
        return result
    finally:
        os.unlink(index)


def _special_files(repo: Path, patch: Patch, before: str, after: str,
                   env: dict[str, str]) -> list[str]:
    # -z: ":<old mode> <new mode> <old id> <new id> <status>" NUL "<path>" NUL ...
    fields = git(repo, "diff-tree", "-r", "-z", "--no-renames", before, after,
                 env=env).stdout.split("\0")
    problems = []
    for meta, path in zip(fields[0::2], fields[1::2]):
        mode = meta.split()[1]
        if problem := path_problem(path):  # what git wrote, whatever the text said
            problems.append(f"{patch.name}: {problem}")
        elif mode != "000000" and mode not in _REGULAR_MODES:
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
    import email.policy  # only `make check` and the export read headers; it is slow to load
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
