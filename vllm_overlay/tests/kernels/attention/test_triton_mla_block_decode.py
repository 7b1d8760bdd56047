# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton MLA decode of a non-causal block equals the flattened decode.

``decode_attention_fwd_mla_block`` decodes a request's ``query_len`` draft
tokens together, reading each KV tile once for a tile of the request's
``query_len x num_heads`` rows. It must give what ``decode_attention_fwd`` gives
on the block flattened to one decode row per token (as ``TritonMLAImpl``
decoded non-causal blocks before), up to floating-point reordering: outputs and
LSEs, for bf16, fp16 and fp8 (e4m3fn, and MI300's e4m3fnuz) caches, vLLM's page
sizes, ragged context lengths with a CUDA-graph padding request of length 0,
one and several KV splits (more than a context fills), 2 to 8 tokens and 8 to
64 heads, and every tile the kernel picks on NVIDIA and ROCm.

On a GPU both kernels run compiled. Without one, they run on CPU tensors in
Triton's interpreter, in a spawned pool of worker processes: Triton picks the
interpreter when a kernel is decorated, so it has to be on before vLLM is
imported, and the workers keep it out of this process and out of other tests.
Most cases use a narrower latent than production's 512 + 64 (the kernel is
generic in both widths) to keep the interpreter fast; one case per cache dtype
family uses 512 + 64.
"""

import contextlib
import multiprocessing
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skip_global_cleanup


@dataclass(frozen=True)
class Case:
    name: str
    query_len: int
    num_heads: int
    context_lens: tuple[int, ...]  # one request each; 0 is CUDA-graph padding
    page_size: int
    kv_dtype: torch.dtype
    kv_lora_rank: int = 64
    rope_dim: int = 16
    num_kv_splits: int = 2
    q_dtype: torch.dtype = torch.bfloat16
    # (block_m, block_n, num_warps, num_stages) to force in the interpreter,
    # or the kernel's pick.
    tile: tuple[int, int, int, int] | None = None


CASES = [
    Case(
        "bf16-512+64", 4, 16, (1, 50, 0), 16, torch.bfloat16, 512, 64, num_kv_splits=4
    ),
    Case("e4m3fn-512+64", 3, 8, (70, 9), 64, torch.float8_e4m3fn, 512, 64),
    Case("e4m3fnuz-512+64", 2, 8, (33, 64), 16, torch.float8_e4m3fnuz, 512, 64),
    Case("bf16-page1", 7, 8, (5, 70, 0), 1, torch.bfloat16),
    Case("bf16-page64-64heads", 2, 64, (40, 3), 64, torch.bfloat16),
    Case("e4m3fn-page16-32heads", 5, 32, (50, 17), 16, torch.float8_e4m3fn),
    Case("e4m3fnuz-page64", 8, 8, (129, 1, 0), 64, torch.float8_e4m3fnuz),
    Case("fp16-page16", 6, 8, (77, 31), 16, torch.float16, q_dtype=torch.float16),
    Case("bf16-one-split", 4, 8, (200, 45), 16, torch.bfloat16, num_kv_splits=1),
    # More splits than a short context fills (stage 1 skips the empty ones and
    # stage 2 must not read them), and a count that is not a power of 2.
    Case("bf16-16-splits", 3, 8, (5, 70, 0), 16, torch.bfloat16, num_kv_splits=16),
    Case("e4m3fn-6-splits", 2, 16, (3, 40), 1, torch.float8_e4m3fn, num_kv_splits=6),
    Case("bf16-wide-rope", 2, 8, (60, 90), 64, torch.bfloat16, 48, 40),
    # Tiles the kernel picks on other hardware (see _mla_block_tile).
    Case(
        "rocm-tile", 7, 8, (80, 33, 0), 16, torch.float8_e4m3fnuz, tile=(32, 16, 4, 1)
    ),
    Case("small-tile", 4, 16, (90, 20), 64, torch.bfloat16, tile=(32, 32, 4, 2)),
    Case("one-head-group", 2, 8, (90, 7), 64, torch.bfloat16, tile=(16, 64, 4, 2)),
]


# forward_mqa end to end, at production width (its single split covers these
# contexts).
FORWARD_MQA_CASES = [
    Case("forward_mqa-bf16", 2, 8, (45, 0, 20), 16, torch.bfloat16, 512, 64),
    Case("forward_mqa-e4m3fn", 7, 8, (45, 0, 20), 64, torch.float8_e4m3fn, 512, 64),
]


def _inputs(case: Case, device: str) -> dict:
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
    q = 3 * torch.randn(
        num_reqs * case.query_len, case.num_heads, head_size, generator=gen
    )
    inputs = dict(
        q=q.to(case.q_dtype),
        kv_cache=cache.to(case.kv_dtype),
        block_table=perm.view(num_reqs, pages_per_req).to(torch.int32),
        seq_lens=torch.tensor(case.context_lens, dtype=torch.int32),
        kv_scale=torch.tensor([0.5]),
    )
    return {name: value.to(device) for name, value in inputs.items()}


def _use_interpreter_dot_for_bf16() -> None:
    """Triton's interpreter multiplies the raw bits of bf16 dot operands
    (numpy has no bf16); widen them to fp32 first, which is exact, as the
    tensor cores do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot
    if getattr(create_dot, "widens_bf16", False):
        return

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(
            self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc
        )

    create_dot_bf16.widens_bf16 = True  # type: ignore[attr-defined]
    interpreter.InterpreterBuilder.create_dot = create_dot_bf16


def _flattened_decode(
    case: Case, x: dict, logits: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of decode_attention_fwd on the block flattened to one decode row
    per token, as forward_mqa decoded non-causal blocks before; `logits` is
    its scratch, whose third dimension is the split count."""
    from vllm.v1.attention.ops import triton_decode_attention as ops

    q, kv_cache = x["q"], x["kv_cache"].unsqueeze(2)
    o = q.new_zeros(*q.shape[:2], case.kv_lora_rank)
    lse = q.new_zeros(q.shape[:2])
    ops.decode_attention_fwd(
        q,
        kv_cache,
        kv_cache[..., : case.kv_lora_rank],
        o,
        lse,
        x["block_table"].repeat_interleave(case.query_len, dim=0),
        x["seq_lens"].repeat_interleave(case.query_len),
        logits,
        logits.shape[2],
        scale,
        case.page_size,
        k_scale=x["kv_scale"],
        v_scale=x["kv_scale"],
        is_mla=True,
    )
    return o, lse


def _decode_both_ways(case: Case) -> dict[str, torch.Tensor]:
    """(o, lse) of the block kernel and of the flattened decode."""
    from vllm.v1.attention.ops import triton_decode_attention as ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        _use_interpreter_dot_for_bf16()
    x = _inputs(case, device)
    q, kv_cache = x["q"], x["kv_cache"].unsqueeze(2)
    num_tokens, num_heads, _ = q.shape
    scale = q.shape[-1] ** -0.5

    def scratch() -> torch.Tensor:
        # The split count is the caller's (mla_block_decode_num_kv_splits picks
        # one for forward_mqa); the contexts here are too short for it to split.
        shape = (num_tokens, num_heads, case.num_kv_splits, case.kv_lora_rank + 1)
        return torch.empty(shape, device=device)

    o = q.new_zeros(num_tokens, num_heads, case.kv_lora_rank)
    lse = q.new_zeros(num_tokens, num_heads)
    tile = contextlib.nullcontext()
    # A GPU compiles its own platform's tiles; others may not fit its memory.
    if case.tile is not None and device == "cpu":
        forced = ops._MLABlockTile(*case.tile)
        tile = patch.object(ops, "_mla_block_tile", lambda *args: forced)
    with tile:
        ops.decode_attention_fwd_mla_block(
            q,
            kv_cache,
            o,
            lse,
            x["block_table"],
            x["seq_lens"],
            scratch(),
            scale,
            case.page_size,
            x["kv_scale"],
        )
    flat_o, flat_lse = _flattened_decode(case, x, scratch(), scale)
    results = dict(o=o, lse=lse, flat_o=flat_o, flat_lse=flat_lse)
    return {name: value.cpu() for name, value in results.items()}


def _forward_mqa_both_ways(case: Case) -> dict[str, torch.Tensor]:
    """TritonMLAImpl.forward_mqa on a non-causal block (the block kernel), and
    the flattened decode it used to run, on the same inputs."""
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        _use_interpreter_dot_for_bf16()
    x = _inputs(case, device)
    rank = case.kv_lora_rank
    impl = object.__new__(TritonMLAImpl)
    impl.kv_lora_rank, impl.scale = rank, (rank + case.rope_dim) ** -0.5
    impl._sm_count, impl.dcp_world_size = 64, 1
    metadata = SimpleNamespace(
        max_seq_len=max(case.context_lens),
        causal=False,
        decode=SimpleNamespace(block_table=x["block_table"], seq_lens=x["seq_lens"]),
    )
    layer = SimpleNamespace(_k_scale=x["kv_scale"])
    q_nope, q_pe = x["q"].split([rank, case.rope_dim], dim=-1)
    o, lse = impl.forward_mqa((q_nope, q_pe), x["kv_cache"], metadata, layer)

    logits = torch.empty(*o.shape[:2], 1, rank + 1, device=device)
    flat_o, flat_lse = _flattened_decode(case, x, logits, impl.scale)
    results = dict(o=o, lse=lse, flat_o=flat_o, flat_lse=flat_lse)
    return {name: value.cpu() for name, value in results.items()}


def _has_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON


def _call(job: tuple[Callable, Any]):
    function, argument = job
    return function(argument)


Run = Callable[[list[tuple[Callable, Any]]], list]


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    """Runs a list of (function, argument) jobs: in this process on a GPU,
    else in two interpreter workers."""
    if torch.cuda.is_available():
        yield lambda jobs: list(map(_call, jobs))
        return
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        # vLLM keeps Triton on without an active GPU driver when the visible
        # device list is empty on purpose.
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        pool = multiprocessing.get_context("spawn").Pool(2)
    with pool:
        if not pool.apply(_has_triton):
            pytest.skip("vLLM does not enable Triton's interpreter here")
        yield lambda jobs: pool.map(_call, jobs, chunksize=1)


@pytest.fixture(scope="module")
def results(run: Run) -> dict[str, dict[str, torch.Tensor]]:
    """Every kernel case of this file, run once (in parallel without a GPU)."""
    jobs: list[tuple[Callable, Any]] = [(_decode_both_ways, case) for case in CASES]
    jobs += [(_forward_mqa_both_ways, case) for case in FORWARD_MQA_CASES]
    return dict(zip([case.name for _, case in jobs], run(jobs)))


def _assert_equal_to_flat(got: dict[str, torch.Tensor], case: Case) -> None:
    real = torch.tensor(case.context_lens).repeat_interleave(case.query_len) > 0
    # NaN never passes: real rows are finite. Padding rows (no KV) come out
    # of the shared stage-2 merge as 0/0, in both paths alike.
    assert torch.isfinite(got["o"][real]).all()
    assert torch.isfinite(got["lse"][real]).all()
    # Both round to the query dtype after summing in different orders; LSEs
    # near 8 have a bf16 step of 1/32.
    for name in ("o", "lse"):
        torch.testing.assert_close(
            got[name], got[f"flat_{name}"], rtol=2e-2, atol=2e-2, equal_nan=True
        )


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_block_decode_equals_flattened_decode(results, case: Case):
    _assert_equal_to_flat(results[case.name], case)


@pytest.mark.parametrize("case", FORWARD_MQA_CASES, ids=lambda case: case.name)
def test_forward_mqa_decodes_non_causal_block_like_flattened_rows(results, case: Case):
    """forward_mqa hands the block kernel the right cache view, scale and
    scratch: its output is the flattened decode's."""
    _assert_equal_to_flat(results[case.name], case)


def _num_kv_splits(shape: tuple[int, int, int, int, int]) -> int:
    from vllm.v1.attention.ops.triton_decode_attention import (
        mla_block_decode_num_kv_splits,
    )

    num_reqs, query_len, num_heads, max_seq_len, max_kv_splits = shape
    q = torch.empty(num_reqs * query_len, num_heads, 576, dtype=torch.bfloat16)
    kv_cache = torch.empty(1, 64, 1, 576, dtype=torch.bfloat16)
    # The table's tiles, as on an H200 (132 SMs, 227 KiB of shared memory).
    return mla_block_decode_num_kv_splits(
        q, kv_cache, num_reqs, max_seq_len, 132, max_kv_splits
    )


SPLITS = [
    # One request of 4k: the flattened decode's 8 splits leave 124 of 132
    # SMs idle; split down to 128 tokens a program instead.
    ((1, 4, 8, 4096, 256), 32),
    # ... but never past the scratch the workspace reserved.
    ((1, 4, 8, 4096, 16), 16),
    # One request of 128k: 256 programs of a 32-row bf16 tile, two an SM.
    ((1, 4, 8, 131072, 256), 256),
    # 16 long requests, 56 rows each (one tile): one wave of 128 programs.
    ((16, 7, 8, 65536, 256), 8),
    # 64 requests x 448 rows (7 tiles): 448 programs already; a second split
    # evens out the waves (7 of 132 instead of 4 of 112).
    ((64, 7, 64, 32768, 256), 2),
    # Short contexts never split below 128 tokens.
    ((2, 2, 8, 200, 256), 1),
]


@pytest.mark.skipif(
    torch.version.hip is not None, reason="expected counts are for CUDA's tiles"
)
def test_block_decode_splits_fill_the_gpu(run: Run):
    """(num_reqs, query_len, num_heads, max_seq_len, max_kv_splits) -> the
    split count forward_mqa sizes the scratch with."""
    shapes = [shape for shape, _ in SPLITS]
    got = run([(_num_kv_splits, shape) for shape in shapes])
    assert dict(zip(shapes, got)) == dict(SPLITS)
