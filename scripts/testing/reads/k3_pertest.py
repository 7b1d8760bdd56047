"""Per-test record: which functions of the tree each test runs.

`make test` no longer turns it on (its units are reused whole: README.md);
scripts/testing/testblocks.py says what it is kept for.

Started by the read tracker (sitecustomize.py) in a unit's pytest process,
or in the fork server whose children run them (scripts/testing/forkserver.py), when
K3_TESTS_PROFILE is set; pytest loads this module as a plugin through
PYTEST_PLUGINS. A C profiler without caller data counts the Python code
objects each stretch of the run calls; those of files under the tree (the
first of K3_READS_ROOT) go into the bucket of the test that ran them, or
into the unit's "shared" bucket: collection, imports, fixtures that outlive
their test, the fork server's start. A Python subprocess a test starts (with
the tracker, and $K3_TESTS_CHILD as the test set it) records the same way,
all it runs into one bucket, which it leaves at its exit beside the unit's
log for the test to take in; a test that started a subprocess that left no
record (killed, exec'd, not Python, or not yet ended) is marked "whole". So
is a test that reads one of the tree's Python files as text, or runs what the
profiler cannot see (a thread, a fork, a process pool, Dynamo's tracing,
Triton's compiler, another profile hook), or during which a process or a
thread started before it still runs: a zygote or a server started by a
session's fixture runs code for every test that talks to it. At the end the
record is written beside the unit's read log, as `<K3_READS_LOG>.tests.json`;
scripts/testing/testblocks.py decides from it which tests a change reaches.
"""

from __future__ import annotations

import atexit
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
    ("torch/_dynamo/symbolic_convert.py", "InstructionTranslatorBase.run"): "Dynamo traces Python",
    ("torch/jit/frontend.py", ""): "TorchScript compiles Python",
    ("triton/compiler/compiler.py", "compile"): "Triton compiles a kernel",
}
# Processes whose code no record shows (subprocess.Popen's may leave one).
_SPAWNS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn"})
# Where the Python subprocesses a test starts leave their records: a path prefix,
# set while the test runs (their own subprocesses inherit it).
CHILD_ENV = "K3_TESTS_CHILD"
NO_RECORD = "a subprocess left no record"
# Who reads a tree's Python file without it being data: the import system, and
# Triton keeping a kernel's source (compiled kernels are caught by _BEYOND; the
# interpreter runs the code, and the profiler sees it).
_SOURCE_READERS = ("<frozen importlib._bootstrap_external>", os.path.join(
    "triton", "runtime", "jit.py"), os.path.join("triton", "runtime", "interpreter.py"))


def _bucket(children: str | None = None) -> dict:
    """What ran for one test (or outside the tests); `children` is where its
    Python subprocesses leave theirs, and `started` holds those it started (their
    Popen, and whether their record is required: one started by a library's
    import may outlive the test)."""
    return {"code": {}, "data": set(), "whole": set(), "children": children, "started": []}


class Recorder:
    """Records a pytest process by test, or (`child`: the prefix of its record's
    path) a subprocess that runs for one test."""

    def __init__(self, tree: str, child: str | None = None):
        spellings = {os.path.abspath(tree), os.path.realpath(tree)}
        self.prefixes = tuple(sorted((os.path.join(p, "") for p in spellings), key=len,
                                     reverse=True))
        self.child = child
        self.library_import = False  # (a subprocess) inside the import of a module off the tree
        self.shared = _bucket()
        self.current = _bucket(child) if child else self.shared
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
        # Keep the pids of the Popens it started, not the objects (they hold pipes).
        bucket["started"] = [(_pid(p), required) for p, required in bucket["started"]]
        for entry in stats:
            code = entry.code
            if isinstance(code, str):
                continue
            path = self._relative(code.co_filename)
            if path is not None:
                bucket["code"].setdefault(path, set()).add(code.co_qualname)
            elif bucket is not self.shared and not self.library_import:
                for (ending, qualname), why in _BEYOND.items():
                    if code.co_filename.endswith(ending) and qualname in ("", code.co_qualname):
                        bucket["whole"].add(why)

    def switch(self, bucket: dict) -> dict:
        self.flush()
        before, self.current = self.current, bucket
        if bucket["children"]:
            os.environ[CHILD_ENV] = bucket["children"]
        else:
            os.environ.pop(CHILD_ENV, None)
        return before

    def test_bucket(self, nodeid: str) -> dict:
        if nodeid not in self.tests:
            log = os.environ.get("K3_READS_LOG", "")
            self.tests[nodeid] = _bucket(f"{log}.child-{len(self.tests)}" if log else None)
        return self.tests[nodeid]

    def _audit(self, event: str, args: tuple) -> None:
        if self.current is self.shared:
            return  # what runs outside the tests counts for all of them anyway
        if event == "subprocess.Popen":
            executable, argv, _, env = args
            env = os.environ if env is None else env
            children = self.current["children"]
            if not _python(executable, argv):
                # No Python: none of the tree's code, unless it starts Python,
                # which only a program the read tracker cannot follow does.
                return
            if children and env.get(CHILD_ENV) == children:
                # The Popen whose _execute_child raised this: its pid, once forked.
                popen = sys._getframe(1).f_locals.get("self")
                if popen is None:
                    self.current["whole"].add(NO_RECORD)
                else:
                    self.current["started"].append((popen, not self.library_import))
            elif not self.library_import:
                self.current["whole"].add("runs a subprocess")
        elif event in _SPAWNS and not self.library_import:
            self.current["whole"].add("runs a subprocess")
        elif event == "open" and isinstance(args[0], str) and args[0].endswith(".py"):
            path = self._relative(os.path.abspath(args[0]))
            mode = args[1] or ""
            if path is not None and not any(c in mode for c in "wax+") and not _from(
                    _SOURCE_READERS):
                self.current["data"].add(path)

    def record(self) -> dict:
        self.flush()
        for bucket in self.tests.values():
            _take_in_children(bucket)
        return {"shared": _plain(self.shared),
                "tests": {nodeid: {**_plain(bucket), "outcome": self.outcomes.get(
                    nodeid, "passed")} for nodeid, bucket in self.tests.items()}}

    def leave_record(self) -> None:
        """A subprocess's exit: its bucket, for the test that started it."""
        self.flush()
        self.profiler.disable()
        path = f"{self.child}.{os.getpid()}.json"
        with open(f"{path}.part", "w") as f:
            json.dump({**_plain(self.current), "pid": os.getpid(),
                       **_started(self.current)}, f)
        os.replace(f"{path}.part", path)


def _python(executable, argv) -> bool:
    words = [argv] if isinstance(argv, (str, bytes)) else list(argv or [])
    program = executable or (words[0] if words else "")
    name = os.path.basename(os.fsdecode(program) if isinstance(program, bytes) else str(program))
    return name.startswith("python")


def _plain(bucket: dict) -> dict:
    return {"code": {p: sorted(q) for p, q in sorted(bucket["code"].items())},
            "data": sorted(bucket["data"]), "whole": sorted(bucket["whole"])}


def _pid(popen):
    """A Popen's pid once it has forked (a pid stays one), the Popen until then."""
    return popen if isinstance(popen, int) else getattr(popen, "pid", None) or popen


def _started(bucket: dict) -> dict:
    """The pids of the Python subprocesses a bucket started: whose records it needs."""
    pids: dict[str, list[int]] = {"required": [], "optional": []}
    for popen, required in bucket["started"]:
        if isinstance(_pid(popen), int):  # else it never started
            pids["required" if required else "optional"].append(_pid(popen))
    return pids


def _take_in_children(bucket: dict) -> None:
    """Add to a test's bucket what its Python subprocesses (and theirs) ran; a
    required one that left no record makes the test whole."""
    if not bucket["children"]:
        return
    records: dict[int, dict] = {}
    for path in sorted(glob.glob(glob.escape(bucket["children"]) + ".*")):
        try:
            if path.endswith(".json"):
                with open(path) as f:
                    record = json.load(f)
                records[record["pid"]] = record
        except (OSError, ValueError, KeyError):
            bucket["whole"].add(NO_RECORD)
        finally:
            os.unlink(path)
    # Every subprocess the test started, and each of those started in turn,
    # left its record, but those a library's import started (and theirs).
    started = _started(bucket)
    waiting, optional, seen = started["required"], started["optional"], set()
    while waiting or optional:
        pid, required = (waiting.pop(), True) if waiting else (optional.pop(), False)
        if pid in seen:
            continue
        seen.add(pid)
        if pid in records:
            waiting += records[pid].get("required", [])
            optional += records[pid].get("optional", [])
        elif required:
            bucket["whole"].add(NO_RECORD)
    for record in records.values():
        for path, names in record.get("code", {}).items():
            bucket["code"].setdefault(path, set()).update(names)
        bucket["data"].update(record.get("data", []))
        bucket["whole"].update(record.get("whole", []))


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


def start_child() -> None:
    """Record a subprocess of a test (the tracker calls this when CHILD_ENV is set):
    all it runs, imports included, is the test's; its bucket is left at its exit."""
    global recorder
    roots = [r for r in os.environ.get("K3_READS_ROOT", "").split(os.pathsep) if r]
    if recorder is None and roots:
        recorder = Recorder(roots[0], child=os.environ[CHILD_ENV])
        _wrap_library_imports()
        atexit.register(recorder.leave_record)


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


def _wrap_library_imports() -> None:
    """In a test's subprocess, what the import of a module off the tree (torch,
    opentelemetry, ...) starts (threads, pools, probes, TorchScript) runs that
    library's code, not the tree's: it makes the test no "whole". The tree's
    code it runs still counts, as does a tree module it imports in turn."""
    from importlib import _bootstrap_external

    loader = _bootstrap_external._LoaderBasics
    original = loader.exec_module

    def exec_module(self, module):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        library = not origin or recorder is None or recorder._relative(
            os.path.abspath(origin)) is None
        if recorder is None or recorder.library_import == library:
            return original(self, module)
        recorder.flush()
        before, recorder.library_import = recorder.library_import, library
        try:
            return original(self, module)
        finally:
            recorder.flush()
            recorder.library_import = before

    loader.exec_module = exec_module


# --- the pytest plugin --------------------------------------------------------------

try:
    # A test's subprocess needs no hooks, nor pytest loaded for them.
    if os.environ.get(CHILD_ENV):
        raise ImportError
    import pytest
except ImportError:  # the tracker also runs in processes that never load pytest
    pytest = None

if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        if recorder is None:
            yield
            return
        bucket = recorder.test_bucket(item.nodeid)
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
