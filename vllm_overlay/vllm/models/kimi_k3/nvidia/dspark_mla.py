# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""K3 dense MLA draft model for DSpark speculative decoding (NVIDIA).

The drafter itself lives in ``vllm.models.kimi_k3.common.dspark_mla``; this
module supplies only the NVIDIA layers: the K3 ``MultiHeadLatentAttention``,
which owns its KV cache, and the K3 ``KimiMLP``.
"""

import torch.nn as nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.models.kimi_k3.common.dspark_mla import (
    K3DSparkDecoderLayerBase,
    K3DSparkForCausalLMBase,
    K3DSparkModelBase,
    # Still importable from here, where they were before the base: tests
    # reach them through this module.
    _duplicate_context_kv_weights,  # noqa: F401
    get_draft_quant_config,  # noqa: F401
)
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
from vllm.models.kimi_k3.nvidia.model import KimiMLP


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
        # The MLA module owns its KV cache (the default kv_cache_layer).
        return MultiHeadLatentAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            prefix=prefix,
            use_rope=True,
            non_causal_multi_token_decode=True,
        )


class K3DSparkModel(K3DSparkModelBase):
    decoder_layer_cls = K3DSparkDecoderLayer


class K3DSparkForCausalLM(K3DSparkForCausalLMBase):
    model_cls = K3DSparkModel
