"""Download pinned release artifacts through pip's configured package index.

Files land in the download cache only after their size and sha256 match the
pin, and a cached file is hashed again each time it is used: a file changed
in place is never trusted on its size or date. A mismatching file is moved to
the quarantine folder (the last one per artifact is kept), never used. A
download stops as soon as it exceeds the expected size, so no index can fill
the disk. Each cached file has its own lock, since K3_CACHE_DIR may share the
cache between clones; a partial download is a `.part` file of its run, never
taken as good.

Every network step (an index page, a download) has one deadline for the
whole step, not only for each read: an index that answers one byte at a
time cannot hold a run for ever. Each step says what it fetches and when it
gives up. Credentials in an index URL (`https://user:token@host/simple`, as
pip takes them) are sent to that host only and never printed.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, read_regular, rel, say, warn
from scripts.mutex import cache_lock
from scripts.stack.pin import Artifact

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20
# A project page larger than this is not an index page (PyPI's for vLLM is ~1 MB).
_MAX_PAGE = 64 << 20
_RELEASE_SDIST = re.compile(r"^vllm-(\d+(?:\.\d+)*)\.tar\.gz$")
# A read that brings nothing for this long is a dead connection.
_READ_TIMEOUT = 60
# Deadlines: an index page gets this long; a download this plus its size at
# the slowest rate worth waiting for. K3_NETWORK_DEADLINE (seconds) sets both.
_PAGE_DEADLINE = 120
_SLOWEST_RATE = 100_000  # bytes per second
_PROGRESS_EVERY = 15  # seconds between progress lines when no 10% step is reached


class IndexUnreachable(StackError):
    """The package index did not answer (offline, a proxy, a wrong URL)."""


class _DeadlinePassed(Exception):
    pass


def deadline_seconds(size: int | None = None) -> float:
    """How long one network step may take: fetching a page (`size` None) or
    downloading `size` bytes."""
    chosen = os.environ.get("K3_NETWORK_DEADLINE", "").strip()
    if chosen:
        try:
            value = float(chosen)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise StackError(f"K3_NETWORK_DEADLINE={chosen!r}: give a number of seconds "
                             "(more than 0), or unset it")
        return value
    return _PAGE_DEADLINE + (size or 0) / _SLOWEST_RATE


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _DeadlinePassed in the main thread once `seconds` have passed,
    wherever it waits (connecting, reading headers or the body)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread gets signals; its reads still time out
        return

    def expired(_signum, _frame):
        raise _DeadlinePassed()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def redacted(url: str) -> str:
    """`url` with any user name and password replaced by ***, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}"))


def _request(url: str, credentials: dict[str, str], **headers: str) -> urllib.request.Request:
    """A request for `url` without its credentials; those of its host (from an
    index URL) go in an Authorization header, as pip sends them."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    credentials = {**credentials, **_credentials(url)}
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=host)),
                                     headers=headers)
    if host in credentials and parts.scheme in ("http", "https"):
        token = base64.b64encode(credentials[host].encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request


def _credentials(url: str) -> dict[str, str]:
    """host -> "user:password" from the URL, if it names a user."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    return {parts.netloc.rpartition("@")[2]: f"{urllib.parse.unquote(parts.username)}:"
            f"{urllib.parse.unquote(parts.password or '')}"}


def _shown_seconds(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:g}"


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None
    credentials: dict[str, str] | None = None  # host -> user:password, from the index URL


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
        _download_verified(layout, index_file, artifact, path)
        return path


def _download_verified(layout: Layout, index_file: IndexFile, artifact: Artifact,
                       path: Path) -> None:
    """Download into a `.part` file of this run; only verified bytes become `path`."""
    for stale in [*path.parent.glob(f"{path.name}.part"), *path.parent.glob(f"{path.name}.*.part")]:
        stale.unlink()  # from a run that was killed: we hold the file's lock
    fd, name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    part = Path(name)
    try:
        received = _download(index_file, part, artifact, layout)
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
    deadline_seconds()  # a bad K3_NETWORK_DEADLINE is named before anything is fetched
    unreachable, missing = [], []
    for index in configured_indexes():
        try:
            files = project_page(index, project)
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


# Index pages read by this process: a command that looks up several files (a
# release's sdist and wheel, then the download) reads each page once.
_PAGES: dict[tuple[str, str], list[IndexFile]] = {}


def project_page(index: str, project: str) -> list[IndexFile]:
    if (index, project) not in _PAGES:
        _PAGES[index, project] = list_project_files(index, project)
    return _PAGES[index, project]


def _not_listed(index: str, project: str, filename: str, files: list[IndexFile]) -> str:
    version = filename[len(project) + 1:].split("-")[0].removesuffix(".tar.gz")
    versions = release_versions(files)
    index = redacted(index)
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
    shown = redacted(url)
    if urllib.parse.urlsplit(index).scheme == "file":
        return _local_project_files(url)
    credentials = _credentials(index)
    request = _request(url, credentials,
                       Accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    seconds = deadline_seconds()
    waited = _shown_seconds(seconds)
    say(f"reading the package index page {shown} (gives up after {waited} s)")
    try:
        with _deadline(seconds), urllib.request.urlopen(request, timeout=_READ_TIMEOUT) \
                as response:
            body = response.read(_MAX_PAGE + 1)
            content_type = response.headers.get("Content-Type", "")
            base = response.geturl()
    except _DeadlinePassed:
        raise IndexUnreachable(f"{shown}: no complete answer within {waited} s "
                               "(K3_NETWORK_DEADLINE sets how long to wait)")
    except urllib.error.HTTPError as e:
        if e.code == 404:  # the index answered: it has no such project
            raise StackError(f"{shown}: {e.code} {e.reason}")
        raise IndexUnreachable(f"{shown}: {e.code} {e.reason}")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = str(getattr(e, "reason", e)).replace(url, shown)
        raise IndexUnreachable(f"{shown}: {redacted(reason)}")
    if len(body) > _MAX_PAGE:
        raise StackError(f"{shown}: the page is larger than {_MAX_PAGE >> 20} MB; that is "
                         "not a package index page")
    return _project_files(shown, base, content_type, body, credentials)


def _local_project_files(url: str) -> list[IndexFile]:
    """A `file://` index, as pip reads one: a project folder's index.html."""
    folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
    page = folder / "index.html" if folder.is_dir() else folder
    try:
        body = read_regular(page, "a file:// index holds <project>/index.html pages",
                            follow_links=True)
    except FileNotFoundError:
        raise StackError(f"{url}: no {page} (a file:// index holds one folder per project "
                         "with an index.html, as pip reads it)")
    return _project_files(url, page.as_uri(), "text/html", body, {})


def _project_files(shown: str, base: str, content_type: str, body: bytes,
                   credentials: dict[str, str]) -> list[IndexFile]:
    try:
        if "json" in content_type:
            files = [_json_file(base, f) for f in json.loads(body)["files"]]
        else:
            files = _html_files(base, body.decode("utf-8", "replace"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StackError(f"{shown}: not a PEP 691 project page ({e!r})")
    return [IndexFile(f.filename, f.url, f.sha256, f.size, credentials) for f in files]


def _json_file(base: str, entry: dict) -> IndexFile:
    size = entry.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise ValueError(f"size {size!r} of {entry.get('filename')!r}")
    return IndexFile(entry["filename"], urllib.parse.urljoin(base, entry["url"]),
                     entry.get("hashes", {}).get("sha256"), size)


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


def _download(index_file: IndexFile, part: Path, artifact: Artifact, layout: Layout) -> int:
    """Stream the file into `part`, stopping once past the expected size or the
    deadline; return the number of bytes received."""
    url, shown = index_file.url, redacted(index_file.url)
    seconds = deadline_seconds(artifact.size)
    waited = _shown_seconds(seconds)
    say(f"downloading {artifact.filename} ({artifact.size / 1e6:.1f} MB; gives up after "
        f"{waited} s)")
    received = 0
    request = _request(url, index_file.credentials or {})
    try:
        with _deadline(seconds), \
                urllib.request.urlopen(request, timeout=_READ_TIMEOUT) as response, \
                open(part, "wb") as out:
            progress = _Progress(artifact.size)
            # read1: whatever has arrived, so progress shows even at a trickle
            while chunk := response.read1(_CHUNK):
                out.write(chunk)
                received += len(chunk)
                if received > artifact.size:
                    break  # an index must not be able to fill the disk
                progress.update(len(chunk))
            progress.done()
    except _DeadlinePassed:
        raise StackError(
            f"download of {artifact.filename} from {shown} stopped: {received} of "
            f"{artifact.size} bytes in {waited} s (K3_NETWORK_DEADLINE sets how long "
            "to wait). The partial file is never used; run the command again to retry, or "
            f"put the file in {rel(layout.downloads_dir, layout)}/ by hand.")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = redacted(str(getattr(e, "reason", e)).replace(url, shown))
        raise StackError(
            f"download of {artifact.filename} from {shown} failed: {reason}. The partial "
            "file is never used; run the command again to retry, or put the file in "
            f"{rel(layout.downloads_dir, layout)}/ by hand."
        )
    return received


class _Progress:
    """Progress on stderr: a live line on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.seen, self.start = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.next_mark, self.last_draw = 10, self.start

    def update(self, n: int) -> None:
        self.seen += n
        percent = 100 * self.seen / self.total if self.total else 100
        now = time.monotonic()
        if self.tty and now - self.last_draw > 0.2:
            self.last_draw = now
            sys.stderr.write(f"\r  {self._line(percent)}")
        elif not self.tty and (percent >= self.next_mark
                               or now - self.last_draw > _PROGRESS_EVERY):
            self.next_mark = (int(percent) // 10 + 1) * 10
            self.last_draw = now
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
