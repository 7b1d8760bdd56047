"""Download pinned release artifacts through pip's configured package index.

Files land in the download cache only after their size and sha256 match the
pin; a mismatching download is moved to the quarantine folder, never used.
A partial download stays a `.part` file, which is never taken as good.
"""

from __future__ import annotations

import hashlib
import html.parser
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, rel, say, warn
from scripts.pin import Artifact

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None


def configured_indexes() -> list[str]:
    """pip's index-url followed by its extra-index-urls, as pip would use them."""
    env_index = os.environ.get("PIP_INDEX_URL")
    index, extras = env_index, os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    if index is None:
        config = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True,
        ).stdout
        for line in config.splitlines():
            key, _, value = line.partition("=")
            value = value.strip().strip("'\"")
            if key.endswith(".index-url") and index is None:
                index = value
            elif key.endswith(".extra-index-url") and not extras:
                extras = value.split()
    return [(index or DEFAULT_INDEX).rstrip("/")] + [e.rstrip("/") for e in extras]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path(layout: Layout, artifact: Artifact) -> Path:
    return layout.downloads_dir / artifact.filename


def ensure_artifact(layout: Layout, project: str, artifact: Artifact) -> Path:
    """Return the verified cached file, downloading it if it is not cached yet."""
    path = cached_path(layout, artifact)
    if path.exists():
        if _is_verified(path, artifact):
            return path
        moved = _quarantine(layout, path)
        warn(f"cached {artifact.filename} does not match pin.toml; moved to "
             f"{rel(moved, layout)}, downloading it again")
    layout.downloads_dir.mkdir(parents=True, exist_ok=True)
    index_file = find_in_index(project, artifact.filename, layout.downloads_dir)
    if index_file.sha256 and index_file.sha256 != artifact.sha256:
        raise StackError(
            f"the index lists {artifact.filename} with sha256 {index_file.sha256}, "
            f"but pin.toml pins {artifact.sha256}; check pin.toml before going on"
        )
    part = path.with_name(path.name + ".part")
    _download(index_file.url, part, artifact, layout)
    actual = sha256_of(part)
    size = part.stat().st_size
    if size != artifact.size or actual != artifact.sha256:
        moved = _quarantine(layout, part)
        raise StackError(
            f"downloaded {artifact.filename} does not match pin.toml "
            f"(size {size}, expected {artifact.size}; sha256 {actual}, expected "
            f"{artifact.sha256}). It was moved to {rel(moved, layout)} and not "
            "used. Run the command again to retry; if the index keeps serving "
            "these bytes, the pin or the index is wrong."
        )
    os.replace(part, path)
    _mark_verified(path, artifact)
    return path


def find_in_index(project: str, filename: str, downloads: Path | None = None) -> IndexFile:
    """Look `filename` up on each configured index (PEP 691 JSON, else PEP 503 HTML)."""
    problems = []
    for index in configured_indexes():
        try:
            files = list_project_files(index, project)
        except StackError as e:
            problems.append(str(e))
            continue
        for f in files:
            if f.filename == filename:
                return f
        problems.append(f"{index}: no file {filename} for {project}")
    raise StackError(
        f"cannot download {filename}: " + "; ".join(problems) + "\n"
        f"If this machine is offline, fetch {filename} on a machine that can "
        f"(e.g. from the project's page on PyPI) and put it in {downloads or 'the download cache'}/; "
        "it is checked against pin.toml before use."
    )


def list_project_files(index: str, project: str) -> list[IndexFile]:
    url = f"{index}/{project}/"
    request = urllib.request.Request(url, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read()
            content_type = response.headers.get("Content-Type", "")
            base = response.geturl()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise StackError(f"{url}: {getattr(e, 'reason', e)}")
    if "json" in content_type:
        return [_json_file(base, f) for f in json.loads(body)["files"]]
    return _html_files(base, body.decode("utf-8", "replace"))


def _json_file(base: str, entry: dict) -> IndexFile:
    return IndexFile(entry["filename"], urllib.parse.urljoin(base, entry["url"]),
                     entry.get("hashes", {}).get("sha256"), entry.get("size"))


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def _html_files(base: str, page: str) -> list[IndexFile]:
    parser = _Anchors()
    parser.feed(page)
    files = []
    for href, text in parser.links:
        url, _, fragment = href.partition("#")
        sha = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        files.append(IndexFile(text, urllib.parse.urljoin(base, url), sha, None))
    return files


def _download(url: str, part: Path, artifact: Artifact, layout: Layout) -> None:
    say(f"downloading {artifact.filename} ({artifact.size / 1e6:.1f} MB)")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            progress = _Progress(artifact.size)
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                progress.update(len(chunk))
            progress.done()
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise StackError(
            f"download of {artifact.filename} from {url} failed: "
            f"{getattr(e, 'reason', e)!r}. The partial file {part.name} is never "
            "used; run the command again to retry, or put the file in "
            f"{rel(layout.downloads_dir, layout)}/ by hand."
        )


class _Progress:
    """Progress on stderr: a live line on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.seen, self.start = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.next_mark, self.last_draw = 10, 0.0

    def update(self, n: int) -> None:
        self.seen += n
        percent = 100 * self.seen / self.total if self.total else 100
        now = time.monotonic()
        if self.tty and now - self.last_draw > 0.2:
            self.last_draw = now
            sys.stderr.write(f"\r  {self._line(percent)}")
        elif not self.tty and percent >= self.next_mark:
            self.next_mark = (int(percent) // 10 + 1) * 10
            sys.stderr.write(f"  {self._line(percent)}\n")

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")

    def _line(self, percent: float) -> str:
        rate = self.seen / max(time.monotonic() - self.start, 1e-6) / 1e6
        return f"{percent:5.1f}%  {self.seen / 1e6:7.1f} MB  {rate:6.1f} MB/s"


def _quarantine(layout: Layout, path: Path) -> Path:
    """Move a file that failed verification out of the cache, keeping it for inspection."""
    layout.quarantine_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = layout.quarantine_dir / f"{path.name}.{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = layout.quarantine_dir / f"{path.name}.{stamp}.{n}"
    os.replace(path, target)
    path.with_name(path.name + ".verified").unlink(missing_ok=True)
    return target


def _stamp(path: Path, artifact: Artifact) -> str:
    st = path.stat()
    return f"{artifact.sha256} {st.st_size} {st.st_mtime_ns}\n"


def _is_verified(path: Path, artifact: Artifact) -> bool:
    """True when the file was hashed before and has not changed since."""
    marker = path.with_name(path.name + ".verified")
    if marker.exists() and marker.read_text() == _stamp(path, artifact):
        return True
    if path.stat().st_size == artifact.size and sha256_of(path) == artifact.sha256:
        _mark_verified(path, artifact)
        return True
    return False


def _mark_verified(path: Path, artifact: Artifact) -> None:
    path.with_name(path.name + ".verified").write_text(_stamp(path, artifact))
