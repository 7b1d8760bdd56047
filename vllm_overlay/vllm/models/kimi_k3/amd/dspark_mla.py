# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""K3 dense MLA draft model for DSpark speculative decoding (ROCm).

The drafter itself lives in ``vllm.models.kimi_k3.common.dspark_mla``; this
module supplies only what differs on ROCm:

* the attention is the K3 ROCm ``KimiK3MultiHeadLatentAttentionWrapper`` (not
  ``amd/linear.py``'s ``KimiMLAAttention``, which is NoPE-only) with the
  checkpoint's RoPE and a non-causal draft block. Its inner generic
  ``MLAAttention`` (``self_attn.mla_attn``, named ``<prefix>.attn``) owns the
  KV cache and runs the absorb BMMs (AITER FP8/FP4 BMM when enabled,
  otherwise ``torch.bmm``) and the attention;
* two of the wrapper's opt-in fusions: the q/kv RMSNorms as one launch
  (AITER's with ``VLLM_ROCM_USE_AITER=1``, else the Triton
  ``fused_q_kv_rmsnorm`` that NVIDIA's K3 MLA runs), and the RoPE with the
  KV-cache write as one launch of ``ops.concat_and_cache_mla_rope_fused``.
  The target's identity-RoPE fused decode stays out of reach of the draft;
* ``K3DSparkRotaryEmbedding``: the rope module, an in-place
  ``ops.rotary_embedding`` launch on the fp32 table NVIDIA's kernels read,
  which the context-KV precompute reads too;
* the ROCm ``KimiMLP``;
* the grouped context-KV insert excludes ``fp8_e5m2``, which the grouped
  kernel rejects on ROCm; such caches are filled layer by layer.
"""

from typing import Any

import torch
import torch.nn as nn

import vllm._custom_ops as ops
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mla import MLAModules
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
from vllm.models.kimi_k3.amd.linear import KimiMLP
from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper
from vllm.models.kimi_k3.common.dspark_mla import (
    K3DSparkDecoderLayerBase,
    K3DSparkForCausalLMBase,
    K3DSparkModelBase,
)
from vllm.models.kimi_k3.common.mla_rope import get_k3_mla_rope


class K3DSparkRotaryEmbedding(nn.Module):
    """The draft layer's RoPE as one in-place launch of vLLM's rotary op.

    ``ops.rotary_embedding`` (built for ROCm too) reads an fp32 cos/sin table
    with bf16 q/k, rotates in fp32 and rounds once. Calling the rope module
    instead would either re-bind its fp32 table to bf16 on the first forward
    (``RotaryEmbedding._match_cos_sin_cache_dtype``), which the context-KV
    precompute reads as well, or run about 16 unfused kernels
    (``DeepseekScalingRotaryEmbedding.forward_hip`` is ``forward_native``).
    """

    def __init__(self, rope: RotaryEmbeddingBase) -> None:
        super().__init__()
        # get_k3_mla_rope builds every rope type with an fp32 table.
        assert rope.cos_sin_cache.dtype == torch.float32
        self.head_size = rope.head_size
        self.is_neox_style = rope.is_neox_style
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", rope.cos_sin_cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops.rotary_embedding(
            positions,
            query,
            key,
            self.head_size,
            self.cos_sin_cache,
            self.is_neox_style,
        )
        return query, key


class K3DSparkDecoderLayer(K3DSparkDecoderLayerBase):
    mlp_cls = KimiMLP

    def build_self_attn(
        self,
        *,
        vllm_config: VllmConfig,
        config,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> nn.Module:
        # K3DSparkConfig rejects q_lora_rank=None and mla_use_output_gate, so
        # this is the q-LoRA layout without an output gate (no g_proj).
        num_heads = config.num_attention_heads
        tp_size = get_tensor_model_parallel_world_size()
        assert num_heads % tp_size == 0
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        rope, scale_multiplier = get_k3_mla_rope(config, config.qk_rope_head_dim)

        # The projections take the global head count and shard it over TP.
        fused_qkv_a_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.q_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim],
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.fused_qkv_a_proj",
            disable_tp=True,
        )
        q_b_proj = ColumnParallelLinear(
            config.q_lora_rank,
            num_heads * qk_head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
        )
        kv_b_proj = ColumnParallelLinear(
            config.kv_lora_rank,
            num_heads * (config.qk_nope_head_dim + config.v_head_dim),
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.kv_b_proj",
        )
        o_proj = RowParallelLinear(
            num_heads * config.v_head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        mla_modules = MLAModules(
            kv_a_layernorm=RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps),
            kv_b_proj=kv_b_proj,
            rotary_emb=K3DSparkRotaryEmbedding(rope),
            o_proj=o_proj,
            fused_qkv_a_proj=fused_qkv_a_proj,
            kv_a_proj_with_mqa=None,
            q_a_layernorm=RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps),
            q_b_proj=q_b_proj,
            q_proj=None,
            indexer=None,
            is_sparse=False,
            topk_indices_buffer=None,
        )
        # The wrapper and its MLAAttention work on this rank's heads. With a
        # rotary embedding the wrapper never takes its identity-RoPE fused
        # decode (see _fused_qk_prep_supported).
        return KimiK3MultiHeadLatentAttentionWrapper(
            hidden_size=config.hidden_size,
            num_heads=num_heads // tp_size,
            scale=qk_head_dim**-0.5 * scale_multiplier,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            mla_modules=mla_modules,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            prefix=prefix,
            non_causal_multi_token_decode=True,
            fuse_qkv_rmsnorm=True,
            fuse_rope_into_kv_cache_write=True,
        )


class K3DSparkModel(K3DSparkModelBase):
    decoder_layer_cls = K3DSparkDecoderLayer
    # concat_and_cache_mla_grouped rejects fp8_e5m2 on ROCm (cache_kernels.cu).
    grouped_kv_cache_dtypes = K3DSparkModelBase.grouped_kv_cache_dtypes - {"fp8_e5m2"}

    def kv_cache_layer(self, attn: nn.Module) -> Any:
        # The wrapper's inner MLAAttention ("<prefix>.attn") owns the cache.
        return attn.mla_attn


class K3DSparkForCausalLM(K3DSparkForCausalLMBase):
    model_cls = K3DSparkModel
    # Not torch.compiled: under a compiled target, DSparkSpeculator builds and
    # runs it on vLLM's kernels (custom ops, IR op kernels), as --enforce-eager.
    dspark_draft_runs_uncompiled = True
