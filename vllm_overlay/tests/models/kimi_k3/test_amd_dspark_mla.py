# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ROCm-only tests of the K3 DSpark MLA drafter (``kimi_k3/amd/dspark_mla.py``)
with vLLM's real ROCm kernels and attention backend. The CPU tests are in
``tests/models/test_dspark_mla_rocm.py``."""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.models.kimi_k3.amd import dspark_mla as amd_dspark_mla
from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper
from vllm.models.kimi_k3.common import dspark_mla as common_dspark_mla
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
from vllm.utils.torch_utils import set_default_torch_dtype

pytestmark = pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm only")

TARGET_LAYERS = 61
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _production_config() -> K3DSparkConfig:
    # Production latent geometry (kv_lora_rank 512, rope 64), small elsewhere.
    return K3DSparkConfig(
        hidden_size=256,
        intermediate_size=512,
        hidden_act="silu",
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        target_hidden_size=256,
        target_layer_ids=[1, 3],
        num_target_layers=2,
        markov_rank=4,
        rope_parameters=dict(YARN),
    )


def _build_layer(
    config: K3DSparkConfig, cache_dtype: str = "auto"
) -> amd_dspark_mla.K3DSparkDecoderLayer:
    vllm_config = VllmConfig()
    vllm_config.cache_config.cache_dtype = cache_dtype
    # Backend selection reads the draft's MLA dimensions and dtype.
    vllm_config.model_config = SimpleNamespace(
        hf_text_config=config, dtype=torch.bfloat16, rswa_window=None
    )
    device = torch.device(current_platform.device_type)
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(torch.bfloat16),
        device,
    ):
        return amd_dspark_mla.K3DSparkDecoderLayer(
            vllm_config=vllm_config,
            config=config,
            layer_idx=1,
            start_layer_id=TARGET_LAYERS,
            prefix="model",
        )


def test_k3_dspark_rocm_decoder_builds_mla_wrapper(dist_init, monkeypatch):
    """With the real ROCm attention backend, the draft layer is the K3 ROCm MLA
    wrapper around a generic MLAAttention that owns the KV cache."""
    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)
    config = _production_config()
    layer = _build_layer(config)

    attn = layer.self_attn
    assert isinstance(attn, KimiK3MultiHeadLatentAttentionWrapper)
    assert type(attn.mla_attn) is MLAAttention
    assert attn.mla_attn.non_causal_multi_token_decode is True
    assert attn.mla_attn.num_heads == config.num_attention_heads
    assert (
        attn.mla_attn.layer_name == f"model.layers.{TARGET_LAYERS + 1}.self_attn.attn"
    )
    assert isinstance(attn.rotary_emb, amd_dspark_mla.K3DSparkRotaryEmbedding)
    assert not attn._fused_qk_prep


def test_k3_dspark_rocm_rope_kernel_matches_fp32_math(dist_init, monkeypatch):
    """The in-place rotary kernel on the draft's strided q_pe/k_pe views, with
    the fp32 YaRN table, equals the fp32 rotation rounded once (to within one
    bf16 step where the compiler contracts the kernel's math into FMAs)."""
    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)
    config = _production_config()
    rope = _build_layer(config).self_attn.rotary_emb
    table = rope.cos_sin_cache
    assert table.dtype == torch.float32

    positions = torch.tensor([0, 4095, 65536, 131071], device="cuda")
    q = torch.randn(4, 8, 192, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(4, 576, dtype=torch.bfloat16, device="cuda")
    q_pe, k_pe = q[..., 128:], kv[:, 512:].unsqueeze(1)
    with set_current_vllm_config(VllmConfig()):
        ref_rope = get_rope(
            64,
            max_position=config.max_position_embeddings,
            rope_parameters=dict(YARN, rope_type="deepseek_yarn"),
            is_neox_style=False,
            dtype=torch.float32,
        )
    want_q, want_k = ref_rope.forward_static(
        positions, q_pe.float(), k_pe.float(), 64, 64, table, False
    )

    rope(positions, q_pe, k_pe)

    assert want_k is not None
    torch.testing.assert_close(q[..., 128:], want_q.bfloat16(), atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(
        kv[:, 512:], want_k.squeeze(1).bfloat16(), atol=1e-5, rtol=2**-7
    )
    assert rope.cos_sin_cache is table


def _aiter_layer(cache_dtype: str, monkeypatch):
    """A draft layer's wrapper with AITER on, built for `cache_dtype`."""
    pytest.importorskip("aiter.ops.triton.fused_kv_cache")
    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)
    monkeypatch.setattr(amd_dspark_mla.rocm_aiter_ops, "is_enabled", lambda: True)
    layer = _build_layer(_production_config(), cache_dtype)
    return layer.self_attn


def _rope_then_cache_write(attn, q, kv_c, k_pe, positions, kv_cache, slots):
    """The unfused path: the in-place rotary kernel, then concat_and_cache_mla
    as MLAAttention calls it."""
    mla_attn = attn.mla_attn
    q_pe = q[..., 128:]
    attn.rotary_emb(positions, q_pe, k_pe)
    mla_attn.impl.do_kv_cache_update(
        kv_c,
        k_pe,
        kv_cache,
        slots,
        mla_attn.kv_cache_dtype,
        mla_attn._k_scale,
        skip_scale=mla_attn.kv_cache_dtype != "auto" and mla_attn._k_scale_float == 1.0,
    )
    return q, k_pe


@pytest.mark.parametrize("k_scale", [1.0, 0.5])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_k3_dspark_rocm_fused_rope_cache_matches_rope_then_cache_write(
    dist_init, monkeypatch, cache_dtype, k_scale
):
    """The draft layer's call of aiter's Triton fused_qk_rope_cat_and_cache_mla
    against the in-place rotary kernel and concat_and_cache_mla on the
    same inputs (YaRN table, positions to 131071, strided views, a paged
    cache, a padded token with slot -1): the query's nope part and the
    cache's nope bytes are equal; the rotated parts within one bf16 step
    (FMA contraction) and, in an fp8 cache, one fp8 step (the fused kernel
    rounds the rotation once, the unfused path to bf16 first)."""
    attn = _aiter_layer(cache_dtype, monkeypatch)
    assert attn._fused_rope_cache
    mla_attn = attn.mla_attn
    mla_attn._k_scale.fill_(k_scale)
    mla_attn._k_scale_float = k_scale
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads = 5, 16
    positions = torch.tensor([0, 4095, 65536, 131071, 7], device="cuda")
    slots = torch.tensor([3, 17, 40, 63, -1], device="cuda")
    q = torch.randn(tokens, heads, 192, device="cuda", generator=g).bfloat16()
    kv = torch.randn(tokens, 64 + 576, device="cuda", generator=g).bfloat16()
    kv_c, k_pe = kv[:, 64:576], kv[:, 576:].unsqueeze(1)
    cache_torch_dtype = torch.bfloat16 if cache_dtype == "auto" else torch.uint8
    row_bytes = 576 * cache_torch_dtype.itemsize
    sentinel = torch.full((4, 16, row_bytes), 7, dtype=torch.uint8, device="cuda")
    caches = [sentinel.clone().view(cache_torch_dtype) for _ in range(2)]

    q_fused, _ = attn._rope_and_cache_write(
        q, kv_c, k_pe, positions, caches[0], slots, tokens
    )
    q_unfused, _ = _rope_then_cache_write(
        attn, q.clone(), kv_c, k_pe.clone(), positions, caches[1], slots
    )

    assert torch.equal(q_fused[..., :128], q[..., :128])
    torch.testing.assert_close(q_fused, q_unfused, atol=1e-5, rtol=2**-7)
    if cache_dtype == "auto":
        fused, unfused = (c.float() for c in caches)
        rtol = 2**-7
    else:
        fused, unfused = (c.view(current_platform.fp8_dtype()).float() for c in caches)
        rtol = 2**-3
    assert torch.equal(fused[..., :512], unfused[..., :512])
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=rtol)
    # Only the four real tokens' rows were written.
    written = (caches[0].view(torch.uint8) != sentinel).any(-1).sum()
    assert int(written) == 4


def test_k3_dspark_rocm_fused_rope_cache_saturates_fp8(dist_init, monkeypatch):
    """A cache value beyond the fp8 range saturates, as concat_and_cache_mla's
    does (vLLM's ROCm cache write converts with saturation; aiter's kernel
    converts with v_cvt_pk_fp8_f32 on gfx942, compiled without a clamp)."""
    attn = _aiter_layer("fp8", monkeypatch)
    attn.mla_attn._k_scale.fill_(1.0)
    q = torch.zeros(1, 16, 192, dtype=torch.bfloat16, device="cuda")
    kv = torch.full((1, 576), 1000.0, dtype=torch.bfloat16, device="cuda")
    kv[:, 1::2] = -1000.0
    cache = torch.zeros(1, 16, 576, dtype=torch.uint8, device="cuda")
    attn._rope_and_cache_write(
        q,
        kv[:, :512],
        kv[:, 512:].unsqueeze(1),
        torch.zeros(1, dtype=torch.long, device="cuda"),
        cache,
        torch.zeros(1, dtype=torch.long, device="cuda"),
        1,
    )
    row = cache[0, 0].view(current_platform.fp8_dtype()).float()
    fp8_max = torch.finfo(current_platform.fp8_dtype()).max
    assert torch.isfinite(row).all()
    assert torch.equal(row[:512].abs(), torch.full_like(row[:512], fp8_max))


def test_k3_dspark_registry_resolves_rocm_drafter():
    from vllm.model_executor.models.registry import ModelRegistry

    resolved = ModelRegistry._try_load_model_cls("K3DSparkModel")
    assert resolved is amd_dspark_mla.K3DSparkForCausalLM
