"""Run vLLM's test files in forks of one process that has imported what they import.

A pytest process of one vLLM test file spends about 11 s of CPU before its
first test: torch, transformers and vLLM, which vLLM's tests/conftest.py
imports first thing. `make test` runs dozens of them, one per file and tree
(scripts/testing/testrun.py), so a server per tree (and platform) imports those once
(`python -m scripts.testing.forkserver`, in the tree, under the read tracker), then
forks a child per test file that runs `pytest.main` on it, as a fresh
`pytest <file>` there would. The child's reads go to the file's own log
(scripts/testing/reads/sitecustomize.py `switch_log`); what the server read before
the fork counts as read by every file it serves (`ForkServers.run` returns
that log too). Under emulated ROCm the server applies the emulation before
importing vLLM, as the rocm_emulation plugin does in a fresh process. The
server's objects are frozen out of the garbage collector before the first
fork (gc.freeze), as CPython advises for a process that forks workers.

A server that fails to start or dies is replaced by a plain pytest process
for the files it would have served: slower, never different. So is a child
whose run could have differed from a fresh process's (FrozenHeap: the server's
objects stay frozen in the child, which a test could in principle notice).
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

ROCM_PLUGIN = "rocm_emulation.plugin"
# A child's exit status when its run could differ from a fresh process's
# (FrozenHeap): the file runs again in a plain pytest process.
UNPROVEN = 86


# --- the server (runs in .venv's python, in the tree) --------------------------------


def _preimports(tree: Path) -> list[str]:
    """The modules vLLM's tests/conftest.py imports at its top, but its own tests.*."""
    try:
        module = ast.parse((tree / "tests" / "conftest.py").read_text())
    except (OSError, SyntaxError):
        return []
    names = []
    for node in module.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] != "tests"]


def serve(rocm: bool) -> None:
    """Import, then answer each request line {"args", "log", "reads", "tmp"} with
    {"code"}: the exit status of pytest on `args` in a fork."""
    sys.path[0] = os.getcwd()  # as `python -m pytest` has it (this runs as a file)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to the server's stderr
    if rocm:
        plugin = importlib.import_module(ROCM_PLUGIN)
        plugin.platform.activate(plugin.emulated_mode())
    import pytest  # noqa: F401 - loaded once, for every child

    for name in _preimports(Path.cwd()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child will import it, and say why
            pass
    # What is alive now is shared with every child until written to. Out of the
    # collector's reach, the gc.collect() that vLLM's tests run after each test
    # neither walks it (a third of a second each, with torch and vLLM loaded)
    # nor copies its pages into the child (FrozenHeap keeps it so there).
    # Collected first, so that all of it is alive when frozen.
    gc.collect()
    gc.freeze()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"code": code}) + "\n")
        replies.flush()


def _child(request: dict) -> None:
    code = 3
    try:
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's
        import sitecustomize  # the read tracker, loaded at startup through PYTHONPATH

        sitecustomize.switch_log(request["reads"])
        if request.get("tmp"):  # this file's temporary folder, as TMPDIR gives a process
            os.environ["TMPDIR"] = request["tmp"]
            tempfile.tempdir = None  # found again, from TMPDIR
        import warnings

        import pytest

        # The server imported pytest plugins' packages (anyio, through vLLM's
        # imports) before pytest could rewrite their asserts: said once per
        # child, and of no test's concern.
        warnings.filterwarnings("ignore", "Module already imported so cannot be rewritten",
                                pytest.PytestAssertRewriteWarning)
        sys.argv = ["pytest", *request["args"]]
        heap = FrozenHeap()
        code = int(pytest.main(request["args"]))
        if not heap.unobservable():
            code = UNPROVEN
    except BaseException:  # noqa: BLE001 - reported in the file's log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class FrozenHeap:
    """Keeps what the server froze out of the cyclic collector for a child's
    whole run, and tells afterwards whether a test could have seen that.

    vLLM's per-test cleanup (cleanup_dist_env_and_memory) calls gc.unfreeze()
    before its gc.collect(): the server's 700,000 objects would go back to the
    collector at the first teardown and be walked after every test (0.3 s
    each, half the time of vLLM's CPU test files). Here gc.unfreeze() leaves
    them frozen. A collection then differs from a fresh process's in one way
    only: an object of the server's that became cyclic garbage during the run
    is not freed. That can show through what freeing runs (a finalizer, a weak
    reference cleared or its callback) or through the gc module's own view of
    the heap; `unobservable` checks the first after the run, and any use of
    the second (gc.get_objects, gc.get_referrers, gc.freeze,
    gc.get_freeze_count) ends the freeze at once and fails the check. Memory
    use and collection counts differ, as they do between two fresh processes
    with different hash seeds."""

    _WATCHED = ("freeze", "get_objects", "get_referrers", "get_freeze_count")

    def __init__(self) -> None:
        self._real = {name: getattr(gc, name) for name in ("unfreeze", *self._WATCHED)}
        self.looked = False
        gc.unfreeze = self._unfreeze
        for name in self._WATCHED:
            setattr(gc, name, self._watched(self._real[name]))

    def _unfreeze(self) -> None:
        if self.looked:
            self._real["unfreeze"]()

    def _watched(self, real):
        def watched(*args, **kwargs):
            if not self.looked:
                self.looked = True
                self._real["unfreeze"]()
            return real(*args, **kwargs)

        return watched

    def unobservable(self) -> bool:
        """True when no test looked at the heap and nothing of the server's that
        became garbage has a finalizer or a weak reference: freeing it earlier,
        as a fresh process would have, would have run no code and changed no
        value. (Run once, at the end: it frees what it finds.)"""
        if self.looked:
            return False
        gc.collect()  # the run's own garbage, as every teardown frees it
        self._real["unfreeze"]()
        referenced = {id(o) for o in self._real["get_objects"]() if weakref.getweakrefcount(o)}
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds, to look at
        before = len(gc.garbage)
        gc.collect()
        found = gc.garbage[before:]
        return not any(id(o) in referenced or hasattr(type(o), "__del__") for o in found)


# --- the pool (runs in make test) ---------------------------------------------------


class _Server:
    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], reads: Path):
        self.reads = reads
        self.idle_since = 0.0
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.ready = json.loads(self.proc.stdout.readline() or "{}").get("ready", False)

    def run(self, args: list[str], log: Path, reads: Path, tmp: str | None) -> int | None:
        """pytest's exit status, or None if the server is gone."""
        try:
            self.proc.stdin.write(json.dumps({"args": args, "log": str(log),
                                              "reads": str(reads), "tmp": tmp}) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            return None
        return json.loads(reply)["code"] if reply else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reads.unlink(missing_ok=True)  # read by each file it served, as it ended


def idle_servers_memory_allows() -> int:
    """How many servers may wait idle: each holds about 1 GB, and together they
    take at most a third of the memory available now (at least 2). A run over
    the eight trees of the stack needs nine (a tree each, and build/vllm's
    emulated ROCm); with fewer, a server is started again for most files."""
    try:
        with open("/proc/meminfo") as f:
            available_kb = next(int(line.split()[1]) for line in f
                                if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2
    return max(2, available_kb // (3 * 1024 * 1024))


class ForkServers:
    """Servers by (folder, environment), started when a file first needs one; as many
    per key as files run at once there. At most `keep` wait idle (by default as
    many as memory allows): the one idle longest goes first. Leaving closes
    them all."""

    def __init__(self, python: Path, scratch: Path, keep: int | None = None):
        self.python, self.scratch = python, scratch
        self.keep = idle_servers_memory_allows() if keep is None else keep
        self._idle: dict[tuple, list[_Server]] = {}
        self._all: list[_Server] = []
        self._lock = threading.Lock()

    def run(self, cwd: Path, env: dict[str, str], args: list[str], log: Path,
            reads: Path, tmp: str | None = None) -> tuple[int, Path] | None:
        """pytest on `args` in a fork of a server for `cwd` and `env` (whose
        K3_READS_LOG is replaced), under emulated ROCm if `args` load its plugin,
        with its temporary files in `tmp` (if given): its exit status and the
        server's own reads, or None if no server could run it. The status is
        UNPROVEN (and `reads` emptied) when the run could differ from a fresh
        process's: run it in one."""
        rocm = ROCM_PLUGIN in args
        env = {k: v for k, v in env.items() if k != "K3_READS_LOG"}  # each file has its own
        key = (str(cwd), rocm, tuple(sorted(env.items())))
        server = self._take(key, cwd, env, rocm)
        if server is None:
            return None
        code = server.run(args, log, reads, tmp)
        if code is None:
            server.close()
            return None
        if code == UNPROVEN:
            reads.write_text("")  # the plain process records its own
        with self._lock:
            self._idle.setdefault(key, []).append(server)
            server.idle_since = time.monotonic()
            idle = sorted((s.idle_since, k, s) for k, ss in self._idle.items() for s in ss)
            for _, old_key, old in idle[:max(0, len(idle) - self.keep)]:
                self._idle[old_key].remove(old)
                old.close()
        return code, server.reads

    def _take(self, key: tuple, cwd: Path, env: dict[str, str], rocm: bool) -> _Server | None:
        with self._lock:
            if self._idle.get(key):
                return self._idle[key].pop()
        self.scratch.mkdir(parents=True, exist_ok=True)
        fd, reads = tempfile.mkstemp(prefix="server-", suffix=".reads", dir=self.scratch)
        os.close(fd)
        server = _Server([str(self.python), str(Path(__file__).resolve()),
                          *(["--rocm"] if rocm else [])], cwd,
                         {**env, "K3_READS_LOG": reads}, Path(reads))
        with self._lock:
            self._all.append(server)
        if not server.ready:
            server.close()
            return None
        return server

    def __enter__(self) -> ForkServers:
        return self

    def __exit__(self, *exc) -> None:
        for server in self._all:
            server.close()


if __name__ == "__main__":
    serve(rocm="--rocm" in sys.argv[1:])
