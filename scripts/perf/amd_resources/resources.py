"""Compile a recorded launch for an AMD GPU and read what it needs there.

The launch is compiled by the kernel's own JIT (`run(..., warmup=True)`), as the
launch would compile it on the GPU: the same argument specialization (16-byte
alignment, tensors under 2 GiB), constexprs and options, the options parsed by
the AMD backend (which, on gfx950, overwrites kpack != 1 with 1 and warns).
The kernel's LDS is `metadata.shared`; registers, scratch and spills come from
the AMDGCN kernel's metadata and descriptor.
"""

from __future__ import annotations

import multiprocessing
import re
import warnings
from dataclasses import asdict, dataclass, field

from scripts.perf.amd_resources.kernel_tree import Launch
from scripts.perf.amd_resources.targets import (
    Arch,
    waves_by_registers,
    waves_per_simd,
    workgroups_per_cu,
)

# Launch options shown with each kernel (HIPOptions fields).
OPTIONS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")
@dataclass
class Resources:
    """One compiled variant of a kernel on one GPU, and the shapes it serves."""

    kernel: str
    arch: str
    shapes: list[dict]
    options: dict = field(default_factory=dict)
    constexprs: dict = field(default_factory=dict)
    lds: int = 0  # bytes a workgroup allocates
    vgprs: int = 0  # .vgpr_count: arch VGPRs and AGPRs together (gfx90a+)
    agprs: int = 0
    allocated_vgprs: int = 0  # the descriptor's next_free_vgpr: what the SIMD reserves
    sgprs: int = 0
    scratch: int = 0  # bytes of private segment a lane
    sgpr_spills: int = 0
    vgpr_spills: int = 0
    # per SIMD: 512 // allocated VGPRs and 800 // SGPRs, at most 8 (LLVM's occupancy)
    waves_by_registers: int = 0
    workgroups_per_cu: int = 0
    waves_per_simd: int = 0  # registers and LDS counted
    llvm_occupancy: int = 0  # the assembler's "; Occupancy:" comment
    notes: list[str] = field(default_factory=list)  # backend warnings, e.g. kpack
    error: str = ""

    def violations(self, arch: Arch) -> list[str]:
        """Why this kernel cannot run as launched on `arch`, or would run slowed
        by scratch; empty when it fits."""
        if self.error:
            return [f"does not compile: {self.error}"]
        found = []
        if self.lds > arch.lds_bytes:
            found.append(f"LDS {self.lds} B > {arch.lds_bytes} B of a {arch.gpu} CU")
        if self.vgpr_spills or self.sgpr_spills:
            found.append(f"spills {self.vgpr_spills} VGPRs, {self.sgpr_spills} SGPRs")
        if self.scratch:
            found.append(f"scratch {self.scratch} B a lane")
        if not found and self.workgroups_per_cu == 0:
            found.append(f"no workgroup of {self.options['num_warps']} waves fits a CU "
                         f"({self.allocated_vgprs} VGPRs a lane)")
        return found

    def to_json(self) -> dict:
        return asdict(self)


def variant_key(launch: Launch) -> tuple:
    """What decides the compiled code of a launch: the kernel, its arguments'
    dtypes and specialization, constexprs and options."""
    kernel = launch.kernel
    bound = _bind(launch)
    parts = tuple((p.name, repr(value) if p.is_constexpr else _describe(value))
                  for p in kernel.params
                  for value in [bound.get(p.name, p.default)])
    options = tuple(sorted((k, v) for k, v in launch.kwargs.items()
                           if k not in kernel.signature.parameters))
    return (kernel.fn.__module__, kernel.__name__, parts, options)


def _bind(launch: Launch) -> dict:
    """The kernel's parameters by name, as the launch passed them."""
    parameters = launch.kernel.signature.parameters
    return launch.kernel.signature.bind(
        *launch.args, **{k: v for k, v in launch.kwargs.items() if k in parameters}).arguments


def _describe(value) -> object:
    """A runtime argument as the JIT specializes it: tensors by dtype, 16-byte
    alignment and storage under 2 GiB; ints by being 1, 16-aligned or wide."""
    if hasattr(value, "data_ptr"):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0,
                value.untyped_storage().size() < 2**31)
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, value.bit_length() > 31)
    return repr(value)


def compile_variant(launches: list[Launch], arch: Arch) -> Resources:
    """Compile the first launch (all share a variant_key) on `arch`; the active
    Triton driver must be that GPU's (kernel_tree.rocm_modules)."""
    launch = launches[0]
    bound = _bind(launch)
    constexprs = {p.name: bound.get(p.name, p.default) for p in launch.kernel.params
                  if p.is_constexpr}
    result = Resources(launch.name, arch.name, [x.shape for x in launches],
                       constexprs={k: v for k, v in constexprs.items()
                                   if isinstance(v, (int, float, str))})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = launch.kernel.run(*launch.args, grid=launch.grid, warmup=True,
                                         **launch.kwargs)
        except Exception as exc:  # a compile error is a finding, reported per kernel
            result.error = f"{type(exc).__name__}: {_summary(exc)}"
            return result
    result.notes = sorted({_summary(w.message) for w in caught})
    read_compiled(result, compiled, arch)
    return result


def read_compiled(result: Resources, compiled, arch: Arch) -> None:
    metadata = compiled.metadata
    result.options = {name: getattr(metadata, name) for name in OPTIONS}
    result.lds = metadata.shared
    asm = compiled.asm["amdgcn"]
    result.vgprs = _field(asm, r"\.vgpr_count:\s+(\d+)")
    result.agprs = _field(asm, r"\.agpr_count:\s+(\d+)")
    result.sgprs = _field(asm, r"\.sgpr_count:\s+(\d+)")
    result.sgpr_spills = _field(asm, r"\.sgpr_spill_count:\s+(\d+)")
    result.vgpr_spills = _field(asm, r"\.vgpr_spill_count:\s+(\d+)")
    result.scratch = max(_field(asm, r"\.private_segment_fixed_size:\s+(\d+)"),
                         _field(asm, r"\.amdhsa_private_segment_fixed_size\s+(\d+)"))
    result.allocated_vgprs = max(result.vgprs,
                                 _field(asm, r"\.amdhsa_next_free_vgpr\s+(\d+)"))
    result.llvm_occupancy = _field(asm, r"; Occupancy:\s+(\d+)")
    num_warps = result.options["num_warps"]
    result.waves_by_registers = waves_by_registers(result.allocated_vgprs, result.sgprs)
    result.workgroups_per_cu = workgroups_per_cu(arch, result.waves_by_registers, result.lds,
                                                 num_warps)
    result.waves_per_simd = waves_per_simd(arch, result.waves_by_registers, result.lds,
                                           num_warps)


def _field(asm: str, pattern: str) -> int:
    """The one kernel's value of a metadata field (the file holds one kernel)."""
    values = {int(v) for v in re.findall(pattern, asm)}
    if len(values) > 1:
        raise ValueError(f"AMDGCN holds several values for {pattern!r}: {sorted(values)}")
    return values.pop() if values else 0


def _summary(message: object) -> str:
    """The last line of a message: a CompilationError ends with what went wrong."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1] if lines else repr(message)


def compile_all(launches: list[Launch], arch: Arch, jobs: int = 1) -> list[Resources]:
    """Each distinct variant among the launches (variant_key), compiled once, in
    launch order; `jobs` processes compile in parallel (forked: they share the
    loaded kernels)."""
    variants: dict[tuple, list[Launch]] = {}
    for launch in launches:
        variants.setdefault(variant_key(launch), []).append(launch)
    groups = list(variants.values())
    if jobs <= 1 or len(groups) <= 1:
        return [compile_variant(group, arch) for group in groups]
    global _FORKED_WORK
    _FORKED_WORK = (groups, arch)
    try:
        with multiprocessing.get_context("fork").Pool(min(jobs, len(groups))) as pool:
            return pool.map(_compile_forked, range(len(groups)), chunksize=1)
    finally:
        _FORKED_WORK = None


_FORKED_WORK: tuple[list[list[Launch]], Arch] | None = None


def _compile_forked(index: int) -> Resources:
    groups, arch = _FORKED_WORK
    return compile_variant(groups[index], arch)
