"""The review's fp32 ``k_pe`` defect, reproduced and measured.

A draft block goes through the real ``KimiK3MultiHeadLatentAttentionWrapper``
front end with the drafter's real RoPE (``get_rope``, fp32 table, YaRN), into
the real generic ``MLAAttention`` whose cache write (``do_kv_cache_update`` ->
``concat_and_cache_mla``) runs on the reference kernel, which reads ``k_pe``
as the bf16 the GPU kernel is dispatched on. With the RoPE dtype fix absent,
fp32 ``k_pe`` is reinterpreted and the cached rope slice is garbage; with the
fix the slice matches an independent computation.

The front end is the AMD drafter's own layer once ``amd/dspark_mla.py`` exists;
before that (pristine 0.33.0), a probe wrapper is assembled from the NVIDIA
drafter layer's real submodules and RoPE -- exactly what the upstream ROCm
copy did.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.verification.harness import drafter as D
from tests.verification.harness import expected as E

T = 6


def _front_end(which, cache_dtype):
    draft = D.build(rope="yarn", cache_dtype=cache_dtype, cls=D.drafter_cls(which))
    layer0 = draft.layers[0].self_attn
    if hasattr(layer0, "mla_attn"):
        return draft, layer0
    # Probe: the upstream ROCm copy's layer, from the NVIDIA layer's parts.
    from vllm.model_executor.layers.mla import MLAModules
    from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper

    modules = MLAModules(
        kv_a_layernorm=layer0.kv_a_layernorm,
        kv_b_proj=layer0.kv_b_proj,
        rotary_emb=layer0.rotary_emb,
        o_proj=layer0.o_proj,
        fused_qkv_a_proj=layer0.fused_qkv_a_proj,
        kv_a_proj_with_mqa=None,
        q_a_layernorm=layer0.q_a_layernorm,
        q_b_proj=layer0.q_b_proj,
        q_proj=None,
        indexer=None,
        is_sparse=False,
        topk_indices_buffer=None,
    )
    with D.config_context(draft.vllm_config):
        wrapper = KimiK3MultiHeadLatentAttentionWrapper(
            hidden_size=layer0.hidden_size,
            num_heads=layer0.num_local_heads,
            scale=layer0.scale,
            qk_nope_head_dim=layer0.qk_nope_head_dim,
            qk_rope_head_dim=layer0.qk_rope_head_dim,
            v_head_dim=layer0.v_head_dim,
            q_lora_rank=layer0.q_lora_rank,
            kv_lora_rank=layer0.kv_lora_rank,
            mla_modules=modules,
            cache_config=draft.vllm_config.cache_config,
            quant_config=None,
            prefix="probe.layers.7.self_attn",
            non_causal_multi_token_decode=True,
        )
        wrapper.mla_attn.process_weights_after_loading(torch.bfloat16)
    return draft, wrapper


def body_rope_slice(which, cache_dtype):
    from vllm.forward_context import set_forward_context
    from vllm.platforms import current_platform

    from tests.verification.harness import ops

    draft, front = _front_end(which, cache_dtype)
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
    assert ops.calls.get("concat_and_cache_mla") == 1, ops.calls

    # Independent computation of the cache entries for layer 0.
    entries = E.context_entries(draft.checkpoint, cfg, hidden, positions)[0]
    scale = float(attn._k_scale.reshape(-1)[0])
    fp8 = current_platform.fp8_dtype()
    got = E.read_cache_entries(attn.kv_cache, slots, cache_dtype, scale, fp8)
    want = entries.float()
    if cache_dtype.startswith("fp8"):
        want = E.fp8_roundtrip(entries, scale, fp8)
    R = attn.kv_lora_rank
    return dict(
        k_pe_dtype=str(seen["k_pe"].dtype),
        kv_c_dtype=str(seen["kv_c"].dtype),
        kv_c_err=float((got[:, :R] - want[:, :R]).abs().max()),
        rope_err=float(
            (got[:, R:] - want[:, R:]).abs().nan_to_num(nan=float("inf")).max()
        ),
        rope_scale=float(want[:, R:].abs().max()),
    )


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cached_rope_slice_matches_reference(rocm, record_property, cache_dtype):
    """Measurement + guard. Fails on pristine 0.33.0 (fix absent); the max
    error is recorded as a measurement either way."""
    from tests.verification.conftest import HAVE_AMD_DRAFTER

    which = "amd" if HAVE_AMD_DRAFTER else "nvidia"
    m = rocm.call(body_rope_slice, which=which, cache_dtype=cache_dtype)
    record_property(f"measure:rope_slice_max_err[{cache_dtype}]", m["rope_err"])
    record_property(f"measure:kv_c_max_err[{cache_dtype}]", m["kv_c_err"])
    record_property(
        f"measure:k_pe_dtype_into_MLAAttention[{cache_dtype}]", m["k_pe_dtype"]
    )
    assert m["k_pe_dtype"] == m["kv_c_dtype"], m
    tol = 0.15 * m["rope_scale"] if cache_dtype == "fp8" else 2e-2 * m["rope_scale"]
    assert m["rope_err"] <= tol, m


def body_rope_slice_with_simulated_fix(cache_dtype):
    """Same path, with ``forward_static`` casting back to the input dtype (what
    the stack's RoPE patch does): the harness must then see an exact slice."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding as Rope,
    )

    real = Rope.forward_static

    def fixed(positions, query, key, *args, **kwargs):
        q, k = real(positions, query, key, *args, **kwargs)
        return q.to(query.dtype), (None if k is None else k.to(key.dtype))

    Rope.forward_static = staticmethod(fixed)
    return body_rope_slice("nvidia", cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_cached_rope_slice_with_simulated_fix(rocm, record_property, cache_dtype):
    """Guards the harness: with a cast-back RoPE the check passes (so a failure
    of the test above is the defect, not the harness)."""
    m = rocm.call(body_rope_slice_with_simulated_fix, cache_dtype=cache_dtype)
    record_property(
        f"measure:rope_slice_max_err_with_fix[{cache_dtype}]", m["rope_err"]
    )
    assert m["k_pe_dtype"] == m["kv_c_dtype"] == "torch.bfloat16", m
    tol = 0.15 * m["rope_scale"] if cache_dtype == "fp8" else 2e-2 * m["rope_scale"]
    assert m["rope_err"] <= tol, m
