"""Plain-torch reference kernels for the GPU ops the K3 DSpark drafter calls.

Each function mirrors the semantics of the compiled kernel in vLLM's csrc
(cited per function), including the parts that matter for the defects this
harness looks for: a kernel reads its inputs as the element type it was
dispatched on, whatever the tensor's dtype says, and the grouped cache insert
writes through raw base addresses. Nothing here imports vLLM.
"""

from __future__ import annotations

import torch

FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e4m3fnuz: 240.0,
    torch.float8_e5m2: 57344.0,
}


def quantize_fp8(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``fp8::scaled_convert``: x / scale in fp32, saturated to the finite range
    (``__HIP_SATFINITE`` on ROCm), rounded to ``fp8_dtype``; returned as raw bytes."""
    y = x.float() / float(scale)
    limit = FP8_MAX[fp8_dtype]
    y = torch.where(torch.isnan(y), y, y.clamp(-limit, limit))
    return y.to(fp8_dtype).view(torch.uint8)


def dequantize_fp8(
    raw: torch.Tensor, scale: float, fp8_dtype: torch.dtype
) -> torch.Tensor:
    return raw.view(fp8_dtype).float() * float(scale)


def _flat(storage, byte_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """1-D ``dtype`` view of raw memory from ``byte_offset`` to the end."""
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(storage, 0, (storage.nbytes(),))
    return raw[byte_offset:].view(dtype)


def reinterpret_rows(
    t: torch.Tensor, as_dtype: torch.dtype, width: int
) -> torch.Tensor:
    """Read a 2-D tensor the way a kernel dispatched on ``as_dtype`` does.

    The kernel takes ``t.data_ptr()`` as an ``as_dtype*`` and indexes it with
    ``row * t.stride(0) + col`` (the stride in *t's* elements). When ``t`` has
    the expected dtype this is ``t[:, :width]``; when it does not (an fp32
    ``k_pe`` handed to a bf16 kernel) it is what the GPU would read: halves of
    fp32 words, at the wrong offsets.
    """
    assert t.dim() == 2
    if t.dtype == as_dtype:
        return t[:, :width]
    item = torch.empty((), dtype=as_dtype).element_size()
    storage = t.untyped_storage()
    base_bytes = t.storage_offset() * t.element_size()
    assert base_bytes % item == 0
    flat = _flat(storage, base_bytes, as_dtype)
    rows = torch.arange(t.shape[0]).unsqueeze(1) * t.stride(0)
    cols = torch.arange(width).unsqueeze(0)
    return flat[rows + cols]


def write_cache_entries(
    cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    block_stride: int,
    entry_stride: int,
    kv_cache_dtype: str,
    scale: float,
    fp8_dtype: torch.dtype,
) -> None:
    """Scatter ``rows`` [T, W] into the paged ``cache`` at ``slots`` (skip < 0).

    Addresses are computed the kernel's way (block * block_stride + offset *
    entry_stride + i, in cache elements) on a flat view of the cache storage.
    """
    quant = kv_cache_dtype.startswith("fp8")
    elem = torch.uint8 if quant else rows.dtype
    base = cache.storage_offset() * cache.element_size()
    flat = _flat(cache.untyped_storage(), base, elem)
    width = rows.shape[1]
    for t in range(rows.shape[0]):
        slot = int(slots[t])
        if slot < 0:
            continue
        start = (slot // block_size) * block_stride + (slot % block_size) * entry_stride
        value = rows[t]
        if quant:
            value = quantize_fp8(value, scale, fp8_dtype)
        flat[start : start + width] = value


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> None:
    """csrc/cache_kernels.cu ``concat_and_cache_mla`` (plain bf16 / fp8 layouts).

    Dispatched on ``kv_c``'s dtype: ``k_pe`` is read as that dtype whatever
    it really is (see ``reinterpret_rows``). ``kv_cache`` is [blocks, block_size,
    kv_lora_rank + pe_dim]; token count is ``slot_mapping.numel()``.
    """
    num_tokens = slot_mapping.numel()
    kv_lora_rank, pe_dim = kv_c.shape[1], k_pe.shape[1]
    assert kv_cache.shape[2] == kv_lora_rank + pe_dim
    kv = reinterpret_rows(kv_c[:num_tokens], kv_c.dtype, kv_lora_rank)
    pe = reinterpret_rows(k_pe[:num_tokens], kv_c.dtype, pe_dim)
    rows = torch.cat([kv, pe], dim=1)
    s = 1.0 if skip_scale else float(scale.reshape(-1)[0])
    write_cache_entries(
        kv_cache,
        rows,
        slot_mapping.reshape(-1),
        kv_cache.shape[1],
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache_dtype,
        s,
        fp8_dtype,
    )


class LiveCacheRegistry:
    """What the device's memory looks like to a kernel holding raw pointers.

    Caches are registered when allocated and marked freed when released. Freed
    caches are kept alive here (so the allocator cannot hand their addresses to
    a new cache and hide a stale write); a write through a freed address, or
    through an address that is not the base of any registered cache, raises.
    """

    def __init__(self) -> None:
        self._live: dict[int, torch.Tensor] = {}
        self._freed: dict[int, torch.Tensor] = {}
        self.writes: list[tuple[int, int]] = []  # (address, tokens written)

    def register(self, cache: torch.Tensor) -> torch.Tensor:
        self._live[cache.data_ptr()] = cache
        self._freed.pop(cache.data_ptr(), None)
        return cache

    def free(self, cache: torch.Tensor) -> None:
        ptr = cache.data_ptr()
        self._freed[ptr] = self._live.pop(ptr)

    def free_all(self) -> None:
        for cache in list(self._live.values()):
            self.free(cache)

    def is_live(self, cache: torch.Tensor) -> bool:
        return cache.data_ptr() in self._live

    def resolve(self, address: int) -> torch.Tensor:
        if address in self._live:
            return self._live[address]
        if address in self._freed:
            raise StaleCachePointerError(
                f"write through address {address:#x}, which belonged to a KV cache "
                "that has since been freed (stale pointer array)"
            )
        raise StaleCachePointerError(
            f"write through address {address:#x}, which is not the base of any "
            "live KV cache"
        )


class StaleCachePointerError(RuntimeError):
    pass


def concat_and_cache_mla_grouped(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache_ptrs: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    block_stride: int,
    entry_stride: int,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    *,
    registry: LiveCacheRegistry,
    rocm: bool,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> None:
    """csrc/cache_kernels.cu ``concat_and_cache_mla_grouped``.

    kv_c [L, T, R], k_pe [L, T, P] (bf16), kv_cache_ptrs [L] int64 base
    addresses resolved through ``registry``, slot_mapping [L, T] (any layer
    stride, including 0). The host-side checks are the kernel's, including
    the ROCm build's rejection of ``fp8_e5m2``.
    """
    use_fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
    if rocm and kv_cache_dtype == "fp8_e5m2":
        raise RuntimeError(
            "concat_and_cache_mla_grouped does not support fp8_e5m2 KV cache on ROCm"
        )
    if not (use_fp8 or kv_cache_dtype in ("auto", "bfloat16")):
        raise RuntimeError(
            "concat_and_cache_mla_grouped only supports BF16 and plain FP8 KV "
            f"cache; got {kv_cache_dtype}"
        )
    if kv_c.dtype != torch.bfloat16 or k_pe.dtype != torch.bfloat16:
        raise RuntimeError(
            "concat_and_cache_mla_grouped requires BF16 inputs; got "
            f"kv_c={kv_c.dtype}, k_pe={k_pe.dtype}"
        )
    if kv_cache_ptrs.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise RuntimeError("cache pointers and slot mapping must be int64")
    num_layers, num_tokens, _ = kv_c.shape
    if use_fp8:
        if kv_scales is None:
            raise RuntimeError("FP8 grouped cache insert requires kv_scales")
        if kv_scales.dtype != torch.float32 or kv_scales.numel() != num_layers:
            raise RuntimeError("kv_scales must be float32 with one scale per layer")
    elif kv_scales is not None:
        raise RuntimeError("BF16 grouped cache insert does not use kv_scales")
    if num_tokens == 0 or num_layers == 0:
        return
    if kv_cache_dtype == "fp8_e5m2":
        fp8_dtype = torch.float8_e5m2
    for layer in range(num_layers):
        address = int(kv_cache_ptrs[layer])
        cache = registry.resolve(address)
        slots = slot_mapping[layer]
        rows = torch.cat([kv_c[layer], k_pe[layer]], dim=1)
        scale = float(kv_scales[layer]) if use_fp8 else 1.0
        write_cache_entries(
            cache,
            rows,
            slots,
            block_size,
            block_stride,
            entry_stride,
            kv_cache_dtype,
            scale,
            fp8_dtype,
        )
        registry.writes.append((address, int((slots >= 0).sum())))


def rms_norm(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> None:
    """csrc/layernorm_kernels.cu ``rms_norm``: fp32 statistics, weight 1-D or
    2-D (one row per leading index of ``x``, e.g. one per draft layer)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is not None:
        if weight.dim() == 2:
            assert weight.shape[0] == x.shape[0]
            w = weight.view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1])
        else:
            w = weight
        normed = normed * w
    out.copy_(normed)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """csrc/pos_encoding_kernels.cu ``rotary_embedding``, in place.

    ``cos_sin_cache`` is [max_pos, rot_dim] = [cos | sin] (any float dtype,
    read as fp32); the math is fp32 and the result is stored in the input's
    dtype. Interleaved (GPT-J) pairs (2i, 2i+1) unless ``is_neox``. Like the
    kernel, it writes through strided views ([tokens, heads, head_size] with
    any token and head stride, or a flat [tokens, heads * head_size]).
    """
    rot_dim = cos_sin_cache.shape[1]
    for t in (query, key):
        if t is None:
            continue
        heads = t if t.dim() == 3 else t.unflatten(-1, (-1, head_size))
        view = heads[..., :rot_dim]
        view.copy_(rotate(view, positions, cos_sin_cache, is_neox).to(t.dtype))


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [T, ..., rot_dim] rotated at ``positions`` [T] in ``dtype`` (returned
    in it): the table and x cast to it, each product and sum rounded to it."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.to(dtype)[positions.reshape(-1).long()]
    lead = (x.shape[0],) + (1,) * (x.dim() - 2)
    c, s = cs[:, :half].view(*lead, half), cs[:, half:].view(*lead, half)
    xf = x.to(dtype)
    if is_neox:
        a, b = xf[..., :half], xf[..., half:]
    else:
        a, b = xf[..., 0::2], xf[..., 1::2]
    na, nb = a * c - b * s, b * c + a * s
    if is_neox:
        return torch.cat([na, nb], dim=-1)
    return torch.stack([na, nb], dim=-1).flatten(-2)


def concat_and_cache_mla_rope_fused(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> None:
    """csrc/cache_kernels_fused.cu ``concat_and_cache_mla_rope_fused``: the
    table must be q_pe's dtype; the first ``slot_mapping.numel()`` tokens with
    a slot >= 0 get q_pe [T, H, rot] and k_pe [T, rot] rotated in place and
    their cache row [kv_c | rotated k_pe] written; other tokens are left as
    they are."""
    assert cos_sin_cache.dtype == q_pe.dtype == k_pe.dtype == kv_c.dtype
    tokens = slot_mapping.numel()
    live = (slot_mapping.reshape(-1) >= 0).nonzero().reshape(-1)
    pos = positions[:tokens][live]
    # The kernel casts cos and sin to q's dtype and computes in it.
    q_pe[live] = rotate(q_pe[live], pos, cos_sin_cache, is_neox, q_pe.dtype)
    k_pe[live] = rotate(k_pe[live], pos, cos_sin_cache, is_neox, k_pe.dtype)
    concat_and_cache_mla(
        kv_c[live],
        k_pe[live],
        kv_cache,
        slot_mapping.reshape(-1)[live],
        kv_cache_dtype,
        scale,
        fp8_dtype=fp8_dtype,
    )


def mla_decode_q_concat_kv_cache_insert(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    mqa_q: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_block_size: int,
    position_ids: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    q_scale_inv: torch.Tensor | None = None,
    cache_scale_inv: torch.Tensor | None = None,
    *,
    fp8_max: float = 448.0,
) -> None:
    """csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu, the K3 decode
    epilogue (``fused_kimi_k3_mla_decode_q_concat_kv_cache{,_fp8}_insert``).

    ``mqa_q[t, h] = [ql_nope | rope(q_pe)]`` and cache row ``slot_mapping[t]``
    (skipped when < 0) ``= [kv_c | rope(k_pe)]``; RoPE (interleaved pairs, fp32
    table) only when ``position_ids`` is given. With a scale, a value is
    stored as e4m3 of ``x * scale_inv`` saturated to ``fp8_max``. The kernel
    is compiled for K3's sizes only; this body takes any.
    """
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    q_pe, k_pe = q_pe.float(), k_pe.float()
    if position_ids is not None:
        assert cos_sin_cache is not None
        q_pe = rotate(q_pe, position_ids, cos_sin_cache, is_neox=False)
        k_pe = rotate(k_pe, position_ids, cos_sin_cache, is_neox=False)

    def stored(x: torch.Tensor, scale_inv, dtype) -> torch.Tensor:
        """``x`` as ``dtype`` holds it (fp8: e4m3 bytes, ``dtype`` may be uint8)."""
        if scale_inv is None:
            return x.to(dtype)
        y = (x * float(scale_inv.reshape(-1)[0])).clamp(-fp8_max, fp8_max)
        return y.to(torch.float8_e4m3fn).view(dtype)

    q = torch.cat([ql_nope.float(), q_pe], dim=-1)
    mqa_q.copy_(stored(q, q_scale_inv, mqa_q.dtype))
    kv = torch.cat([kv_c.float(), k_pe], dim=-1)
    rows = stored(kv, cache_scale_inv, k_cache.dtype)
    write_cache_entries(
        k_cache,
        rows,
        slot_mapping.reshape(-1),
        cache_block_size,
        k_cache.stride(0),
        k_cache.stride(1),
        "auto",  # rows are already in the cache's element type
        1.0,
        torch.float8_e4m3fn,
    )


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    out.copy_((torch.nn.functional.silu(gate) * up).to(out.dtype))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> None:
    """In place: residual <- x + residual; x <- rms_norm(residual)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    residual.copy_(summed)
    rms_norm(x, summed, weight, eps)


def fused_q_kv_rmsnorm(
    qr: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm/models/common/ops/fused_qk_rmsnorm.py (Triton): RMSNorm of the
    q-LoRA and KV latents, one launch, new tensors."""
    q_out, kv_out = torch.empty_like(qr), torch.empty_like(kv)
    rms_norm(q_out, qr, q_weight, eps)
    rms_norm(kv_out, kv, kv_weight, eps)
    return q_out, kv_out
