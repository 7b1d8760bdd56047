# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""K3 dense MLA draft model for DSpark speculative decoding (ROCm).

The drafter itself lives in ``vllm.models.kimi_k3.common.dspark_mla``; this
module supplies only what differs on ROCm:

* the attention is the K3 ROCm ``KimiK3MultiHeadLatentAttentionWrapper`` (not
  ``amd/linear.py``'s ``KimiMLAAttention``, which is NoPE-only) with the
  checkpoint's RoPE and a non-causal draft block. Its inner generic
  ``MLAAttention`` runs the absorb BMMs (AITER FP8/FP4 BMM when enabled,
  otherwise ``torch.bmm``) and the KV-cache write (``concat_and_cache_mla``);
* the RoPE is one in-place ``ops.rotary_embedding`` launch per call on the
  fp32 cos/sin table, the table NVIDIA's fused kernels read. With AITER on, a
  decode batch's RoPE and KV-cache write are instead one launch of aiter's
  Triton ``fused_qk_rope_cat_and_cache_mla`` on the same table
  (``K3DSparkMLAAttention``); the target's identity-RoPE fused decode stays
  out of reach of the draft;
* that inner ``MLAAttention`` (``self_attn.mla_attn``, named ``<prefix>.attn``)
  owns the KV cache;
* the ROCm ``KimiMLP``;
* the grouped context-KV insert excludes ``fp8_e5m2``, which the grouped
  kernel rejects on ROCm; such caches are filled layer by layer.
"""

from typing import Any

import torch
import torch.nn as nn

import vllm._custom_ops as ops
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention.attention import get_attention_context
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
from vllm.platforms import current_platform
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.kv_cache_interface import is_quantized_kv_cache


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


class K3DSparkMLAAttention(KimiK3MultiHeadLatentAttentionWrapper):
    """The draft layer's MLA wrapper. With AITER on, a decode batch's RoPE (of
    q_pe and k_pe, on the fp32 table) and its KV-cache write are one launch of
    aiter's Triton ``fused_qk_rope_cat_and_cache_mla``, where the unfused path
    runs ``ops.rotary_embedding`` and then ``concat_and_cache_mla``; the
    attention itself is ``MLAAttention``'s, unchanged."""

    # The KV-cache dtypes ROCm's concat_and_cache_mla writes (its kAuto and
    # kFp8E4M3), which the fused kernel reproduces.
    FUSED_ROPE_CACHE_DTYPES = frozenset(
        {"auto", "bfloat16", "float16", "fp8", "fp8_e4m3"}
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fused_rope_cache = self._fused_rope_cache_supported()

    def _fused_rope_cache_supported(self) -> bool:
        attn = self.mla_attn
        return (
            rocm_aiter_ops.is_enabled()
            and isinstance(self.rotary_emb, K3DSparkRotaryEmbedding)
            and attn.kv_cache_dtype in self.FUSED_ROPE_CACHE_DTYPES
            # The q-LoRA layout without an output gate, as K3DSparkConfig
            # builds it, with a cache no DCP/PCP shards (they rewrite the cache
            # inputs); a DCP=1 draft under a DCP target replicates its cache.
            and self.q_lora_rank is not None
            and self.g_proj is None
            and not self._qkv_gate_fused
            and not self.dcp_q_replicate
            and attn.impl.dcp_world_size == 1
            and not attn.use_pcp
            and attn.hisparse_cache is None
        )

    def _fused_rope_cache_context(self):
        """(metadata, cache, slots) of a decode-only batch whose cache is bound
        and has one stride per slot, as the kernel indexes it; else None."""
        attn_metadata, _, kv_cache, slot_mapping = get_attention_context(
            self.mla_attn.layer_name
        )
        if (
            attn_metadata is None
            or slot_mapping is None
            or kv_cache.numel() == 0
            or attn_metadata.num_actual_tokens != attn_metadata.num_decode_tokens
            or slot_mapping.numel() < attn_metadata.num_actual_tokens
            or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1)
        ):
            return None
        return attn_metadata, kv_cache, slot_mapping

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
        skip_o_proj: bool = False,
    ) -> torch.Tensor:
        context = None
        if self._fused_rope_cache and llama_4_scaling is None and not skip_o_proj:
            context = self._fused_rope_cache_context()
        if context is None:
            return super().forward(
                positions, hidden_states, llama_4_scaling, skip_o_proj
            )
        attn_metadata, kv_cache, slot_mapping = context
        # The projections of the base forward's q-LoRA branch.
        assert self.fused_qkv_a_proj is not None and self.q_b_proj is not None
        qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
        q_c, kv_lora = qkv_lora.split(
            [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
        )
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_in, kv_c_normed = self._normalize_q_kv(q_c, kv_c)
        q = self.q_b_proj(q_in)[0].view(-1, self.num_heads, self.qk_head_dim)
        q_out, k_pe_out = self._rope_and_cache_write(
            q,
            kv_c_normed,
            k_pe.unsqueeze(1),
            positions,
            kv_cache,
            slot_mapping,
            attn_metadata.num_actual_tokens,
        )
        output = q.new_empty((q.shape[0], self.num_heads * self.v_head_dim))
        # MLAAttention.forward without its cache write, done above.
        attn = self.mla_attn
        if attn.use_direct_call:
            attn.forward_impl(
                q_out, kv_c_normed, k_pe_out, attn.kv_cache, attn_metadata, output
            )
        else:
            torch.ops.vllm.unified_mla_attention_with_output(
                q_out,
                kv_c_normed,
                k_pe_out,
                output,
                _encode_layer_name(attn.layer_name),
            )
        return self.o_proj(output)[0]

    def _rope_and_cache_write(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q with its rope part rotated, rotated k_pe) of the first num_tokens
        tokens, whose cache rows [kv_c_normed | rotated k_pe] are written by
        the same launch. The rotation reads the fp32 table in fp32 and rounds
        once, as ops.rotary_embedding does."""
        from aiter.ops.triton.fused_kv_cache import fused_qk_rope_cat_and_cache_mla

        attn, rope = self.mla_attn, self.rotary_emb
        assert isinstance(rope, K3DSparkRotaryEmbedding)
        nope = self.qk_nope_head_dim
        quantized = is_quantized_kv_cache(attn.kv_cache_dtype)
        # One row per slot; an fp8 cache is stored as bytes.
        cache = kv_cache.view(-1, 1, kv_cache.shape[-1])
        if quantized:
            cache = cache.view(current_platform.fp8_dtype())
        cos, sin = rope.cos_sin_cache.chunk(2, dim=-1)
        q_out, _, k_pe_out, _ = fused_qk_rope_cat_and_cache_mla(
            q[:num_tokens, :, :nope],
            q[:num_tokens, :, nope:],
            kv_c_normed[:num_tokens].unsqueeze(1),
            k_pe[:num_tokens],
            cache,
            slot_mapping[:num_tokens],
            positions[:num_tokens],
            cos,
            sin,
            attn._k_scale,
            rope.is_neox_style,
            # ROCm's 16-bit cache write ignores the scale.
            apply_scale=quantized,
            q_out=q.new_empty((num_tokens, self.num_heads, self.qk_head_dim)),
        )
        return q_out, k_pe_out


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
        return K3DSparkMLAAttention(
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
