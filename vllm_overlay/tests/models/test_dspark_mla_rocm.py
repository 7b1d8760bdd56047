# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the ROCm K3 DSpark MLA drafter (``kimi_k3/amd/dspark_mla.py``).

They build the real drafter (the ROCm ``KimiK3MultiHeadLatentAttentionWrapper``,
linear layers, RMSNorm and ``get_rope``) with the wrapper's inner
``MLAAttention`` replaced by a recorder, which shows what the attention
receives, and record the custom ops, which are not built for CPU. The ROCm
kernels themselves are checked in ``tests/models/kimi_k3/test_amd_dspark_mla.py``.
"""

import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers import mla as generic_mla
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models import registry
from vllm.models.kimi_k3.amd import dspark_mla as amd_dspark_mla
from vllm.models.kimi_k3.amd import mla as amd_mla
from vllm.models.kimi_k3.amd.linear import KimiMLP
from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper
from vllm.models.kimi_k3.common import dspark_mla as common_dspark_mla
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
from vllm.v1.worker.workspace import WorkspaceManager

from ..utils import create_new_process_for_each_test

# The module's tests share one TP group (tp_group), which the per-test global
# cleanup would tear down.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

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
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 50000.0}


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory):
    """A single-rank gloo TP group for the parallel linear layers."""
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
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
        self.kv_cache = torch.zeros(4, 2, self.head_size)
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

    def forward(self, q, kv_c_normed, k_pe, output_shape, q_dcp_replicated=None):
        self.calls.append(dict(q=q, kv_c_normed=kv_c_normed, k_pe=k_pe))
        return q.new_zeros(output_shape)

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


class RecordingOps:
    """Records the custom ops the drafter launches. ``rotary_embedding``
    negates query and key in place, so that a test can tell whether the
    attention receives what the launch wrote."""

    def __init__(self):
        self.rope_launches: list[dict] = []
        self.grouped: list[tuple] = []

    def rotary_embedding(self, positions, query, key, head_size, table, is_neox):
        self.rope_launches.append(
            dict(
                positions=positions,
                query=query.clone(),
                key=None if key is None else key.clone(),
                head_size=head_size,
                cos_sin_cache=table,
                is_neox=is_neox,
            )
        )
        query.neg_()
        if key is not None:
            key.neg_()

    def rms_norm(self, out, x, weight, eps):
        out.copy_(x)

    def concat_and_cache_mla_grouped(self, *args):
        self.grouped.append(args)


@pytest.fixture
def ops(monkeypatch) -> RecordingOps:
    """The drafter's custom ops, a CPU workspace and no graph capture."""
    recorder = RecordingOps()
    monkeypatch.setattr(amd_dspark_mla, "ops", recorder)
    monkeypatch.setattr(common_dspark_mla, "ops", recorder)
    workspace = WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(
        common_dspark_mla, "current_workspace_manager", lambda: workspace
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return recorder


@pytest.fixture
def build_draft(tp_group, monkeypatch):
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
        # its weights are post-processed, which these tests skip.
        for module in draft.modules():
            if isinstance(module, LinearBase):
                module.cpu_linear = torch.nn.functional.linear
        return draft

    return build


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


@pytest.mark.parametrize(
    ("rope_parameters", "rope_type", "scale_multiplier"),
    [
        (DEFAULT_ROPE, "default", 1.0),
        (dict(YARN, attention_factor=1.0), "deepseek_llama_scaling", 1.0),
        (YARN, "deepseek_yarn", (0.1 * math.log(32.0) + 1.0) ** 2),
    ],
    ids=["default", "llama_scaling", "yarn"],
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


def test_k3_dspark_rocm_rope_table_stays_fp32(build_draft, ops):
    """The draft forward and the context-KV precompute read the fp32 cos/sin
    table NVIDIA uses, before and after forwards. (A default rope module
    re-binds its table to the activation dtype on its first forward.)"""
    config = _k3_config(rope_parameters=dict(DEFAULT_ROPE))
    expected = _nvidia_rope(config, "default").cos_sin_cache
    draft = build_draft(config)

    def precompute():
        draft.precompute_and_store_context_kv(
            torch.randn(3, 32, dtype=torch.bfloat16), torch.tensor([0, 1, 2]), None
        )
        return ops.rope_launches.pop()["cos_sin_cache"]

    before = precompute()
    for step in range(3):
        for layer in draft.model.layers:
            layer.self_attn(
                positions=torch.tensor([step, 7]),
                hidden_states=torch.randn(2, 32, dtype=torch.bfloat16),
            )
    after = precompute()

    assert len(ops.rope_launches) == 3 * len(draft.model.layers)
    for table in [before, after] + [r["cos_sin_cache"] for r in ops.rope_launches]:
        assert table is draft.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert before.dtype == torch.float32
    assert torch.equal(before, expected)


def test_k3_dspark_rocm_rope_is_one_in_place_launch(build_draft, ops):
    """A layer forward applies the RoPE as one in-place ``rotary_embedding``
    launch on q_pe and k_pe with the fp32 table, and MLAAttention receives
    what that launch wrote, in the activation dtype."""
    draft = build_draft(_k3_config(rope_parameters=dict(YARN)))
    attn = draft.model.layers[0].self_attn
    positions = torch.tensor([0, 5000, 100000])

    attn(positions=positions, hidden_states=torch.randn(3, 32, dtype=torch.bfloat16))

    (launch,) = ops.rope_launches
    assert launch["positions"] is positions
    assert launch["cos_sin_cache"] is attn.rotary_emb.cos_sin_cache
    assert launch["cos_sin_cache"].dtype == torch.float32
    assert (launch["head_size"], launch["is_neox"]) == (8, False)
    (call,) = attn.mla_attn.calls
    assert call["q"].dtype == call["k_pe"].dtype == torch.bfloat16
    assert call["k_pe"].shape == (3, 1, 8)
    # The recorder negated q_pe and k_pe in place.
    assert torch.equal(call["q"][..., 8:], -launch["query"])
    assert torch.equal(call["k_pe"], -launch["key"])


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
        assert type(layer.mlp) is KimiMLP  # the ROCm one
    # Same parameter names as the NVIDIA drafter's MLA module.
    assert {n for n, _ in draft.model.layers[0].self_attn.named_parameters()} == {
        "fused_qkv_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }


def test_k3_dspark_rocm_never_takes_identity_rope_fused_decode(
    build_draft, ops, monkeypatch
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


def test_k3_dspark_rocm_kv_cache_spec_groups_with_target_mla(build_draft):
    """The draft's MLAAttention layers share one KV-cache group with the K3
    ROCm target's MLA layers (AITER MLA), as the engine needs."""
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


@pytest.mark.parametrize(
    ("cache_dtype", "grouped"),
    [
        ("fp8", True),
        # 0.33.0's grouped kernel rejects fp8_e5m2 on ROCm: per-layer fallback.
        ("fp8_e5m2", False),
    ],
)
def test_k3_dspark_rocm_grouped_context_kv_insert(
    cache_dtype, grouped, build_draft, ops
):
    """The context KV goes into the inner MLAAttention's caches: grouped,
    with their scales, for the dtypes the ROCm grouped kernel accepts."""
    draft = build_draft(_k3_config(), cache_dtype=cache_dtype, dtype=torch.float32)
    owners = [layer.self_attn.mla_attn for layer in draft.model.layers]
    for i, owner in enumerate(owners):
        owner._k_scale = torch.tensor([0.5 + i])

    # No process_weights_after_loading: the metadata is built lazily.
    slots = torch.tensor([0, 1, 2])
    draft.precompute_and_store_context_kv(
        torch.randn(3, 32), torch.tensor([0, 1, 2]), slots
    )

    if grouped:
        (call,) = ops.grouped
        assert call[2].tolist() == [o.kv_cache.data_ptr() for o in owners]
        assert torch.equal(call[-2], torch.tensor([0.5, 1.5]))
        assert call[-1] == cache_dtype
        assert all(owner.updates == [] for owner in owners)
    else:
        assert ops.grouped == []
        assert draft.model._context_kv_scales is None
        for owner in owners:
            (update,) = owner.updates
            assert update[2] is owner.kv_cache
            assert update[3] is slots
            assert update[4] == cache_dtype
            assert update[5] is owner._k_scale


# vllm.models.kimi_k3 picks the platform's classes when it is imported, so it
# is imported again, in a process of its own, with is_rocm() true.
@create_new_process_for_each_test("fork")
def test_k3_dspark_registry_resolves_rocm_drafter_on_rocm(monkeypatch):
    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    monkeypatch.setitem(sys.modules, "aiter", None)  # as without aiter
    for name in [n for n in sys.modules if n.startswith("vllm.models.kimi_k3")]:
        monkeypatch.delitem(sys.modules, name)
    registry._try_load_model_cls.cache_clear()

    import vllm.models.kimi_k3 as kimi_k3
    from vllm.models.kimi_k3.amd.dspark_mla import K3DSparkForCausalLM

    assert kimi_k3.K3DSparkForCausalLM is K3DSparkForCausalLM
    resolved = registry.ModelRegistry._try_load_model_cls("K3DSparkModel")
    assert resolved is K3DSparkForCausalLM
