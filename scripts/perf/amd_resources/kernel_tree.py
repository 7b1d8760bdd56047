"""The tree's kernel files, imported as ROCm would import them, on a CPU.

`rocm_modules(tree, arch)` imports vllm modules from the files of a vLLM tree
on disk (uncommitted edits included) with stand-ins: vllm.triton_utils (the
one `make gpubench` writes), vllm.platforms, whose current platform is ROCm on
the given GPU, and `make gpubench`'s for the tensor-parallel and batch-sharding
modules that the draft logits cache imports. Package `__init__` files are not
run, so a kernel file pulls in only the modules it imports itself. Triton's active driver answers
for that GPU too (target, LDS, CUs), so a wrapper that asks Triton gets the
answer it would get there.

`record_launches()` replaces the launch of every JIT kernel (`kernel[grid](...)`)
by a record of its arguments while a wrapper runs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from scripts.perf.amd_resources.targets import WAVE_SIZE, Arch
from scripts.perf.gpubench import DRAFT_LOGITS_STANDINS, STANDINS


class _RocmPlatform:
    """vllm.platforms.current_platform as ROCm on `arch` answers it."""

    def __init__(self, arch: Arch) -> None:
        self._arch = arch

    def is_rocm(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return True

    def get_device_capability(self, device_id: int = 0):
        major, minor = int(self._arch.name[3]), int(self._arch.name[4])
        return types.SimpleNamespace(major=major, minor=minor,
                                     to_int=lambda: major * 10 + minor)

    def num_compute_units(self, device_id: int = 0) -> int:
        return self._arch.compute_units

    def fp8_dtype(self):
        import torch

        return getattr(torch, self._arch.fp8_dtype)

    def is_fp8_fnuz(self) -> bool:
        return self._arch.fp8_dtype.endswith("fnuz")


class _RocmDriver:
    """Triton's active driver for a GPU that is not there: it answers target and
    device queries; nothing is ever launched through it."""

    def __init__(self, arch: Arch) -> None:
        self._target = GPUTarget("hip", arch.name, WAVE_SIZE)
        properties = {"max_shared_mem": arch.lds_bytes,
                      "multiprocessor_count": arch.compute_units, "warpSize": WAVE_SIZE}
        self.utils = types.SimpleNamespace(get_device_properties=lambda device=0: properties)

    def get_current_target(self) -> GPUTarget:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Finds vllm.* in a tree's files; packages are namespaces (no __init__ runs)."""

    def __init__(self, root: Path, standins: dict[str, types.ModuleType]) -> None:
        self.root = root
        self.standins = standins

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in self.standins:
            return importlib.util.spec_from_loader(name, _Given(self.standins[name]))
        base = self.root.joinpath(*name.split("."))
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
        if base.is_dir():
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        return None


class _Given(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


def _standins(arch: Arch) -> dict[str, types.ModuleType]:
    triton_utils = types.ModuleType("vllm.triton_utils")
    exec(STANDINS["vllm.triton_utils"].source, triton_utils.__dict__)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _RocmPlatform(arch)
    platforms.__path__ = []  # a package: vllm.platforms.rocm is below it
    # vLLM's own arch and shared-memory queries, as the kernel files ask them.
    rocm = types.ModuleType("vllm.platforms.rocm")
    rocm.on_gfx942 = lambda: arch.name == "gfx942"
    rocm.on_gfx950 = lambda: arch.name == "gfx950"
    mem_utils = types.ModuleType("vllm.utils.mem_utils")
    mem_utils.get_max_shared_memory_bytes = lambda gpu=0: arch.lds_bytes
    standins = {"vllm.triton_utils": triton_utils, "vllm.platforms": platforms,
                "vllm.platforms.rocm": rocm, "vllm.utils.mem_utils": mem_utils}
    for name in DRAFT_LOGITS_STANDINS:
        standins[name] = types.ModuleType(name)
        exec(STANDINS[name].source, standins[name].__dict__)
    return standins


@contextlib.contextmanager
def rocm_modules(tree: Path, arch: Arch) -> Iterator[Any]:
    """Yields import(name) -> the tree's module `name`, loaded under ROCm on `arch`.
    The modules are dropped afterwards, so the next arch loads them afresh
    (kernel files read the platform when they are imported)."""
    if not (tree / "vllm").is_dir():
        raise FileNotFoundError(f"{tree} holds no vllm/ package: run `make apply` first")
    if any(n == "vllm" or n.startswith("vllm.") for n in sys.modules):
        raise RuntimeError("vllm is imported already; the kernel files must load under "
                           "the ROCm stand-ins, in a process of their own")
    finder = _TreeFinder(tree, _standins(arch))
    sys.meta_path.insert(0, finder)
    triton.runtime.driver.set_active(_RocmDriver(arch))
    try:
        yield importlib.import_module
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]


@dataclass
class Launch:
    """One `kernel[grid](*args, **kwargs)` a wrapper made."""

    kernel: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    shape: dict = field(default_factory=dict)  # what the wrapper was called for

    @property
    def name(self) -> str:
        return self.kernel.__name__


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """While active, launching a JIT kernel appends a Launch and runs nothing."""
    launches: list[Launch] = []
    real_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        if warmup:
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append(Launch(self, tuple(grid) if not callable(grid) else grid, args, kwargs))
        return None

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = real_run
