"""Run test bodies in fresh forks of a process that emulates a GPU platform.

A zygote is a separate Python process that applies ``platform.activate(mode)``
before importing vLLM, imports the drafter stack once, then serves requests:
each request forks a child that runs one function and reports its result (or
its exception, traceback included) back. Every test therefore starts from the
same clean, already-imported emulated state, pays no per-test import cost,
and the pytest process itself never imports vLLM or sees the platform swap.

Usage (pytest side): ``Zygote("rocm-gfx942").call(fn, **kwargs)`` where ``fn``
is a module-level function importable by the zygote (test modules are: the
zygote runs with the project root first on ``sys.path``).
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]


def _send(fd_or_file, obj) -> None:
    data = pickle.dumps(obj)
    payload = struct.pack("!Q", len(data)) + data
    if isinstance(fd_or_file, int):
        view = memoryview(payload)
        while view:
            n = os.write(fd_or_file, view)
            view = view[n:]
    else:
        fd_or_file.write(payload)
        fd_or_file.flush()


def _read_exact(read, n: int) -> bytes:
    chunks = []
    while n:
        chunk = read(n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(fd_or_file):
    if isinstance(fd_or_file, int):

        def read(n):
            return os.read(fd_or_file, n)
    else:
        read = fd_or_file.read
    (size,) = struct.unpack("!Q", _read_exact(read, 8))
    return pickle.loads(_read_exact(read, size))


class RemoteError(AssertionError):
    """Raised in pytest when the emulated child failed without a picklable error."""


class Zygote:
    """Starts in the background; the first ``call`` waits until it is ready,
    so several zygotes start concurrently. ``vllm_tree``: a folder holding a
    ``vllm`` package to import instead of the installed one. ``aiter``: the
    AITER-on world in the FP8 BMM regime, Triton compiling and launching
    nothing (``harness/aiter_drafter.py``)."""

    def __init__(
        self, mode: str, vllm_tree: str | None = None, *, aiter: bool = False
    ) -> None:
        self.mode = mode
        self.aiter = aiter
        self.vllm_tree = vllm_tree
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"k3-zygote-{mode}-", suffix=".log", delete=False
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(PROJECT_ROOT)]
            + ([vllm_tree] if vllm_tree else [])
            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.verification.harness.zygote", mode]
            + (["aiter"] if aiter else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=PROJECT_ROOT,
            env=env,
        )
        self._ready = False

    def _await_ready(self) -> None:
        if not self._ready:
            status = _recv(self.proc.stdout)
            if status[0] != "ready":
                raise RuntimeError(
                    f"zygote {self.mode} failed to start: {status[1]}\n"
                    f"its output ends:\n{self._output_tail()}"
                )
            self._ready = True

    def call(self, fn, /, **kwargs):
        self._await_ready()
        _send(self.proc.stdin, (fn.__module__, fn.__qualname__, kwargs))
        kind, payload = _recv(self.proc.stdout)
        if kind == "ok":
            return payload
        raise RemoteError(f"in the {self.mode} emulated child:\n{payload}")

    def close(self) -> None:
        if self.proc.poll() is None:
            if self._ready:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            else:  # still starting up: nothing of it is needed
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        # What it printed is of no use once it is gone (a second close finds none).
        Path(self.log.name).unlink(missing_ok=True)

    def _output_tail(self, lines: int = 40) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def _run_child(module: str, qualname: str, kwargs: dict, wfd: int) -> None:
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        result = ("ok", obj(**kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        # Sent as text: unpickling a vLLM exception class in pytest would
        # import vLLM there, under the wrong platform.
        result = ("err", "".join(traceback.format_exception(exc)))
    try:
        _send(wfd, result)
    except Exception:
        _send(wfd, ("err", f"unpicklable result: {result!r:.2000}"))


def _serve(mode: str, aiter: bool = False) -> None:
    out = sys.stdout.buffer
    # Anything the stack prints goes to the log, not into the protocol stream.
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    proto = os.fdopen(proto_fd, "wb")
    try:
        if aiter:
            from tests.verification.harness import aiter_drafter

            aiter_drafter.activate_regime(mode)
            aiter_drafter.compile_nothing()
            # Loading quantizes W_K/W_V (a parallel region here, in the warm-up):
            # an OpenMP pool started before a fork hangs the child's next GEMM.
            import torch

            torch.set_num_threads(1)
        else:
            from tests.verification.harness import platform

            platform.activate(mode)
        from tests.verification.harness import drafter

        drafter.warm_up()
    except BaseException:
        _send(proto, ("failed", traceback.format_exc()))
        return
    _send(proto, ("ready", None))
    del out
    stdin = sys.stdin.buffer
    while True:
        try:
            module, qualname, kwargs = _recv(stdin)
        except EOFError:
            return
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            code = 0
            try:
                _run_child(module, qualname, kwargs, wfd)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(wfd)
        try:
            result = _recv(rfd)
        except EOFError:
            result = None
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        if result is None:
            result = ("err", f"child died without a result (wait status {status})")
        # Forward the raw result to pytest.
        _send(proto, result)


if __name__ == "__main__":
    _serve(sys.argv[1], aiter=sys.argv[2:] == ["aiter"])
