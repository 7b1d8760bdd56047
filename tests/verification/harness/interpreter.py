"""Run vLLM's Triton kernels on CPU, in Triton's interpreter, in worker processes.

Triton picks the interpreter when a kernel is decorated, so TRITON_INTERPRET=1
must be set before vLLM is imported; with an empty CUDA_VISIBLE_DEVICES (set on
purpose) vLLM keeps Triton on without a GPU driver. Both are set in a pool of
spawned workers only: the pytest process never imports vLLM, and other tests
never see the interpreter.

The interpreter differs from compiled Triton in ways that have nothing to do
with the kernels under test; the workarounds for them (``widen_bf16_dots``,
``stand_in_libdevice_log1p``, and ``patch_language_once_per_launch`` for its
speed, in every worker) patch Triton or vLLM inside the workers, which is why
these checks live here and not in vLLM's tree.

Usage: ``with InterpreterPool(widen_bf16_dots) as pool: pool.map(fn, args)``,
where ``fn`` is a module-level function of a module the workers can import
(the project root is on their path, as on the pytest process's).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

# Set in each worker before it imports Triton or vLLM (a spawned process
# starts without them).
INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}

NUM_WORKERS = 2


class InterpreterWorkerError(AssertionError):
    """A job raised in an interpreter worker; carries the worker's traceback
    as text (unpickling a vLLM or Triton exception here would import them)."""


def widen_bf16_dots() -> None:
    """numpy has no bf16: the interpreter keeps bf16 tensors as their raw
    16 bits and multiplies those in ``tl.dot``. Widen bf16 operands to fp32
    first, which is exact (tensor cores accumulate bf16 products in fp32)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot_widening_bf16(self, a, b, d, input_precision, max_imprecise):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_imprecise)

    interpreter.InterpreterBuilder.create_dot = create_dot_widening_bf16


def patch_language_once_per_launch() -> None:
    """The interpreter patches ``triton.language`` for a launch and again for
    every call of a ``@triton.jit`` helper inside it, in every program (more
    than half the run time of vLLM's MLA block decode). A helper that sees
    only the modules the launch patched needs nothing more; others are
    patched as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    patched: set[int] = set()  # ids of the modules the running launch patched

    class Unpatched:
        def restore(self) -> None:
            pass

    langs_of: dict[object, set[int]] = {}  # helper -> ids of its language modules

    def patch_lang_once(fn):
        if fn not in langs_of:
            langs_of[fn] = {
                id(value)
                for value in fn.__globals__.values()
                if inspect.ismodule(value) and value in (tl, tl.core)
            }
        langs = langs_of[fn]
        if patched and langs <= patched:
            return Unpatched()
        scope = patch_lang(fn)
        patched.update(langs)
        restore = scope.restore

        def restore_and_forget() -> None:  # at the end of the launch
            restore()
            patched.clear()

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang_once


def _log1p(x):
    import triton.language as tl

    return tl.log(1.0 + x)


def stand_in_libdevice_log1p() -> None:
    """The interpreter cannot call libdevice externs; the rejection sampler's
    resample residual (``tldevice.log1p``) is their only user there."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

    rejection_sampler_utils.tldevice = types.SimpleNamespace(log1p=_log1p)


# The traceback of a worker whose setup failed, reported by each of its jobs.
_SETUP_ERROR: str | None = None


def _set_up_worker(
    workarounds: tuple[Callable[[], None], ...], prepare: Callable[[], None] | None
) -> None:
    # Not raised here, where it would only break the pool without a word.
    global _SETUP_ERROR
    try:
        imported = [name for name in ("triton", "vllm") if name in sys.modules]
        if imported:
            raise RuntimeError(f"{imported} imported before the interpreter was on")
        os.environ.update(INTERPRETER_ENV)
        if prepare is not None:  # e.g. a platform emulation, before vLLM loads
            prepare()
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise RuntimeError("vLLM turned Triton off in the interpreter worker")
        patch_language_once_per_launch()
        for workaround in workarounds:
            workaround()
    except BaseException:  # noqa: BLE001 - reported by the jobs
        _SETUP_ERROR = traceback.format_exc()


def _run_job(job: tuple[Callable[[Any], Any], Any]) -> tuple[str, Any]:
    function, argument = job
    if _SETUP_ERROR is not None:
        return "err", f"worker setup failed:\n{_SETUP_ERROR}"
    try:
        return "ok", function(argument)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return "err", "".join(traceback.format_exception(exc))


class InterpreterPool:
    """``workers`` (NUM_WORKERS) spawned processes with Triton's interpreter on
    and the given workarounds applied, serving ``map``; a context manager.
    ``prepare`` runs in each worker once the interpreter is on, before vLLM is
    imported (the aiter harness emulates a ROCm platform there)."""

    def __init__(
        self,
        *workarounds: Callable[[], None],
        prepare: Callable[[], None] | None = None,
        workers: int = NUM_WORKERS,
    ) -> None:
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_set_up_worker,
            initargs=(workarounds, prepare),
        )

    def map(
        self,
        function: Callable[[Any], Any],
        arguments: Iterable[Any],
        *,
        return_errors: bool = False,
    ) -> list:
        """``[function(a) for a in arguments]``, computed in the workers. A
        failed job raises InterpreterWorkerError (with the worker's traceback),
        or with `return_errors` takes its place in the list. A worker that
        dies (a kernel writing out of bounds can crash the interpreter) breaks
        the pool: that raises."""
        jobs = [(function, argument) for argument in arguments]
        try:
            outcomes = list(self._pool.map(_run_job, jobs))
        except BrokenProcessPool as exc:
            raise InterpreterWorkerError(
                f"an interpreter worker died running {function.__qualname__}: {exc}"
            ) from None
        results = []
        for kind, payload in outcomes:
            if kind == "err":
                error = InterpreterWorkerError(f"in an interpreter worker:\n{payload}")
                if not return_errors:
                    raise error
                payload = error
            results.append(payload)
        return results

    def __enter__(self) -> InterpreterPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(cancel_futures=True)
