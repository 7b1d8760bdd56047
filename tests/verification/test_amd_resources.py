"""The stack's Triton kernels, compiled for MI300 (gfx942) and MI355 (gfx950) on CPU.

`python -m scripts.perf.amd_resources` compiles, with Triton's AMD backend, every
launch that patch 8's `rejection_sample` and patch 5's
`decode_attention_fwd_mla_block` make at the drafter's production shapes (the
block path at 1, 3 and 16 requests), with the launch options and constexprs
the wrappers pass on ROCm, and exits 1 when one does not compile, needs more
LDS than a CU has, or spills. With them, for reference (never a failure of
the stack), aiter's FP8 batched GEMM as the MLA absorb pre-compiles it with
AITER's FP8 BMM on. It runs in a process of its own: it imports the tree's
kernel files under a ROCm platform stand-in, which this pytest process must
never see. Compiled kernels are kept in build/amd-resources/ (about 3
minutes on 2 cores the first time, seconds after).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.perf.amd_resources.resources import Resources
from scripts.perf.amd_resources.targets import arch_named, waves_by_registers, waves_per_simd

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("gfx942", "gfx950")
STAGE1 = "_fwd_mla_block_kernel_stage1"
# What the wrappers of patches 5 and 8 launch (with draft logits and one-hot
# drafts, standard and block verification).
STACK_KERNELS = {
    STAGE1, "_fwd_mla_block_kernel_stage2", "_mla_block_plan_kernel",
    "_compute_local_logits_stats_kernel", "_compute_cumulative_log_p_kernel",
    "_compute_local_residual_mass_kernel", "_rejection_kernel", "_resample_kernel",
    "_insert_resampled_kernel",
}
# heads per rank x query_len x KV dtype x page x KV storage (under/over 2 GiB)
PRODUCTION_SHAPES = 4 * 7 * 2 * 2 * 2
AITER_FP8_BMM = "_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel"


def amd_resources(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "resources.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-m", "scripts.perf.amd_resources", *args,
                             "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=1800)
    data = json.loads(out.read_text()) if out.exists() else {}
    return result, data


def test_every_stack_kernel_fits_mi300_and_mi355(tmp_path, record_property):
    result, data = amd_resources(tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    for arch in ARCHS:
        variants = data[arch]
        assert STACK_KERNELS <= {v["kernel"] for v in variants}
        stage1 = [v for v in variants if v["kernel"] == STAGE1]
        served = {tuple(sorted(shape.items())) for v in stage1 for shape in v["shapes"]}
        assert len(served) == PRODUCTION_SHAPES
        # Registers give the waves LLVM computes for the kernel.
        assert [v["waves_by_registers"] for v in variants] == [
            v["llvm_occupancy"] for v in variants]
        # The launch options are the wrapper's: ROCm's, not Triton's defaults
        # (matrix_instr_nonkdim 0, kpack 1); gfx950 takes only kpack 1.
        assert all(v["options"]["matrix_instr_nonkdim"] == 16 for v in stage1)
        assert all(v["options"]["kpack"] == (2 if arch == "gfx942" else 1) for v in stage1)
        # The resample kernel with and without skipping fully masked vocab
        # blocks (top-k/top-p batches), with draft logits and one-hot drafts.
        resample = [v for v in variants if v["kernel"] == "_resample_kernel"]
        assert {(v["constexprs"]["SKIP_MASKED_BLOCKS"], v["constexprs"]["HAS_DRAFT_LOGITS"])
                for v in resample} == set(itertools.product((False, True), repeat=2))
        record_property(f"measure:{arch} block stage 1 VGPRs (unified)",
                        f"{min(v['vgprs'] for v in stage1)}-{max(v['vgprs'] for v in stage1)}")
        record_property(f"measure:{arch} block stage 1 LDS KiB",
                        max(v["lds"] for v in stage1) // 1024)
        # aiter's FP8 BMM, every head count with W_K and W_V, compiled for this
        # GPU (its fp8 is the platform's) without errors; shown, not checked.
        bmm = [v for v in variants if v["kernel"] == AITER_FP8_BMM]
        assert {(s["heads"], s["weight"]) for v in bmm for s in v["shapes"]} == {
            (heads, weight) for heads in (8, 16, 32, 64) for weight in ("W_K", "W_V")}
        assert not any(v["error"] for v in bmm)
        record_property(f"measure:{arch} aiter FP8 BMM variants, with scratch",
                        f"{len(bmm)}, {sum(1 for v in bmm if v['scratch'])}")
    assert "flat (release, ref.)" in result.stdout and "fwd_grouped_stage1" in result.stdout
    assert "aiter FP8 BMM (ref.)" in result.stdout


# Stage 1 at the tile study's shape with the wrapper's launch, except for these.
LDS_OVER_MI300 = "kv=bf16,BLOCK_M=64,BLOCK_N=64,num_warps=8,num_stages=2"
SPILLS = "kv=bf16,BLOCK_M=64,BLOCK_N=32,num_warps=8,num_stages=2"
NO_COMPILE = "BLOCK_N=24"


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tiles")
    specs = [LDS_OVER_MI300, SPILLS, NO_COMPILE]
    args = ["--arch", "gfx942"] + [a for spec in specs for a in ("--tile", spec)]
    result, data = amd_resources(*args, tmp_path=tmp_path)
    return result, dict(zip(specs, data.get("gfx942", [])))


def test_check_fails_on_tiles_that_break_a_limit(tiles):
    result, by_spec = tiles
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(v.startswith("LDS 81920 B > 65536 B") for v in by_spec[LDS_OVER_MI300]
               ["violations"])
    spills = by_spec[SPILLS]
    assert spills["vgpr_spills"] > 0 and spills["scratch"] > 0
    assert any(v.startswith("spills") for v in spills["violations"])
    assert by_spec[NO_COMPILE]["violations"] == [
        "does not compile: CompilationError: arange's range must be a power of 2"]


def test_limits_are_each_gpus():
    mi300, mi355 = arch_named("gfx942"), arch_named("gfx950")
    tile = Resources("k", "", [{}], lds=72 * 1024, workgroups_per_cu=1)
    assert tile.violations(mi300) == ["LDS 73728 B > 65536 B of a MI300X CU"]
    assert tile.violations(mi355) == []
    assert Resources("k", "", [{}], sgpr_spills=1, workgroups_per_cu=1).violations(mi355) == [
        "spills 0 VGPRs, 1 SGPRs"]
    assert Resources("k", "", [{}], options={"num_warps": 8},
                     allocated_vgprs=264).violations(mi355) == [
        "no workgroup of 8 waves fits a CU (264 VGPRs a lane)"]
    # 512 VGPRs a SIMD lane in granules of 8, 800 SGPRs (LLVM: 800 // SGPRs), at
    # most 8 waves.
    assert [waves_by_registers(n) for n in (512, 257, 256, 129, 128, 64, 24)] == [
        1, 1, 2, 3, 4, 8, 8]
    assert waves_by_registers(24, sgprs=104) == 7
    # An 8-wave workgroup needs 2 waves' registers on each of the 4 SIMDs.
    assert waves_per_simd(mi300, 1, 16 * 1024, 8) == 0
    assert waves_per_simd(mi300, 2, 16 * 1024, 8) == 2
    # 32 KiB workgroups: two fit an MI300 CU's LDS, five an MI355's.
    assert waves_per_simd(mi300, 4, 32 * 1024, 4) == 2
    assert waves_per_simd(mi355, 4, 32 * 1024, 4) == 4
