"""The reference rotary kernel against vLLM's own RoPE math.

Every end-to-end check runs vLLM's ``_C.rotary_embedding`` as
``harness/reference.py``'s ``rotary_embedding``, which the ROCm drafter calls
in place on its q_pe and k_pe views with the fp32 cos/sin table. Here that
reference is compared, bit for bit, with ``forward_static`` of the rope class
the drafter's RoPE mapping builds (``get_k3_mla_rope``) on fp32 inputs,
rounded once to bf16: what the kernel computes (fp32 table, fp32 math, one
rounding). ``test_reference_kernels.py`` checks the same reference on cases
computed by hand; this ties it to vLLM's definition of each rope type, at the
drafter's positions and table sizes, on the strided views the drafter passes.
(It replaces the check of a plain-torch stand-in that vLLM's CPU test of the
ROCm drafter used to carry; the real kernel is checked on ROCm by
``tests/models/kimi_k3/test_amd_dspark_mla.py``.)
"""

from __future__ import annotations

import pytest
import torch

from tests.verification.harness import drafter as D

ROPES = {
    "default": D.DEFAULT_ROPE,
    "llama_scaling": dict(D.YARN, attention_factor=1.0),
    "yarn": D.YARN,
}


def body_reference_matches_forward_static(rope_parameters: dict) -> dict:
    from vllm.models.kimi_k3.common.mla_rope import get_k3_mla_rope

    from tests.verification.harness import reference as R

    cfg = D.make_hf_config(rope_parameters=dict(rope_parameters))
    nope, rope_dim, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    with D.config_context(D.make_vllm_config(cfg)):
        rope, _ = get_k3_mla_rope(cfg, rope_dim)
    table = rope.cos_sin_cache

    # The drafter's layout: q [T, heads, nope | rope] and the latent projection
    # [T, kv_lora | rope]; the kernel rotates q[..., nope:] and the k_pe slice.
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, cfg.max_position_embeddings - 1])
    tokens = positions.numel()
    q = torch.randn(tokens, cfg.num_attention_heads, nope + rope_dim, generator=g)
    kv = torch.randn(tokens, lora + rope_dim, generator=g)
    q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
    q_pe, k_pe = q[..., nope:], kv[:, lora:].unsqueeze(1)
    want_q, want_k = type(rope).forward_static(
        positions, q_pe.float(), k_pe.float(), rope_dim, rope_dim, table, False
    )
    q_nope, kv_c = q[..., :nope].clone(), kv[:, :lora].clone()

    R.rotary_embedding(positions, q_pe, k_pe, rope_dim, table, False)

    return dict(
        rope_class=type(rope).__name__,
        table_dtype=str(table.dtype),
        q_pe_equal=torch.equal(q_pe, want_q.to(torch.bfloat16)),
        k_pe_equal=torch.equal(k_pe, want_k.to(torch.bfloat16)),
        rest_untouched=torch.equal(q[..., :nope], q_nope)
        and torch.equal(kv[:, :lora], kv_c),
    )


@pytest.mark.parametrize("rope", list(ROPES))
def test_reference_rotary_matches_vllm_rope_math(rocm, rope):
    m = rocm.call(body_reference_matches_forward_static, rope_parameters=ROPES[rope])
    assert m["table_dtype"] == "torch.float32", m
    assert m["q_pe_equal"] and m["k_pe_equal"], m
    assert m["rest_untouched"], m
