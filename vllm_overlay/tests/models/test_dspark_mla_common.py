# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the platform-neutral K3 DSpark MLA drafter base and its
NVIDIA binding. Custom ops, ``impl`` and the stream-capture query are
replaced where they need a GPU."""

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import vllm
from vllm.models.kimi_k3.common import dspark_mla as common_dspark_mla
from vllm.models.kimi_k3.common import mla_rope
from vllm.models.kimi_k3.common.dspark_mla import (
    K3DSparkDecoderLayerBase,
    K3DSparkForCausalLMBase,
    K3DSparkModelBase,
)
from vllm.models.kimi_k3.nvidia import dspark_mla as nvidia_dspark_mla
from vllm.models.kimi_k3.nvidia.dspark_mla import (
    K3DSparkDecoderLayer,
    K3DSparkForCausalLM,
    K3DSparkModel,
)
from vllm.v1.worker.workspace import WorkspaceManager

# CPU tests that start no distributed environment: vLLM's per-test cleanup
# would only add a full gc.collect() after each of them.
pytestmark = pytest.mark.skip_global_cleanup

_KIMI_K3 = "vllm.models.kimi_k3"
_COMMON_PACKAGE = f"{_KIMI_K3}.common"
_COMMON_MODULES = ("dspark_mla.py", "mla_rope.py")

KV_LORA_RANK = 4
ROPE_DIM = 2
KV_WIDTH = KV_LORA_RANK + ROPE_DIM


def _platform_imports(source: str) -> list[str]:
    """Modules imported by a ``kimi_k3.common`` source that pull in platform
    code: ``kimi_k3.nvidia``, ``kimi_k3.amd`` or the ``kimi_k3`` package,
    whose ``__init__`` imports the current platform's implementation."""
    imported = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = _COMMON_PACKAGE.split(".")[: 1 - node.level or None]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            imported.append(base)
            imported += [f"{base}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            imported.append(str(node.args[0].value))
    return sorted(
        {
            name
            for name in imported
            if name == _KIMI_K3
            or name.startswith((f"{_KIMI_K3}.nvidia", f"{_KIMI_K3}.amd"))
        }
    )


@pytest.mark.cpu_test
@pytest.mark.parametrize("module_file", _COMMON_MODULES)
def test_k3_dspark_common_modules_import_no_platform_module(module_file):
    # Checked on the source: importing the module runs vllm.models.kimi_k3's
    # __init__, which imports a platform, so sys.modules cannot tell.
    path = Path(vllm.__file__).parent / "models/kimi_k3/common" / module_file
    assert _platform_imports(path.read_text()) == []


@pytest.mark.cpu_test
def test_k3_dspark_nvidia_binding_uses_nvidia_mla(monkeypatch):
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.models.kimi_k3.nvidia.model import KimiMLP

    assert issubclass(K3DSparkDecoderLayer, K3DSparkDecoderLayerBase)
    assert issubclass(K3DSparkModel, K3DSparkModelBase)
    assert issubclass(K3DSparkForCausalLM, K3DSparkForCausalLMBase)
    assert K3DSparkModel.decoder_layer_cls is K3DSparkDecoderLayer
    assert K3DSparkForCausalLM.model_cls is K3DSparkModel
    assert nvidia_dspark_mla.MultiHeadLatentAttention is MultiHeadLatentAttention
    assert K3DSparkDecoderLayer.mlp_cls is KimiMLP
    # NVIDIA's MLA module owns its KV cache: the default seam is kept.
    assert K3DSparkModel.kv_cache_layer is K3DSparkModelBase.kv_cache_layer

    attn_calls: list[dict] = []
    mlp_calls: list[dict] = []

    class RecordingModule(nn.Module):
        def __init__(self, calls, **kwargs):
            super().__init__()
            calls.append(kwargs)
            self.o_proj = SimpleNamespace(reduce_results=True)

    class RecordingMLP(RecordingModule):
        def __init__(self, **kwargs):
            super().__init__(mlp_calls, **kwargs)

    monkeypatch.setattr(
        nvidia_dspark_mla,
        "MultiHeadLatentAttention",
        lambda **kwargs: RecordingModule(attn_calls, **kwargs),
    )
    monkeypatch.setattr(K3DSparkDecoderLayer, "mlp_cls", RecordingMLP)
    monkeypatch.setattr(common_dspark_mla, "get_draft_quant_config", lambda _: None)
    monkeypatch.setattr(common_dspark_mla, "RMSNorm", lambda *a, **kw: nn.Identity())
    config = SimpleNamespace(
        hidden_size=8,
        num_attention_heads=2,
        qk_nope_head_dim=3,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=3,
        q_lora_rank=5,
        kv_lora_rank=KV_LORA_RANK,
        intermediate_size=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
    )
    cache_config = SimpleNamespace(cache_dtype="auto")

    layer = K3DSparkDecoderLayer(
        vllm_config=SimpleNamespace(cache_config=cache_config),
        config=config,
        layer_idx=1,
        start_layer_id=61,
        prefix="model",
    )

    assert attn_calls == [
        dict(
            config=config,
            hidden_size=8,
            num_heads=2,
            qk_nope_head_dim=3,
            qk_rope_head_dim=ROPE_DIM,
            v_head_dim=3,
            q_lora_rank=5,
            kv_lora_rank=KV_LORA_RANK,
            cache_config=cache_config,
            quant_config=None,
            prefix="model.layers.62.self_attn",
            use_rope=True,
            non_causal_multi_token_decode=True,
        )
    ]
    assert mlp_calls == [
        dict(
            hidden_size=8,
            intermediate_size=16,
            hidden_act="silu",
            quant_config=None,
            reduce_results=False,
            prefix="model.layers.62.mlp",
        )
    ]
    assert layer.self_attn.o_proj.reduce_results is False


class _Recorder:
    """Stands in for the custom ops and ``impl``, which need a GPU."""

    def __init__(self):
        self.calls: list[tuple] = []

    def rms_norm(self, out, x, weight, eps):
        self.calls.append(("rms_norm",))
        out.copy_(x)

    def rotary_embedding(self, *args):
        self.calls.append(("rotary_embedding",))

    def concat_and_cache_mla_grouped(self, kv_c, k_pe, cache_ptrs, *args):
        self.calls.append(("concat_and_cache_mla_grouped", cache_ptrs, *args))

    def do_kv_cache_update(self, *args):
        self.calls.append(("do_kv_cache_update", *args))


def _attention(layer_idx: int, recorder: _Recorder, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        q_lora_rank=5,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        kv_a_layernorm=SimpleNamespace(
            weight=torch.full((KV_LORA_RANK,), float(layer_idx)),
            variance_epsilon=1e-6,
        ),
        rotary_emb=SimpleNamespace(
            head_size=ROPE_DIM, cos_sin_cache=torch.ones(8, 2), is_neox_style=False
        ),
        **extra,
    )


def _cache_state(layer_idx: int, recorder: _Recorder, dtype: str) -> dict:
    return dict(
        kv_cache=torch.zeros(4, 2, KV_WIDTH),
        kv_cache_dtype=dtype,
        _k_scale=torch.tensor([0.5 + layer_idx]),
        impl=recorder,
        layer_name=f"model.layers.{61 + layer_idx}.self_attn.attn",
    )


class _Layer:
    # The NVIDIA layout: the attention module owns the KV cache.
    def __init__(self, layer_idx: int, recorder: _Recorder, dtype: str):
        self.self_attn = _attention(
            layer_idx, recorder, **_cache_state(layer_idx, recorder, dtype)
        )


class _WrappedLayer:
    # A wrapper layout: the attention module has the geometry but an inner
    # module owns the KV cache (no cache attributes on self_attn).
    def __init__(self, layer_idx: int, recorder: _Recorder, dtype: str):
        self.self_attn = _attention(
            layer_idx,
            recorder,
            mla_attn=SimpleNamespace(**_cache_state(layer_idx, recorder, dtype)),
        )


class _WrappedModel(K3DSparkModelBase):
    def kv_cache_layer(self, attn):
        return attn.mla_attn


class _WrappedNoE5M2Model(_WrappedModel):
    # A platform whose grouped kernel rejects fp8_e5m2 (ROCm in 0.33.0).
    grouped_kv_cache_dtypes = K3DSparkModelBase.grouped_kv_cache_dtypes - {"fp8_e5m2"}


def _model(layers, recorder, monkeypatch, model_cls) -> K3DSparkModelBase:
    # The custom ops and the workspace need a GPU; nothing is captured on CPU.
    monkeypatch.setattr(common_dspark_mla, "ops", recorder)
    workspace = WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(
        common_dspark_mla, "current_workspace_manager", lambda: workspace
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    model = object.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = layers
    model._max_num_context_tokens = 8
    model.context_kv_proj = lambda x: x.new_zeros(x.shape[0], len(layers) * KV_WIDTH)
    model._build_fused_context_kv_metadata()
    return model


def _precompute(model, slot_mapping):
    model.precompute_and_store_context_kv(
        torch.zeros(3, 8), torch.tensor([0, 1, 2]), slot_mapping
    )


@pytest.mark.cpu_test
def test_k3_dspark_kv_cache_layer_defaults_to_self_attn():
    attn = nn.Linear(1, 1)
    assert K3DSparkModelBase.kv_cache_layer(object.__new__(K3DSparkModel), attn) is (
        attn
    )


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("layer_cls", "model_cls"),
    [(_Layer, K3DSparkModelBase), (_WrappedLayer, _WrappedModel)],
)
def test_k3_dspark_context_kv_goes_through_kv_cache_layer(
    layer_cls, model_cls, monkeypatch
):
    recorder = _Recorder()
    layers = [layer_cls(i, recorder, "fp8") for i in range(2)]
    model = _model(layers, recorder, monkeypatch, model_cls)
    cache_layers = [model.kv_cache_layer(layer.self_attn) for layer in layers]
    slots = torch.tensor([0, 1, 2])

    assert torch.equal(model._context_kv_scales, torch.tensor([0.5, 1.5]))
    assert torch.equal(
        model._context_kv_norm_weights,
        torch.stack([torch.zeros(KV_LORA_RANK), torch.ones(KV_LORA_RANK)]),
    )

    _precompute(model, slots)
    assert [c[0] for c in recorder.calls] == [
        "rms_norm",
        "rotary_embedding",
        "concat_and_cache_mla_grouped",
    ]
    grouped = recorder.calls[-1]
    assert grouped[1].tolist() == [cl.kv_cache.data_ptr() for cl in cache_layers]
    assert grouped[3:] == (2, 2 * KV_WIDTH, KV_WIDTH, model._context_kv_scales, "fp8")
    recorder.calls.clear()

    # A layer without a slot mapping falls back to per-layer cache updates.
    _precompute(model, [slots, None])
    (update,) = [c for c in recorder.calls if c[0] == "do_kv_cache_update"]
    assert update[3] is cache_layers[0].kv_cache
    assert update[4] is slots
    assert update[5] == "fp8"
    assert update[6] is cache_layers[0]._k_scale

    draft = SimpleNamespace(model=model)
    assert K3DSparkForCausalLMBase.get_draft_kv_cache_layer_names(draft) == [
        "model.layers.61.self_attn.attn",
        "model.layers.62.self_attn.attn",
    ]


@pytest.mark.cpu_test
def test_k3_dspark_grouped_kv_cache_dtypes_default():
    # The default (NVIDIA) allowlist is the module constant, unchanged.
    assert K3DSparkModelBase.grouped_kv_cache_dtypes is (
        common_dspark_mla._GROUPED_KV_CACHE_DTYPES
    )
    assert K3DSparkModelBase.grouped_kv_cache_dtypes == {
        "auto",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    }
    assert K3DSparkModel.grouped_kv_cache_dtypes is (
        K3DSparkModelBase.grouped_kv_cache_dtypes
    )


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("model_cls", "dtype", "grouped"),
    [
        (_WrappedModel, "fp8_e5m2", True),
        (_WrappedNoE5M2Model, "fp8_e5m2", False),
        (_WrappedNoE5M2Model, "fp8_e4m3", True),
        (_WrappedNoE5M2Model, "auto", True),
    ],
)
def test_k3_dspark_grouped_insert_follows_platform_dtypes(
    model_cls, dtype, grouped, monkeypatch
):
    """Both the grouped insert and its stacked scales follow the model class's
    ``grouped_kv_cache_dtypes``; other dtypes fall back per layer."""
    recorder = _Recorder()
    layers = [_WrappedLayer(i, recorder, dtype) for i in range(2)]
    model = _model(layers, recorder, monkeypatch, model_cls)
    cache_layers = [model.kv_cache_layer(layer.self_attn) for layer in layers]
    slots = torch.tensor([0, 1, 2])

    quantized = dtype.startswith("fp8")
    if grouped and quantized:
        assert torch.equal(model._context_kv_scales, torch.tensor([0.5, 1.5]))
    else:
        assert model._context_kv_scales is None

    _precompute(model, slots)
    names = [c[0] for c in recorder.calls]
    if grouped:
        assert names[-1] == "concat_and_cache_mla_grouped"
        assert "do_kv_cache_update" not in names
        assert recorder.calls[-1][-1] == dtype
    else:
        assert "concat_and_cache_mla_grouped" not in names
        updates = [c for c in recorder.calls if c[0] == "do_kv_cache_update"]
        assert len(updates) == len(cache_layers)
        for update, cl in zip(updates, cache_layers):
            assert update[3] is cl.kv_cache
            assert update[5] == dtype
            assert update[6] is cl._k_scale


def _grouped_ptrs_arg(recorder: _Recorder) -> torch.Tensor:
    (call,) = [c for c in recorder.calls if c[0] == "concat_and_cache_mla_grouped"]
    recorder.calls.clear()
    return call[1]


@pytest.mark.cpu_test
def test_k3_dspark_refreshes_cache_pointers_in_place(monkeypatch):
    """The grouped insert writes through an array of cache base addresses.
    The context precompute first runs (and is graph-captured) against the
    memory-profiling caches; the real caches are bound later. The array must
    then hold the new addresses in the same storage, which a captured graph
    still reads, written before any capture and not during it."""
    recorder = _Recorder()
    layers = [_Layer(i, recorder, "auto") for i in range(2)]
    model = _model(layers, recorder, monkeypatch, K3DSparkModelBase)
    slots = torch.tensor([0, 1, 2])
    capturing = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)

    def bind(*caches):
        for layer, cache in zip(layers, caches):
            layer.self_attn.kv_cache = cache
        return [cache.data_ptr() for cache in caches]

    # Keep every cache alive so that no address is reused.
    profiling = [layer.self_attn.kv_cache for layer in layers]
    _precompute(model, slots)
    ptrs = _grouped_ptrs_arg(recorder)
    storage = ptrs.data_ptr()
    assert ptrs.tolist() == [c.data_ptr() for c in profiling]

    # The real caches arrive; the first precompute on them takes the
    # per-layer path (one layer has no slot mapping yet), and the array
    # already holds their addresses after it, before any capture ...
    real = [torch.zeros(4, 2, KV_WIDTH), torch.zeros(4, 2, KV_WIDTH)]
    expected = bind(*real)
    _precompute(model, [slots, None])
    recorder.calls.clear()
    assert ptrs.tolist() == expected
    assert ptrs.data_ptr() == storage
    # ... so the next precompute, captured, reads that array and builds
    # none (a new array is a host-to-device copy inside the graph).
    states, positions = torch.zeros(3, 8), torch.tensor([0, 1, 2])

    def no_host_copy(*args, **kwargs):
        raise AssertionError("a tensor built from host data during capture")

    capturing = True
    with monkeypatch.context() as capture:
        capture.setattr(torch, "tensor", no_host_copy)
        model.precompute_and_store_context_kv(states, positions, slots)
    capturing = False
    assert _grouped_ptrs_arg(recorder) is ptrs
    assert ptrs.data_ptr() == storage
    assert ptrs.tolist() == expected

    # Layers whose caches no longer share a block layout use per-layer updates.
    non_uniform = [torch.zeros(4, 2, KV_WIDTH), torch.zeros(2, 4, KV_WIDTH)]
    bind(*non_uniform)
    _precompute(model, slots)
    updates = [c for c in recorder.calls if c[0] == "do_kv_cache_update"]
    assert [c[3] for c in updates] == non_uniform
    assert not any(c[0] == "concat_and_cache_mla_grouped" for c in recorder.calls)
    recorder.calls.clear()

    uniform_again = [torch.zeros(4, 2, KV_WIDTH), torch.zeros(4, 2, KV_WIDTH)]
    expected = bind(*uniform_again)
    _precompute(model, slots)
    assert _grouped_ptrs_arg(recorder) is ptrs
    assert ptrs.tolist() == expected


@pytest.mark.cpu_test
def test_k3_dspark_weight_reload_refills_context_kv_tensors_in_place(monkeypatch):
    """A weight reload ends in every module's post-load hook, which rebuilds
    the stacked context-KV norm weights and cache scales. Captured graphs read
    them by address: the reload must refill them, not replace them."""
    recorder = _Recorder()
    layers = [_Layer(i, recorder, "fp8") for i in range(2)]
    model = _model(layers, recorder, monkeypatch, K3DSparkModel)
    drafter = object.__new__(K3DSparkForCausalLM)
    nn.Module.__init__(drafter)
    drafter.model = model
    norms, scales = model._context_kv_norm_weights, model._context_kv_scales
    addresses = (norms.data_ptr(), scales.data_ptr())

    # The loader writes new values into the same weights, then runs the hooks.
    for i, layer in enumerate(layers):
        layer.self_attn.kv_a_layernorm.weight.fill_(10.0 + i)
        layer.self_attn._k_scale.fill_(2.0 + i)
    drafter.process_weights_after_loading()

    assert model._context_kv_norm_weights is norms
    assert model._context_kv_scales is scales
    assert (norms.data_ptr(), scales.data_ptr()) == addresses
    expected_norms = torch.tensor([[10.0] * KV_LORA_RANK, [11.0] * KV_LORA_RANK])
    assert torch.equal(norms, expected_norms)
    assert torch.equal(scales, torch.tensor([2.0, 3.0]))


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    ("rope_parameters", "rope_type", "scale_multiplier"),
    [
        ({"rope_type": "default"}, "default", 1.0),
        (
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0},
            "deepseek_llama_scaling",
            1.0,
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0},
            "deepseek_yarn",
            (0.1 * math.log(4.0) + 1.0) ** 2,
        ),
        ({"rope_type": "yarn", "factor": 4.0}, "deepseek_yarn", 1.0),
        (
            {"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},
            "deepseek_yarn",
            1.0,
        ),
    ],
)
def test_k3_mla_rope_maps_rope_type_and_softmax_scale(
    rope_parameters, rope_type, scale_multiplier, monkeypatch
):
    calls = []
    rotary_emb = object()

    def fake_get_rope(*args, **kwargs):
        calls.append((args, kwargs))
        return rotary_emb

    monkeypatch.setattr(mla_rope, "get_rope", fake_get_rope)
    config = SimpleNamespace(
        rope_parameters=dict(rope_parameters), max_position_embeddings=256
    )

    got_rotary_emb, got_scale_multiplier = mla_rope.get_k3_mla_rope(config, 8)

    assert got_rotary_emb is rotary_emb
    assert got_scale_multiplier == pytest.approx(scale_multiplier)
    assert config.rope_parameters == rope_parameters  # the config is not mutated
    assert calls == [
        (
            (8,),
            dict(
                max_position=256,
                rope_parameters=rope_parameters | {"rope_type": rope_type},
                is_neox_style=False,
                dtype=torch.float32,
            ),
        )
    ]
