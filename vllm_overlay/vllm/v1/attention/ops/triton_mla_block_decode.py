# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton MLA decode of a non-causal multi-token block (a speculative draft).

Every query row of a request attends the same KV span, so one program takes a
tile of the request's query_len x num_heads rows and reads each KV tile once
for all of them, with tl.dot on the whole row tile. The KV range is split
across programs (split-K); a second kernel merges each row's splits.

Speculative drafters decode under CUDA graphs captured with max_seq_len =
max_model_len and a padded batch, so whatever the host derived from the
lengths would be wrong at every replay. The host sizes only the grids (from
the batch size and the scratch) and the scratch (the most splits one request
may take). On the device, a one-program kernel (_mla_block_plan_kernel)
shares the batch's real KV out into splits from the lengths, sized to keep
the GPU full whether the batch is short, long or ragged (a lone request's
stage 1 programs plan it themselves, in one wave, which saves a launch);
stage 1 runs a program for every split the scratch allows (one wave for a
lone request), and those the plan leaves without work exit at once; the
merge reads only the splits a row has.
"""

from dataclasses import dataclass, replace

import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.utils.mem_utils import get_max_shared_memory_bytes

_IS_HIP = current_platform.is_rocm()
if _IS_HIP:
    from vllm.platforms.rocm import on_gfx950


@dataclass(frozen=True)
class _MLABlockTile:
    block_m: int  # query rows per program
    block_n: int  # KV tokens per iteration
    num_warps: int
    num_stages: int
    # An fp8 tile is loaded a second time for PV (see the kernel).
    reload_fp8_v: bool = False
    # Programs of this tile that run at once on an SM (registers, shared
    # memory): the split plan fills waves of this many per SM.
    programs_per_sm: int = 1
    # ROCm compiler option (see _launch_options): 0 lets the registers decide.
    waves_per_eu: int = 0


# Tiles measured best on an H200 (512 + 64 latent), by query rows per program
# and KV dtype (fp8?). A 64-row tile needs 8 warps: its fp32 accumulator
# (64 x 512) is 128 registers a thread there. Shared memory at 576-wide rows:
# the query tile (72 KiB at 64 rows) plus the KV stages (bf16: 2 x 72 KiB;
# fp8: 72 KiB loaded to registers and converted into 144 KiB), 216 KiB in all,
# within the 227 KiB of Hopper and datacenter Blackwell. 32-row tiles: bf16
# 112 KiB and 4 warps (two programs an SM), fp8 108 KiB and 8 warps (one).
# These tiles spill registers; 8-warp 32-row tiles that do not were 1.2-1.5x
# slower on an H200.
_TILES_LARGE_SMEM = {
    (64, False): _MLABlockTile(64, 64, 8, 2),
    (64, True): _MLABlockTile(64, 128, 8, 1),
    (32, False): _MLABlockTile(32, 64, 4, 2, programs_per_sm=2),
    (32, True): _MLABlockTile(32, 64, 8, 3, reload_fp8_v=True),
}
_LARGE_SMEM_BYTES = 216 * 1024
# Elsewhere (A100: 164 KiB, consumer parts: ~100 KiB): 32 rows and 32 KV
# tokens, 70-74 KiB as compiled for an H200 (2 x 36 KiB of KV stages; the
# query tile passes through shared memory once).
_TILE_SMALL_SMEM = _MLABlockTile(32, 32, 4, 2, reload_fp8_v=True)
# ROCm, by architecture and KV dtype (fp8?): 16 KV tokens a tile, one stage
# where 64 KiB of LDS (CDNA3) allow no more. Chosen by compiling for each
# architecture (Triton 3.8): LDS, VGPRs and spills, and the waves per SIMD they
# leave; how fast they run is measured on the hardware, not here. bf16: 64
# rows in 8 warps, 64 KiB, two waves per SIMD, the KV read once per 64 rows.
# fp8 on gfx942: 32 rows in 4 warps (8 warps spill there), 32 KiB, one wave.
# fp8 on gfx950: 32 rows in 8 warps and two stages, two waves.
_TILES_ROCM = {
    "gfx942": {
        False: _MLABlockTile(64, 16, 8, 1),
        True: _MLABlockTile(32, 16, 4, 1, waves_per_eu=1),
    },
    "gfx950": {
        False: _MLABlockTile(64, 16, 8, 1),
        True: _MLABlockTile(32, 16, 8, 2),
    },
}

# A split reads at least this many KV tokens, and costs about as much as
# reading _SPLIT_OVERHEAD_TOKENS more (loading its query tile, writing and
# merging its partial output).
_MIN_SPLIT_TOKENS = 128
_SPLIT_OVERHEAD_TOKENS = 256
# The split plan weighs this many candidates (a power of 2): waves of programs
# from those that hold every request's row tiles unsplit, each twice the last.
_NUM_PLANS = 4
# Requests the split plan reads at once; a loop covers larger batches, so the
# kernels compile once whatever the batch size.
_REQ_CHUNK = 1024
# Partial outputs (splits x columns) the merge reads at once: larger tiles
# spill scalar registers on gfx942.
_MERGE_TILE = 4096


def _rocm_arch() -> str:
    """The row of _TILES_ROCM: MI355's, else MI300's."""
    return "gfx950" if on_gfx950() else "gfx942"


def _launch_options(tile: _MLABlockTile) -> dict:
    """Compiler options of a tile: on ROCm, 16x16 MFMAs, and the waves per EU
    the tile asks for (0: as many as its registers allow)."""
    if not _IS_HIP:
        return {}
    options = {"matrix_instr_nonkdim": 16, "waves_per_eu": tile.waves_per_eu}
    if _rocm_arch() != "gfx950":
        options["kpack"] = 2  # gfx950 takes only 1, its default
    return options


def _mla_block_tile(
    rows: int, kv_dtype: torch.dtype, device: torch.device
) -> _MLABlockTile:
    """The tile for a request's `rows` query rows (query_len x num_heads)."""
    rows_per_tile = min(64, max(16, next_power_of_2(rows)))
    fp8 = kv_dtype.itemsize == 1
    if _IS_HIP:
        tile = _TILES_ROCM[_rocm_arch()][fp8]
    elif (
        device.type == "cuda"
        and get_max_shared_memory_bytes(device.index or 0) >= _LARGE_SMEM_BYTES
    ):
        # 96 rows (16 heads x 6, 32 x 3) take two 64-row tiles: measured on
        # an H200, 7-11% faster than three 32-row ones two to an SM.
        tile = _TILES_LARGE_SMEM[(max(32, rows_per_tile), fp8)]
    else:
        tile = _TILE_SMALL_SMEM
    return replace(tile, block_m=min(tile.block_m, rows_per_tile))


def mla_block_decode_num_kv_splits(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    num_reqs: int,
    max_seq_len: int,
    num_sms: int,
    max_kv_splits: int,
) -> int:
    """The most KV splits decode_attention_fwd_mla_block may give one request
    (the scratch is sized with it): enough for the longest request alone to
    fill the GPU twice over, a power of 2, at most max_kv_splits. How many
    each request takes is decided on the device, from the lengths."""
    rows = q.shape[0] // num_reqs * q.shape[1]
    tile = _mla_block_tile(rows, kv_buffer.dtype, q.device)
    slots = num_sms * tile.programs_per_sm
    wanted = min(
        cdiv(2 * slots, cdiv(rows, tile.block_m)),
        cdiv(max_seq_len, _MIN_SPLIT_TOKENS),
    )
    return max(1, min(next_power_of_2(wanted), max_kv_splits))


@triton.jit
def _mla_block_plan_share(
    tokens, busy, row_tiles, slots, plan, MIN_SPLIT_TOKENS: tl.constexpr
):
    """KV tokens a split under candidate `plan` (an index or a range of them):
    the batch's `tokens` shared out evenly (at least MIN_SPLIT_TOKENS) over
    `busy` requests' row tiles in 2**plan times as many waves of `slots`
    programs as hold the unsplit row tiles. Rounding each request's splits up
    adds at most one program per row tile to an even share, so the busy
    programs stay within the waves."""
    tiles = busy * row_tiles
    waves = tl.maximum(tl.cdiv(tiles, slots), 1) << plan
    even = tl.cdiv(tokens * row_tiles, tl.maximum(waves * slots - tiles, 1))
    return tl.minimum(tl.maximum(even, MIN_SPLIT_TOKENS), 1 << 30).to(tl.int32)


@triton.jit
def _mla_block_plan_cost(
    num_splits,
    longest,
    row_tiles,
    slots,
    SPLIT_OVERHEAD_TOKENS: tl.constexpr,
):
    """A plan's estimated time: its rounds of `slots` programs, each as long as
    its longest split plus SPLIT_OVERHEAD_TOKENS (exact for a uniform batch; a
    ragged one finishes sooner)."""
    rounds = tl.cdiv(num_splits * row_tiles, slots)
    return rounds * (longest + SPLIT_OVERHEAD_TOKENS)


@triton.jit
def _mla_block_plan_kernel(
    Seq_Lens,
    Split_Ends,
    num_reqs,
    row_tiles,
    slots,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    SPLIT_OVERHEAD_TOKENS: tl.constexpr,
    NUM_PLANS: tl.constexpr,
    REQ_CHUNK: tl.constexpr,
):
    """One program: the KV splits of every request, as their running total
    (Split_Ends[r] = splits of requests 0..r), for both kernels. The batch's
    KV is shared out evenly (at most NUM_KV_SPLITS splits a request) for the
    candidate number of waves with the shortest estimated time: more waves
    even out ragged lengths and the last wave, fewer spare each split's fixed
    cost."""
    busy = tl.full([], 0, tl.int64)
    tokens = tl.full([], 0, tl.int64)
    for start in range(0, num_reqs, REQ_CHUNK):
        offs_r = start + tl.arange(0, REQ_CHUNK)
        lens = tl.load(Seq_Lens + offs_r, mask=offs_r < num_reqs, other=0)
        busy += tl.sum((lens > 0).to(tl.int64), 0)
        tokens += tl.sum(lens.to(tl.int64), 0)
    candidates = tl.arange(0, NUM_PLANS)
    even = _mla_block_plan_share(
        tokens, busy, row_tiles, slots, candidates, MIN_SPLIT_TOKENS
    )
    num_splits = tl.zeros([NUM_PLANS], dtype=tl.int64)
    longest = tl.zeros([NUM_PLANS], dtype=tl.int32)
    for start in range(0, num_reqs, REQ_CHUNK):
        offs_r = start + tl.arange(0, REQ_CHUNK)
        lens = tl.load(Seq_Lens + offs_r, mask=offs_r < num_reqs, other=0)[None, :]
        splits = tl.minimum(tl.cdiv(lens, even[:, None]), NUM_KV_SPLITS)
        num_splits += tl.sum(splits.to(tl.int64), 1)
        split_len = tl.cdiv(lens, tl.maximum(splits, 1))
        longest = tl.maximum(longest, tl.max(split_len, 1))
    cost = _mla_block_plan_cost(
        num_splits, longest, row_tiles, slots, SPLIT_OVERHEAD_TOKENS
    )
    # The fewest waves among the fastest.
    best = tl.argmin(cost, 0)
    share = tl.sum(tl.where(candidates == best, even, 0), 0)
    total = tl.full([], 0, tl.int32)
    for start in range(0, num_reqs, REQ_CHUNK):
        offs_r = start + tl.arange(0, REQ_CHUNK)
        mask_r = offs_r < num_reqs
        lens = tl.load(Seq_Lens + offs_r, mask=mask_r, other=0)
        splits = tl.minimum(tl.cdiv(lens, share), NUM_KV_SPLITS).to(tl.int32)
        ends = total + tl.cumsum(splits, 0)
        tl.store(Split_Ends + offs_r, ends, mask=mask_r)
        total = tl.max(ends, 0)


@triton.jit
def _mla_block_single_req_splits(
    seq_len,
    row_tiles,
    slots,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
):
    """The splits of a lone request, in scalars: its share of one wave of
    programs (the plan kernel's first candidate). More waves only even out
    ragged lengths, and one wave bounds the work items the grid must hold."""
    even = _mla_block_plan_share(
        seq_len.to(tl.int64),
        (seq_len > 0).to(tl.int64),
        row_tiles,
        slots,
        0,
        MIN_SPLIT_TOKENS,
    )
    return tl.minimum(tl.cdiv(seq_len, even), NUM_KV_SPLITS).to(tl.int32)


@triton.jit
def _mla_block_req_splits(Split_Ends, req):
    """(splits before request `req`, splits of `req`) from the plan."""
    first = tl.load(Split_Ends + req - 1, mask=req > 0, other=0)
    return first, tl.load(Split_Ends + req) - first


@triton.jit
def _mla_block_split_len(seq_len, num_splits, SPLIT_ALIGN: tl.constexpr):
    """KV tokens per split: the request's length evened out over its splits,
    a multiple of SPLIT_ALIGN (whole KV tiles)."""
    per_split = tl.cdiv(seq_len, tl.maximum(num_splits, 1))
    return tl.cdiv(per_split, SPLIT_ALIGN) * SPLIT_ALIGN


@triton.jit
def _fwd_mla_block_kernel_stage1(
    Q,
    Q_PE,
    KV_Buffer,
    sm_scale_log2,
    Block_Table,
    Seq_Lens,
    Split_Ends,
    Att_Out,
    kv_scale,
    query_len,
    num_reqs,
    slots,
    stride_block_table,
    stride_q_token,
    stride_q_head,
    stride_qpe_token,
    stride_qpe_head,
    stride_kv_page,
    stride_kv_token,
    stride_mid_req,
    stride_mid_row,
    stride_mid_split,
    NUM_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    RELOAD_FP8_V: tl.constexpr,
    SINGLE_REQ: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
):
    # One program per work item: item `work // row_tiles` of the splits,
    # counted over the requests in order, for row tile `work % row_tiles` (the
    # row tiles of a split run side by side and share its KV in L2). The grid
    # holds every item the scratch allows (sized on the host, e.g. at graph
    # capture; for a lone request, one wave); the programs past the plan's
    # total exit at once. A persistent grid looping over the items ran 32-row
    # blocks 1.2-1.3x slower on an H200: the registers it keeps live across
    # its loop spill.
    row_tiles = tl.cdiv(query_len * NUM_HEADS, BLOCK_M)
    if SINGLE_REQ:
        # One request: every program plans its splits (one load), which spares
        # the plan kernel's launch; the first keeps them for stage 2.
        single_req_splits = _mla_block_single_req_splits(
            tl.load(Seq_Lens),
            row_tiles,
            slots,
            NUM_KV_SPLITS,
            MIN_SPLIT_TOKENS,
        )
        if tl.program_id(0) == 0:
            tl.store(Split_Ends, single_req_splits)
        total = single_req_splits * row_tiles
    else:
        last = tl.load(Split_Ends + num_reqs - 1, mask=num_reqs > 0, other=0)
        total = last * row_tiles
    work = tl.program_id(0)
    if work < total:
        row_tile = work % row_tiles
        item = work // row_tiles
        if SINGLE_REQ:
            req = num_reqs * 0
            num_splits = single_req_splits
            split_kv_id = item
        else:
            # The request is the first whose running total passes `item`.
            lo = num_reqs * 0  # a tensor, even where num_reqs is the constant 1
            hi = num_reqs
            while lo < hi:
                mid = (lo + hi) // 2
                past = tl.load(Split_Ends + mid) > item
                hi = tl.where(past, mid, hi)
                lo = tl.where(past, lo, mid + 1)
            req = lo
            first, num_splits = _mla_block_req_splits(Split_Ends, req)
            split_kv_id = item - first
        seq_len = tl.load(Seq_Lens + req)
        split_len = _mla_block_split_len(seq_len, num_splits, BLOCK_N)
        split_kv_start = split_len * split_kv_id
        split_kv_end = tl.minimum(split_kv_start + split_len, seq_len)

        if split_kv_end > split_kv_start:
            # Row m of the request is draft token m // NUM_HEADS, head m % NUM_HEADS.
            offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            mask_m = offs_m < query_len * NUM_HEADS
            token = req * query_len + offs_m // NUM_HEADS
            head = offs_m % NUM_HEADS
            offs_q = token * stride_q_token + head * stride_q_head
            offs_dv = tl.arange(0, BLOCK_DV)
            mask_dv = offs_dv < Lv
            q = tl.load(
                Q + offs_q[:, None] + offs_dv[None, :],
                mask=mask_m[:, None] & mask_dv[None, :],
                other=0.0,
            )
            if BLOCK_DPE > 0:
                offs_dpe = Lv + tl.arange(0, BLOCK_DPE)
                mask_dpe = offs_dpe < Lk
                offs_qpe = token * stride_qpe_token + head * stride_qpe_head
                q_pe = tl.load(
                    Q_PE + offs_qpe[:, None] + (offs_dpe - Lv)[None, :],
                    mask=mask_m[:, None] & mask_dpe[None, :],
                    other=0.0,
                )

            # An fp8 cache is multiplied by its scale after the dots rather than
            # before: the latent is both K and V, read once in the query's dtype.
            # Like the grouped kernel, a 16-bit cache ignores the scale.
            KV_FP8: tl.constexpr = KV_Buffer.dtype.element_ty.is_fp8()
            scale = 1.0
            if KV_FP8:
                scale = tl.load(kv_scale)
            qk_scale = sm_scale_log2 * scale
            e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            block_table = Block_Table + req * stride_block_table
            # When pages hold whole KV tiles, tiles start on a multiple of BLOCK_N
            # (the first one masked below the split) and each reads one page.
            TILES_IN_PAGES: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
            loop_start = split_kv_start
            if TILES_IN_PAGES:
                loop_start = split_kv_start // BLOCK_N * BLOCK_N
            for start_n in tl.range(loop_start, split_kv_end, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                mask_n = (offs_n >= split_kv_start) & (offs_n < split_kv_end)
                if TILES_IN_PAGES:
                    page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int64)
                    offs_kv = (
                        page * stride_kv_page
                        + (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N))
                        * stride_kv_token
                    )
                else:
                    pages = tl.load(
                        block_table + offs_n // PAGE_SIZE, mask=mask_n, other=0
                    ).to(tl.int64)  # page number * page stride overflows int32
                    offs_kv = (
                        pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_token
                    )
                kv_ptrs = KV_Buffer + offs_kv[:, None] + offs_dv[None, :]
                mask_kv = mask_n[:, None] & mask_dv[None, :]
                kv = tl.load(kv_ptrs, mask=mask_kv, other=0.0).to(q.dtype)
                qk = tl.dot(q, tl.trans(kv))
                if BLOCK_DPE > 0:
                    k_pe = tl.load(
                        KV_Buffer + offs_kv[:, None] + offs_dpe[None, :],
                        mask=mask_n[:, None] & mask_dpe[None, :],
                        other=0.0,
                    ).to(q.dtype)
                    qk = tl.dot(q_pe, tl.trans(k_pe), qk)
                qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))

                n_e_max = tl.maximum(tl.max(qk, 1), e_max)
                re_scale = tl.exp2(e_max - n_e_max)
                p = tl.exp2(qk - n_e_max[:, None])
                e_sum = e_sum * re_scale + tl.sum(p, 1)
                if KV_FP8 and RELOAD_FP8_V:
                    # Loaded again for PV, from L1/L2: Triton copies a load with one
                    # use asynchronously (pipelined); a converted tile with two uses
                    # is loaded synchronously every iteration. Costlier than the
                    # stall for 64-row tiles, which have no registers to spare.
                    kv = tl.load(
                        kv_ptrs, mask=mask_kv, other=0.0, cache_modifier=".ca"
                    ).to(q.dtype)
                acc = tl.dot(p.to(q.dtype), kv, acc * re_scale[:, None])
                e_max = n_e_max

            offs_mid = (
                req.to(tl.int64) * stride_mid_req
                + offs_m * stride_mid_row
                + split_kv_id * stride_mid_split
            )
            tl.store(
                Att_Out + offs_mid[:, None] + offs_dv[None, :],
                acc * (scale / e_sum[:, None]),
                mask=mask_m[:, None] & mask_dv[None, :],
            )
            # The LSE in natural-log units, as stage 2 and the callers expect.
            tl.store(
                Att_Out + offs_mid + Lv,
                (e_max + tl.log2(e_sum)) * 0.6931471805599453,
                mask=mask_m,
            )


@triton.jit
def _fwd_mla_block_kernel_stage2(
    Mid_O,
    Out,
    Lse,
    Seq_Lens,
    Split_Ends,
    rows_per_req,
    stride_mid_row,
    stride_mid_split,
    stride_o_row,
    SPLIT_ALIGN: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    Lv: tl.constexpr,
):
    # One program per query row and BLOCK_DV output columns merges the splits
    # stage 1 wrote for the row, SPLIT_CHUNK at a time, with a running
    # maximum: the work follows the splits the row has, not the most a
    # request may take (the scratch is sized for max_model_len).
    row = tl.program_id(0)
    dv_tile = tl.program_id(1)
    req = row // rows_per_req
    seq_len = tl.load(Seq_Lens + req)
    _, num_splits = _mla_block_req_splits(Split_Ends, req)
    split_len = _mla_block_split_len(seq_len, num_splits, SPLIT_ALIGN)
    # Stage 1 skipped (and did not write) the splits that start past the end.
    written = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    mid = Mid_O + row.to(tl.int64) * stride_mid_row

    offs_d = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv
    e_max = tl.full([], float("-inf"), tl.float32)
    e_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(0, written, SPLIT_CHUNK):
        offs_s = start + tl.arange(0, SPLIT_CHUNK)
        mask_s = offs_s < written
        split_lse = tl.load(
            mid + offs_s * stride_mid_split + Lv, mask=mask_s, other=float("-inf")
        )
        split_o = tl.load(
            mid + offs_s[:, None] * stride_mid_split + offs_d[None, :],
            mask=mask_s[:, None] & mask_d[None, :],
            other=0.0,
        )
        # The chunk's first split is written, so n_e_max is finite.
        n_e_max = tl.maximum(tl.max(split_lse, 0), e_max)
        re_scale = tl.exp(e_max - n_e_max)
        weight = tl.exp(split_lse - n_e_max)
        acc = acc * re_scale + tl.sum(weight[:, None] * split_o, 0)
        e_sum = e_sum * re_scale + tl.sum(weight, 0)
        e_max = n_e_max
    # A row without KV (a padding request) gets 0 / 0 and a -inf LSE, as from
    # the flattened decode's merge.
    tl.store(Out + row.to(tl.int64) * stride_o_row + offs_d, acc / e_sum, mask=mask_d)
    if dv_tile == 0:
        tl.store(Lse + row, e_max + tl.log(e_sum))


def decode_attention_fwd_mla_block(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    attn_logits: torch.Tensor,
    sm_scale: float,
    page_size: int,
    kv_scale: torch.Tensor,
    num_sms: int,
) -> None:
    """MLA decode of a non-causal block of query_len tokens per request.

    Equals decode_attention_fwd(is_mla=True) on the block flattened to one row
    per token (each row with its request's block table row and sequence
    length), up to floating-point reordering, but reads the KV once per tile
    of a request's rows instead of once per row and per 16 heads.

    q: [num_reqs * query_len, num_heads, Lk], a request's tokens adjacent, or
        its two parts ([..., Lv] latent, [..., Lk - Lv] rope), as MLAAttention
        hands them over (read in place: no concatenation).
    kv_buffer: the latent cache, [num_pages, page_size, 1, Lk]; the first Lv
        columns are the latent (K and V), the rest the rope part of K.
    o, lse: contiguous [num_reqs * query_len, num_heads(, Lv)] outputs.
    block_table, seq_lens: one row per request.
    attn_logits: contiguous fp32 scratch [num_reqs * query_len, num_heads,
        num_kv_splits, Lv + 1]; num_kv_splits bounds the splits of a request
        (see mla_block_decode_num_kv_splits).
    kv_scale: the scale of an fp8 cache (a 16-bit cache ignores it).
    num_sms: the GPU's SMs (CUs on ROCm), which the splits are sized to fill.
    """
    num_reqs = seq_lens.shape[0]
    Lv = o.shape[-1]
    q_nope, q_pe = q if isinstance(q, tuple) else (q[..., :Lv], q[..., Lv:])
    num_tokens, num_heads, _ = q_nope.shape
    Lk = Lv + q_pe.shape[-1]
    query_len = num_tokens // num_reqs
    rows = query_len * num_heads
    assert num_tokens == num_reqs * query_len

    tile = _mla_block_tile(rows, kv_buffer.dtype, q_nope.device)
    num_row_tiles = triton.cdiv(rows, tile.block_m)
    num_kv_splits = attn_logits.shape[2]
    # Programs of this tile that run at once on the GPU.
    slots = num_sms * tile.programs_per_sm
    # Per request, its rows are contiguous in the outputs and the scratch.
    mid = attn_logits.view(num_reqs, rows, *attn_logits.shape[2:])
    o_rows = o.view(num_reqs, rows, Lv)
    # The splits of each request, decided once from the lengths on the device
    # (for one request, by stage 1 itself).
    split_ends = torch.empty(num_reqs, dtype=torch.int32, device=seq_lens.device)
    splits = dict(NUM_KV_SPLITS=num_kv_splits, MIN_SPLIT_TOKENS=_MIN_SPLIT_TOKENS)
    # A program for every split and row tile the scratch allows: how many
    # have work, the plan decides on the device (graph-safe).
    grid = num_reqs * num_kv_splits * num_row_tiles
    single_req = num_reqs == 1
    if single_req:
        # Planned in one wave (_mla_block_single_req_splits), whose busy
        # programs stay within it (_mla_block_plan_share): measured on an
        # H200, 2-7 us faster than a grid of every split.
        grid = min(grid, max(cdiv(num_row_tiles, slots), 1) * slots)
    else:
        _mla_block_plan_kernel[(1,)](
            seq_lens,
            split_ends,
            num_reqs,
            num_row_tiles,
            slots,
            SPLIT_OVERHEAD_TOKENS=_SPLIT_OVERHEAD_TOKENS,
            NUM_PLANS=_NUM_PLANS,
            REQ_CHUNK=_REQ_CHUNK,
            **splits,
        )

    _fwd_mla_block_kernel_stage1[(grid,)](
        q_nope,
        q_pe,
        kv_buffer,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        block_table,
        seq_lens,
        split_ends,
        mid,
        kv_scale,
        query_len,
        num_reqs,
        slots,
        block_table.stride(0),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_buffer.stride(0),  # the real stride: a cross-layer view has gaps
        kv_buffer.stride(-3),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2),
        NUM_HEADS=num_heads,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_DV=triton.next_power_of_2(Lv),
        BLOCK_DPE=triton.next_power_of_2(Lk - Lv) if Lk > Lv else 0,
        PAGE_SIZE=page_size,
        Lk=Lk,
        Lv=Lv,
        RELOAD_FP8_V=tile.reload_fp8_v,
        SINGLE_REQ=single_req,
        **splits,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **_launch_options(tile),
    )
    # Stage 2: the output columns in as many tiles as give every SM a few
    # programs when there are few rows (one long request), else whole rows.
    block_dv = triton.next_power_of_2(Lv)
    while block_dv > 64 and num_reqs * rows * triton.cdiv(Lv, block_dv) < 4 * num_sms:
        block_dv //= 2
    _fwd_mla_block_kernel_stage2[(num_reqs * rows, triton.cdiv(Lv, block_dv))](
        mid,
        o_rows,
        lse,
        seq_lens,
        split_ends,
        rows,
        mid.stride(1),
        mid.stride(2),
        o_rows.stride(1),
        SPLIT_ALIGN=tile.block_n,
        SPLIT_CHUNK=max(8, _MERGE_TILE // block_dv),
        BLOCK_DV=block_dv,
        Lv=Lv,
        num_warps=4,
    )
