"""Count the device kernels a piece of code would launch, on CPU.

``LaunchCounter`` is a ``TorchDispatchMode``: every op that reaches PyTorch's
dispatcher while it is active passes through it, below autograd, i.e. the ops
a device backend would execute. The rules, per op:

* **Decomposed first**: an ATen op without a device kernel of its own (a
  ``CompositeImplicitAutograd`` op such as ``to``, ``linear``, ``reshape``,
  ``contiguous``, ``repeat_interleave(int)``) runs as its decomposition on
  the device, so the counter decomposes it and classifies the parts. (Outside
  ``torch.inference_mode`` autograd already did; inside it, such ops reach the
  mode whole.) ``x.to(x.dtype)`` thus launches nothing, ``x.to(other)`` one
  ``_to_copy``.
* **No launch**: ops that only make a new view of existing memory (every op
  whose schema returns a read-only alias of an input: ``view``,
  ``_unsafe_view``, ``_reshape_alias``, ``slice``, ``select``, ``split``,
  ``unbind``, ``unsqueeze``, ``squeeze``, ``permute``, ``expand``, ``t``,
  ``transpose``, ``as_strided``, ``alias``, ``detach``, ...); allocations
  (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ``resize_``,
  ...); in-place metadata changes (``detach_``, ``as_strided_``, ...) and
  metadata queries (``NO_KERNEL``); and a ``copy_`` whose destination and
  source are the same memory with the same sizes, strides and dtype (ATen's
  ``copy_`` returns before launching anything).
* **One launch each**: every other ATen op, including fills (``zeros``,
  ``fill_``, ``zero_``), casts (``_to_copy``), ``clone``, ``arange``, a
  ``copy_`` between different memory, ``lift_fresh`` (``torch.tensor(host
  data)``: every tensor of the emulation lives on "the device", so this is
  the host-to-device copy) and ``_local_scalar_dense`` (``.item()``, the
  device-to-host copy).
* **Compiled custom ops** (vLLM's ``_C``, ``_C_cache_ops``, ``_rocm_C``, ...)
  are one launch each, under their own name. Their CPU bodies in the harness
  are plain-torch reference kernels whose inner ops are not counted: PyTorch
  runs a mode's handler with the mode popped, so the op the handler calls
  runs unobserved. Anything run under ``opaque_launch`` is likewise one
  launch; the harness uses it for kernels that are not torch ops (Triton
  kernels, the attention kernel).
* **Python custom ops** (``wrapper_namespaces``: vLLM's ``torch.ops.vllm.*``
  and its IR ops ``torch.ops.vllm_ir.*``) are not kernels but Python
  functions registered as ops so that ``torch.compile`` treats them as
  opaque. The op itself is not counted; its body runs with the mode active
  and what it launches is.

Counts are kept per ``phase``, a label the caller sets (e.g. per layer).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Non-view ops that allocate, change metadata in place or read it: no kernel.
NO_KERNEL = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
        "aten::set_",
        "aten::detach_",
        "aten::as_strided_",
        "aten::squeeze_",
        "aten::unsqueeze_",
        "aten::transpose_",
        "aten::t_",
        "aten::swapdims_",
        "aten::swapaxes_",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::sym_storage_offset",
        "aten::is_same_size",
        "aten::_has_compatible_shallow_copy_type",
    }
)
# Alias-returning ops that still move data: torch.tensor(host data) -> device.
VIEWS_THAT_LAUNCH = frozenset({"aten::lift_fresh"})

_ACTIVE: list[LaunchCounter] = []


def op_name(func) -> str:
    """``namespace::name`` without the overload (``aten::copy_``)."""
    return func._schema.name


def is_noop_copy(args) -> bool:
    """``dst.copy_(src)`` onto the very same memory layout (no kernel)."""
    dst, src = args[0], args[1]
    return (
        isinstance(src, torch.Tensor)
        and dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        and dst.storage_offset() == src.storage_offset()
        and dst.shape == src.shape
        and dst.stride() == src.stride()
        and dst.dtype == src.dtype
    )


def _storage(t) -> int | None:
    if isinstance(t, (list, tuple)):
        t = t[0] if t else None
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def launches(func, args, out) -> bool:
    name = op_name(func)
    if name in VIEWS_THAT_LAUNCH:
        return True
    if func.is_view:
        # A view op shares its input's memory; should one ever copy, count it.
        return _storage(out) != _storage(args[0])
    if name in NO_KERNEL:
        return False
    if name == "aten::copy_" and is_noop_copy(args):
        return False
    return True


def decomposes(func) -> bool:
    """An ATen op the device runs as its decomposition (it has no device
    kernel of its own). Such ops reach a mode undecomposed only under
    ``torch.inference_mode``; the counter decomposes them itself, so counts do
    not depend on the autograd mode."""
    name = func.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return (
        func.namespace == "aten"
        and has(name, "CompositeImplicitAutograd")
        and not has(name, "CUDA")
    )


def body_key(func) -> torch._C.DispatchKey | None:
    """The dispatch key a Python custom op's body is registered under."""
    for key in ("CPU", "CompositeExplicitAutograd"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key):
            return getattr(torch._C.DispatchKey, key)
    return None


class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...`` then ``c.counts[phase][op]``."""

    def __init__(
        self,
        wrapper_namespaces: tuple[str, ...] = ("vllm", "vllm_ir"),
        sites_under: str | None = None,
    ) -> None:
        super().__init__()
        self.wrapper_namespaces = frozenset(wrapper_namespaces)
        self.counts: dict[str, Counter[str]] = {}
        self.phase = "all"
        # With ``sites_under`` (a path fragment), each launch also records the
        # innermost calling line under it: {phase: {op: Counter(site)}}.
        self.sites_under = sites_under
        self.sites: dict[str, dict[str, Counter[str]]] = {}

    def record(self, name: str) -> None:
        self.counts.setdefault(self.phase, Counter())[name] += 1
        if self.sites_under is not None:
            by_op = self.sites.setdefault(self.phase, {})
            by_op.setdefault(name, Counter())[self._site()] += 1

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if self.sites_under in path:
                short = path.split(self.sites_under, 1)[1]
                return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return "?"

    def total(self) -> Counter[str]:
        return sum(self.counts.values(), Counter())

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = body_key(func) if func.namespace in self.wrapper_namespaces else None
        if key is not None:
            # Run the Python body under this mode so its launches are seen.
            with self:
                return func._op_dk(key, *args, **kwargs)
        if decomposes(func):
            with self:
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        if launches(func, args, out):
            self.record(op_name(func))
        return out


def active_counter() -> LaunchCounter | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def opaque_launch(name: str) -> Iterator[None]:
    """Count one launch named ``name``; nothing run inside is counted.

    For kernels that do not reach the dispatcher (Triton, the attention
    kernel) and whose stand-in body, if any, is plain torch.
    """
    counter = active_counter()
    if counter is not None:
        counter.record(name)
    with _disable_current_modes():
        yield
