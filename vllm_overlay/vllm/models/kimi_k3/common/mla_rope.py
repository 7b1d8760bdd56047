# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RoPE of the Kimi-K3 MLA layers that apply one (the DSpark draft layers).

Shared by every platform's MLA implementation so that the checkpoint's
``rope_parameters`` map to the same rotary embedding and softmax scale.
"""

import math
from typing import Any

import torch

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope


def get_k3_mla_rope(
    config: Any, qk_rope_head_dim: int
) -> tuple[RotaryEmbedding, float]:
    """Return the layer's rotary embedding and its softmax-scale multiplier.

    A non-default ``rope_type`` becomes ``deepseek_llama_scaling`` when the
    checkpoint sets ``attention_factor == 1.0`` and ``deepseek_yarn``
    otherwise. Only YaRN scales the softmax, by ``mscale**2``. The embedding
    is interleaved (not NeoX) with an fp32 cos/sin table.
    """
    rope_parameters = dict(config.rope_parameters)
    if rope_parameters["rope_type"] != "default":
        rope_parameters["rope_type"] = (
            "deepseek_llama_scaling"
            if rope_parameters.get("attention_factor") == 1.0
            else "deepseek_yarn"
        )
    rotary_emb = get_rope(
        qk_rope_head_dim,
        max_position=config.max_position_embeddings,
        rope_parameters=rope_parameters,
        is_neox_style=False,
        dtype=torch.float32,
    )
    scale_multiplier = 1.0
    if rope_parameters["rope_type"] == "deepseek_yarn":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", False)
        scaling_factor = rope_parameters["factor"]
        mscale = (
            1.0
            if scaling_factor <= 1
            else 0.1 * float(mscale_all_dim) * math.log(scaling_factor) + 1.0
        )
        scale_multiplier = mscale * mscale
    return rotary_emb, scale_multiplier
