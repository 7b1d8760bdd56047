"""Patch 5's block decode equals the flattened decode, in Triton's interpreter.

``decode_attention_fwd_mla_block`` (vllm/v1/attention/ops/triton_mla_block_decode.py)
decodes a request's ``query_len`` draft tokens together. vLLM's own test
(tests/kernels/attention/test_triton_mla_block_decode.py) checks it against
``decode_attention_fwd`` on the block flattened to one row per token, compiled
on a GPU, with that GPU's tiles and SM count. Here the same comparison runs on
CPU tensors in Triton's interpreter (harness/interpreter.py), which lets one
machine run what no single GPU does:

- every tile the kernel picks, on every platform: ``_mla_block_tile`` runs
  with the platform's device properties emulated (the tile tables are read
  from the module, and a test checks that each one is run);
- the device-side split sizing pushed hard: few SMs and a small
  ``_MIN_SPLIT_TOKENS`` so short contexts take many splits, a
  scratch bound below what a request wants, batches of several waves,
  graph-style bounds planned for max_model_len, all-padding batches;
- bf16, fp16, e4m3fn and MI300's e4m3fnuz caches, pages of 1, 16 and 64,
  ragged lengths with padding requests (length 0), 2 to 8 tokens, 8 to 64 heads.

The split scratch starts as NaN: a split that stage 2 merges but stage 1 never
wrote poisons the output, and the splits each request took can be read back.
Most cases use a 64 + 16 latent (the kernel is generic in both widths); one
case per cache dtype uses production's 512 + 64.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from unittest.mock import patch

import pytest
import torch

from tests.support.pristine import PROJECT_ROOT
from tests.verification.harness.interpreter import InterpreterPool, widen_bf16_dots

# What the tile choice sees of each platform.
LARGE_SMEM = "nvidia-large-smem"  # Hopper, datacenter Blackwell
SMALL_SMEM = "nvidia-small-smem"  # A100, consumer parts
ROCM = "gfx942"  # MI300
ROCM_950 = "gfx950"  # MI355
SMALL_SMEM_BYTES = 100 * 1024

# Graphs are captured for the longest context (see vLLM's test).
MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class Case:
    name: str
    platform: str
    query_len: int
    num_heads: int
    context_lens: tuple[int, ...]  # one request each; 0 is CUDA-graph padding
    page_size: int
    kv_dtype: torch.dtype
    kv_lora_rank: int = 64
    rope_dim: int = 16
    # Device-side split sizing: the SMs (CUs) it fills, the fewest tokens of a
    # split, the workspace's bound on the scratch, and the max_seq_len the
    # host plans the scratch with (the batch's own by default).
    num_sms: int = 8
    min_split_tokens: int = 16
    max_kv_splits: int = 64
    planned_len: int | None = None
    # Requests the split plan reads at a time (the kernels loop over larger
    # batches).
    req_chunk: int = 64
    # What the case is there to reach (checked from the scratch): the most
    # splits a request takes, at least; that request held to the scratch
    # bound; more busy programs than one wave of the GPU.
    min_most_splits: int = 1
    capped: bool = False
    several_waves: bool = False
    # The query as the two tensors MLAAttention hands over ([ql_nope | q_pe],
    # each contiguous), not one.
    q_parts: bool = False


E4M3FN, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
BF16, FP16 = torch.bfloat16, torch.float16

CASES = [
    # Production width, one per cache dtype.
    Case("bf16-512+64", LARGE_SMEM, 2, 16, (50, 0, 300), 16, BF16, 512, 64),
    Case("fp16-512+64", SMALL_SMEM, 6, 8, (77, 31), 64, FP16, 512, 64),
    Case("e4m3fn-512+64", LARGE_SMEM, 4, 8, (170, 9), 64, E4M3FN, 512, 64),
    Case("e4m3fnuz-512+64", ROCM, 2, 16, (33, 64, 0), 16, E4M3FNUZ, 512, 64),
    # The tiles of each platform, by rows per request (query_len x heads).
    Case("bf16-64-rows-page1", LARGE_SMEM, 8, 8, (70, 0), 1, BF16),
    # A 128-token KV tile over pages of 64: the gathering path.
    Case("e4m3fn-64-rows", LARGE_SMEM, 4, 16, (129, 1), 64, E4M3FN),
    # 96 rows: two 64-row tiles, the second part-filled.
    Case("bf16-96-rows", LARGE_SMEM, 6, 16, (90, 0), 64, BF16),
    Case("e4m3fn-96-rows", LARGE_SMEM, 3, 32, (150,), 16, E4M3FN),
    Case("bf16-64-heads", LARGE_SMEM, 2, 64, (40,), 64, BF16),
    Case("bf16-small-smem-page1", SMALL_SMEM, 2, 16, (60, 0, 9), 1, BF16),
    Case("e4m3fnuz-rocm-page64", ROCM, 8, 8, (129, 0), 64, E4M3FNUZ),
    Case("e4m3fn-mi355-page1", ROCM_950, 7, 8, (80, 33), 1, E4M3FN),
    Case("bf16-mi355-96-rows", ROCM_950, 6, 16, (75, 4), 16, BF16),
    Case("bf16-rocm-96-rows", ROCM, 3, 32, (90, 0), 64, BF16),
    Case("fp16-rocm", ROCM, 3, 8, (61, 2), 16, FP16),
    # The query as two tensors.
    Case("bf16-q-parts", LARGE_SMEM, 4, 8, (300, 70, 0), 16, BF16, q_parts=True),
    Case("e4m3fnuz-q-parts", ROCM, 3, 16, (129, 16), 64, E4M3FNUZ, q_parts=True),
    # Split sizing. One request alone on 8 slots: 5 splits of the 128-token
    # minimum.
    Case(
        "many-splits", LARGE_SMEM, 2, 16, (600,), 16, BF16, num_sms=4,
        min_most_splits=5,
    ),
    # ... held to a scratch of 4.
    Case(
        "scratch-caps-splits", LARGE_SMEM, 2, 16, (600,), 16, BF16, num_sms=4,
        max_kv_splits=4, capped=True,
    ),
    # 7 requests with KV on 2 slots: several waves, ragged splits (up to 4 of
    # the longest), padding between.
    Case(
        "several-waves", ROCM, 2, 8, (1500, 0, 33, 4000, 7, 900, 2600, 1), 16,
        E4M3FNUZ,
        num_sms=2, min_most_splits=3, several_waves=True, req_chunk=2,
    ),
    # Busy programs first over requests of several splits each.
    Case(
        "ragged-multi-split", SMALL_SMEM, 2, 8, (3000, 0, 17, 1250, 0, 64), 16,
        E4M3FN, num_sms=4, min_most_splits=2, req_chunk=4,
    ),
    # Scratch planned for max_model_len, as captured, replayed over a short
    # batch (most splits idle) and one long request (most splits busy).
    Case(
        "captured-short", LARGE_SMEM, 2, 8, (30, 1, 0, 0), 16, BF16,
        planned_len=MAX_MODEL_LEN,
    ),
    Case(
        "captured-one-long", LARGE_SMEM, 2, 8, (2000,), 64, BF16, num_sms=16,
        planned_len=MAX_MODEL_LEN, min_most_splits=16,
    ),
    Case("all-padding", LARGE_SMEM, 3, 8, (0, 0, 0), 16, BF16),
    Case("one-split", LARGE_SMEM, 4, 8, (200, 45), 16, BF16, max_kv_splits=1),
]


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    """forward_mqa's inputs for one decode step of the block: the query, a
    paged cache whose pages are shuffled, the block table and lengths."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    num_reqs = len(case.context_lens)
    head_size = case.kv_lora_rank + case.rope_dim
    pages_per_req = max(1, -(-max(case.context_lens) // case.page_size))
    num_pages = num_reqs * pages_per_req + 2
    cache = torch.randn(num_pages, case.page_size, head_size, generator=gen)
    perm = torch.randperm(num_pages, generator=gen)[: num_reqs * pages_per_req]
    # Scaled so that attention is peaked: a wrong KV row changes the output.
    q = 3 * torch.randn(num_reqs * case.query_len, case.num_heads, head_size, generator=gen)
    return dict(
        q=q.to(FP16 if case.kv_dtype == FP16 else BF16),
        kv_cache=cache.to(case.kv_dtype).unsqueeze(2),
        block_table=perm.view(num_reqs, pages_per_req).to(torch.int32),
        seq_lens=torch.tensor(case.context_lens, dtype=torch.int32),
        # Not 1: a 16-bit cache must ignore it.
        kv_scale=torch.tensor([0.5]),
    )


def _platform_tiles(ops, platform: str, picked: list):
    """A stand-in for ``ops._mla_block_tile`` that runs it as on `platform`
    and records what it returns."""
    original = ops._mla_block_tile

    def pick(rows, kv_dtype, device):
        with ExitStack() as emulated:
            if platform in (ROCM, ROCM_950):
                emulated.enter_context(patch.object(ops, "_IS_HIP", True))
                emulated.enter_context(patch.object(ops, "_rocm_arch", lambda: platform))
            else:
                smem = ops._LARGE_SMEM_BYTES if platform == LARGE_SMEM else SMALL_SMEM_BYTES
                emulated.enter_context(
                    patch.object(ops, "get_max_shared_memory_bytes", lambda index: smem)
                )
                device = torch.device("cuda", 0)
            tile = original(rows, kv_dtype, device)
        picked.append(dataclasses.astuple(tile))
        return tile

    return pick


def _scratch(q: torch.Tensor, num_kv_splits: int, lv: int) -> torch.Tensor:
    return torch.full((*q.shape[:2], num_kv_splits, lv + 1), float("nan"))


def _decode_both_ways(case: Case) -> dict:
    """In a worker: the block kernel's (o, lse), sized as forward_mqa sizes
    it, the flattened decode's, the tile and the splits each request took."""
    from vllm.v1.attention.ops import triton_decode_attention as flat
    from vllm.v1.attention.ops import triton_mla_block_decode as ops

    x = _inputs(case)
    q, kv_cache = x["q"], x["kv_cache"]
    num_reqs, lv = len(case.context_lens), case.kv_lora_rank
    scale = (lv + case.rope_dim) ** -0.5
    picked: list[tuple] = []
    with (
        patch.object(ops, "_mla_block_tile", _platform_tiles(ops, case.platform, picked)),
        patch.object(ops, "_MIN_SPLIT_TOKENS", case.min_split_tokens),
        patch.object(ops, "_REQ_CHUNK", case.req_chunk),
    ):
        num_kv_splits = ops.mla_block_decode_num_kv_splits(
            q,
            kv_cache,
            num_reqs,
            case.planned_len or max(case.context_lens),
            case.num_sms,
            case.max_kv_splits,
        )
        o, lse = q.new_zeros(*q.shape[:2], lv), q.new_zeros(q.shape[:2])
        scratch = _scratch(q, num_kv_splits, lv)
        q_in = (q[..., :lv].contiguous(), q[..., lv:].contiguous()) if case.q_parts else q
        ops.decode_attention_fwd_mla_block(
            q_in,
            kv_cache,
            o,
            lse,
            x["block_table"],
            x["seq_lens"],
            scratch,
            scale,
            case.page_size,
            x["kv_scale"],
            case.num_sms,
        )
    # Stage 1 writes a split's LSE for every row of the request; row 0 is in
    # the first row tile, which every request has.
    first_rows = scratch.view(num_reqs, -1, num_kv_splits, lv + 1)[:, 0]
    splits_taken = (~first_rows[..., lv].isnan()).sum(-1)

    flat_o, flat_lse = q.new_zeros(o.shape), q.new_zeros(lse.shape)
    flat.decode_attention_fwd(
        q,
        kv_cache,
        kv_cache[..., :lv],
        flat_o,
        flat_lse,
        x["block_table"].repeat_interleave(case.query_len, dim=0),
        x["seq_lens"].repeat_interleave(case.query_len),
        # One split: the reference's own split merge is not under test, and
        # fewer programs run faster in the interpreter.
        _scratch(q, 1, lv),
        1,
        scale,
        case.page_size,
        k_scale=x["kv_scale"],
        v_scale=x["kv_scale"],
        is_mla=True,
    )
    return dict(
        o=o,
        lse=lse,
        flat_o=flat_o,
        flat_lse=flat_lse,
        tile=picked[-1],
        num_kv_splits=num_kv_splits,
        splits_taken=splits_taken.tolist(),
    )


def _module_tiles(_: None) -> list[tuple]:
    """In a worker: every tile in the module's tables."""
    from vllm.v1.attention.ops import triton_mla_block_decode as ops

    tiles = [
        *ops._TILES_LARGE_SMEM.values(),
        ops._TILE_SMALL_SMEM,
        *(tile for row in ops._TILES_ROCM.values() for tile in row.values()),
    ]
    return [dataclasses.astuple(tile) for tile in tiles]


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case of this file, run once over the interpreter workers; a
    case that raised holds the worker's error."""
    with InterpreterPool(widen_bf16_dots) as pool:
        outcomes = pool.map(_decode_both_ways, CASES, return_errors=True)
        [module_tiles] = pool.map(_module_tiles, [None], return_errors=True)
    names = [case.name for case in CASES]
    return dict(zip(names, outcomes, strict=True), module_tiles=module_tiles)


def _result(results: dict, case: Case) -> dict:
    got = results[case.name]
    if isinstance(got, Exception):
        raise got
    return got


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_block_decode_equals_flattened_decode(results, case: Case):
    got = _result(results, case)
    real = torch.tensor(case.context_lens).repeat_interleave(case.query_len) > 0
    # Real rows are finite (NaN never passes); padding rows (no KV) come out
    # of both split merges as 0/0.
    assert torch.isfinite(got["o"][real]).all()
    assert torch.isfinite(got["lse"][real]).all()
    # Both round to the query dtype after summing in different orders; LSEs
    # near 8 have a bf16 step of 1/32.
    for name in ("o", "lse"):
        torch.testing.assert_close(
            got[name], got[f"flat_{name}"], rtol=2e-2, atol=2e-2, equal_nan=True
        )


SIZING_CASES = [
    case for case in CASES if case.min_most_splits > 1 or case.capped or case.several_waves
]


@pytest.mark.parametrize("case", SIZING_CASES, ids=lambda case: case.name)
def test_case_reaches_its_split_regime(results, case: Case):
    """The split-sizing cases split as their comments say (else they test
    less than they claim)."""
    got = _result(results, case)
    taken, bound = got["splits_taken"], got["num_kv_splits"]
    assert [n > 0 for n in taken] == [n > 0 for n in case.context_lens]
    assert max(taken) >= case.min_most_splits, taken
    if case.capped:
        assert max(taken) == bound, (taken, bound)
    if case.several_waves:
        block_m, *_, programs_per_sm = got["tile"]
        rows = case.query_len * case.num_heads
        busy_programs = sum(taken) * -(-rows // block_m)
        assert busy_programs > case.num_sms * programs_per_sm, taken


def test_every_tile_of_the_module_is_run(results):
    """Each tile of the kernel's tables is run at its full size by some case:
    a tile added to vLLM's tables needs a case here."""
    if isinstance(results["module_tiles"], Exception):
        raise results["module_tiles"]
    picked = {
        results[case.name]["tile"]
        for case in CASES
        if not isinstance(results[case.name], Exception)
    }
    missing = [tile for tile in results["module_tiles"] if tile not in picked]
    assert not missing, f"no case runs the tiles {missing}"


# vLLM 0.34.0 decodes sliding windows in TRITON_MLA; the stack keeps a windowed
# non-causal block on the flat path. The tree's test of that runs the real
# kernels against a windowed reference, on a GPU or in Triton's interpreter:
# here, the interpreter, in a process of its own (the flag is read at import).
WINDOWED_TESTS = (
    "tests/kernels/attention/test_triton_mla_block_decode.py::"
    "test_forward_mqa_windowed_non_causal_block_honours_the_window"
)


def test_the_trees_windowed_block_test_passes_in_the_interpreter():
    tree = PROJECT_ROOT / "build" / "vllm"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", WINDOWED_TESTS],
        cwd=tree, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout, result.stdout[-2000:]
