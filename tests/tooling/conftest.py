"""Fixtures for the tests of the stack tooling (scripts/).

The tests never touch the real vLLM release, the network or the venv: they
build tiny fake vLLM releases in a temporary folder, write a matching
pin.toml into a temporary project, serve the fake files from a PEP 691 / 503
package index on loopback, and drive `python3 -m scripts <command>` as a
user would, with K3_PROJECT_ROOT / K3_CACHE_DIR / PIP_INDEX_URL pointing at
the temporary places.
"""

from __future__ import annotations

import atexit
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from scripts.stack.pin import Artifact, Pin, render_pin

REPO = Path(__file__).resolve().parents[2]  # /work/main: where `python3 -m scripts` runs
FAULT_DIR = Path(__file__).resolve().parent / "fault"
PYCACHE = Path(tempfile.mkdtemp(prefix="k3-tooling-pycache-"))
atexit.register(shutil.rmtree, PYCACHE, ignore_errors=True)
PYTHON = sys.executable  # not a pyenv shim: each call costs less
V1, V2 = "0.1.0", "0.2.0"
AUTHOR_NAME, AUTHOR_EMAIL = "Dev One", "dev@example.com"
AUTHOR = f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>"
SIGNOFF = f"Signed-off-by: {AUTHOR}"
RATIONALE = ("The ROCm kernels tile the work differently from the CUDA ones, so the\n"
             "default block size overflows the shared memory budget on MI300 and the\n"
             "model falls back to a slow path; this keeps it on the fast one.")
RELEASE_MTIME = 1_700_000_000
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")

FOO_V1 = """\
# SPDX-License-Identifier: Apache-2.0
\"\"\"Fake model for the tooling tests.\"\"\"

BLOCK = 16


def forward(x):
    return x * BLOCK


def backward(x):
    return x / BLOCK
"""

TEST_FOO_V1 = """\
from vllm.models.foo import forward


def test_forward():
    assert forward(1) == 16
"""


# Lines of vLLM's own .gitignore: what it ignores may still be someone's work.
GITIGNORE = """\
*.so
__pycache__/
*.csv
.env
benchmarks/**/*.json
*_hip*
vllm/third_party/
"""
# A file the pinned wheel ships and the python-only build copies into the tree.
WHEEL_COPY = ("vllm/third_party/dep/__init__.py", b"# from the wheel\n")


def release_files(version: str, commit_id: str = "g1234567") -> dict[str, bytes]:
    """The files of a fake vLLM source release (paths under its top folder)."""
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        "pyproject.toml": "[project]\nname = \"vllm\"\ndynamic = [\"version\"]\n",
        "CMakeLists.txt": "cmake_minimum_required(VERSION 3.26)\n",
        "csrc/attention.cu": "// kernel\n",
        "vllm/__init__.py": "\"\"\"vLLM.\"\"\"\nfrom vllm._version import __version__\n",
        "vllm/_version.py": (f"__version__ = version = '{version}'\n"
                             f"__version_tuple__ = version_tuple = "
                             f"{tuple(int(p) for p in version.split('.'))!r}\n"
                             f"__commit_id__ = commit_id = '{commit_id}'\n"),
        "vllm/_custom_ops.py": "def op():\n    pass\n",
        "vllm/models/__init__.py": "",
        "vllm/models/foo.py": FOO_V1,
        "vllm/models/bar.py": "def bar():\n    return 'bar'\n",
        "tests/test_foo.py": TEST_FOO_V1,
        # What `make export` fills in (vLLM's own template is in data/).
        ".github/PULL_REQUEST_TEMPLATE.md": "## Purpose\n\n## Test Plan\n",
        ".gitignore": GITIGNORE,
        "vllm.egg-info/PKG-INFO": f"Name: vllm\nVersion: {version}\n",
    }
    return {k: v.encode() for k, v in files.items()}


def make_sdist(folder: Path, version: str, files: dict[str, bytes] | None = None,
               extra: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]] = ()) -> Path:
    """Write `vllm-<version>.tar.gz` (one top folder `vllm-<version>/`) deterministically."""
    files = release_files(version) if files is None else files
    top = f"vllm-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({"/".join(p.split("/")[:i]) for p in files
                       for i in range(1, p.count("/") + 1)})
        for d in ["", *dirs]:
            info = tarfile.TarInfo(f"{top}/{d}".rstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, RELEASE_MTIME
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, RELEASE_MTIME
            tar.addfile(info, io.BytesIO(data))
        for item in extra:
            info, data = item if isinstance(item, tuple) else (item, None)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    # A fixed gzip mtime: the same inputs always give the same bytes (and sha256).
    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return path


def make_wheel(folder: Path, version: str, requires: list[str] | None = None) -> Path:
    """A wheel (a zip) with a compiled kernel and a file the build copies into the tree;
    with `requires`, a METADATA naming them as its `Requires-Dist`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    buf = io.BytesIO()
    files = [("vllm/_C.abi3.so", hashlib.sha256(version.encode()).digest() * 64), WHEEL_COPY]
    if requires is not None:
        metadata = (f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n"
                    + "".join(f"Requires-Dist: {r}\n" for r in requires))
        files.append((f"vllm-{version}.dist-info/METADATA", metadata.encode()))
    with zipfile.ZipFile(buf, "w") as wheel:
        for name, data in files:
            wheel.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    path.write_bytes(buf.getvalue())
    return path


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def artifact_of(path: Path) -> Artifact:
    return Artifact(path.name, path.stat().st_size, sha256_file(path))


def pin_for(version: str, sdist: Path, wheel: Path, commit: str = "g1234567") -> Pin:
    return Pin(version, commit, f"vllm-{version}", artifact_of(sdist), artifact_of(wheel))


def snapshot(folder: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `folder` (symlinks not followed): relpath -> (kind, content hash)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            relpath = p.relative_to(folder).as_posix()
            if p.is_symlink():
                out[relpath] = ("link", os.readlink(p))
            elif p.is_dir():
                out[relpath] = ("dir", "")
            else:
                out[relpath] = ("file", sha256_file(p))
    return out


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the package index ----------------------------------------------------------


@dataclass
class Index:
    """A PEP 691 (JSON) / PEP 503 (HTML) simple index for `vllm` on loopback."""

    files: dict[str, bytes] = field(default_factory=dict)
    listed_sha256: dict[str, str | None] = field(default_factory=dict)  # override
    truncate: set[str] = field(default_factory=set)  # send half, then close
    chunked_cut: set[str] = field(default_factory=set)  # chunked, cut mid-way
    stall: float = 0.0  # seconds to pause half-way through each file (downloads overlap)
    drip: set[str] = field(default_factory=set)  # "page" or file names: a byte at a time
    html: bool = False
    requests: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # per request
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple"

    def add(self, *paths: Path) -> None:
        for p in paths:
            self.files[p.name] = p.read_bytes()

    def downloads(self, name: str | None = None) -> int:
        return sum(1 for r in self.requests if r.startswith("/files/")
                   and (name is None or r == f"/files/{name}"))

    def sha(self, name: str) -> str | None:
        if name in self.listed_sha256:
            return self.listed_sha256[name]
        return hashlib.sha256(self.files[name]).hexdigest()

    def page(self) -> tuple[str, bytes]:
        if self.html:
            links = "".join(
                f'<a href="../../files/{n}'
                + (f'#sha256={self.sha(n)}' if self.sha(n) else "")
                + f'">{n}</a><br/>\n' for n in sorted(self.files))
            body = f"<!DOCTYPE html><html><body><h1>vllm</h1>\n{links}</body></html>\n"
            return "text/html", body.encode()
        files = [{"filename": n, "url": f"../../files/{n}", "size": len(data),
                  "hashes": ({"sha256": self.sha(n)} if self.sha(n) else {})}
                 for n, data in sorted(self.files.items())]
        body = {"meta": {"api-version": "1.1"}, "name": "vllm", "files": files}
        return "application/vnd.pypi.simple.v1+json", json.dumps(body).encode()


def _handler(index: Index):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output clean
            pass

        def drip(self, body: bytes) -> None:
            """The headers, then one byte every 0.2 s (until the client gives up)."""
            self.end_headers()
            for i in range(len(body)):
                try:
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

        def do_GET(self):
            index.requests.append(self.path)
            index.authorizations.append(self.headers.get("Authorization"))
            if self.path in ("/simple/vllm/", "/simple/vllm"):
                ctype, body = index.page()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if "page" in index.drip:
                    self.drip(body)
                    return
                self.end_headers()
                self.wfile.write(body)
                return
            name = self.path.rsplit("/", 1)[-1]
            if not self.path.startswith("/files/") or name not in index.files:
                self.send_error(404)
                return
            data = index.files[name]
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            if name in index.chunked_cut:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                half = data[: len(data) // 2]
                self.wfile.write(f"{len(half):x}\r\n".encode() + half + b"\r\n")
                self.wfile.flush()
                self.close_connection = True
                return
            self.send_header("Content-Length", str(len(data)))
            if name in index.drip:
                self.drip(data)
                return
            self.end_headers()
            if name in index.truncate:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if index.stall:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                time.sleep(index.stall)
                data = data[len(data) // 2:]
            self.wfile.write(data)

    return Handler


@pytest.fixture
def index():
    idx = Index()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(idx))
    server.daemon_threads = True
    idx.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield idx
    server.shutdown()
    server.server_close()


# --- the temporary project ------------------------------------------------------

# The global git configuration the tooling sees: a machine with an identity set.
# Tests that model a fresh CI machine empty this file (`project.no_git_identity()`).
MACHINE_GITCONFIG = "[user]\n\tname = Machine User\n\temail = machine@example.com\n"

SERIES_HEADER = ("# The patch stack, in the order it is applied to the pinned vLLM release.\n"
                 "# One file name per line; `make patches` rewrites this file from build/vllm.\n")


class Project:
    """A temporary project root (pin.toml, patches/) plus its download cache."""

    def __init__(self, root: Path, cache: Path, releases: Path, gitconfig: Path):
        self.root, self.cache, self.releases = root, cache, releases
        self.gitconfig = gitconfig
        self.index_url = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens
        self.cache_env = True
        self.extra_env: dict[str, str] = {}  # more variables for every command run

    def no_git_identity(self) -> None:
        """Model a fresh machine (CI): no user.name / user.email anywhere."""
        self.gitconfig.write_text("")

    def kill_git_writing(self, pattern: str) -> None:
        """Make every git that writes a file matching `pattern` to a work tree kill
        its process group (a command started with `start_new_session`) at that
        moment: a smudge filter, which git runs while it holds its locks."""
        attributes = self.gitconfig.with_name("attributes")
        attributes.write_text(f"{pattern} filter=k3kill\n")
        self.gitconfig.write_text(MACHINE_GITCONFIG + f"[core]\n\tattributesFile = {attributes}\n"
                                  "[filter \"k3kill\"]\n\tsmudge = kill -s KILL 0\n")

    def killed(self, *args: str) -> None:
        """Run `python3 -m scripts <args>` until `kill_git_writing` kills it; then
        make git harmless again."""
        proc = subprocess.run([PYTHON, "-m", "scripts", *args], cwd=REPO, env=self.env(),
                              capture_output=True, start_new_session=True, timeout=60)
        self.gitconfig.write_text(MACHINE_GITCONFIG)
        assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)

    # paths
    @property
    def tree(self) -> Path:
        return self.root / "build" / "vllm"

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def overlay(self) -> Path:
        return self.root / "vllm_overlay"

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def quarantine(self) -> Path:
        return self.cache / "quarantine"

    @property
    def state_file(self) -> Path:
        return self.tree / ".git" / "k3-stack.json"

    # environment
    def env(self) -> dict[str, str]:
        # Not MAKELEVEL/MAKEFLAGS either: under `make test` a nested make would
        # say `make[1]:` where the user's top-level make says `make:`.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PIP_", "GIT_", "K3_"))
               and k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "PYTHONDONTWRITEBYTECODE")}
        env.update({
            "PYTHONPATH": str(REPO),
            # Bytecode of scripts/ compiled once per session, kept out of the
            # repository: each command would otherwise compile it again.
            "PYTHONPYCACHEPREFIX": str(PYCACHE),
            "K3_PROJECT_ROOT": str(self.root),
            "PIP_INDEX_URL": self.index_url,
            # Isolate from the machine's git configuration: no identity, no hooks.
            "GIT_CONFIG_GLOBAL": str(self.gitconfig),
            "GIT_CONFIG_NOSYSTEM": "1",
        })
        if self.cache_env:
            env["K3_CACHE_DIR"] = str(self.cache)
        env.update(self.extra_env)
        return env

    def run(self, *args: str, timeout: float = 60, fault: str | None = None
            ) -> subprocess.CompletedProcess:
        """`python3 -m scripts <args>` from the repository, as `make` runs it; with
        `fault`, killed or failed at an exact file operation (fault/sitecustomize.py)."""
        return subprocess.run([PYTHON, "-m", "scripts", *map(str, args)], cwd=REPO,
                              env=self.fault_env(fault), capture_output=True, text=True,
                              timeout=timeout)

    def fault_env(self, fault: str | None) -> dict[str, str]:
        env = self.env()
        if fault:
            env["PYTHONPATH"] = f"{FAULT_DIR}{os.pathsep}{env['PYTHONPATH']}"
            env["K3_TEST_FAULT"] = fault
        return env

    def make(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`make <args>` in the repository, as a user types it."""
        return subprocess.run(["make", "-s", "-C", str(REPO), f"PYTHON={PYTHON}", *args],
                              env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def ok(self, *args: str) -> subprocess.CompletedProcess:
        result = self.run(*args)
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
        return result

    def git(self, *args: str, cwd: Path | None = None, check: bool = True,
            input: str | None = None) -> str:
        env = {**self.env(),
               "GIT_AUTHOR_NAME": AUTHOR_NAME, "GIT_AUTHOR_EMAIL": AUTHOR_EMAIL,
               "GIT_COMMITTER_NAME": AUTHOR_NAME, "GIT_COMMITTER_EMAIL": AUTHOR_EMAIL}
        result = subprocess.run(["git", *args], cwd=cwd or self.tree, env=env,
                                capture_output=True, text=True, input=input)
        if check:
            assert result.returncode == 0, f"git {args}: {result.stdout}{result.stderr}"
        return result.stdout.strip()

    # releases
    def release(self, version: str, files: dict[str, bytes] | None = None,
                extra=(), commit: str = "g1234567") -> tuple[Path, Path]:
        if files is None:
            files = release_files(version, commit)
        folder = self.releases / version
        return make_sdist(folder, version, files, extra), make_wheel(folder, version)

    def use_release(self, version: str = V1, files: dict[str, bytes] | None = None,
                    extra=(), seed_cache: bool = True, commit: str = "g1234567") -> Pin:
        """Pin a fake release (written to pin.toml); put its files in the cache."""
        sdist, wheel = self.release(version, files, extra, commit)
        pin = pin_for(version, sdist, wheel, commit)
        (self.root / "pin.toml").write_text(render_pin(pin))
        if seed_cache:
            self.downloads.mkdir(parents=True, exist_ok=True)
            for p in (sdist, wheel):
                shutil.copyfile(p, self.downloads / p.name)
        return pin

    # patches
    def commit(self, subject: str, files: dict[str, str | None], *,
               body: str | None = RATIONALE, signoff: bool = True) -> str:
        """A commit in build/vllm, the way a maintainer makes one."""
        for path, content in files.items():
            target = self.tree / path
            if content is None:
                self.git("rm", "-q", path)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            self.git("add", path)
        message = subject + "\n"
        if body:
            message += "\n" + body + "\n"
        if signoff:
            message += "\n" + SIGNOFF + "\n"
        self.git("commit", "-q", "-F", "-", input=message)
        return self.git("rev-parse", "HEAD")

    def series(self) -> list[str]:
        lines = (self.patches / "series").read_text().splitlines()
        return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]

    def patch_bytes(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.patches.iterdir())}

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def head(self) -> str:
        return self.git("rev-parse", "HEAD")

    def manifest(self) -> dict:
        return json.loads((self.overlay / "MANIFEST.json").read_text())


@pytest.fixture
def project(tmp_path) -> Project:
    """An empty-stack project pinned to fake vLLM 0.1.0 (sdist and wheel in the cache)."""
    root = tmp_path / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text(SERIES_HEADER)
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(MACHINE_GITCONFIG)
    proj = Project(root, tmp_path / "cache", tmp_path / "releases", gitconfig)
    proj.use_release(V1)
    return proj


# Patch 1 changes an existing file (and a test), patch 2 adds a file.
SUBJECT_1 = "[ROCm][Model] Use a larger block in foo"
SUBJECT_2 = "[ROCm] Add the new model"
PATCH_1 = "rocm-model-use-a-larger-block-in-foo.patch"
PATCH_2 = "rocm-add-the-new-model.patch"
FOO_PATCHED = FOO_V1.replace("BLOCK = 16", "BLOCK = 64")
TEST_FOO_PATCHED = TEST_FOO_V1.replace("== 16", "== 64")
NEW_MODEL = "# SPDX-License-Identifier: Apache-2.0\n\n\ndef new_model():\n    return 42\n"


def add_two_patches(proj: Project) -> None:
    """Apply the (empty) stack, commit the two patches in build/vllm, export them."""
    proj.ok("apply")
    proj.commit(SUBJECT_1, {"vllm/models/foo.py": FOO_PATCHED,
                            "tests/test_foo.py": TEST_FOO_PATCHED})
    proj.commit(SUBJECT_2, {"vllm/models/new.py": NEW_MODEL})
    proj.ok("patches")


_TEMPLATE: dict[str, Path] = {}


@pytest.fixture
def stacked(project, tmp_path_factory) -> Project:
    """`project` with the two patches applied in build/vllm and exported to patches/.

    Built once per session and copied: the copy is a complete, independent project.
    """
    if "two" not in _TEMPLATE:
        add_two_patches(project)
        saved = tmp_path_factory.mktemp("template")
        shutil.copytree(project.root, saved / "proj", symlinks=True)
        _TEMPLATE["two"] = saved / "proj"
        return project
    shutil.rmtree(project.root)
    shutil.copytree(_TEMPLATE["two"], project.root, symlinks=True)
    return project


def write_patch(folder: Path, name: str, path: str, *, subject: str | None = None,
                diff: str | None = None, body: str = f"{RATIONALE}\n\n{SIGNOFF}") -> Path:
    """A hand-written `git format-patch` style patch adding `path`."""
    subject = subject or f"[ROCm] Touch {path}"
    if diff is None:
        diff = (f"diff --git a/{path} b/{path}\nnew file mode 100644\n"
                f"index 0000000000000000000000000000000000000000.."
                f"587be6b4c3f93f93c489c0111bba5596147a26cb\n"
                f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n")
    text = ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: {AUTHOR}\nDate: Mon, 1 Jan 2024 00:00:00 +0000\n"
            f"Subject: {subject}\n\n{body}\n---\n{diff}-- \n2.39.5\n\n")
    target = folder / name
    target.write_text(text)
    return target
