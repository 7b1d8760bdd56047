"""Independent, straightforward computations of what the drafter must produce.

Works from the synthetic checkpoint tensors and the config only (never from
the module under test), one layer at a time, no fused/grouped anything.
"""

from __future__ import annotations

import math

import torch

from . import reference


def rope_cos_sin(
    rope_parameters: dict, rot_dim: int, max_pos: int, positions
) -> torch.Tensor:
    """[len(positions), rot_dim] = [cos | sin] in fp32 for default and YaRN
    (DeepSeek flavour: mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    rp = dict(rope_parameters)
    base = rp["rope_theta"]
    idx = torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim
    pos_freqs = base**idx
    scale = 1.0
    if rp["rope_type"] == "default":
        inv_freq = 1.0 / pos_freqs
    else:
        factor = rp["factor"]
        orig = rp["original_max_position_embeddings"]
        beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)

        def dim_for(rot):
            return (rot_dim * math.log(orig / (rot * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), rot_dim - 1)
        if low == high:
            high += 0.001
        ramp = (
            (torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)
        ).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
            1.0 / pos_freqs
        ) * extrapolation_weight

        def get_mscale(s, m):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        scale = get_mscale(factor, rp.get("mscale", 1)) / get_mscale(
            factor, rp.get("mscale_all_dim", 0)
        )
    pos = torch.as_tensor(positions, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq.float().double())
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).float()


def rope_interleaved(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [T, ..., rot] in fp32; returns fp32."""
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, :half].view(x.shape[0], *([1] * (x.dim() - 2)), half)
    sin = cos_sin[:, half:].view_as(cos)
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def context_entries(ckpt, cfg, context_states, positions) -> list[torch.Tensor]:
    """Per draft layer: [T, kv_lora_rank + rope] bf16 latent cache entries."""
    R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cos_sin = rope_cos_sin(
        cfg.rope_parameters, P, cfg.max_position_embeddings, positions
    )
    out = []
    for i in range(cfg.num_hidden_layers):
        w = ckpt[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
        kv = torch.nn.functional.linear(context_states, w)
        kv_c, k_pe = kv[:, :R], kv[:, R:]
        kv_c = rms(
            kv_c, ckpt[f"layers.{i}.self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps
        )
        k_pe = rope_interleaved(k_pe, cos_sin).to(torch.bfloat16)
        out.append(torch.cat([kv_c, k_pe], dim=-1))
    return out


def attention_q(ckpt, cfg, hidden, positions, layer: int = 0) -> torch.Tensor:
    """[T, heads, nope + rope] bf16 query the layer hands its MLA attention:
    q_a_proj, q_a_layernorm, q_b_proj, then interleaved RoPE on the rope part."""
    p = f"layers.{layer}.self_attn."
    dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_c = torch.nn.functional.linear(hidden, ckpt[p + "q_a_proj.weight"])
    q_c = rms(q_c, ckpt[p + "q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = torch.nn.functional.linear(q_c, ckpt[p + "q_b_proj.weight"])
    q = q.view(hidden.shape[0], cfg.num_attention_heads, dn + dr)
    cos_sin = rope_cos_sin(
        cfg.rope_parameters, dr, cfg.max_position_embeddings, positions
    )
    q_pe = rope_interleaved(q[..., dn:], cos_sin).to(q.dtype)
    return torch.cat([q[..., :dn], q_pe], dim=-1)


def read_cache_entries(
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_cache_dtype: str,
    scale: float,
    fp8_dtype,
) -> torch.Tensor:
    """Entries at ``slots`` as fp32 (dequantized for fp8 caches)."""
    bs = cache.shape[1]
    rows = torch.stack([cache[int(s) // bs, int(s) % bs] for s in slots])
    if kv_cache_dtype.startswith("fp8"):
        return reference.dequantize_fp8(rows.view(torch.uint8), scale, fp8_dtype)
    return rows.float()


def fp8_roundtrip(x: torch.Tensor, scale: float, fp8_dtype) -> torch.Tensor:
    return reference.dequantize_fp8(
        reference.quantize_fp8(x, scale, fp8_dtype), scale, fp8_dtype
    )
