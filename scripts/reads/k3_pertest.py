"""Per-test record of `make test`: which functions of the tree each test runs.

Started by the read tracker (sitecustomize.py) in a unit's pytest process,
or in the fork server whose children run them (scripts/forkserver.py), when
K3_TESTS_PROFILE is set; pytest loads this module as a plugin through
PYTEST_PLUGINS. A C profiler without caller data counts the Python code
objects each stretch of the run calls; those of files under the tree (the
first of K3_READS_ROOT) go into the bucket of the test that ran them, or
into the unit's "shared" bucket: collection, imports, fixtures that outlive
their test, the fork server's start. A test that reads one of the tree's
Python files as text, or runs what the profiler cannot see (a thread, a
subprocess, a process pool, Dynamo's tracing, Triton's compiler, another
profile hook) is marked "whole", as is one during which a process or a
thread started before it still runs: a zygote or a server started by a
session's fixture runs code for every test that talks to it. At the end the
record is written beside the unit's read log, as `<K3_READS_LOG>.tests.json`;
scripts/testblocks.py decides from it which tests a change reaches.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading

import _lsprof

# (file name ending, qualified name or "" for any): code that means a test ran
# more than the profiler of this thread sees.
_BEYOND = {
    ("threading.py", "Thread.start"): "starts a thread",
    ("concurrent/futures/thread.py", "ThreadPoolExecutor.submit"): "uses a thread pool",
    ("concurrent/futures/process.py", "ProcessPoolExecutor.submit"): "uses a process pool",
    ("multiprocessing/process.py", "BaseProcess.start"): "starts a process",
    ("multiprocessing/pool.py", "Pool._map_async"): "uses a process pool",
    ("multiprocessing/pool.py", "Pool.apply_async"): "uses a process pool",
    ("subprocess.py", "Popen.__init__"): "runs a subprocess",
    ("torch/_dynamo/symbolic_convert.py", "InstructionTranslatorBase.run"): "Dynamo traces Python",
    ("torch/jit/frontend.py", ""): "TorchScript compiles Python",
    ("triton/compiler/compiler.py", "compile"): "Triton compiles a kernel",
}
_SPAWNS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
                     "subprocess.Popen"})
# Who reads a tree's Python file without it being data: the import system, and
# Triton keeping a kernel's source (compiled kernels are caught by _BEYOND; the
# interpreter runs the code, and the profiler sees it).
_SOURCE_READERS = ("<frozen importlib._bootstrap_external>", os.path.join(
    "triton", "runtime", "jit.py"), os.path.join("triton", "runtime", "interpreter.py"))


def _bucket() -> dict:
    return {"code": {}, "data": set(), "whole": set()}


class Recorder:
    def __init__(self, tree: str):
        spellings = {os.path.abspath(tree), os.path.realpath(tree)}
        self.prefixes = tuple(sorted((os.path.join(p, "") for p in spellings), key=len,
                                     reverse=True))
        self.shared = _bucket()
        self.current = self.shared
        self.tests: dict[str, dict] = {}
        self.outcomes: dict[str, str] = {}
        self.importing = 0
        self.profiler = _lsprof.Profiler()
        self.profiler.enable(subcalls=False, builtins=False)
        sys.addaudithook(self._audit)

    def _relative(self, filename: str) -> str | None:
        for prefix in self.prefixes:
            if filename.startswith(prefix):
                return filename[len(prefix):]
        return None

    def flush(self) -> None:
        """What ran since the last flush, into the current bucket."""
        profiler = self.profiler
        replaced = sys.getprofile() is not profiler
        profiler.disable()
        stats = profiler.getstats()
        profiler.clear()
        profiler.enable(subcalls=False, builtins=False)
        bucket = self.current
        if replaced:
            bucket["whole"].add("replaced the profile hook")
        for entry in stats:
            code = entry.code
            if isinstance(code, str):
                continue
            path = self._relative(code.co_filename)
            if path is not None:
                bucket["code"].setdefault(path, set()).add(code.co_qualname)
            elif bucket is not self.shared:
                for (ending, qualname), why in _BEYOND.items():
                    if code.co_filename.endswith(ending) and qualname in ("", code.co_qualname):
                        bucket["whole"].add(why)

    def switch(self, bucket: dict) -> dict:
        self.flush()
        before, self.current = self.current, bucket
        return before

    def _audit(self, event: str, args: tuple) -> None:
        if self.current is self.shared:
            return  # what runs outside the tests counts for all of them anyway
        if event in _SPAWNS:
            self.current["whole"].add("runs a subprocess")
        elif event == "open" and isinstance(args[0], str) and args[0].endswith(".py"):
            path = self._relative(os.path.abspath(args[0]))
            mode = args[1] or ""
            if path is not None and not any(c in mode for c in "wax+") and not _from(
                    _SOURCE_READERS):
                self.current["data"].add(path)

    def record(self) -> dict:
        self.flush()

        def plain(bucket: dict) -> dict:
            return {"code": {p: sorted(q) for p, q in sorted(bucket["code"].items())},
                    "data": sorted(bucket["data"]), "whole": sorted(bucket["whole"])}

        return {"shared": plain(self.shared),
                "tests": {nodeid: {**plain(bucket), "outcome": self.outcomes.get(
                    nodeid, "passed")} for nodeid, bucket in self.tests.items()}}


def _still_running() -> set[str]:
    """Why code may run for the current test where this thread's profiler cannot
    see it: child processes or other threads that outlived what started them."""
    why = set()
    for children in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(children) as f:
                if f.read().split():
                    why.add("a process started before it still runs")
        except OSError:
            continue
    if any(t is not threading.main_thread() for t in threading.enumerate()):
        why.add("a thread started before it still runs")
    return why


def _from(files: tuple[str, ...]) -> bool:
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name.startswith(files[0]) or name.endswith(files[1:]):
            return True
        frame = frame.f_back
    return False


recorder: Recorder | None = None


def start() -> None:
    """Start recording (the tracker calls this when K3_TESTS_PROFILE is set)."""
    global recorder
    roots = [r for r in os.environ.get("K3_READS_ROOT", "").split(os.pathsep) if r]
    if recorder is None and roots:
        recorder = Recorder(roots[0])
        _wrap_imports()


def _wrap_imports() -> None:
    """What a module runs as it is imported counts for every test (its state
    outlives the test that imported it)."""
    from importlib import _bootstrap_external

    loader = _bootstrap_external._LoaderBasics
    original = loader.exec_module

    def exec_module(self, module):
        if recorder is None or recorder.current is recorder.shared:
            return original(self, module)
        before = recorder.switch(recorder.shared)
        try:
            return original(self, module)
        finally:
            recorder.switch(before)

    loader.exec_module = exec_module


# --- the pytest plugin --------------------------------------------------------------

try:
    import pytest
except ImportError:  # the tracker also runs in processes that never load pytest
    pytest = None

if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        if recorder is None:
            yield
            return
        bucket = recorder.tests.setdefault(item.nodeid, _bucket())
        bucket["whole"] |= _still_running()
        before = recorder.switch(bucket)
        try:
            yield
        finally:
            recorder.switch(before)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        if recorder is not None and recorder.current is not recorder.shared:
            recorder.current["whole"] |= _still_running()  # its fixtures' too
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(fixturedef, request):
        if recorder is None or fixturedef.scope == "function":
            yield
            return
        before = recorder.switch(recorder.shared)
        try:
            yield
        finally:
            recorder.switch(before)

    def pytest_runtest_logreport(report):
        if recorder is None:
            return
        if report.failed:
            recorder.outcomes[report.nodeid] = "failed"
        elif report.skipped and recorder.outcomes.get(report.nodeid) != "failed":
            recorder.outcomes[report.nodeid] = "skipped"

    def pytest_unconfigure(config):
        log = os.environ.get("K3_READS_LOG")
        if recorder is None or not log:
            return
        path = log + ".tests.json"
        with open(path + ".part", "w") as f:
            json.dump(recorder.record(), f)
        os.replace(path + ".part", path)
