# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the ROCm K3 DSpark MLA drafter (``kimi_k3/amd/dspark_mla.py``).

The CPU tests build the real drafter (real ``KimiK3MultiHeadLatentAttentionWrapper``,
linear layers, RMSNorm and ``get_rope``) with the wrapper's inner
``MLAAttention`` replaced by a recorder, which shows exactly what the attention
receives, and vLLM's compiled ops replaced by plain-torch references with
the kernels' semantics. The emulated-ROCm tests make vLLM's real
``RocmPlatform`` the current platform in a fresh interpreter, so nothing leaks
into other tests. The ROCm-only tests are in
``tests/models/kimi_k3/test_amd_dspark_mla.py``.
"""

import math
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import vllm._custom_ops as custom_ops
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers import mla as generic_mla
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.rotary_embedding import (
    DeepseekScalingRotaryEmbedding,
    RotaryEmbedding,
    get_rope,
)
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead
from vllm.models.kimi_k3.amd import dspark_mla as amd_dspark_mla
from vllm.models.kimi_k3.amd import mla as amd_mla
from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper
from vllm.models.kimi_k3.common import dspark_mla as common_dspark_mla
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.worker.workspace import WorkspaceManager

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_dist() -> None:
    """A single-rank gloo TP group for the parallel linear layers."""
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


@pytest.fixture
def dist_env():
    _init_dist()
    yield
    cleanup_dist_env_and_memory()


def _k3_config(**overrides) -> K3DSparkConfig:
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        hidden_act="silu",
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        target_hidden_size=32,
        target_layer_ids=[1, 3],
        num_target_layers=2,
        markov_rank=4,
    )
    kwargs.update(overrides)
    return K3DSparkConfig(**kwargs)


class RecordingMLAAttention(nn.Module, AttentionLayerBase):
    """Stands in for the generic ``MLAAttention`` (which needs a GPU backend):
    records its constructor arguments and what each forward receives, and owns
    a small KV cache with the attributes the drafter reads."""

    def __init__(self, *, prefix: str, cache_config=None, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.num_heads = kwargs["num_heads"]
        self.layer_name = prefix
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config else "auto"
        # What MLAAttention.get_kv_cache_spec reads. The drafter runs the
        # backend of its speculative config, TRITON_MLA.
        self.head_size = kwargs["kv_lora_rank"] + kwargs["qk_rope_head_dim"]
        self.indexer = kwargs["indexer"]
        self.sliding_window = None
        self.topk_buffer_width = None
        self.attn_backend = TritonMLABackend
        # As MLAAttention: kv_b_proj's weight is read directly, not run as GEMM.
        kwargs["kv_b_proj"]._cpu_skip_gemm_dispatch = True
        self.non_causal_multi_token_decode = kwargs["non_causal_multi_token_decode"]
        width = kwargs["kv_lora_rank"] + kwargs["qk_rope_head_dim"]
        self.kv_cache = torch.zeros(4, 2, width)
        self._k_scale = torch.tensor([1.0])
        self.updates: list[tuple] = []
        self.impl = SimpleNamespace(
            dcp_world_size=1,
            do_kv_cache_update=lambda *args: self.updates.append(args),
        )
        # What the ROCm wrapper's fused-decode predicate reads.
        self.use_pcp = False
        self.hisparse_cache = None
        self.q_pad_num_heads = None
        self.is_aiter_triton_fp4_bmm_enabled = False
        self.is_aiter_triton_fp8_bmm_enabled = False
        self.W_UK_T = torch.zeros(1)
        self.calls: list[dict] = []
        self.log: list[str] | None = None

    def forward(self, q, kv_c_normed, k_pe, output_shape, q_dcp_replicated=None):
        self.calls.append(dict(q=q, kv_c_normed=kv_c_normed, k_pe=k_pe))
        return q.new_zeros(output_shape)

    def process_weights_after_loading(self, act_dtype):
        if self.log is not None:
            self.log.append(f"attention {self.layer_name}")

    def get_attn_backend(self):
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config):
        return None


def _vllm_config(config, cache_dtype="auto"):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=config, quantization=None)
        ),
        model_config=SimpleNamespace(
            get_total_num_hidden_layers=lambda: TARGET_LAYERS,
            # A per-PP-rank count must not be used for the layer offset.
            get_num_layers=lambda parallel_config: 7,
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8),
        cache_config=CacheConfig(cache_dtype=cache_dtype),
        load_config=None,
    )


def _reference_rotary_embedding(
    positions, query, key, head_size, cos_sin_cache, is_neox
):
    """``_C.rotary_embedding`` (csrc/pos_encoding_kernels.cu) in plain torch:
    in place on strided views, table read as fp32, fp32 math, one rounding."""
    assert not is_neox  # interleaved (GPT-J) pairs, as the K3 MLA RoPE
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache.float()[positions].unsqueeze(1).chunk(2, dim=-1)
    for x in (query, key):
        heads = x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))
        even = heads[..., 0:rot_dim:2].float()
        odd = heads[..., 1:rot_dim:2].float()
        heads[..., 0:rot_dim:2] = (even * cos - odd * sin).to(x.dtype)
        heads[..., 1:rot_dim:2] = (odd * cos + even * sin).to(x.dtype)


class RecordingRope:
    """Records each ``ops.rotary_embedding`` launch (its inputs before the
    in-place update) and applies the reference."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, positions, query, key, head_size, cos_sin_cache, is_neox):
        self.calls.append(
            dict(
                positions=positions,
                query=query.clone(),
                key=key.clone(),
                head_size=head_size,
                cos_sin_cache=cos_sin_cache,
                is_neox=is_neox,
            )
        )
        _reference_rotary_embedding(
            positions, query, key, head_size, cos_sin_cache, is_neox
        )


@pytest.fixture
def rope_launches(monkeypatch) -> RecordingRope:
    # vLLM's compiled ops are not built for CPU.
    recorder = RecordingRope()
    monkeypatch.setattr(custom_ops, "rotary_embedding", recorder)
    return recorder


def _cpu_context_kv_runtime(monkeypatch, ops) -> None:
    """Run the context-KV precompute on CPU: recorded custom ops, a CPU
    workspace, and no graph capture."""
    monkeypatch.setattr(common_dspark_mla, "ops", ops)
    workspace = WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(
        common_dspark_mla, "current_workspace_manager", lambda: workspace
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def build_draft(dist_env, rope_launches, monkeypatch):
    """Build the ROCm drafter on CPU with a recording inner attention."""
    monkeypatch.setattr(generic_mla, "MLAAttention", RecordingMLAAttention)
    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)

    def build(config, cache_dtype="auto", dtype=torch.bfloat16):
        vllm_config = VllmConfig(device_config=DeviceConfig("cpu"))
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with set_current_vllm_config(vllm_config):
                draft = amd_dspark_mla.K3DSparkForCausalLM(
                    vllm_config=_vllm_config(config, cache_dtype)
                )
        finally:
            torch.set_default_dtype(old_dtype)
        # Parameters start as torch.empty; uninitialised memory can hold NaN,
        # so give every test the same finite weights.
        generator = torch.Generator().manual_seed(0)
        for param in draft.parameters():
            if param.is_floating_point():
                param.data.normal_(std=0.02, generator=generator)
        # On the CPU platform an unquantized linear runs the GEMM picked when
        # its weights are post-processed, which most of these tests skip.
        for module in draft.modules():
            if isinstance(module, LinearBase):
                module.cpu_linear = torch.nn.functional.linear
        return draft

    return build


@pytest.mark.cpu_test
def test_k3_dspark_rocm_k_pe_keeps_dtype_with_yarn(build_draft):
    """The YaRN draft RoPE has an fp32 table; k_pe must still reach
    MLAAttention (and so concat_and_cache_mla) in the activation dtype."""
    torch.manual_seed(0)
    draft = build_draft(_k3_config(rope_parameters=dict(YARN)))
    attn = draft.model.layers[0].self_attn
    assert attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    for p in attn.parameters():
        p.data.normal_()

    hidden_states = torch.randn(3, 32, dtype=torch.bfloat16)
    out = attn(positions=torch.tensor([0, 5000, 100000]), hidden_states=hidden_states)

    (call,) = attn.mla_attn.calls
    assert call["kv_c_normed"].dtype == torch.bfloat16
    assert call["k_pe"].dtype == call["kv_c_normed"].dtype
    assert call["q"].dtype == torch.bfloat16
    assert call["k_pe"].shape == (3, 1, 8)
    assert out.dtype == torch.bfloat16


ROPE_CASES = [
    ({"rope_type": "default", "rope_theta": 50000.0}, "default", 1.0),
    (dict(YARN, attention_factor=1.0), "deepseek_llama_scaling", 1.0),
    (YARN, "deepseek_yarn", (0.1 * math.log(32.0) + 1.0) ** 2),
]
ROPE_IDS = ["default", "llama_scaling", "yarn"]


def _nvidia_rope(config, rope_type):
    """The rotary embedding the NVIDIA drafter builds for this config."""
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        return get_rope(
            config.qk_rope_head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters, rope_type=rope_type),
            is_neox_style=False,
            dtype=torch.float32,
        )


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("rope_parameters", "rope_type", "scale_multiplier"), ROPE_CASES, ids=ROPE_IDS
)
def test_k3_dspark_rocm_rope_and_softmax_scale_match_nvidia(
    rope_parameters, rope_type, scale_multiplier, build_draft
):
    """Same RoPE and softmax scale as the NVIDIA drafter: a non-default
    rope_type becomes deepseek_llama_scaling when attention_factor == 1.0,
    else deepseek_yarn; only YaRN scales the softmax by mscale**2."""
    config = _k3_config(rope_parameters=dict(rope_parameters))
    expected_rope = _nvidia_rope(config, rope_type)
    draft = build_draft(config)
    for layer in draft.model.layers:
        attn = layer.self_attn
        assert attn.rotary_emb.is_neox_style is False
        assert attn.rotary_emb.cos_sin_cache.dtype == torch.float32
        assert torch.equal(attn.rotary_emb.cos_sin_cache, expected_rope.cos_sin_cache)
        # NVIDIA: qk_head_dim**-0.5, times mscale**2 for YaRN only.
        assert attn.mla_attn.kwargs["scale"] == pytest.approx(
            16**-0.5 * scale_multiplier
        )


class _ContextKVOps:
    """Records the context-KV custom ops, which do not run on CPU."""

    def __init__(self):
        self.rope_tables: list[torch.Tensor] = []
        self.grouped: list[tuple] = []

    def rms_norm(self, out, x, weight, eps):
        out.copy_(x)

    def rotary_embedding(self, positions, query, key, head_size, table, is_neox):
        self.rope_tables.append(table)

    def concat_and_cache_mla_grouped(self, *args):
        self.grouped.append(args)


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("rope_parameters", "rope_type", "scale_multiplier"), ROPE_CASES, ids=ROPE_IDS
)
def test_k3_dspark_rocm_rope_table_stays_fp32(
    rope_parameters, rope_type, scale_multiplier, build_draft, monkeypatch
):
    """The draft forward and the context-KV precompute read the fp32 cos/sin
    table NVIDIA uses, before and after any number of forwards. (A rope
    module re-binds its table to the activation dtype on its first forward.)"""
    config = _k3_config(rope_parameters=dict(rope_parameters))
    expected = _nvidia_rope(config, rope_type).cos_sin_cache
    draft = build_draft(config)
    ops = _ContextKVOps()
    _cpu_context_kv_runtime(monkeypatch, ops)

    def precompute():
        draft.precompute_and_store_context_kv(
            torch.randn(3, 32, dtype=torch.bfloat16), torch.tensor([0, 1, 2]), None
        )
        return ops.rope_tables.pop()

    before = precompute()
    for step in range(3):
        hidden_states = torch.randn(2, 32, dtype=torch.bfloat16)
        draft(
            input_ids=None,
            positions=torch.tensor([step, 7]),
            inputs_embeds=hidden_states,
        )
    after = precompute()

    for table in (before, after):
        assert table.dtype == torch.float32
        assert torch.equal(table, expected)
    for layer in draft.model.layers:
        assert layer.self_attn.rotary_emb.cos_sin_cache is before


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "rope_parameters", [ROPE_CASES[0][0], YARN], ids=["default", "yarn"]
)
def test_k3_dspark_rocm_rope_is_one_launch_with_fp32_math(
    rope_parameters, build_draft, rope_launches
):
    """One in-place ``rotary_embedding`` launch per layer forward, and the
    q/k_pe that MLAAttention receives equal the fp32 rotation of the
    projections rounded once to bf16 (``forward_static`` of the rope class
    on fp32 inputs)."""
    config = _k3_config(rope_parameters=dict(rope_parameters))
    draft = build_draft(config)
    attn = draft.model.layers[0].self_attn
    positions = torch.tensor([0, 5000, 100000])

    attn(positions=positions, hidden_states=torch.randn(3, 32, dtype=torch.bfloat16))

    (launch,) = rope_launches.calls
    assert launch["positions"] is positions
    assert launch["cos_sin_cache"] is attn.rotary_emb.cos_sin_cache
    assert (launch["head_size"], launch["is_neox"]) == (8, False)
    rope_cls = (
        RotaryEmbedding
        if rope_parameters["rope_type"] == "default"
        else DeepseekScalingRotaryEmbedding
    )
    want_q, want_k = rope_cls.forward_static(
        positions,
        launch["query"].float(),
        launch["key"].float(),
        8,
        8,
        attn.rotary_emb.cos_sin_cache,
        False,
    )
    (call,) = attn.mla_attn.calls
    assert torch.equal(call["q"][..., 8:], want_q.view(3, 4, 8).bfloat16())
    assert torch.equal(call["k_pe"], want_k.view(3, 1, 8).bfloat16())


@pytest.mark.cpu_test
def test_k3_dspark_rocm_wrapper_takes_per_rank_heads(build_draft, monkeypatch):
    monkeypatch.setattr(
        amd_dspark_mla, "get_tensor_model_parallel_world_size", lambda: 2
    )
    draft = build_draft(_k3_config())
    attn = draft.model.layers[0].self_attn

    assert isinstance(attn, KimiK3MultiHeadLatentAttentionWrapper)
    assert attn.num_heads == 2
    assert attn.mla_attn.num_heads == 2
    assert attn.mla_attn.kwargs["non_causal_multi_token_decode"] is True
    assert attn.mla_attn.kwargs["kv_b_proj"] is attn.kv_b_proj
    # The projections shard the global head count over TP themselves.
    assert attn.q_b_proj.output_size == 4 * 16
    assert attn.kv_b_proj.output_size == 4 * (8 + 8)
    assert attn.o_proj.input_size == 4 * 8
    assert attn.o_proj.reduce_results is False


@pytest.mark.cpu_test
def test_k3_dspark_rocm_kv_cache_layer_names(build_draft):
    draft = build_draft(_k3_config())
    names = draft.get_draft_kv_cache_layer_names()

    assert names == [
        f"model.layers.{TARGET_LAYERS + i}.self_attn.attn" for i in range(2)
    ]
    for name, layer in zip(names, draft.model.layers):
        assert draft.model.kv_cache_layer(layer.self_attn) is layer.self_attn.mla_attn
        assert layer.self_attn.mla_attn.layer_name == name
        assert layer.self_attn.prefix == name.removesuffix(".attn")
    # Same parameter names as the NVIDIA drafter's MLA module.
    assert {n for n, _ in draft.model.layers[0].self_attn.named_parameters()} == {
        "fused_qkv_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }


@pytest.mark.cpu_test
@pytest.mark.parametrize("enable", [True, False])
def test_k3_dspark_rocm_confidence_head(enable, build_draft):
    draft = build_draft(_k3_config(enable_confidence_head=enable))
    mapped = draft.hf_to_vllm_mapper._map_name("confidence_head.proj.weight")
    if enable:
        assert isinstance(draft.model.confidence_head, DSparkConfidenceHead)
        assert mapped == "model.confidence_head.proj.weight"
        hidden = torch.randn(3, 32, dtype=torch.bfloat16)
        markov = torch.randn(3, 4, dtype=torch.bfloat16)
        confidence = draft.compute_confidence(hidden, markov)
        assert confidence.shape[0] == 3
        assert ((confidence >= 0) & (confidence <= 1)).all()
    else:
        assert draft.model.confidence_head is None
        assert mapped is None


@pytest.mark.cpu_test
def test_k3_dspark_rocm_never_takes_identity_rope_fused_decode(
    build_draft, monkeypatch
):
    """The ROCm wrapper's fused decode applies an identity RoPE (it was written
    for the NoPE target). Its predicate reads the global AITER MLA switch, not
    the layer's own backend: with AITER MLA on for the target, production
    shapes and an fp8 KV cache, a draft layer running TRITON_MLA qualifies.
    Only the layer's rotary embedding rules it out, so decode still goes
    through MLAAttention with RoPE applied."""
    monkeypatch.setattr(amd_mla.rocm_aiter_ops, "is_mla_enabled", lambda: True)
    config = _k3_config(kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=32)
    draft = build_draft(config, cache_dtype="fp8")
    attn = draft.model.layers[0].self_attn
    assert attn.mla_attn.attn_backend.get_name() == "TRITON_MLA"

    fused_calls = []

    def fused_decode(self, q, kv_c_normed, k_pe, positions, output_shape, *args):
        fused_calls.append(tuple(k_pe.shape))
        return q.new_zeros(output_shape)

    monkeypatch.setattr(
        KimiK3MultiHeadLatentAttentionWrapper, "_fused_decode", fused_decode
    )
    decode_only = SimpleNamespace(num_actual_tokens=2, num_decode_tokens=2)
    monkeypatch.setattr(
        amd_mla,
        "get_attention_context",
        lambda name: (decode_only, attn.mla_attn, torch.ones(1), torch.zeros(2)),
    )
    hidden_states = torch.randn(2, 32, dtype=torch.bfloat16)
    attn(positions=torch.tensor([3, 4]), hidden_states=hidden_states)

    assert fused_calls == []
    assert len(attn.mla_attn.calls) == 1
    assert not attn._fused_qk_prep
    # Every other condition of the shortcut holds for this Triton layer: only
    # its RoPE rules it out.
    attn.rotary_emb = None
    assert attn._fused_qk_prep_supported()


@pytest.mark.cpu_test
def test_k3_dspark_rocm_kv_cache_spec_groups_with_target_mla(build_draft):
    """The draft's MLAAttention layers share one KV-cache group with the K3
    ROCm target's MLA layers (AITER MLA), as the engine needs."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size

    config = _k3_config(kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=32)
    draft = build_draft(config, cache_dtype="fp8")
    vllm_config = SimpleNamespace(
        model_config=None, cache_config=SimpleNamespace(block_size=64)
    )
    target_attn = SimpleNamespace(
        topk_buffer_width=None,
        kv_cache_dtype="fp8",
        head_size=576,
        sliding_window=None,
        indexer=None,
        non_causal_multi_token_decode=False,
        attn_backend=SimpleNamespace(get_name=lambda: "ROCM_AITER_MLA"),
    )
    target_spec = MLAAttention.get_kv_cache_spec(target_attn, vllm_config)
    kv_cache_spec = {
        f"model.layers.{i}.self_attn.attn": target_spec for i in range(TARGET_LAYERS)
    }
    for layer in draft.model.layers:
        mla_attn = draft.model.kv_cache_layer(layer.self_attn)
        kv_cache_spec[mla_attn.layer_name] = MLAAttention.get_kv_cache_spec(
            mla_attn, vllm_config
        )
    assert set(draft.get_draft_kv_cache_layer_names()) <= set(kv_cache_spec)

    groups = _get_kv_cache_groups_uniform_page_size(kv_cache_spec)
    assert len(groups) == 1
    assert sorted(groups[0].layer_names) == sorted(kv_cache_spec)


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("cache_dtype", "grouped", "scaled"),
    [
        ("auto", True, False),
        ("bfloat16", True, False),
        ("fp8", True, True),
        ("fp8_e4m3", True, True),
        # 0.33.0's grouped kernel rejects fp8_e5m2 on ROCm: per-layer fallback.
        ("fp8_e5m2", False, False),
    ],
)
def test_k3_dspark_rocm_grouped_context_kv_insert(
    cache_dtype, grouped, scaled, build_draft, monkeypatch
):
    draft = build_draft(_k3_config(), cache_dtype=cache_dtype, dtype=torch.float32)
    ops = _ContextKVOps()
    _cpu_context_kv_runtime(monkeypatch, ops)
    owners = [layer.self_attn.mla_attn for layer in draft.model.layers]
    for i, owner in enumerate(owners):
        owner._k_scale = torch.tensor([0.5 + i])

    # No process_weights_after_loading: the metadata is built lazily.
    slots = torch.tensor([0, 1, 2])
    draft.precompute_and_store_context_kv(
        torch.randn(3, 32), torch.tensor([0, 1, 2]), slots
    )

    if scaled:
        assert torch.equal(draft.model._context_kv_scales, torch.tensor([0.5, 1.5]))
    else:
        assert draft.model._context_kv_scales is None
    if grouped:
        (call,) = ops.grouped
        assert call[2].tolist() == [o.kv_cache.data_ptr() for o in owners]
        assert call[-2] is draft.model._context_kv_scales
        assert call[-1] == cache_dtype
        assert all(owner.updates == [] for owner in owners)
    else:
        assert ops.grouped == []
        for owner in owners:
            (update,) = owner.updates
            assert update[2] is owner.kv_cache
            assert update[3] is slots
            assert update[4] == cache_dtype
            assert update[5] is owner._k_scale


@pytest.mark.cpu_test
def test_k3_dspark_rocm_context_metadata_after_attention_post_processing(
    build_draft, monkeypatch
):
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    draft = build_draft(_k3_config(), dtype=torch.float32)
    log: list[str] = []
    for layer in draft.model.layers:
        layer.self_attn.mla_attn.log = log
    build_metadata = (
        common_dspark_mla.K3DSparkModelBase._build_fused_context_kv_metadata
    )

    def logged_build(self):
        log.append("context metadata")
        build_metadata(self)

    monkeypatch.setattr(
        amd_dspark_mla.K3DSparkModel, "_build_fused_context_kv_metadata", logged_build
    )
    process_weights_after_loading(
        draft,
        SimpleNamespace(
            dtype=torch.float32,
            quantization=None,
            word_embeddings_untied_by_checkpoint=False,
        ),
        torch.device("cpu"),
    )

    assert log == [
        f"attention model.layers.{TARGET_LAYERS + i}.self_attn.attn" for i in range(2)
    ] + ["context metadata"]
    assert draft.model._num_context_layers == 2


# Runs in a fresh interpreter before anything imports vllm.platforms: the real
# RocmPlatform becomes the current platform on a machine without an AMD GPU,
# with aiter unavailable even where it is installed.
_EMULATED_ROCM_PRELUDE = """
import sys
from types import SimpleNamespace

import torch

sys.modules["aiter"] = None  # import aiter -> ImportError, find_spec -> None
torch.cuda.get_device_properties = lambda *args, **kwargs: SimpleNamespace(
    gcnArchName="gfx942",
    name="AMD Instinct MI300X",
    major=9,
    minor=4,
    multi_processor_count=304,
    total_memory=192 << 30,
)
import vllm.platforms
from vllm.platforms.rocm import RocmPlatform

vllm.platforms.current_platform = RocmPlatform()

# Under ROCm, SiluAndMul binds vLLM's compiled op at construction.
if not hasattr(torch.ops._C, "silu_and_mul"):
    _lib = torch.library.Library("_C", "FRAGMENT")
    _lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")

    def _silu_and_mul(out, x):
        d = x.shape[-1] // 2
        out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    _lib.impl("silu_and_mul", _silu_and_mul, "CPU")
"""


def _run_emulated_rocm(code: str) -> None:
    # Appended, so that vllm itself still comes from where pytest imports it.
    repo_root = Path(__file__).resolve().parents[2]
    script = (
        f"import sys\nsys.path.append({str(repo_root)!r})\n"
        + _EMULATED_ROCM_PRELUDE
        + textwrap.dedent(code)
        + "\nprint('DONE')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "DONE" in result.stdout, result.stderr[-5000:]


@pytest.mark.cpu_test
def test_k3_dspark_rocm_builds_under_emulated_rocm_without_aiter():
    """On (emulated) ROCm, without aiter, the module imports and the drafter
    builds on the ROCm layers; only the inner MLAAttention is a recorder."""
    _run_emulated_rocm(
        """
        from vllm.platforms import current_platform
        from tests.models import test_dspark_mla_rocm as t
        from vllm.model_executor.layers import mla as generic_mla
        from vllm.models.kimi_k3.amd import dspark_mla as amd_dspark_mla
        from vllm.models.kimi_k3.amd.linear import KimiMLP
        from vllm.models.kimi_k3.common import dspark_mla as common_dspark_mla

        assert current_platform.is_rocm()
        generic_mla.MLAAttention = t.RecordingMLAAttention
        common_dspark_mla.get_draft_quant_config = lambda _: None
        t._init_dist()
        config = t._k3_config(rope_parameters=dict(t.YARN))
        vllm_config = t.VllmConfig(device_config=t.DeviceConfig("cpu"))
        torch.set_default_dtype(torch.bfloat16)
        with t.set_current_vllm_config(vllm_config):
            draft = amd_dspark_mla.K3DSparkForCausalLM(
                vllm_config=t._vllm_config(config)
            )
        for layer in draft.model.layers:
            assert type(layer.mlp) is KimiMLP
            assert layer.mlp.act_fn.op is torch.ops._C.silu_and_mul
            assert not layer.self_attn._fused_qk_prep
        assert draft.get_draft_kv_cache_layer_names() == [
            "model.layers.61.self_attn.attn",
            "model.layers.62.self_attn.attn",
        ]
        assert sys.modules["aiter"] is None
        """
    )


@pytest.mark.cpu_test
def test_k3_dspark_registry_resolves_rocm_drafter_under_emulated_rocm():
    _run_emulated_rocm(
        """
        import vllm.models.kimi_k3 as kimi_k3
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.models.kimi_k3.amd.dspark_mla import K3DSparkForCausalLM

        assert kimi_k3.K3DSparkForCausalLM is K3DSparkForCausalLM
        resolved = ModelRegistry._try_load_model_cls("K3DSparkModel")
        assert resolved is K3DSparkForCausalLM, resolved
        assert sys.modules["aiter"] is None
        """
    )
