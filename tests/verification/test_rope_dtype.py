"""The review's fp32 ``k_pe`` defect, reproduced and measured.

A draft block goes through the real ``KimiK3MultiHeadLatentAttentionWrapper``
front end with the drafter's real RoPE (``get_rope``, fp32 table, YaRN), into
the real generic ``MLAAttention``. The drafter's RoPE + cache write
(``concat_and_cache_mla_rope_fused``) and, in the defect's reproduction, the
first ROCm drafter's rope module + ``concat_and_cache_mla`` run on reference
kernels that read ``k_pe`` as the bf16 the GPU kernels are dispatched on. With the RoPE dtype fix absent,
fp32 ``k_pe`` is reinterpreted and the cached rope slice is garbage; with the
fix the slice matches an independent computation.

The front end is the AMD drafter's own first layer. The defect is measured
in every run by putting pristine 0.34.0's promotion back (RoPE computed on
fp32 inputs, as ``forward_static`` did for bf16 inputs and an fp32 table).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.verification.harness import drafter as D
from tests.verification.harness import expected as E

T = 6


def _front_end(cache_dtype):
    draft = D.build(rope="yarn", cache_dtype=cache_dtype, cls=D.drafter_cls("amd"))
    return draft, draft.layers[0].self_attn


def body_rope_slice(cache_dtype, pristine_rope=False):
    from vllm.forward_context import set_forward_context
    from vllm.platforms import current_platform

    from vllm.models.kimi_k3.amd import mla as amd_mla

    from tests.verification.harness import ops, reference

    # The q/kv norms' Triton kernel, on its reference body (no GPU here).
    amd_mla.fused_q_kv_rmsnorm = reference.fused_q_kv_rmsnorm
    if pristine_rope:
        _restore_pristine_rope_promotion()
    draft, front = _front_end(cache_dtype)
    if pristine_rope:
        _call_the_rope_module(front, draft.hf_config)
    attn = front.mla_attn
    cfg = draft.hf_config
    width = attn.kv_lora_rank + attn.qk_rope_head_dim
    raw = torch.zeros(
        4,
        1,
        16,
        width,
        dtype=torch.uint8 if cache_dtype.startswith("fp8") else torch.bfloat16,
    )
    attn.bind_kv_cache(raw)
    seen = {}

    def record(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output=None, **kw):
        seen.update(q=q.clone(), kv_c=kv_c_normed.clone(), k_pe=k_pe.clone())
        return output

    attn.forward_impl = record
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    positions = torch.arange(40, 40 + T)
    slots = torch.arange(3, 3 + T, dtype=torch.int64)
    meta = SimpleNamespace(
        num_decode_tokens=T,
        num_actual_tokens=T,
        num_decodes=1,
        num_prefills=0,
        num_prefill_tokens=0,
    )
    ops.calls.clear()
    with (
        D.config_context(draft.vllm_config),
        set_forward_context(
            {attn.layer_name: meta},
            draft.vllm_config,
            slot_mapping={attn.layer_name: slots},
        ),
    ):
        front(positions, hidden)
    cache_write = (
        "concat_and_cache_mla" if pristine_rope else "concat_and_cache_mla_rope_fused"
    )
    assert ops.calls.get(cache_write) == 1, ops.calls

    # Independent computation of the cache entries for layer 0.
    entries = E.context_entries(draft.checkpoint, cfg, hidden, positions)[0]
    scale = float(attn._k_scale.reshape(-1)[0])
    fp8 = current_platform.fp8_dtype()
    got = E.read_cache_entries(attn.kv_cache, slots, cache_dtype, scale, fp8)
    want = entries.float()
    if cache_dtype.startswith("fp8"):
        want = E.fp8_roundtrip(entries, scale, fp8)
    R = attn.kv_lora_rank
    want_q = E.attention_q(draft.checkpoint, cfg, hidden, positions)
    got_q = seen["q"].reshape(want_q.shape)
    return dict(
        q_dtype=str(seen["q"].dtype),
        q_err=float((got_q.float() - want_q.float()).abs().max()),
        q_scale=float(want_q.float().abs().max()),
        k_pe_dtype=str(seen["k_pe"].dtype),
        kv_c_dtype=str(seen["kv_c"].dtype),
        kv_c_err=float((got[:, :R] - want[:, :R]).abs().max()),
        rope_err=float(
            (got[:, R:] - want[:, R:]).abs().nan_to_num(nan=float("inf")).max()
        ),
        rope_scale=float(want[:, R:].abs().max()),
    )


def _restore_pristine_rope_promotion():
    """Undo the stack's RoPE fix: 0.34.0 computed the rotation of bf16 inputs
    against the fp32 table in fp32 and returned it without casting back."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding as Rope,
    )

    fixed = Rope.forward_static

    def promoting(positions, query, key, *args, **kwargs):
        return fixed(positions, query.float(), key.float(), *args, **kwargs)

    Rope.forward_static = staticmethod(promoting)


def _call_the_rope_module(front, cfg):
    """Undo the ROCm drafter's RoPE launches: hand the wrapper the rope module
    itself and MLAAttention the cache write, as the first ROCm drafter did
    (its forward_hip is forward_native, so the promotion above reaches
    k_pe)."""
    from vllm.models.kimi_k3.common.mla_rope import get_k3_mla_rope

    front.rotary_emb, _ = get_k3_mla_rope(cfg, cfg.qk_rope_head_dim)
    front._rope_in_kv_cache_write = False


def _tolerance(m, cache_dtype):
    return (0.15 if cache_dtype == "fp8" else 2e-2) * m["rope_scale"]


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cached_rope_slice_matches_reference(rocm, record_property, cache_dtype):
    """The AMD drafter hands MLAAttention a bf16 k_pe and caches the right rope
    slice. Fails on pristine 0.34.0 and with the RoPE fix reverted."""
    m = rocm.call(body_rope_slice, cache_dtype=cache_dtype)
    record_property(f"measure:rope_slice_max_err[{cache_dtype}]", m["rope_err"])
    record_property(f"measure:kv_c_max_err[{cache_dtype}]", m["kv_c_err"])
    assert m["k_pe_dtype"] == m["kv_c_dtype"] == "torch.bfloat16", m
    assert m["rope_err"] <= _tolerance(m, cache_dtype), m


def test_attention_inputs_match_reference(rocm, record_property):
    """What the AMD front end hands MLAAttention: the query (q_a_proj, norm,
    q_b_proj, RoPE on the rope part) equals an independent computation from the
    checkpoint, in bf16; kv_c and k_pe are checked through the cache above."""
    m = rocm.call(body_rope_slice, cache_dtype="auto")
    record_property("measure:q_max_err", m["q_err"])
    assert m["q_dtype"] == "torch.bfloat16", m
    assert m["q_err"] <= 2e-2 * m["q_scale"], m


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cached_rope_slice_without_the_fix(rocm, record_property, cache_dtype):
    """The review's measurement (1.6e38 auto, 450 fp8 on MI355X), reproduced:
    with 0.34.0's promotion back and the rope module called as the first ROCm
    drafter did, fp32 k_pe reaches the cache write and the rope slice is
    garbage while kv_c stays exact. Guards the harness's sensitivity."""
    m = rocm.call(body_rope_slice, cache_dtype=cache_dtype, pristine_rope=True)
    record_property(
        f"measure:rope_slice_max_err_without_fix[{cache_dtype}]", m["rope_err"]
    )
    assert m["k_pe_dtype"] == "torch.float32", m
    assert m["kv_c_err"] <= _tolerance(m, cache_dtype), m
    assert m["rope_err"] > 10 * _tolerance(m, cache_dtype), m
