"""The AMD GPUs the stack targets, and what limits a kernel's occupancy there."""

from __future__ import annotations

from dataclasses import dataclass

# CDNA3 and CDNA4 share the register files: 512 VGPRs per lane of a SIMD, arch
# VGPRs and AGPRs from one pool (gfx90a+), allocated in granules of 8; 800
# SGPRs a SIMD, counted as LLVM's occupancy for GFX9 counts them (10, 9, 8 waves
# up to 80, 88, 100 SGPRs: 800 // SGPRs, no granule); at most 8 waves per SIMD
# (LLVM's getMaxWavesPerEU for gfx90a+); 4 SIMDs a CU.
VGPRS_PER_SIMD = 512
VGPR_GRANULE = 8
SGPRS_PER_SIMD = 800
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4
WAVE_SIZE = 64


@dataclass(frozen=True)
class Arch:
    name: str  # the gfx target Triton compiles for
    gpu: str
    lds_bytes: int  # LDS per CU, the most one workgroup may take
    compute_units: int
    # The platform's fp8 KV cache dtype (vLLM's RocmPlatform.fp8_dtype()).
    fp8_dtype: str


ARCHS = (
    Arch("gfx942", "MI300X", 64 * 1024, 304, "float8_e4m3fnuz"),
    Arch("gfx950", "MI355X", 160 * 1024, 256, "float8_e4m3fn"),
)


def arch_named(name: str) -> Arch:
    for arch in ARCHS:
        if arch.name == name:
            return arch
    raise ValueError(f"unknown AMD target {name!r}: one of {', '.join(a.name for a in ARCHS)}")


def _granules(count: int, granule: int) -> int:
    return -(-max(count, 1) // granule) * granule


def waves_by_registers(allocated_vgprs: int, sgprs: int = 0) -> int:
    """Waves a SIMD holds with this many VGPRs allocated per lane and SGPRs a wave."""
    return min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD // _granules(allocated_vgprs, VGPR_GRANULE),
               SGPRS_PER_SIMD // max(sgprs, 1))


def workgroups_per_cu(arch: Arch, waves_a_simd: int, lds_bytes: int, num_warps: int) -> int:
    """Workgroups of num_warps waves a CU runs at once, when its SIMDs' registers
    hold waves_a_simd waves each and its LDS has to hold them too (0: one
    workgroup does not fit)."""
    by_registers = waves_a_simd * SIMDS_PER_CU // num_warps
    by_lds = arch.lds_bytes // lds_bytes if lds_bytes else by_registers
    return min(by_registers, by_lds)


def waves_per_simd(arch: Arch, waves_a_simd: int, lds_bytes: int, num_warps: int) -> int:
    """Waves each SIMD holds, registers and LDS counted (a workgroup's waves
    spread over the CU's SIMDs)."""
    waves = workgroups_per_cu(arch, waves_a_simd, lds_bytes, num_warps) * num_warps
    return min(MAX_WAVES_PER_SIMD, -(-waves // SIMDS_PER_CU))
