# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepseekScalingRotaryEmbedding returns query/key in their input dtypes.

The RoPE is built with the real ``get_rope`` the way the Kimi-K3 DSpark
drafter builds it (``vllm/models/kimi_k3/common/mla_rope.py``): DeepSeek YaRN
scaling, interleaved (GPT-J style) rotation and an fp32 cos/sin table, then
fed bf16 activations. Everything runs on CPU tensors.
"""

import pytest
import torch

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    get_rope,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

ORIGINAL_MAX_POSITION = 4096
YARN_FACTOR = 32.0
MAX_POSITION = int(ORIGINAL_MAX_POSITION * YARN_FACTOR)
# A DeepSeek-V3 / Kimi style YaRN config, already remapped to the DeepSeek
# rope type the way the MLA layers do it (no ``attention_factor``).
DEEPSEEK_YARN = {
    "rope_type": "deepseek_yarn",
    "rope_theta": 50000.0,
    "factor": YARN_FACTOR,
    "original_max_position_embeddings": ORIGINAL_MAX_POSITION,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
NUM_TOKENS = 9
NUM_Q_HEADS = 4
# (head_size, rotary_dim): the MLA rope head alone (the drafter's k_pe/q_pe),
# and a head with a pass-through part.
HEAD_AND_ROTARY_DIMS = [(64, 64), (128, 64)]
# Every pure-torch entry point of the class; with an fp32 table FlashInfer is
# never selected, so forward_cuda falls back to forward_native as well.
FORWARD_METHODS = [
    "forward",
    "forward_native",
    "forward_hip",
    "forward_cpu",
    "forward_cuda",
]


@pytest.fixture(autouse=True)
def cpu_vllm_config():
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        yield


def _drafter_rope(head_size: int, rotary_dim: int) -> DeepseekScalingRotaryEmbedding:
    rope = get_rope(
        head_size,
        max_position=MAX_POSITION,
        is_neox_style=False,
        rope_parameters={
            **DEEPSEEK_YARN,
            "partial_rotary_factor": rotary_dim / head_size,
        },
        dtype=torch.float32,
    )
    assert isinstance(rope, DeepseekScalingRotaryEmbedding)
    assert rope.rotary_dim == rotary_dim
    assert rope.cos_sin_cache.dtype == torch.float32
    assert not rope.use_flashinfer
    return rope


def _inputs(head_size: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 17, 4095, 4096, 65537, 131070, 131071])
    assert positions.numel() == NUM_TOKENS
    # The MLA layers rotate q_pe [T, H, rope] and k_pe [T, 1, rope].
    query = torch.randn(NUM_TOKENS, NUM_Q_HEADS, head_size, generator=generator)
    key = torch.randn(NUM_TOKENS, 1, head_size, generator=generator)
    return positions, query.to(dtype), key.to(dtype)


def _reference_fp32(
    rope: DeepseekScalingRotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """Interleaved RoPE on the first rotary_dim channels, in fp32."""
    rotary_dim = rope.rotary_dim
    cos, sin = rope.cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    x = x.float()
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    even, odd = x_rot[..., ::2], x_rot[..., 1::2]
    rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


@pytest.mark.parametrize("method", FORWARD_METHODS)
@pytest.mark.parametrize("head_size,rotary_dim", HEAD_AND_ROTARY_DIMS)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"]
)
@torch.inference_mode()
def test_fp32_table_keeps_half_input_dtype(
    method: str, head_size: int, rotary_dim: int, dtype: torch.dtype
):
    rope = _drafter_rope(head_size, rotary_dim)
    positions, query, key = _inputs(head_size, dtype)

    out_query, out_key = getattr(rope, method)(positions, query.clone(), key.clone())

    assert out_query.dtype == dtype
    assert out_key is not None and out_key.dtype == dtype
    # The rotation is done in fp32 and rounded to the input dtype exactly once.
    assert torch.equal(out_query, _reference_fp32(rope, positions, query).to(dtype))
    assert torch.equal(out_key, _reference_fp32(rope, positions, key).to(dtype))
