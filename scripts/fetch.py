"""Download pinned release artifacts through pip's configured package index.

Files land in the download cache only after their size and sha256 match the
pin, and a cached file is hashed again each time it is used: a file changed
in place is never trusted on its size or date. A mismatching file is moved to
the quarantine folder (the last one per artifact is kept), never used. A
download stops as soon as it exceeds the expected size, so no index can fill
the disk. Each cached file has its own lock, since K3_CACHE_DIR may share the
cache between clones; a partial download is a `.part` file of its run, never
taken as good.
"""

from __future__ import annotations

import hashlib
import html.parser
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, rel, say, warn
from scripts.mutex import cache_lock
from scripts.pin import Artifact

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20
# A project page larger than this is not an index page (PyPI's for vLLM is ~1 MB).
_MAX_PAGE = 64 << 20
_RELEASE_SDIST = re.compile(r"^vllm-(\d+(?:\.\d+)*)\.tar\.gz$")


class IndexUnreachable(StackError):
    """The package index did not answer (offline, a proxy, a wrong URL)."""


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
    """Return the cached file, its sha256 checked now; download it if it is not cached."""
    with cache_lock(layout, artifact.filename):
        path = cached_path(layout, artifact)
        if path.exists():
            if _matches(path, artifact):
                return path
            moved = _quarantine(layout, path, artifact)
            warn(f"cached {artifact.filename} does not match pin.toml; moved to "
                 f"{rel(moved, layout)}, downloading it again")
        layout.downloads_dir.mkdir(parents=True, exist_ok=True)
        try:
            index_file = find_in_index(project, artifact.filename)
        except IndexUnreachable as e:
            raise StackError(
                f"cannot download {artifact.filename}: {e}\nIf this machine is offline, "
                f"fetch {artifact.filename} on a machine that can (e.g. from the project's "
                f"page on PyPI) and put it in {layout.downloads_dir}/; it is checked "
                "against pin.toml before use.")
        if index_file.sha256 and index_file.sha256 != artifact.sha256:
            raise StackError(
                f"the index lists {artifact.filename} with sha256 {index_file.sha256}, "
                f"but pin.toml pins {artifact.sha256}; check pin.toml before going on"
            )
        _download_verified(layout, index_file.url, artifact, path)
        return path


def _download_verified(layout: Layout, url: str, artifact: Artifact, path: Path) -> None:
    """Download into a `.part` file of this run; only verified bytes become `path`."""
    for stale in [*path.parent.glob(f"{path.name}.part"), *path.parent.glob(f"{path.name}.*.part")]:
        stale.unlink()  # from a run that was killed: we hold the file's lock
    fd, name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    part = Path(name)
    try:
        received = _download(url, part, artifact, layout)
        actual = sha256_of(part)
        if received != artifact.size or actual != artifact.sha256:
            moved = _quarantine(layout, part, artifact)
            size = (f"more than the {artifact.size} bytes pinned: the download was stopped "
                    "there" if received > artifact.size
                    else f"size {received}, expected {artifact.size}")
            raise StackError(
                f"downloaded {artifact.filename} does not match pin.toml ({size}; sha256 "
                f"{actual}, expected {artifact.sha256}). It was moved to {rel(moved, layout)} "
                "and not used. Run the command again to retry; if the index keeps serving "
                "these bytes, the pin or the index is wrong."
            )
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def find_in_index(project: str, filename: str) -> IndexFile:
    """Look `filename` up on each configured index (PEP 691 JSON, else PEP 503 HTML)."""
    unreachable, missing = [], []
    for index in configured_indexes():
        try:
            files = list_project_files(index, project)
        except IndexUnreachable as e:
            unreachable.append(str(e))
            continue
        except StackError as e:  # it answered, but not with a usable page
            missing.append(str(e))
            continue
        for f in files:
            if f.filename == filename:
                return f
        missing.append(_not_listed(index, project, filename, files))
    if unreachable:  # the file may be on an index that did not answer
        raise IndexUnreachable("; ".join(unreachable + missing))
    raise StackError(f"cannot download {filename}: " + "; ".join(missing)
                     + ". Check the version asked for (pin.toml, or VLLM_VERSION).")


def _not_listed(index: str, project: str, filename: str, files: list[IndexFile]) -> str:
    version = filename[len(project) + 1:].split("-")[0].removesuffix(".tar.gz")
    versions = release_versions(files)
    if version in versions:
        return f"{index} has vLLM {version} but no file {filename} for {project}"
    newest = f"the newest is {newest_version(versions)}" if versions else "it lists none"
    return (f"{index} has no file {filename} for {project}: there is no vLLM {version} "
            f"there ({newest})")


def release_versions(files: list[IndexFile]) -> list[str]:
    """The final releases that have an sdist among `files`."""
    return [m.group(1) for f in files if (m := _RELEASE_SDIST.match(f.filename))]


def newest_version(versions: list[str]) -> str:
    def release(v: str) -> tuple[int, ...]:  # "0.34.0rc1" -> (0, 34, 0)
        return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", v).group().split("."))
    return max(versions, key=release)


def index_needed(what: str, error: StackError) -> StackError:
    """The error for a command that cannot work without the package index."""
    return StackError(
        f"cannot reach the package index to {what} ({error}). It is the index pip "
        "uses (PIP_INDEX_URL, or pip's configuration): run the command again where it "
        "is reachable. Nothing was changed.")


def list_project_files(index: str, project: str) -> list[IndexFile]:
    url = f"{index}/{project}/"
    request = urllib.request.Request(url, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read(_MAX_PAGE + 1)
            content_type = response.headers.get("Content-Type", "")
            base = response.geturl()
    except urllib.error.HTTPError as e:
        if e.code == 404:  # the index answered: it has no such project
            raise StackError(f"{url}: {e.code} {e.reason}")
        raise IndexUnreachable(f"{url}: {e.code} {e.reason}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise IndexUnreachable(f"{url}: {getattr(e, 'reason', e)}")
    if len(body) > _MAX_PAGE:
        raise StackError(f"{url}: the page is larger than {_MAX_PAGE >> 20} MB; that is "
                         "not a package index page")
    try:
        if "json" in content_type:
            return [_json_file(base, f) for f in json.loads(body)["files"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StackError(f"{url}: not a PEP 691 project page ({e!r})")
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


def _download(url: str, part: Path, artifact: Artifact, layout: Layout) -> int:
    """Stream `url` into `part`, stopping once past the expected size; return the
    number of bytes received."""
    say(f"downloading {artifact.filename} ({artifact.size / 1e6:.1f} MB)")
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            progress = _Progress(artifact.size)
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                received += len(chunk)
                if received > artifact.size:
                    break  # an index must not be able to fill the disk
                progress.update(len(chunk))
            progress.done()
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise StackError(
            f"download of {artifact.filename} from {url} failed: "
            f"{getattr(e, 'reason', e)!r}. The partial file is never used; run the "
            "command again to retry, or put the file in "
            f"{rel(layout.downloads_dir, layout)}/ by hand."
        )
    return received


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


def _quarantine(layout: Layout, path: Path, artifact: Artifact) -> Path:
    """Move a file that failed verification out of the cache, keeping it for inspection.

    Only the last rejected copy of each artifact is kept: a retry loop against a
    bad mirror must not fill the disk with copies of the same release.
    """
    layout.quarantine_dir.mkdir(parents=True, exist_ok=True)
    for older in layout.quarantine_dir.glob(f"{artifact.filename}.*"):
        older.unlink()
    target = layout.quarantine_dir / f"{artifact.filename}.{time.strftime('%Y%m%dT%H%M%S')}"
    os.replace(path, target)
    return target


def _matches(path: Path, artifact: Artifact) -> bool:
    return path.stat().st_size == artifact.size and sha256_of(path) == artifact.sha256
