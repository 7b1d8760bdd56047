# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import vllm.models.kimi_k3 as kimi_k3
from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.model_executor.models.registry import ModelRegistry
from vllm.models.deepseek_v4.nvidia import dspark as dsv4_dspark
from vllm.models.deepseek_v41.nvidia import dspark as dsv41_dspark
from vllm.models.kimi_k3.common import dspark_mla
from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM, K3DSparkModel


def test_dspark_mla_uses_compile_free_model_entrypoint():
    # The registry resolves the current platform's drafter.
    model_cls = ModelRegistry._try_load_model_cls("K3DSparkModel")
    assert model_cls is kimi_k3.K3DSparkForCausalLM
    assert not issubclass(model_cls.model_cls, TorchCompileWithNoGuardsWrapper)


@pytest.mark.parametrize(
    ("checkpoint_name", "runtime_name", "shard_id"),
    [
        (
            "layers.0.self_attn.q_a_proj.weight",
            "model.layers.0.self_attn.fused_qkv_a_proj.weight",
            0,
        ),
        (
            "layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.0.self_attn.fused_qkv_a_proj.weight",
            1,
        ),
        (
            "layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight",
            0,
        ),
        (
            "layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight",
            1,
        ),
        ("context_proj.weight", "model.context_proj.weight", None),
    ],
)
def test_dspark_mla_checkpoint_weight_mapping(checkpoint_name, runtime_name, shard_id):
    assert K3DSparkForCausalLM.hf_to_vllm_mapper._map_name_with_shard(
        checkpoint_name
    ) == (runtime_name, shard_id)


def test_dspark_mla_shares_frozen_target_weights_and_skips_training_head():
    assert not K3DSparkForCausalLM.has_own_embed_tokens
    assert not K3DSparkForCausalLM.has_own_lm_head
    mapper = K3DSparkForCausalLM.hf_to_vllm_mapper
    for name in ("confidence_head.weight", "embed_tokens.weight", "lm_head.weight"):
        assert mapper._map_name(name) is None


@pytest.mark.cpu_test
def test_dspark_markov_head_is_replicated(
    monkeypatch: pytest.MonkeyPatch,
):
    from vllm.model_executor.layers import logits_processor, vocab_parallel_embedding

    monkeypatch.setattr(
        vocab_parallel_embedding, "get_tensor_model_parallel_rank", lambda: 3
    )
    monkeypatch.setattr(
        vocab_parallel_embedding,
        "get_tensor_model_parallel_world_size",
        lambda: 8,
    )
    monkeypatch.setattr(
        logits_processor,
        "get_current_vllm_config",
        lambda: SimpleNamespace(model_config=None),
    )

    head = DSparkMarkovHead(128, 128, 8, prefix="markov_head")
    assert head.markov_w2.tp_size == 1
    assert head.markov_w1.weight.shape == (128, 8)
    assert head.markov_w2.weight.shape == (128, 8)
    head.markov_w2.quant_method.process_weights_after_loading(head.markov_w2)

    def fail_collective(*args, **kwargs):
        raise AssertionError("replicated Markov head must not invoke TP collectives")

    monkeypatch.setattr(
        vocab_parallel_embedding,
        "tensor_model_parallel_all_reduce",
        fail_collective,
    )
    logits_processor = LogitsProcessor(128)
    monkeypatch.setattr(logits_processor, "_gather_logits", fail_collective)

    markov_embed = head.embed(torch.tensor([1, 2]))
    bias = head.bias(markov_embed, logits_processor)
    assert markov_embed.shape == (2, 8)
    assert bias.shape == (2, 128)


@pytest.mark.cpu_test
def test_k3_dspark_uses_replicated_markov_head(monkeypatch: pytest.MonkeyPatch):
    markov_head_calls = []
    context_kv_proj_calls = []

    class DummyModule(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    def make_markov_head(*args, **kwargs):
        markov_head_calls.append((args, kwargs))
        return DummyModule()

    def make_context_kv_proj(*args, **kwargs):
        context_kv_proj_calls.append((args, kwargs))
        return DummyModule()

    monkeypatch.setattr(dspark_mla, "get_draft_quant_config", lambda _: None)
    monkeypatch.setattr(dspark_mla, "ReplicatedLinear", DummyModule)
    monkeypatch.setattr(dspark_mla, "MergedColumnParallelLinear", make_context_kv_proj)
    monkeypatch.setattr(dspark_mla, "RMSNorm", DummyModule)
    monkeypatch.setattr(K3DSparkModel, "decoder_layer_cls", DummyModule)
    monkeypatch.setattr(dspark_mla, "DSparkMarkovHead", make_markov_head)

    config = SimpleNamespace(
        target_hidden_size=16,
        num_target_layers=2,
        hidden_size=8,
        kv_lora_rank=3,
        qk_rope_head_dim=1,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        vocab_size=128,
        draft_vocab_size=128,
        markov_rank=4,
    )
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=config)
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16),
    )

    K3DSparkModel(vllm_config=vllm_config, start_layer_id=0, prefix="model")

    assert len(markov_head_calls) == 1
    assert context_kv_proj_calls == [
        (
            (8, [4]),
            {
                "bias": False,
                "return_bias": False,
                "quant_config": None,
                "prefix": "model.layers.0.self_attn.fused_qkv_a_proj",
                "disable_tp": True,
            },
        )
    ]


def test_context_kv_weights_are_loaded_as_merged_linear_shards():
    weights = [
        (
            "layers.0.self_attn.kv_a_proj_with_mqa.weight_packed",
            torch.arange(4),
        ),
        (
            "layers.1.self_attn.kv_a_proj_with_mqa.weight_scale",
            torch.tensor(0.5),
        ),
    ]

    duplicated = dspark_mla._duplicate_context_kv_weights(weights, 2)
    mapped = list(K3DSparkForCausalLM.hf_to_vllm_mapper.apply(duplicated))

    assert [name for name, _ in mapped] == [
        "model.layers.0.self_attn.fused_qkv_a_proj.weight_packed",
        "model.context_kv_proj.weight_packed",
        "model.layers.1.self_attn.fused_qkv_a_proj.weight_scale",
        "model.context_kv_proj.weight_scale",
    ]
    assert [weight.shard_id for _, weight in mapped] == [1, 0, 1, 1]
    assert mapped[0][1].data_ptr() == mapped[1][1].data_ptr()
    assert mapped[2][1].data_ptr() == mapped[3][1].data_ptr()


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "scale_dtype", [torch.uint8, torch.float8_e8m0fnu, torch.float32]
)
@pytest.mark.parametrize(
    ("checkpoint_name", "runtime_module", "shard_id"),
    [
        ("mtp.0.attn.wq_a.scale", "model.layers.0.attn.fused_wqa_wkv", 0),
        ("mtp.0.attn.wkv.scale", "model.layers.0.attn.fused_wqa_wkv", 1),
        ("mtp.0.main_proj.scale", "model.main_proj", None),
        (
            "mtp.0.ffn.shared_experts.w1.scale",
            "model.layers.0.ffn.shared_experts.gate_up_proj",
            0,
        ),
        (
            "mtp.0.ffn.shared_experts.w2.scale",
            "model.layers.0.ffn.shared_experts.down_proj",
            None,
        ),
    ],
)
def test_v41_dspark_loads_linear_scales(
    monkeypatch, scale_dtype, checkpoint_name, runtime_module, shard_id
):
    """Checkpoint ``.scale`` maps to the quant method's scale parameter and
    loads untouched. MXFP8 block-scale expansion lives in the KMxfp8Static
    loader (see tests/quantization/test_modelopt.py), not in load_weights."""
    from vllm.models.deepseek_v41.nvidia import dspark

    mxfp8 = scale_dtype != torch.float32
    scale_name = "weight_scale" if mxfp8 else "weight_scale_inv"
    runtime_name = f"{runtime_module}.{scale_name}"
    raw = torch.tensor([[120, 127], [128, 130]], dtype=torch.uint8)
    checkpoint_scale = raw.view(scale_dtype) if mxfp8 else raw.float()
    param = nn.Parameter(torch.empty_like(checkpoint_scale), requires_grad=False)
    shards = []

    def load_scale(param, weight, *args):
        shards.append(args)
        assert weight.dtype == checkpoint_scale.dtype
        param.copy_(weight)

    param.weight_loader = load_scale
    params = {runtime_name: param}
    context_param = None
    if ".attn.wkv." in checkpoint_name:
        context_param = nn.Parameter(
            torch.empty_like(checkpoint_scale), requires_grad=False
        )
        context_param.weight_loader = load_scale
        params[f"model.context_wkv_proj.{scale_name}"] = context_param
    draft = SimpleNamespace(
        config=SimpleNamespace(num_attention_heads=4, n_routed_experts=1),
        quant_config=SimpleNamespace(
            weight_block_size=[32, 32] if mxfp8 else [128, 128]
        ),
        linear_scale_name=scale_name,
        pad_shared_expert=False,
        model=SimpleNamespace(
            layers=[
                SimpleNamespace(
                    ffn=SimpleNamespace(
                        use_native_mega_moe=False,
                        experts=SimpleNamespace(has_fused_shared_experts=False),
                    )
                )
            ],
            confidence_head=None,
        ),
        named_parameters=lambda: params.items(),
        process_weights_after_loading=lambda: None,
    )
    draft._remap_dspark_name = lambda name: (
        dspark.DSparkDeepseekV4ForCausalLM._remap_dspark_name(draft, name)
    )
    monkeypatch.setattr(
        dspark, "fused_moe_make_expert_params_mapping", lambda *a, **kw: []
    )

    loaded = dspark.DSparkDeepseekV4ForCausalLM.load_weights(
        draft, [(checkpoint_name, checkpoint_scale)]
    )

    assert loaded == set(params)
    expected_shards = [() if shard_id is None else (shard_id,)]
    if context_param is not None:
        expected_shards.append((0,))
        torch.testing.assert_close(context_param, checkpoint_scale)
    assert shards == expected_shards
    torch.testing.assert_close(param, checkpoint_scale)


def test_dsv4_dspark_fused_moe_expert_mapping_includes_redundant_experts(
    monkeypatch,
):
    from vllm.models.deepseek_v4.nvidia import dspark

    captured: dict[str, int] = {}

    def capture_expert_mapping(*args, **kwargs):
        captured.update(kwargs)
        return []

    draft = SimpleNamespace(
        config=SimpleNamespace(
            num_attention_heads=4,
            n_routed_experts=8,
            expert_dtype="fp4",
        ),
        quant_config=None,
        pad_shared_expert=False,
        model=SimpleNamespace(
            layers=[
                SimpleNamespace(
                    ffn=SimpleNamespace(
                        use_native_mega_moe=False,
                        use_mega_moe=False,
                        n_redundant_experts=4,
                    )
                )
            ],
            confidence_head=None,
        ),
        named_parameters=lambda: [],
        process_weights_after_loading=lambda: None,
    )
    draft._remap_dspark_name = lambda name: (
        dspark.DSparkDeepseekV4ForCausalLM._remap_dspark_name(draft, name)
    )
    monkeypatch.setattr(
        dspark,
        "fused_moe_make_expert_params_mapping",
        capture_expert_mapping,
    )

    dspark.DSparkDeepseekV4ForCausalLM.load_weights(draft, [])

    assert captured["num_experts"] == 8
    assert captured["num_redundant_experts"] == 4


def test_dsv4_context_wkv_weights_are_duplicated_by_draft_layer():
    weights = [
        ("mtp.0.attn.wkv.weight", torch.arange(4)),
        ("mtp.1.attn.wq_a.weight", torch.arange(3)),
        ("mtp.2.attn.wkv.scale", torch.tensor(0.5)),
        ("mtp.3.attn.wkv.weight", torch.arange(2)),
    ]

    duplicated = list(dsv4_dspark._duplicate_context_wkv_weights(weights, 3))

    assert [name for name, _ in duplicated] == [
        "mtp.0.attn.wkv.weight",
        "context_wkv_proj.weight",
        "mtp.1.attn.wq_a.weight",
        "mtp.2.attn.wkv.scale",
        "context_wkv_proj.scale",
        "mtp.3.attn.wkv.weight",
    ]
    assert duplicated[1][1].shard_id == 0
    assert duplicated[4][1].shard_id == 2
    assert duplicated[0][1].data_ptr() == duplicated[1][1].data_ptr()
    assert duplicated[3][1].data_ptr() == duplicated[4][1].data_ptr()


@pytest.mark.cpu_test
def test_v41_context_wkv_loads_each_layer_into_both_projections(monkeypatch):
    """Duplicating context weights must preserve query WKV and layer order."""
    from vllm.model_executor import parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 3)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 4)
    projections = [
        MergedColumnParallelLinear(
            5, sizes, bias=False, disable_tp=True, params_dtype=torch.float32
        )
        for sizes in ([2, 4], [2, 4], [2, 4], [4, 4, 4])
    ]
    for projection in projections:
        projection.weight.data.fill_(-1)
    params = {
        f"model.layers.{i}.attn.fused_wqa_wkv.weight": projection.weight
        for i, projection in enumerate(projections[:3])
    }
    params["model.context_wkv_proj.weight"] = projections[3].weight
    draft = SimpleNamespace(
        config=SimpleNamespace(n_routed_experts=1),
        linear_scale_name="weight_scale",
        pad_shared_expert=False,
        model=SimpleNamespace(
            layers=[
                SimpleNamespace(ffn=SimpleNamespace(use_native_mega_moe=False))
                for _ in range(3)
            ],
            confidence_head=None,
        ),
        named_parameters=lambda: params.items(),
    )
    draft._remap_dspark_name = lambda name: (
        dsv41_dspark.DSparkDeepseekV4ForCausalLM._remap_dspark_name(draft, name)
    )
    monkeypatch.setattr(
        dsv41_dspark, "fused_moe_make_expert_params_mapping", lambda *a, **kw: []
    )
    weights = [torch.arange(20).view(4, 5).float() + i * 20 for i in range(3)]
    loaded = dsv41_dspark.DSparkDeepseekV4ForCausalLM.load_weights(
        draft, ((f"mtp.{i}.attn.wkv.weight", weights[i]) for i in (2, 0, 1))
    )

    assert loaded == set(params)
    torch.testing.assert_close(projections[3].weight, torch.cat(weights))
    for i, projection in enumerate(projections[:3]):
        torch.testing.assert_close(projection.weight[2:], weights[i])
        assert torch.all(projection.weight[:2] == -1)


@pytest.mark.parametrize("dspark_module", [dsv4_dspark, dsv41_dspark])
def test_dsv4_context_kv_uses_one_stacked_wkv_projection(monkeypatch, dspark_module):
    calls = []
    stacked_output = torch.arange(24, dtype=torch.float32).view(2, 12)

    class StackedProjection:
        def __init__(self):
            self.calls = 0

        def __call__(self, main_x):
            self.calls += 1
            assert main_x.shape == (2, 5)
            return stacked_output

    projection = StackedProjection()
    layers = [
        SimpleNamespace(attn=SimpleNamespace(kv_norm=lambda kv, offset=i: kv + offset))
        for i in range(3)
    ]
    model = SimpleNamespace(
        config=SimpleNamespace(head_dim=4),
        context_wkv_proj=projection,
        layers=layers,
        num_dspark_layers=3,
    )
    slot_mappings = [torch.tensor([0, 1]), None, torch.tensor([4, 5])]
    monkeypatch.setattr(
        dspark_module,
        "_insert_context_kv",
        lambda attn, kv, positions, slots: calls.append(
            (attn, kv.clone(), positions, slots)
        ),
    )

    dspark_module.DSparkDeepseekV4Model.precompute_and_store_context_kv(
        model,
        torch.zeros(2, 5),
        torch.tensor([7, 8]),
        slot_mappings,
    )

    assert projection.calls == 1
    assert len(calls) == 2
    assert torch.equal(calls[0][1], stacked_output.view(2, 3, 4)[:, 0])
    assert torch.equal(calls[1][1], stacked_output.view(2, 3, 4)[:, 2] + 2)
    assert calls[0][3] is slot_mappings[0]
    assert calls[1][3] is slot_mappings[2]


@pytest.mark.cpu_test
def test_k3_dspark_mla_kv_cache_spec_groups_with_target_mla():
    """The draft's MLA layers must share a KV cache group with the target's."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size

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
        _uses_flat_kv_cache=lambda: False,
    )
    draft_attn = SimpleNamespace(
        kv_cache_dtype="fp8", head_size=576, non_causal_multi_token_decode=True
    )
    target_spec = MLAAttention.get_kv_cache_spec(target_attn, vllm_config)
    draft_spec = MultiHeadLatentAttention.get_kv_cache_spec(draft_attn, vllm_config)

    kv_cache_spec = {f"model.layers.{i}.attn": target_spec for i in range(24)}
    kv_cache_spec |= {f"draft.layers.{i}.attn": draft_spec for i in range(5)}

    groups = _get_kv_cache_groups_uniform_page_size(kv_cache_spec)
    assert len(groups) == 1
    assert len(groups[0].layer_names) == 29
