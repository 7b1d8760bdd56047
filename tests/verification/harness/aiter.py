"""aiter (AMD's kernel library, package ``amd-aiter``) in the emulated ROCm world.

``amd-aiter`` is installed in .venv (pinned in requirements/venv.lock), but
``import aiter`` cannot run here: the package ``__init__`` asks the ROCm
install for its version (``hipconfig``, ``rocminfo``) and JIT-builds HIP
modules with ``hipcc``. Its Triton kernels (``aiter.ops.triton``) need none of
that. This module gives an emulated process one of two worlds, chosen once,
before vLLM is imported (``platform.activate(mode, aiter=...)``):

- **AITER off** (``block``, the default of every emulated process): ``aiter``
  is not importable and ``importlib.util.find_spec("aiter")`` is None, exactly
  as on a machine without the package. Without this, vLLM 0.34.0 sees the
  installed package (``IS_AITER_FOUND``), registers its aiter custom ops and
  IR kernels, and ``vllm.model_executor.layers.mhc`` runs ``from aiter.ops
  import mhc`` at import time, which executes the package ``__init__`` and
  fails with "ROCm version file not found" (a RuntimeError, not an
  ImportError): every emulated drafter test breaks.
- **AITER on** (``install_stand_in``): ``aiter`` is a stand-in package whose
  ``__path__`` is the installed folder, so ``aiter.ops.triton.*`` import and run
  (in Triton's interpreter when ``TRITON_INTERPRET=1``), while the package
  ``__init__`` never runs. Every other part of aiter (its HIP/CK/asm ops:
  ``aiter.mla``, ``aiter.ops.cache``, ``from aiter import rms_norm``, ...)
  raises ``HipOpUnavailable`` (an ImportError, so vLLM's "is it there?" probes
  treat it as absent) unless a test double is registered for it with
  ``register_double``, which first checks the double against a torch reference.

The stand-in lives here, in the test harness, never in vLLM's tree.

Triton's interpreter (3.8) differs from compiled Triton in five ways that
aiter's kernels reach; ``INTERPRETER_WORKAROUNDS`` fixes them in the worker
processes that run the kernels:

- ``assume_as_hint``: ``tl.assume`` is an optimisation hint when compiled; the
  interpreter asserts it, and aiter's batched GEMMs assume ``stride > 0`` for
  strides they pass as 0 (the bias stride when there is no bias).
- ``exact_fp8_casts``: the interpreter's fp32 -> fp8 cast rounds by adding the
  cut-off bit to the mantissa without carrying into the exponent (15.5 ->
  e4m3 8.0, 232 -> 240) and writes -0.0 as 0x80, which is NaN in MI300's
  e4m3fnuz. Downcasts to an 8-bit float go through torch's round-to-nearest-
  even cast instead (the hardware's ``v_cvt_*fp8`` rounding).
- ``tensor_math_methods``: math called as a tensor method (``x.floor()``, in
  aiter's MXFP4 quantizer) reaches the unpatched builtin without its semantic
  object; the method is routed to ``tl.math.<name>``, which the interpreter
  patches.
- ``bf16_arithmetic``: numpy has no bf16, the interpreter keeps bf16 tensors as
  their raw 16 bits and adds, multiplies, compares and negates those integers
  (aiter's RoPE rotation, which the GPU bench's ``aiter_rope_cache`` case runs
  here, negates a bf16 tensor: ``-x``). Elementwise bf16
  arithmetic runs in fp32 and rounds to nearest even, as the GPU does;
  negation flips the sign bit.
- ``rounded_bf16_casts``: the interpreter's fp32 -> bf16 cast truncates;
  compiled Triton rounds to nearest even (its default downcast rounding), as
  vLLM's kernels do. vLLM's Triton kernels (the drafter's q/kv RMSNorm, the
  MLA decode) and aiter's cast their fp32 results to bf16 this way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# What may be imported from the installed package in the AITER-on world:
# aiter's Triton kernels and the (empty) package above them.
TRITON_PREFIX = "aiter.ops.triton"
_PARENTS = ("aiter.ops",)


class HipOpUnavailable(ImportError):
    """A part of aiter that is not one of its Triton kernels (a HIP/CK/asm op,
    or the package ``__init__``) was asked for: it cannot run on CPU."""


def installed_folder() -> Path:
    """The installed ``aiter`` package folder, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "amd-aiter is not installed in this environment "
            "(requirements/venv.lock pins it; rebuild .venv)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _world() -> str | None:
    module = sys.modules.get("aiter", "absent")
    if module == "absent":
        return None
    if module is None:
        return "off"
    if isinstance(module, _StandIn):
        return "on"
    return "real"


def block() -> None:
    """The AITER-off world: ``aiter`` is absent (``sys.modules["aiter"] =
    None``: ``find_spec`` returns None and ``import aiter`` raises
    ModuleNotFoundError)."""
    world = _world()
    if world in ("on", "real"):
        raise RuntimeError(f"aiter is already {'stood in' if world == 'on' else 'imported'}")
    sys.modules["aiter"] = None  # type: ignore[assignment]


def _unavailable(name: str) -> HipOpUnavailable:
    return HipOpUnavailable(
        f"{name} is not one of aiter's Triton kernels ({TRITON_PREFIX}.*): a HIP/CK "
        "op or the aiter package __init__, which cannot run on CPU. A test may "
        "register a double for it (tests/verification/harness/aiter.py: "
        "register_double), checked against a torch reference."
    )


class _StandIn(types.ModuleType):
    """``aiter`` as a namespace over the installed folder; its attributes are
    the subpackages imported through it and the registered doubles."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _unavailable(f"aiter.{name}")


class _TritonOnlyFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: ``aiter.*`` outside the Triton kernels (and
    the modules of registered doubles) raises HipOpUnavailable."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("aiter."):
            return None
        if (
            fullname == TRITON_PREFIX
            or fullname.startswith(TRITON_PREFIX + ".")
            or fullname in _PARENTS
        ):
            return None  # the path finder loads it from the installed folder
        raise _unavailable(fullname)


_FINDER = _TritonOnlyFinder()


def install_stand_in() -> types.ModuleType:
    """The AITER-on world (see the module docstring). Idempotent."""
    world = _world()
    if world == "on":
        return sys.modules["aiter"]
    if world is not None:
        raise RuntimeError(f"aiter is already {'blocked' if world == 'off' else 'imported'}")
    folder = installed_folder()
    stand_in = _StandIn("aiter", "aiter's Triton kernels only (test harness stand-in)")
    spec = importlib.machinery.ModuleSpec("aiter", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    stand_in.__spec__ = spec
    stand_in.__path__ = [str(folder)]
    stand_in.__file__ = None
    sys.modules["aiter"] = stand_in
    sys.meta_path.insert(0, _FINDER)
    return stand_in


def register_double(
    qualname: str,
    double: Callable,
    *,
    reference: Callable,
    cases: Sequence[Callable[[], tuple[tuple, dict]]],
    compare: Callable[[object, object], None],
) -> None:
    """Stand ``double`` in for the HIP/CK op ``qualname`` (``aiter.X.name`` or
    ``aiter.name``) after checking it against ``reference`` (torch) on every
    case (a callable building fresh ``(args, kwargs)``; ``compare(got,
    expected)`` raises on disagreement). Only in the AITER-on world."""
    if _world() != "on":
        raise RuntimeError("register_double needs the AITER-on world (install_stand_in)")
    if not cases:
        raise ValueError(f"a double for {qualname} needs at least one checked case")
    for make in cases:
        args, kwargs = make()
        got = double(*args, **kwargs)
        args, kwargs = make()
        compare(got, reference(*args, **kwargs))
    module_name, _, name = qualname.rpartition(".")
    if not module_name.startswith("aiter") or module_name.startswith(TRITON_PREFIX):
        raise ValueError(f"{qualname}: doubles are for aiter's HIP/CK ops only")
    module = sys.modules.get(module_name)
    if module is None:
        module = _StandIn(module_name, f"doubles of {module_name} (test harness)")
        module.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
        sys.modules[module_name] = module
        parent, _, child = module_name.rpartition(".")
        if parent:
            setattr(importlib.import_module(parent), child, module)
    setattr(module, name, double)


# --- Triton interpreter workarounds (applied in interpreter workers) ---------


def assume_as_hint() -> None:
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_assume = lambda self, condition: None


_TORCH_FP8 = {
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e4b8": torch.float8_e4m3fnuz,
    "fp8e5": torch.float8_e5m2,
    "fp8e5b16": torch.float8_e5m2fnuz,
}


def exact_fp8_casts() -> None:
    import numpy as np
    from triton.runtime import interpreter

    create_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp_exact_fp8(self, src, dst_type, rounding_mode):
        target = _TORCH_FP8.get(dst_type.scalar.name)
        if target is None or src.dtype.scalar.primitive_bitwidth <= 8:
            return create_fp_to_fp(self, src, dst_type, rounding_mode)
        wide = create_fp_to_fp(self, src, interpreter.tl.float32, None)  # exact upcast
        values = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32))
        bits = values.to(target).view(torch.uint8).numpy()
        return interpreter.TensorHandle(bits, dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp_exact_fp8


def tensor_math_methods() -> None:
    import triton.language as tl

    for name in dir(tl.math):
        member = getattr(tl.tensor, name, None)
        if member is None or tl.core.is_builtin(member):
            continue
        if not callable(getattr(tl.math, name)):
            continue

        def method(self, *args, _name=name, **kwargs):
            return getattr(tl.math, _name)(self, *args, **kwargs)

        setattr(tl.tensor, name, method)


def bf16_arithmetic() -> None:
    import numpy as np
    from triton.runtime import interpreter

    tl = interpreter.tl
    binary_op = interpreter.InterpreterBuilder.binary_op
    create_fneg = interpreter.InterpreterBuilder.create_fneg

    def widen(handle):
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def binary_op_in_fp32(self, lhs, rhs, op):
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return binary_op(self, lhs, rhs, op)
        output = op(widen(lhs).data, widen(rhs).data)
        if output.dtype != np.float32:  # a comparison: as the interpreter returns it
            return binary_op(self, lhs, rhs, lambda a, b: output)
        rounded = torch.from_numpy(np.ascontiguousarray(output)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.uint16).numpy(), tl.bfloat16)

    def fneg_sign_bit(self, input):
        if input.dtype.scalar != tl.bfloat16:
            return create_fneg(self, input)
        return interpreter.TensorHandle(input.data ^ np.uint16(0x8000), tl.bfloat16)

    interpreter.InterpreterBuilder.binary_op = binary_op_in_fp32
    interpreter.InterpreterBuilder.create_fneg = fneg_sign_bit


def rounded_bf16_casts() -> None:
    """fp32 -> bf16 casts round to nearest even, as compiled Triton's do
    (``fp_downcast_rounding`` defaults to RTNE); the interpreter's cast_impl
    truncates. Without it aiter's fused RoPE + cache kernel is one bf16 step
    off vLLM's rotary kernel in about half the rotated elements."""
    import numpy as np
    from triton.runtime import interpreter

    tl = interpreter.tl
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_bf16(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        rounded = values.to(torch.bfloat16).view(torch.uint16).numpy()
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_bf16


INTERPRETER_WORKAROUNDS = (
    assume_as_hint,
    exact_fp8_casts,
    tensor_math_methods,
    bf16_arithmetic,
    rounded_bf16_casts,
)


# --- interpreter workers in the AITER-on world -------------------------------


def _prepare_gfx942() -> None:
    from tests.verification.harness import platform

    platform.activate("rocm-gfx942", aiter=True)


def _prepare_gfx950() -> None:
    from tests.verification.harness import platform

    platform.activate("rocm-gfx950", aiter=True)


_PREPARE = {"gfx942": _prepare_gfx942, "gfx950": _prepare_gfx950}


def interpreter_pool(arch: str, workers: int = 1):
    """An InterpreterPool whose workers emulate ROCm ``arch`` (gfx942: MI300;
    gfx950: MI355, the only arch aiter's FP4 kernels accept) with the aiter
    stand-in installed, before they import vLLM."""
    from tests.verification.harness.interpreter import InterpreterPool

    return InterpreterPool(*INTERPRETER_WORKAROUNDS, prepare=_PREPARE[arch], workers=workers)


# --- the kernels (call in the AITER-on world) --------------------------------


def fp8_bmm() -> Callable:
    """What vLLM's MLA absorb calls with VLLM_ROCM_USE_AITER_FP8BMM
    (``rocm_aiter_ops.triton_fp8_bmm`` -> aiter's
    ``batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant``)."""
    from vllm._aiter_ops import rocm_aiter_ops

    return rocm_aiter_ops.triton_fp8_bmm


def fp4_quant() -> Callable:
    """vLLM's MXFP4 weight quantizer for the FP4 BMM (aiter's Triton
    ``dynamic_mxfp4_quant``)."""
    from vllm.model_executor.layers.quantization.quark.utils import (
        quark_quantize_weight_to_mxfp4,
    )

    return quark_quantize_weight_to_mxfp4


def fp4_bmms() -> dict[str, Callable]:
    """aiter's FP4 batched GEMMs (gfx950 only): ``afp4wfp4`` takes an MXFP4
    activation, ``afp4wfp4_pre_quant`` quantizes a bf16 one in the kernel (the
    ``prequant`` regime vLLM asks for)."""
    from aiter.ops.triton.batched_gemm_afp4wfp4 import batched_gemm_afp4wfp4
    from aiter.ops.triton.batched_gemm_afp4wfp4_pre_quant import (
        batched_gemm_afp4wfp4_pre_quant,
    )

    return {
        "afp4wfp4": batched_gemm_afp4wfp4,
        "afp4wfp4_pre_quant": batched_gemm_afp4wfp4_pre_quant,
    }


__all__ = [
    "HipOpUnavailable",
    "INTERPRETER_WORKAROUNDS",
    "block",
    "fp4_bmms",
    "fp4_quant",
    "fp8_bmm",
    "install_stand_in",
    "installed_folder",
    "interpreter_pool",
    "register_double",
]
