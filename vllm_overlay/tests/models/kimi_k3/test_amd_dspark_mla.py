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


def _assert_rope_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel rounds the table to bf16 and each product and sum, so it is
    not within one rounding of the fp32 rotation: its relative error is about
    1.6x one rounding's, its largest error a few roundings at the inputs'
    scale (where products cancel)."""
    err = got.double() - want.double()
    assert float(err.norm() / want.double().norm()) < 4e-3
    assert float(err.abs().max()) <= 2**-6 * float(want.abs().max())


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_k3_dspark_rocm_fused_rope_cache_write_matches_fp32_rope(
    cache_dtype, dist_init, monkeypatch
):
    """concat_and_cache_mla_rope_fused, called as the draft layer calls it
    (its bf16 copy of the YaRN table), against the fp32-table rotation
    (forward_static) and a torch cache write. A padding row (slot -1) writes
    nothing."""
    import vllm._custom_ops as ops

    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)
    config = _production_config()
    attn = _build_layer(config, cache_dtype).self_attn
    assert attn._rope_in_kv_cache_write
    table = attn.rotary_emb.cos_sin_cache
    positions = torch.tensor([0, 4095, 65536, 131071, 7], device="cuda")
    slots = torch.tensor([3, 17, 40, 63, -1], device="cuda")
    q = torch.randn(5, 16, 192, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(5, 576, dtype=torch.bfloat16, device="cuda")
    q_pe, k_pe, kv_c = q[..., 128:], kv[:, 512:], kv[:, :512]
    cache_torch_dtype = torch.bfloat16 if cache_dtype == "auto" else torch.uint8
    cache = torch.zeros(4, 16, 576, dtype=cache_torch_dtype, device="cuda")
    scale = torch.tensor([0.75], device="cuda")
    want_q, want_k = get_rope(
        64,
        max_position=config.max_position_embeddings,
        rope_parameters=dict(YARN, rope_type="deepseek_yarn"),
        is_neox_style=False,
        dtype=torch.float32,
    ).forward_static(
        positions, q_pe.float(), k_pe.float().unsqueeze(1), 64, 64, table, False
    )
    assert want_k is not None
    want_k = want_k.squeeze(1)

    ops.concat_and_cache_mla_rope_fused(
        positions,
        q_pe,
        k_pe,
        kv_c,
        attn._rope_cos_sin_cache,
        False,
        slots[:4],
        cache,
        cache_dtype,
        scale,
    )

    real = slice(0, 4)
    _assert_rope_close(q_pe[real], want_q[real])
    _assert_rope_close(k_pe[real], want_k[real])
    rows = cache.view(-1, 576)
    written = torch.cat([kv_c[real], k_pe[real]], dim=-1)
    if cache_dtype == "auto":
        torch.testing.assert_close(rows[slots[real]], written, atol=0, rtol=0)
    else:
        fp8 = current_platform.fp8_dtype()
        stored = rows[slots[real]].view(fp8).float() * scale
        torch.testing.assert_close(stored, written.float(), atol=0.1, rtol=2**-3)
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[real]] = False
    assert not rows[untouched].any()


def test_k3_dspark_registry_resolves_rocm_drafter():
    from vllm.model_executor.models.registry import ModelRegistry

    resolved = ModelRegistry._try_load_model_cls("K3DSparkModel")
    assert resolved is amd_dspark_mla.K3DSparkForCausalLM
