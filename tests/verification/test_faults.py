"""Fault scenarios for the context-KV path under emulated ROCm.

Each one is a way the ROCm drafter went, or could go, wrong: stale cache
pointers after the profiling pass, a cache dtype the grouped kernel rejects
on ROCm, mixed cache dtypes, a missing per-layer slot mapping, and a config
the drafter cannot serve.
"""

from __future__ import annotations

import pytest
import torch

from tests.verification.conftest import DRAFTERS
from tests.verification.harness import drafter as D
from tests.verification.harness import expected as E
from tests.verification.test_context_kv import NUM_TOKENS, _check_layer, _untouched


def _run(draft, states, positions, slots):
    with D.config_context(draft.vllm_config):
        draft.model.precompute_and_store_context_kv(states, positions, slots)


def body_stale_pointers(which):
    from vllm.platforms import current_platform

    from tests.verification.harness import ops

    draft = D.build(cls=D.drafter_cls(which))
    cfg = draft.hf_config
    slots = D.distinct_slots(NUM_TOKENS, 96, 5)
    # Profiling pass: a temporary cache, written once, then freed.
    profiling = D.allocate_caches(draft)
    states, positions = D.context_inputs(cfg, NUM_TOKENS, seed=11)
    _run(draft, states, positions, slots)
    snapshot = [c.clone() for c in profiling]
    D.free_caches(draft)
    # Serving: the real caches are bound (new addresses).
    serving = D.allocate_caches(draft)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(profiling, serving))
    states, positions = D.context_inputs(cfg, NUM_TOKENS, seed=12)
    ops.calls.clear()
    _run(draft, states, positions, slots)
    assert ops.calls.get("concat_and_cache_mla_grouped") == 1
    entries = E.context_entries(draft.checkpoint, cfg, states, positions)
    for i in range(cfg.num_hidden_layers):
        _check_layer(draft, i, entries, slots, current_platform.fp8_dtype())
        assert torch.equal(profiling[i], snapshot[i]), "freed cache was written"


@pytest.mark.parametrize("which", DRAFTERS)
def test_stale_pointers_after_cache_reallocation(rocm, which):
    rocm.call(body_stale_pointers, which=which)


def body_fallback(which, scenario):
    from vllm.platforms import current_platform

    from tests.verification.harness import ops

    cache_dtype = {"e5m2": "fp8", "mixed": "fp8", "missing-slots": "auto"}[scenario]
    draft = D.build(cache_dtype=cache_dtype, cls=D.drafter_cls(which))
    cfg = draft.hf_config
    if scenario == "e5m2":
        # TRITON_MLA refuses fp8_e5m2 on ROCm at construction, so a backend
        # that takes it is simulated: the layers are switched after building,
        # and the cross-layer metadata is rebuilt through the public hook.
        for owner in draft.cache_layers():
            owner.kv_cache_dtype = "fp8_e5m2"
        with D.config_context(draft.vllm_config):
            draft.model.process_weights_after_loading()
    if scenario == "mixed":
        # Layer 1 keeps a bf16 cache while layer 0 is fp8.
        draft.cache_layers()[1].kv_cache_dtype = "auto"
    caches = D.allocate_caches(draft)
    states, positions = D.context_inputs(cfg, NUM_TOKENS)
    s0 = D.distinct_slots(NUM_TOKENS, 96, 7)
    slots = [s0, None] if scenario == "missing-slots" else s0
    ops.calls.clear()
    _run(draft, states, positions, slots)
    assert "concat_and_cache_mla_grouped" not in ops.calls, ops.calls
    entries = E.context_entries(draft.checkpoint, cfg, states, positions)
    fp8 = torch.float8_e5m2 if scenario == "e5m2" else current_platform.fp8_dtype()
    _check_layer(draft, 0, entries, s0, fp8)
    if scenario == "missing-slots":
        assert _untouched(caches[1], torch.tensor([], dtype=torch.int64), "auto")
        assert ops.calls.get("concat_and_cache_mla") == 1
    else:
        _check_layer(draft, 1, entries, s0, fp8)
        assert ops.calls.get("concat_and_cache_mla") == 2


NVIDIA_E5M2 = pytest.mark.xfail(
    reason="0.34.0's NVIDIA module keeps fp8_e5m2 on its grouped allowlist (right "
    "for CUDA); run on ROCm it hits the kernel's rejection. Only the ROCm "
    "drafter is required to fall back.",
    strict=True,
)


@pytest.mark.parametrize(
    ("which", "scenario"),
    [
        pytest.param(
            w, s, marks=[NVIDIA_E5M2] if (w == "nvidia" and s == "e5m2") else []
        )
        if isinstance(w, str)
        else pytest.param(w.values[0], s, marks=w.marks)
        for w in DRAFTERS
        for s in ("e5m2", "mixed", "missing-slots")
    ],
)
def test_context_kv_falls_back_per_layer(rocm, which, scenario):
    """fp8_e5m2 (rejected by 0.34.0's grouped kernel on ROCm), mixed cache
    dtypes and a missing per-layer slot mapping must all fall back to
    per-layer ``do_kv_cache_update`` with the same cache contents."""
    rocm.call(body_fallback, which=which, scenario=scenario)


def body_output_gate():
    with pytest.raises(ValueError, match="mla_use_output_gate"):
        D.make_hf_config(mla_use_output_gate=True)


def test_output_gate_config_is_rejected(rocm):
    """The drafters (the AMD one explicitly) rely on the config refusing an
    output gate: neither builds a gate projection."""
    rocm.call(body_output_gate)
