"""The patch series: `patches/series` and the `git format-patch` files it lists."""

from __future__ import annotations

import email
import email.policy
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scripts.common import FORBIDDEN_PATHS, Layout, StackError, rel

SERIES_HEADER = """\
# The patch stack, in the order it is applied to the pinned vLLM release.
# One file name per line; `make patches` rewrites this file from build/vllm.
"""
# vLLM's PR title rule, e.g. "[ROCm][Model] Add ...".
TITLE_RE = re.compile(r"^(\[[^][]+\])+ +[^\s].*$")
_DIFF_PATH_RE = re.compile(r"^diff --git a/(.+) b/(.+)$")
_PATH_LINE_RE = re.compile(r"^(?:rename|copy) (?:from|to) (.+)$")
_MIN_RATIONALE_WORDS = 15


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
    """Refuse paths outside the tree, into .git, symlinks and the kernel sources."""
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
    if re.search(r"^(?:new file |new |old )?mode 120000$", text, re.M):
        raise StackError(f"{patch.name}: adds or changes a symlink; patches must not")


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
