# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepseekScalingRotaryEmbedding returns query/key in their input dtypes.

The RoPE is built with the real ``get_rope`` the way the Kimi-K3 DSpark
drafter builds it (``vllm/models/kimi_k3/nvidia/mla.py``): DeepSeek YaRN
scaling, interleaved (GPT-J style) rotation and an fp32 cos/sin table, then
fed bf16 activations. Everything runs on CPU tensors.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    get_rope,
)
from vllm.model_executor.layers.rotary_embedding import (
    deepseek_scaling_rope as deepseek_scaling_rope_module,
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


@pytest.mark.parametrize("method", FORWARD_METHODS)
@pytest.mark.parametrize("head_size,rotary_dim", HEAD_AND_ROTARY_DIMS)
@torch.inference_mode()
def test_fp32_input_unchanged(method: str, head_size: int, rotary_dim: int):
    rope = _drafter_rope(head_size, rotary_dim)
    positions, query, key = _inputs(head_size, torch.float32)

    out_query, out_key = getattr(rope, method)(positions, query.clone(), key.clone())

    assert out_query.dtype == torch.float32
    assert out_key is not None and out_key.dtype == torch.float32
    assert torch.equal(out_query, _reference_fp32(rope, positions, query))
    assert torch.equal(out_key, _reference_fp32(rope, positions, key))


def test_matching_dtype_trace_has_no_cast():
    """A cache already in the input dtype traces exactly as before the fix.

    The MLA RoPE + KV-cache fusion pass matches a trace of forward_static with
    a cache in the activation dtype; the cast back must not appear there.
    """

    def rope_fn(positions, query, key, cos_sin_cache):
        return DeepseekScalingRotaryEmbedding.forward_static(
            positions, query, key, 64, 64, cos_sin_cache, False
        )

    positions, query, key = _inputs(64, torch.bfloat16)
    cos_sin_cache = torch.randn(MAX_POSITION, 64, dtype=torch.bfloat16)
    graph = make_fx(rope_fn)(positions, query, key, cos_sin_cache).graph
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.mul.Tensor in targets
    assert torch.ops.aten._to_copy.default not in targets


@torch.inference_mode()
def test_cuda_flashinfer_path_untouched(monkeypatch: pytest.MonkeyPatch):
    """FlashInfer cannot run here; check what selects it and what it is given.

    With FlashInfer available on CUDA and a half-precision rope, the cache stays
    fp32 and forward_cuda hands query/key to the in-place FlashInfer op,
    returning the very same tensors without going through forward_static.
    """
    monkeypatch.setattr(
        deepseek_scaling_rope_module,
        "current_platform",
        SimpleNamespace(is_cuda=lambda: True),
    )
    monkeypatch.setattr(deepseek_scaling_rope_module, "has_flashinfer", lambda: True)
    monkeypatch.setattr(
        DeepseekScalingRotaryEmbedding, "enabled", classmethod(lambda cls: True)
    )
    calls = []
    monkeypatch.setattr(
        torch.ops.vllm,
        "flashinfer_rotary_embedding",
        lambda *args: calls.append(args),
    )

    def _no_forward_static(*args, **kwargs):
        raise AssertionError("FlashInfer path must not call forward_static")

    monkeypatch.setattr(
        DeepseekScalingRotaryEmbedding, "forward_static", _no_forward_static
    )

    rope = DeepseekScalingRotaryEmbedding(
        64,
        64,
        ORIGINAL_MAX_POSITION,
        DEEPSEEK_YARN["rope_theta"],
        False,
        YARN_FACTOR,
        torch.bfloat16,
        beta_fast=DEEPSEEK_YARN["beta_fast"],
        beta_slow=DEEPSEEK_YARN["beta_slow"],
        mscale=DEEPSEEK_YARN["mscale"],
        mscale_all_dim=DEEPSEEK_YARN["mscale_all_dim"],
    )
    assert rope.use_flashinfer
    assert rope.cos_sin_cache.dtype == torch.float32

    positions, query, key = _inputs(64, torch.bfloat16)
    out_query, out_key = rope.forward_cuda(positions, query, key)

    assert out_query is query and out_key is key
    assert len(calls) == 1
    op_positions, op_query, op_key, op_head_size, op_cache, op_is_neox = calls[0]
    assert torch.equal(op_positions, positions)
    assert op_query is query and op_key is key
    assert op_head_size == 64 and op_is_neox is False
    assert op_cache is rope.cos_sin_cache
