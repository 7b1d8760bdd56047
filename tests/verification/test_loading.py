"""Synthetic checkpoint through the drafter's real ``load_weights`` and
``process_weights_after_loading``; confidence head; KV-cache layer names;
RoPE mapping and softmax scale."""

from __future__ import annotations

import pytest
import torch

from tests.verification.conftest import DRAFTERS
from tests.verification.harness import drafter as D


def body_loading(which, confidence, rope):
    from vllm.models.kimi_k3.common.mla_rope import get_k3_mla_rope

    cls = D.drafter_cls(which)
    draft = D.build(rope=rope, confidence=confidence, cls=cls)
    model, cfg, ckpt = draft.model, draft.hf_config, draft.checkpoint
    derived = {"W_UK_T", "W_UV"}  # built from kv_b_proj after loading
    params = dict(model.named_parameters())
    missing = sorted(
        n
        for n in params
        if n not in draft.loaded and n.rsplit(".", 1)[-1] not in derived
    )
    assert not missing, f"parameters never loaded: {missing}"
    # Spot-check values: a loaded parameter equals its checkpoint tensor.
    m = model.model
    assert torch.equal(m.context_proj.weight, ckpt["context_proj.weight"])
    assert torch.equal(m.final_norm.weight, ckpt["final_norm.weight"])
    assert torch.equal(
        m.markov_head.markov_w1.weight, ckpt["markov_head.markov_w1.weight"]
    )
    for i in range(cfg.num_hidden_layers):
        kv_a = ckpt[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
        rows = kv_a.shape[0]
        assert torch.equal(m.context_kv_proj.weight[i * rows : (i + 1) * rows], kv_a)
        assert torch.equal(
            m.layers[i].mlp.down_proj.weight, ckpt[f"layers.{i}.mlp.down_proj.weight"]
        )
    # Confidence head: built and loaded with trained weights iff enabled.
    if confidence:
        head = m.confidence_head
        assert head is not None
        assert torch.equal(head.proj.weight, ckpt["confidence_head.proj.weight"])
        assert torch.equal(head.proj.bias, ckpt["confidence_head.proj.bias"])
        g = torch.Generator().manual_seed(9)
        hidden = torch.randn(3, cfg.hidden_size, generator=g).to(torch.bfloat16)
        markov = torch.randn(3, cfg.markov_rank, generator=g).to(torch.bfloat16)
        with D.config_context(draft.vllm_config):
            got = model.compute_confidence(hidden, markov)
        x = torch.cat([hidden, markov], dim=-1).float()
        want = torch.sigmoid(
            x @ ckpt["confidence_head.proj.weight"].float().T
            + ckpt["confidence_head.proj.bias"].float()
        )
        torch.testing.assert_close(
            got.float().reshape(-1), want.reshape(-1), rtol=2e-2, atol=1e-2
        )
    else:
        assert m.confidence_head is None
    # KV-cache layer names: those of the cache-owning modules, registered in
    # the forward context, at the target's total layer count onwards.
    names = model.get_draft_kv_cache_layer_names()
    owners = draft.cache_layers()
    assert names == [o.layer_name for o in owners]
    ctx = draft.vllm_config.compilation_config.static_forward_context
    assert all(ctx[n] is o for n, o in zip(names, owners))
    base = "model.layers.{}.self_attn" + (".attn" if which == "amd" else "")
    assert names == [
        base.format(D.TARGET_LAYERS + i) for i in range(cfg.num_hidden_layers)
    ]
    # RoPE mapping (interleaved, fp32 table) and YaRN-only softmax scale.
    rope_type, scale_mult = D.rope_mapping(cfg.rope_parameters)
    for layer, owner in zip(m.layers, owners):
        rotary = layer.self_attn.rotary_emb
        assert rotary is not None and not rotary.is_neox_style
        assert rotary.cos_sin_cache.dtype == torch.float32
        want_cls = {
            "default": "RotaryEmbedding",
            "deepseek_yarn": "DeepseekScalingRotaryEmbedding",
        }[rope_type]
        if which == "amd":
            # One in-place rotary launch on the same fp32 table.
            want_cls = "K3DSparkRotaryEmbedding"
            rope, _ = get_k3_mla_rope(cfg, cfg.qk_rope_head_dim)
            assert torch.equal(rotary.cos_sin_cache, rope.cos_sin_cache)
        assert type(rotary).__name__ == want_cls
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        assert owner.impl.scale == pytest.approx(
            qk_head_dim**-0.5 * scale_mult, rel=1e-6
        )
    return sorted(draft.loaded)


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize(
    ("confidence", "rope"), [(True, "yarn"), (False, "default"), (True, "default")]
)
def test_checkpoint_loads_every_parameter(rocm, which, confidence, rope):
    rocm.call(body_loading, which=which, confidence=confidence, rope=rope)


def body_dispatch():
    from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper

    cls = D.drafter_class()
    assert cls.__module__ == "vllm.models.kimi_k3.amd.dspark_mla", cls.__module__
    draft = D.build(cls=cls)
    for layer in draft.layers:
        assert isinstance(layer.self_attn, KimiK3MultiHeadLatentAttentionWrapper)
        assert not layer.self_attn._fused_qk_prep  # identity-RoPE decode never
    return cls.__module__


def test_registry_dispatches_amd_drafter_on_rocm(rocm):
    """Fails on pristine 0.34.0: the registry points K3DSparkModel straight at
    the NVIDIA module, which ROCm then runs."""
    rocm.call(body_dispatch)
