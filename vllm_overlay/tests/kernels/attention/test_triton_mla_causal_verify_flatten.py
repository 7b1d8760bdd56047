# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the multi-token decode flatten in ``TritonMLAImpl.forward_mqa``.

``decode_attention_fwd`` has no causal flag: it launches one program per row of
``q`` and reads that row's KV extent from ``B_Seqlen``. So a ``query_len``-token
decode block is flattened to one row per query token, and intra-block causality
has to be expressed through the per-row sequence lengths -- row ``t`` gets
``seq_len - (query_len - 1) + t``, i.e. the committed prefix plus block tokens
``0..t``. A non-causal draft block, whose rows all attend the same span, goes
to ``decode_attention_fwd_mla_block`` instead, with one row per request.

The kernels are replaced by spies, so these tests assert on the ``block_table``
and ``seq_lens`` the backend actually submits and need no GPU or Triton runtime.
"""

from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
    _compute_num_kv_splits,
)
from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

NUM_HEADS = 16
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
HEAD_SIZE = KV_LORA_RANK + QK_ROPE_HEAD_DIM
PAGE_SIZE = 16

# Committed context per request, including a fresh request at zero context
# where the whole KV extent is the block itself. A decode block's seq_len
# already counts the block, so seq_len = context + query_len.
CONTEXT_LENS = [0, 1, 37, 512]


def _seq_lens(query_len: int) -> list[int]:
    return [c + query_len for c in CONTEXT_LENS]


def _make_impl(dcp_world_size: int = 1) -> TritonMLAImpl:
    """A TritonMLAImpl built by its constructor under a config, as vLLM builds
    it (a CPU has no compute units to count: the platform is given 304)."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    platform = type(current_platform)
    with (
        set_current_vllm_config(config),
        patch.object(platform, "num_compute_units", lambda *args: 304),
    ):
        impl = TritonMLAImpl(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=1,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            q_lora_rank=None,
            kv_lora_rank=KV_LORA_RANK,
            qk_nope_head_dim=128,
            qk_rope_head_dim=QK_ROPE_HEAD_DIM,
            qk_head_dim=128 + QK_ROPE_HEAD_DIM,
            v_head_dim=128,
            kv_b_proj=None,
        )
    # No DCP group is set up here: the rank count is what forward_mqa reads.
    impl.dcp_world_size = dcp_world_size
    impl.decode_sliding_window = None
    return impl


@pytest.fixture(params=["no workspace", "workspace"])
def workspace(request):
    """forward_mqa with and without vLLM's workspace manager, which a test
    before this one in the same process may have left initialised."""
    if request.param == "workspace":
        init_workspace_manager(torch.device("cpu"))
    yield
    reset_workspace_manager()


def _make_metadata(seq_lens: list[int], query_len: int, causal: bool):
    num_decodes = len(seq_lens)
    return SimpleNamespace(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes * query_len,
        max_seq_len=max(seq_lens),
        causal=causal,
        decode=SimpleNamespace(
            # arange page ids so each request's window is an identifiable slice.
            block_table=torch.arange(num_decodes * 64, dtype=torch.int32).reshape(
                num_decodes, 64
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        ),
    )


def _run_forward_mqa(
    seq_lens: list[int],
    query_len: int,
    causal: bool,
    q_rows=None,
    dcp_world_size: int = 1,
    sliding_window: int | None = None,
):
    """Drive forward_mqa with the decode kernels spied out.

    Returns the ``block_table`` and ``seq_lens`` handed to the kernel it
    called, and which one (``"flat"``: ``decode_attention_fwd``, ``"block"``:
    ``decode_attention_fwd_mla_block``).
    """
    captured: dict = {}

    def spy(kernel):
        def record(q, kv_cache, *args, **kwargs):
            # Both take (o, lse, block_table, seq_lens, ...) after the cache;
            # the flat kernel takes the cache's latent view first.
            block_table, b_seq_len = args[3:5] if kernel == "flat" else args[2:4]
            captured["kernel"] = kernel
            captured["block_table"] = block_table.detach().clone()
            captured["seq_lens"] = b_seq_len.detach().clone()
            captured["sliding_window"] = kwargs.get("sliding_window")

        return record

    metadata = _make_metadata(seq_lens, query_len, causal)
    rows = metadata.num_decode_tokens if q_rows is None else q_rows
    q = torch.zeros(rows, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    kv_cache = torch.zeros(
        len(seq_lens) * 64, PAGE_SIZE, HEAD_SIZE, dtype=torch.bfloat16
    )
    layer = SimpleNamespace(_k_scale=torch.ones(1), layer_name="test")

    backend = "vllm.v1.attention.backends.mla.triton_mla"
    with (
        patch(f"{backend}.decode_attention_fwd", spy("flat")),
        patch(f"{backend}.decode_attention_fwd_mla_block", spy("block")),
        # The split heuristics round with Triton helpers; the split count does
        # not change which rows are submitted.
        patch(f"{backend}._compute_num_kv_splits", lambda *args: 4),
        patch(f"{backend}.mla_block_decode_num_kv_splits", lambda *args: 4),
    ):
        impl = _make_impl(dcp_world_size)
        impl.decode_sliding_window = sliding_window
        impl.forward_mqa(q, kv_cache, metadata, layer)

    assert captured, "forward_mqa did not reach a decode kernel"
    return captured


def test_multi_token_decode_flags_are_declared_together():
    """Capture probes max_query_len > 1, which only clears the assert in
    build_for_cudagraph_capture once query_len_support raised the threshold."""
    assert (
        TritonMLAMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    )
    assert TritonMLAMetadataBuilder.query_len_support == QueryLenSupport.UNIFORM


@pytest.mark.parametrize("query_len", [2, 3, 4, 5, 8])
def test_causal_block_rows_see_prefix_plus_own_position(query_len):
    """Causal verify: row t sees seq_len - (query_len - 1) + t KV entries.

    Regression guard: the causal branch used to be skipped entirely, so a verify
    token could attend the draft siblings it is supposed to be checking. Fails
    on unmodified upstream, where no flatten happens at all for causal blocks.
    """
    seq_lens = _seq_lens(query_len)
    captured = _run_forward_mqa(seq_lens, query_len, causal=True)

    got = captured["seq_lens"].tolist()
    want = [s - (query_len - 1) + t for s in seq_lens for t in range(query_len)]
    assert got == want, (
        "causal flatten is not causal: verify row r*query_len+t must get "
        f"seq_len_r - {query_len - 1} + t entries.\n"
        f"  seq_lens {seq_lens}\n  got      {got}\n  expected {want}"
    )

    # Per-request invariants the arithmetic must hold regardless of query_len.
    for r, seq_len in enumerate(seq_lens):
        rows = got[r * query_len : (r + 1) * query_len]
        assert rows == sorted(rows) and len(set(rows)) == query_len, (
            f"request {r} rows must strictly increase, got {rows}"
        )
        assert rows[-1] == seq_len, "last row must see the full sequence"
        assert rows[0] == seq_len - (query_len - 1)
        assert all(n > 0 for n in rows), f"non-positive KV extent in {rows}"


def test_cudagraph_padding_rows_present_no_kv_extent():
    """Causal flattening pins cudagraph padding rows (seq_len 0) to exactly
    zero KV extent, keeping them in the kernel's skipped branch."""
    query_len = 4
    seq_lens = _seq_lens(query_len) + [0]
    captured = _run_forward_mqa(seq_lens, query_len, causal=True)

    padding = captured["seq_lens"].tolist()[-query_len:]
    assert padding == [0] * query_len, (
        f"padding rows must present exactly zero KV extent, got {padding}"
    )


@pytest.mark.parametrize("query_len", [2, 4])
def test_non_causal_block_reads_each_request_once(workspace, query_len):
    """The DSpark draft block is generated in one pass, so every row attends
    the request's whole sequence: the block kernel takes one row per request,
    the block table and lengths as the metadata has them."""
    seq_lens = _seq_lens(query_len)
    captured = _run_forward_mqa(seq_lens, query_len, causal=False)

    assert captured["kernel"] == "block"
    assert captured["seq_lens"].tolist() == seq_lens
    assert torch.equal(
        captured["block_table"], _make_metadata(seq_lens, 1, False).decode.block_table
    )


def test_block_table_is_expanded_to_match_q_rows():
    """The flat kernel indexes block_table by program_id, so it needs one row
    per query token -- a short block_table is read out of bounds."""
    query_len = 4
    captured = _run_forward_mqa(_seq_lens(query_len), query_len, causal=True)

    assert captured["kernel"] == "flat"
    num_rows = len(CONTEXT_LENS) * query_len
    assert captured["block_table"].shape[0] == num_rows
    assert captured["seq_lens"].shape[0] == num_rows
    # repeat_interleave, not repeat: a request's rows must stay adjacent.
    for r in range(len(CONTEXT_LENS)):
        block = captured["block_table"][r * query_len : (r + 1) * query_len]
        assert torch.equal(block, block[:1].expand_as(block))


@pytest.mark.parametrize("causal", [True, False])
def test_single_token_decode_is_untouched(causal):
    """query_len == 1 must short-circuit: ordinary decode sees no expansion."""
    seq_lens = _seq_lens(1)
    captured = _run_forward_mqa(seq_lens, query_len=1, causal=causal)

    assert captured["kernel"] == "flat"
    assert captured["seq_lens"].tolist() == seq_lens
    assert captured["block_table"].shape[0] == len(seq_lens)


def test_expansion_factor_follows_the_q_row_count():
    """The kernel indexes block_table and seq_lens by program_id, so the
    expansion must follow q rows, not the token/request counts."""
    num_rows = len(CONTEXT_LENS) * 4
    captured = _run_forward_mqa(_seq_lens(1), query_len=1, causal=True, q_rows=num_rows)

    assert captured["block_table"].shape[0] == num_rows
    assert captured["seq_lens"].shape[0] == num_rows


def test_non_uniform_block_is_rejected():
    """Q rows must divide evenly across the decode requests."""
    with pytest.raises(AssertionError, match="non-uniform decode block"):
        _run_forward_mqa(_seq_lens(1), query_len=1, causal=True, q_rows=6)


def test_multi_token_decode_is_rejected_under_dcp():
    """Per-row extents offset the global seq_len, but DCP passes the rank-local
    slice, so the causal arithmetic would silently address the wrong KV; the
    builder rejects non-causal blocks under DCP
    (supports_non_causal_multi_token_dcp), and forward_mqa asserts it."""
    for causal in (True, False):
        with pytest.raises(AssertionError, match="not supported with DCP"):
            _run_forward_mqa(_seq_lens(4), query_len=4, causal=causal, dcp_world_size=2)


@pytest.mark.parametrize("query_len", [2, 4, 8])
def test_windowed_non_causal_block_stays_on_the_windowed_flat_kernel(query_len):
    """A windowed draft layer (vLLM's windowed DSpark drafters) must attend only
    its window: decode_attention_fwd applies it per row, the block kernel would
    attend the whole context with splits planned for max_model_len, past the
    workspace reserved from the window. Every row sees the same window."""
    seq_lens = _seq_lens(query_len)
    captured = _run_forward_mqa(seq_lens, query_len, causal=False, sliding_window=128)

    assert captured["kernel"] == "flat"
    assert captured["sliding_window"] == 128
    assert captured["seq_lens"].tolist() == [
        s for s in seq_lens for _ in range(query_len)
    ]
    assert captured["block_table"].shape[0] == len(seq_lens) * query_len


def test_workspace_reservation_is_sized_by_the_sliding_window():
    """The builder reserves after memory profiling, so reserving max_model_len's
    splits for a windowed layer would grow the workspace past what the KV cache
    was sized around. Both reservations must match forward_mqa's split count."""
    sm_count, window, max_model_len = 132, 2048, 1 << 20
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    spec = SlidingWindowMLASpec(
        block_size=PAGE_SIZE,
        num_kv_heads=1,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
        sliding_window=window,
    )

    def builder_init(self, *args):
        self.dcp_world_size = 1
        self.reorder_batch_threshold = 1
        self.num_heads = NUM_HEADS
        self.mla_dims = SimpleNamespace(kv_lora_rank=KV_LORA_RANK)

    impl = _make_impl()
    impl.num_heads = NUM_HEADS
    impl.decode_sliding_window = window
    impl._vllm_config = vllm_config

    workspace = MagicMock()
    triton_mla = "vllm.v1.attention.backends.mla.triton_mla"
    with (
        patch(f"{triton_mla}.is_workspace_manager_initialized", return_value=True),
        patch(f"{triton_mla}.current_workspace_manager", return_value=workspace),
        patch(f"{triton_mla}.max_decode_query_len", return_value=1),
        patch(
            f"{triton_mla}.current_platform.num_compute_units", return_value=sm_count
        ),
        patch.object(MLACommonMetadataBuilder, "__init__", builder_init),
    ):
        TritonMLAMetadataBuilder(spec, ["layer0"], vllm_config, "cpu")
        impl.reserve_workspace()

    expected = _compute_num_kv_splits(window, sm_count)
    assert expected < _compute_num_kv_splits(max_model_len, sm_count)
    reserved = [call.args[0][0][2] for call in workspace.get_simultaneous.mock_calls]
    assert reserved == [expected, expected]
