"""Context KV end to end: ``precompute_and_store_context_kv`` under emulated
ROCm fills every draft layer's paged latent cache with exactly what a
straightforward per-layer computation gives (KV projection, RMSNorm, RoPE at
the given positions, concat, scatter by slot), through the drafter's real
code, with only the GPU kernels replaced by reference kernels."""

from __future__ import annotations

import pytest
import torch

from tests.verification.conftest import DRAFTERS
from tests.verification.harness import drafter as D
from tests.verification.harness import expected as E

NUM_TOKENS = 10


def _check_layer(draft, layer_idx, entries, slots, fp8_dtype):
    owner = draft.cache_layers()[layer_idx]
    scale = float(owner._k_scale.reshape(-1)[0])
    got = E.read_cache_entries(
        owner.kv_cache, slots, owner.kv_cache_dtype, scale, fp8_dtype
    )
    want = entries[layer_idx].float()
    if owner.kv_cache_dtype.startswith("fp8"):
        want = E.fp8_roundtrip(entries[layer_idx], scale, fp8_dtype)
        # One fp8 step of slack: bf16 GEMM accumulation order may differ.
        torch.testing.assert_close(got, want, rtol=0.15, atol=2e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    R = owner.kv_lora_rank
    return float((got[:, R:] - want[:, R:]).abs().max())


def _untouched(cache, slots, kv_cache_dtype):
    bs = cache.shape[1]
    mask = torch.ones(cache.shape[0] * bs, dtype=torch.bool)
    mask[slots] = False
    flat = cache.reshape(-1, cache.shape[-1])[mask]
    sentinel = 0x7F if kv_cache_dtype.startswith("fp8") else -7.0
    return (
        bool((flat.float() == sentinel).all())
        if not kv_cache_dtype.startswith("fp8")
        else bool((flat.view(torch.uint8) == sentinel).all())
    )


def body_context_kv(which, rope, cache_dtype, slot_kind, layout):
    from vllm.platforms import current_platform

    from tests.verification.harness import ops

    draft = D.build(rope=rope, cache_dtype=cache_dtype, cls=D.drafter_cls(which))
    cfg = draft.hf_config
    layouts = [(6, 16), (12, 8)] if layout == "nonuniform" else None
    caches = D.allocate_caches(draft, layouts=layouts)
    total = 96
    states, positions = D.context_inputs(cfg, NUM_TOKENS)
    L = cfg.num_hidden_layers
    if slot_kind == "shared":
        slot_arg = D.distinct_slots(NUM_TOKENS, total, 3)
        slots = [slot_arg] * L
    elif slot_kind == "aliased-list":
        s = D.distinct_slots(NUM_TOKENS, total, 3)
        slot_arg = slots = [s] * L
    else:
        slot_arg = slots = [
            D.distinct_slots(NUM_TOKENS, total, 3 + i) for i in range(L)
        ]
    ops.calls.clear()
    with D.config_context(draft.vllm_config):
        draft.model.precompute_and_store_context_kv(states, positions, slot_arg)
    entries = E.context_entries(draft.checkpoint, cfg, states, positions)
    fp8 = current_platform.fp8_dtype()
    for i in range(L):
        _check_layer(draft, i, entries, slots[i], fp8)
        assert _untouched(caches[i], slots[i], draft.cache_layers()[i].kv_cache_dtype)
    return dict(ops.calls)


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize(
    ("rope", "cache_dtype", "slot_kind", "layout"),
    [
        ("yarn", "auto", "shared", "uniform"),
        ("yarn", "fp8", "shared", "uniform"),
        ("default", "bfloat16", "per-layer", "uniform"),
        ("yarn", "fp8_e4m3", "aliased-list", "uniform"),
        ("yarn", "auto", "per-layer", "nonuniform"),
        ("yarn", "fp8", "per-layer", "nonuniform"),
    ],
)
def test_context_kv_matches_reference(
    rocm, which, rope, cache_dtype, slot_kind, layout
):
    calls = rocm.call(
        body_context_kv,
        which=which,
        rope=rope,
        cache_dtype=cache_dtype,
        slot_kind=slot_kind,
        layout=layout,
    )
    # Uniform layouts take the one-launch grouped insert; others fall back.
    if layout == "uniform":
        assert calls.get("concat_and_cache_mla_grouped") == 1, calls
    else:
        assert "concat_and_cache_mla_grouped" not in calls, calls
        assert calls.get("concat_and_cache_mla") == 2, calls


def test_context_kv_fp8_on_gfx950(rocm950):
    """MI355 stores OCP e4m3 (not fnuz): same contents through the same path."""
    rocm950.call(
        body_context_kv,
        which="nvidia",
        rope="yarn",
        cache_dtype="fp8",
        slot_kind="shared",
        layout="uniform",
    )
