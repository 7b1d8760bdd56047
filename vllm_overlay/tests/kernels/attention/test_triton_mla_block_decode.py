# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton MLA decode of a non-causal block equals the flattened decode.

``decode_attention_fwd_mla_block`` decodes a request's ``query_len`` draft
tokens together, reading each KV tile once for a tile of the request's
``query_len x num_heads`` rows. It must give what ``decode_attention_fwd`` gives
on the block flattened to one decode row per token (as ``TritonMLAImpl``
decoded non-causal blocks before), up to floating-point reordering: outputs and
LSEs, for bf16, fp16 and the platform's fp8 caches, pages of 1, 16 and 64,
ragged context lengths with a CUDA-graph padding request of length 0, 2 to 8
tokens and 8 to 64 heads, and the split counts of a graph captured for
``max_model_len`` replayed over short and long contexts.

The kernels run compiled, so these cases need a GPU: on the platform's own
tiles, and on the tile of GPUs with less shared memory, forced. A graph
captured once with the host side planned for max_model_len is replayed over
other lengths and pages. The split bound is host arithmetic and runs anywhere.
"""

import os
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

from vllm.platforms import current_platform
from vllm.v1.attention.ops import triton_mla_block_decode as ops
from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

needs_gpu = pytest.mark.skipif(
    not current_platform.is_cuda_alike(), reason="Triton kernels need a GPU"
)

# The longest context of the server: graphs are captured with it, and the
# workspace holds the scratch of its split count (TritonMLAImpl).
MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class Case:
    name: str
    query_len: int
    num_heads: int
    context_lens: tuple[int, ...]  # one request each; 0 is CUDA-graph padding
    page_size: int
    kv_dtype: str  # "bf16", "fp16" or "fp8" (the platform's)
    # What forward_mqa's host side saw as max_seq_len: the batch's own, or
    # max_model_len as under a captured graph.
    planned_len: int | None = None
    kv_lora_rank: int = 512
    rope_dim: int = 64


CASES = [
    Case("bf16-page16", 4, 16, (1, 50, 0, 3000), 16, "bf16"),
    Case("fp8-page16", 5, 8, (700, 9, 2048), 16, "fp8"),
    Case("fp8-page64", 3, 8, (70, 4099, 0), 64, "fp8"),
    Case("fp16-page64", 6, 8, (777, 31), 64, "fp16"),
    Case("bf16-page1", 7, 8, (5, 300, 0), 1, "bf16"),
    Case("bf16-64-heads", 2, 64, (400, 3), 64, "bf16"),
    Case("fp8-64-heads", 7, 64, (2500, 80), 16, "fp8"),
    # 96-row blocks: a full row tile and a part-filled one.
    Case("bf16-16-heads-x6", 6, 16, (900, 17, 0), 16, "bf16"),
    Case("fp8-32-heads-x3", 3, 32, (1500, 600), 64, "fp8"),
    Case("bf16-narrow-latent", 8, 8, (90, 7), 64, "bf16", kv_lora_rank=64, rope_dim=16),
    # Split counts planned for max_model_len, as captured, replayed over a
    # short batch (most splits idle), a long request among short ones and a
    # single long request (most splits busy).
    Case("captured-short", 4, 8, (30, 1, 0, 0), 16, "bf16", MAX_MODEL_LEN),
    Case("captured-ragged", 5, 8, (20000, 40, 3, 1000), 64, "fp8", MAX_MODEL_LEN),
    Case("captured-one-long", 2, 16, (33000,), 16, "bf16", MAX_MODEL_LEN),
]


def _kv_dtype(name: str) -> torch.dtype:
    if name == "fp8":
        return current_platform.fp8_dtype()
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _inputs(case: Case) -> dict:
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
    q_dtype = torch.float16 if case.kv_dtype == "fp16" else torch.bfloat16
    inputs = dict(
        q=q.to(q_dtype),
        kv_cache=cache.to(_kv_dtype(case.kv_dtype)),
        block_table=perm.view(num_reqs, pages_per_req).to(torch.int32),
        seq_lens=torch.tensor(case.context_lens, dtype=torch.int32),
        kv_scale=torch.tensor([0.5]),
    )
    return {name: value.to("cuda") for name, value in inputs.items()}


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _max_kv_splits() -> int:
    # TritonMLAImpl reserves the scratch of _compute_num_kv_splits for
    # max_model_len: at most two splits per SM.
    return min(MAX_MODEL_LEN // 512, 2 * _num_sms())


def _flattened_decode(
    case: Case, x: dict, scale: float, num_kv_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of decode_attention_fwd on the block flattened to one decode row
    per token, as forward_mqa decoded non-causal blocks before."""
    q, kv_cache = x["q"], x["kv_cache"].unsqueeze(2)
    o = q.new_zeros(*q.shape[:2], case.kv_lora_rank)
    lse = q.new_zeros(q.shape[:2])
    logits = torch.empty(
        *q.shape[:2], num_kv_splits, case.kv_lora_rank + 1, device="cuda"
    )
    decode_attention_fwd(
        q,
        kv_cache,
        kv_cache[..., : case.kv_lora_rank],
        o,
        lse,
        x["block_table"].repeat_interleave(case.query_len, dim=0),
        x["seq_lens"].repeat_interleave(case.query_len),
        logits,
        num_kv_splits,
        scale,
        case.page_size,
        k_scale=x["kv_scale"],
        v_scale=x["kv_scale"],
        is_mla=True,
    )
    return o, lse


def _block_decode(case: Case, x: dict, scale: float) -> tuple[torch.Tensor, ...]:
    """(o, lse) of the block kernel, with the split count forward_mqa plans."""
    q, kv_cache = x["q"], x["kv_cache"].unsqueeze(2)
    num_reqs = len(case.context_lens)
    splits = ops.mla_block_decode_num_kv_splits(
        q,
        kv_cache,
        num_reqs,
        case.planned_len or max(case.context_lens),
        _num_sms(),
        _max_kv_splits(),
    )
    o = q.new_zeros(*q.shape[:2], case.kv_lora_rank)
    lse = q.new_zeros(q.shape[:2])
    logits = torch.empty(*q.shape[:2], splits, case.kv_lora_rank + 1, device="cuda")
    ops.decode_attention_fwd_mla_block(
        q,
        kv_cache,
        o,
        lse,
        x["block_table"],
        x["seq_lens"],
        logits,
        scale,
        case.page_size,
        x["kv_scale"],
        _num_sms(),
    )
    return o, lse


def _assert_equal_to_flat(case: Case, got, want) -> None:
    real = torch.tensor(case.context_lens).repeat_interleave(case.query_len) > 0
    # NaN never passes: real rows are finite. Padding rows (no KV) come out
    # of the split merge as 0/0, in both paths alike.
    for value in got:
        assert torch.isfinite(value[real]).all()
    # Both round to the query dtype after summing in different orders; LSEs
    # near 8 have a bf16 step of 1/32.
    for value, expected in zip(got, want):
        torch.testing.assert_close(
            value.cpu(), expected.cpu(), rtol=2e-2, atol=2e-2, equal_nan=True
        )


@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_block_decode_equals_flattened_decode(case: Case):
    x = _inputs(case)
    scale = (case.kv_lora_rank + case.rope_dim) ** -0.5
    got = _block_decode(case, x, scale)
    _assert_equal_to_flat(case, got, _flattened_decode(case, x, scale, 4))


@needs_gpu
def test_block_decode_on_the_small_shared_memory_tile():
    """GPUs with less shared memory (A100, consumer parts, vLLM's L4 CI) take
    a 32-row tile of 32 KV tokens; forced here, so that it runs on any GPU."""
    case = Case("small-smem", 5, 16, (900, 0, 70), 16, "bf16", MAX_MODEL_LEN)
    x = _inputs(case)
    scale = (case.kv_lora_rank + case.rope_dim) ** -0.5
    small = ops._LARGE_SMEM_BYTES - 1
    with patch.object(ops, "get_max_shared_memory_bytes", lambda gpu=0: small):
        tile = ops._mla_block_tile(80, torch.bfloat16, torch.device("cuda", 0))
        got = _block_decode(case, x, scale)
    assert tile == ops._TILE_SMALL_SMEM
    _assert_equal_to_flat(case, got, _flattened_decode(case, x, scale, 4))


@needs_gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_block_decode_replays_a_graph_captured_for_max_model_len(
    kv_dtype: str, page_size: int
):
    """As a speculative drafter runs it: the decode captured once in a CUDA
    graph, with the host side planned for max_model_len and a padded batch,
    then replayed over other ragged lengths and other pages. Each replay
    equals the flattened decode of that step's batch."""
    num_reqs, longest = 4, 20000
    replays = [(5, 17000, 0, 300), (longest,) * 4, (1, 2, 3, 0), (9000, 0, 0, 0)]
    case = Case("graph", 5, 8, (longest,) * num_reqs, page_size, kv_dtype)
    x = _inputs(case)  # sized for the longest step: every replay fits
    scale = (case.kv_lora_rank + case.rope_dim) ** -0.5
    q, kv_cache = x["q"], x["kv_cache"].unsqueeze(2)
    splits = ops.mla_block_decode_num_kv_splits(
        q, kv_cache, num_reqs, MAX_MODEL_LEN, _num_sms(), _max_kv_splits()
    )
    o, lse = q.new_zeros(*q.shape[:2], case.kv_lora_rank), q.new_zeros(q.shape[:2])
    logits = torch.empty(*q.shape[:2], splits, case.kv_lora_rank + 1, device="cuda")

    def decode() -> None:
        ops.decode_attention_fwd_mla_block(
            q,
            kv_cache,
            o,
            lse,
            x["block_table"],
            x["seq_lens"],
            logits,
            scale,
            page_size,
            x["kv_scale"],
            _num_sms(),
        )

    decode()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for lens in replays:
        # Each step: other lengths, another order of the pages, another query.
        x["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        pages = x["block_table"].flatten()
        order = torch.randperm(pages.numel(), generator=gen, device="cuda")
        x["block_table"].copy_(pages[order].view_as(x["block_table"]))
        q.copy_(3 * torch.randn(q.shape, generator=gen, device="cuda"))
        graph.replay()
        step = Case("graph-step", 5, 8, lens, page_size, kv_dtype)
        _assert_equal_to_flat(step, (o, lse), _flattened_decode(step, x, scale, 4))


def _triton_mla_impl(num_heads: int, kv_cache_dtype: str):
    """TritonMLAImpl as vLLM builds it: its constructor, under a config."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    rank, rope = 512, 64
    with set_current_vllm_config(VllmConfig()):
        return TritonMLAImpl(
            num_heads=num_heads,
            head_size=rank + rope,
            scale=(rank + rope) ** -0.5,
            num_kv_heads=1,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            q_lora_rank=None,
            kv_lora_rank=rank,
            qk_nope_head_dim=128,
            qk_rope_head_dim=rope,
            qk_head_dim=128 + rope,
            v_head_dim=128,
            kv_b_proj=None,
        )


@needs_gpu
@pytest.mark.parametrize("workspace", [False, True], ids=["alloc", "workspace"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_forward_mqa_decodes_non_causal_block_like_flattened_rows(
    request, kv_dtype: str, workspace: bool
):
    """forward_mqa hands the block kernel the right cache view, scale, scratch
    and SM count: its output is the flattened decode's, with the scratch from
    vLLM's workspace or allocated (a test before it may have set one up)."""
    if workspace:
        request.getfixturevalue("workspace_init")
    case = Case(f"forward_mqa-{kv_dtype}", 5, 8, (45, 0, 2000), 16, kv_dtype)
    x = _inputs(case)
    rank = case.kv_lora_rank
    impl = _triton_mla_impl(8, "fp8" if kv_dtype == "fp8" else "auto")
    metadata = SimpleNamespace(
        max_seq_len=max(case.context_lens),
        causal=False,
        decode=SimpleNamespace(block_table=x["block_table"], seq_lens=x["seq_lens"]),
    )
    layer = SimpleNamespace(_k_scale=x["kv_scale"])
    q_nope, q_pe = x["q"].split([rank, case.rope_dim], dim=-1)
    got = impl.forward_mqa((q_nope, q_pe), x["kv_cache"], metadata, layer)
    _assert_equal_to_flat(case, got, _flattened_decode(case, x, impl.scale, 4))


@pytest.mark.parametrize("num_reqs", [1, 16, 256])
@pytest.mark.parametrize("max_seq_len", [100, 4096, MAX_MODEL_LEN])
def test_block_decode_split_bound_fits_the_workspace(num_reqs: int, max_seq_len: int):
    """The split count sizes the scratch: a power of 2, never more
    than the workspace reserved for max_model_len, and enough for one long
    request alone to give every SM a program."""
    from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits

    num_sms = 132
    # What _reserve_attn_logits_workspace reserves room for, per request row.
    max_kv_splits = _compute_num_kv_splits(MAX_MODEL_LEN, num_sms)
    q = torch.empty(num_reqs * 5, 8, 576, dtype=torch.bfloat16)
    kv_cache = torch.empty(1, 64, 1, 576, dtype=torch.bfloat16)
    splits = ops.mla_block_decode_num_kv_splits(
        q, kv_cache, num_reqs, max_seq_len, num_sms, max_kv_splits
    )
    assert splits & (splits - 1) == 0
    assert 1 <= splits <= max_kv_splits
    # 40 rows take at most two row tiles; a split reads at least 128 tokens.
    assert splits >= min(num_sms // 2, max_seq_len // 128)


# Runs compiled on a GPU, or on CPU tensors in Triton's interpreter
# (TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= pytest ...): fp16, since the
# interpreter multiplies bf16 as raw bits in tl.dot.
needs_triton = pytest.mark.skipif(
    not (current_platform.is_cuda_alike() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need a GPU or Triton's interpreter",
)


@needs_triton
@pytest.mark.parametrize("workspace", ["alloc", "locked workspace"])
def test_forward_mqa_windowed_non_causal_block_honours_the_window(workspace):
    """A windowed DSpark draft layer (decode_sliding_window, vLLM 0.34): every
    row of a request's non-causal block attends the last `window` keys only.
    The pages wholly below the window point at a poisoned null page, as the
    sliding-window KV manager frees them. With the workspace reserved for the
    window and locked (as after capture), decoding a graph-style batch planned
    for max_model_len must not need more scratch than was reserved."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.mla import triton_mla
    from vllm.v1.worker.workspace import (
        current_workspace_manager,
        init_workspace_manager,
        reset_workspace_manager,
    )

    device = "cuda" if current_platform.is_cuda_alike() else "cpu"
    rank, rope, heads, query_len, page, window = 64, 16, 8, 3, 16, 24
    context_lens = (5, 40, 0, 90)  # block included; one padding request
    num_reqs, num_sms = len(context_lens), 4
    gen = torch.Generator().manual_seed(7)
    pages_per_req = -(-max(context_lens) // page)
    num_pages = 1 + num_reqs * pages_per_req
    cache = torch.randn(num_pages, page, rank + rope, generator=gen)
    cache[0] = 50.0  # the null page: reading it swamps the softmax
    block_table = 1 + torch.arange(num_reqs * pages_per_req).view(num_reqs, -1)
    for r, seq_len in enumerate(context_lens):
        block_table[r, : max(seq_len - window, 0) // page] = 0
    q = 3 * torch.randn(num_reqs * query_len, heads, rank + rope, generator=gen)
    q, cache = q.half().to(device), cache.half().to(device)
    block_table = block_table.to(torch.int32).to(device)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    platform = type(current_platform)
    with (
        set_current_vllm_config(config),
        patch.object(platform, "num_compute_units", lambda *args: num_sms),
    ):
        impl = triton_mla.TritonMLAImpl(
            num_heads=heads,
            head_size=rank + rope,
            scale=(rank + rope) ** -0.5,
            num_kv_heads=1,
            alibi_slopes=None,
            sliding_window=window,
            kv_cache_dtype="auto",
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            q_lora_rank=None,
            kv_lora_rank=rank,
            qk_nope_head_dim=32,
            qk_rope_head_dim=rope,
            qk_head_dim=32 + rope,
            v_head_dim=32,
            kv_b_proj=None,
        )
    # As under a FULL graph captured for max_model_len.
    metadata = SimpleNamespace(
        max_seq_len=MAX_MODEL_LEN,
        causal=False,
        decode=SimpleNamespace(block_table=block_table, seq_lens=seq_lens),
    )
    layer = SimpleNamespace(_k_scale=torch.ones(1, device=device))
    try:
        if workspace == "locked workspace":
            init_workspace_manager(torch.device(device))
            with patch.object(
                triton_mla.current_platform, "num_compute_units", lambda *args: num_sms
            ):
                triton_mla._reserve_attn_logits_workspace(
                    SimpleNamespace(
                        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN)
                    ),
                    num_reqs * query_len,
                    heads,
                    rank,
                    window,
                )
            current_workspace_manager().lock()
        o, lse = impl.forward_mqa(
            (q[..., :rank], q[..., rank:]), cache, metadata, layer
        )
    finally:
        reset_workspace_manager()

    assert lse is not None
    for r, seq_len in enumerate(context_lens):
        if seq_len == 0:
            continue
        tokens = torch.arange(max(seq_len - window, 0), seq_len, device=device)
        kv = cache[block_table[r, tokens // page].long(), tokens % page].float()
        rows = slice(r * query_len, (r + 1) * query_len)
        scores = torch.einsum("qhd,kd->qhk", q[rows].float(), kv) * impl.scale
        want_o = torch.einsum("qhk,kd->qhd", scores.softmax(-1), kv[:, :rank])
        torch.testing.assert_close(o[rows].float(), want_o, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(
            lse[rows].float(), scores.logsumexp(-1), rtol=2e-2, atol=2e-2
        )
