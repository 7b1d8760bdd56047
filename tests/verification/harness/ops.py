"""CPU bodies for the compiled vLLM ops the drafter touches.

No vLLM ``.so`` loads on a driver-less machine, so the ``_C`` /
``_C_cache_ops`` namespaces are empty. ``install`` defines the ops with the
schemas from csrc/torch_bindings.cpp and registers the reference kernels as
their CPU implementation, so vLLM's own ``_custom_ops`` wrappers (and layers
that bind ``torch.ops._C.*`` at construction) run unchanged.

``REGISTRY`` is the emulated device memory map for the grouped cache insert;
``calls`` counts op invocations so tests can tell which path ran.
"""

from __future__ import annotations

from collections import Counter

import torch

from . import reference

REGISTRY = reference.LiveCacheRegistry()
calls: Counter[str] = Counter()

_LIBS: list[torch.library.Library] = []
_STATE = {"mode": "", "rocm": False, "fp8_dtype": torch.float8_e4m3fn}

_SCHEMAS = {
    "_C": {
        "rms_norm": "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
        "fused_add_rms_norm": "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
        "rotary_embedding": "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
        "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
        # The NVIDIA K3 MLA decode epilogue (HIPified on ROCm).
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor! mqa_q, Tensor! k_cache, Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()",
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert": "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor! mqa_q, Tensor! k_cache, Tensor slot_mapping, Tensor q_scale_inv, Tensor cache_scale_inv, int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()",
    },
    "_C_cache_ops": {
        "concat_and_cache_mla": "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor scale, bool skip_scale=False) -> ()",
        "concat_and_cache_mla_grouped": "concat_and_cache_mla_grouped(Tensor kv_c, Tensor k_pe, Tensor kv_cache_ptrs, Tensor slot_mapping, int block_size, int block_stride, int entry_stride, Tensor? kv_scales=None, str kv_cache_dtype='auto') -> ()",
        "concat_and_cache_mla_rope_fused": "concat_and_cache_mla_rope_fused(Tensor positions, Tensor! q_pe, Tensor! k_pe, Tensor kv_c, Tensor cos_sin_cache, bool is_neox, Tensor slot_mapping, Tensor! kv_cache, str kv_cache_dtype, Tensor kv_cache_scale) -> ()",
    },
}


def _rms_norm(result, input, weight, epsilon):
    calls["rms_norm"] += 1
    reference.rms_norm(result, input, weight, epsilon)


def _fused_add_rms_norm(input, residual, weight, epsilon):
    calls["fused_add_rms_norm"] += 1
    reference.fused_add_rms_norm(input, residual, weight, epsilon)


def rotary_embedding(
    positions,
    query,
    key,
    head_size,
    cos_sin_cache,
    is_neox,
    rope_dim_offset=0,
    inverse=False,
):
    calls["rotary_embedding"] += 1
    assert rope_dim_offset == 0 and not inverse, "not modelled"
    reference.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _silu_and_mul(result, input):
    calls["silu_and_mul"] += 1
    reference.silu_and_mul(result, input)


def _fp8_max() -> float:
    # The epilogue saturates at 224 on gfx942 (fnuz range), 448 elsewhere.
    return 224.0 if _STATE["mode"] == "rocm-gfx942" else 448.0


def _mla_decode_q_concat_kv_cache_insert(
    ql_nope,
    q_pe,
    kv_c_normed,
    k_pe,
    mqa_q,
    k_cache,
    slot_mapping,
    cache_block_size,
    position_ids=None,
    cos_sin_cache=None,
):
    calls["fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"] += 1
    reference.mla_decode_q_concat_kv_cache_insert(
        ql_nope,
        q_pe,
        kv_c_normed,
        k_pe,
        mqa_q,
        k_cache,
        slot_mapping,
        cache_block_size,
        position_ids,
        cos_sin_cache,
    )


def _mla_decode_q_concat_kv_cache_fp8_insert(
    ql_nope,
    q_pe,
    kv_c_normed,
    k_pe,
    mqa_q,
    k_cache,
    slot_mapping,
    q_scale_inv,
    cache_scale_inv,
    cache_block_size,
    position_ids=None,
    cos_sin_cache=None,
):
    calls["fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert"] += 1
    reference.mla_decode_q_concat_kv_cache_insert(
        ql_nope,
        q_pe,
        kv_c_normed,
        k_pe,
        mqa_q,
        k_cache,
        slot_mapping,
        cache_block_size,
        position_ids,
        cos_sin_cache,
        q_scale_inv,
        cache_scale_inv,
        fp8_max=_fp8_max(),
    )


def _concat_and_cache_mla(
    kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=False
):
    calls["concat_and_cache_mla"] += 1
    reference.concat_and_cache_mla(
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_cache_dtype,
        scale,
        skip_scale,
        fp8_dtype=torch.float8_e5m2
        if kv_cache_dtype == "fp8_e5m2"
        else _STATE["fp8_dtype"],
    )


def _concat_and_cache_mla_grouped(
    kv_c,
    k_pe,
    kv_cache_ptrs,
    slot_mapping,
    block_size,
    block_stride,
    entry_stride,
    kv_scales=None,
    kv_cache_dtype="auto",
):
    calls["concat_and_cache_mla_grouped"] += 1
    reference.concat_and_cache_mla_grouped(
        kv_c,
        k_pe,
        kv_cache_ptrs,
        slot_mapping,
        block_size,
        block_stride,
        entry_stride,
        kv_scales,
        kv_cache_dtype,
        registry=REGISTRY,
        rocm=_STATE["rocm"],
        fp8_dtype=_STATE["fp8_dtype"],
    )


def _concat_and_cache_mla_rope_fused(*args):
    calls["concat_and_cache_mla_rope_fused"] += 1
    reference.concat_and_cache_mla_rope_fused(*args, fp8_dtype=_STATE["fp8_dtype"])


_IMPLS = {
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": _silu_and_mul,
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": (
        _mla_decode_q_concat_kv_cache_insert
    ),
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert": (
        _mla_decode_q_concat_kv_cache_fp8_insert
    ),
    "concat_and_cache_mla": _concat_and_cache_mla,
    "concat_and_cache_mla_grouped": _concat_and_cache_mla_grouped,
    "concat_and_cache_mla_rope_fused": _concat_and_cache_mla_rope_fused,
}


def install(mode: str) -> None:
    """Register the reference kernels (idempotent per process)."""
    _STATE["mode"] = mode
    _STATE["rocm"] = mode.startswith("rocm")
    _STATE["fp8_dtype"] = (
        torch.float8_e4m3fnuz if mode == "rocm-gfx942" else torch.float8_e4m3fn
    )
    if _LIBS:
        return
    for ns, schemas in _SCHEMAS.items():
        lib = torch.library.Library(ns, "FRAGMENT")
        for name, schema in schemas.items():
            if not hasattr(getattr(torch.ops, ns), name):
                lib.define(schema)
            lib.impl(name, _IMPLS[name], "CPU")
        _LIBS.append(lib)
