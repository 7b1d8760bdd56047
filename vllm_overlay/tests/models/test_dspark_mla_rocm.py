# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the ROCm K3 DSpark MLA drafter (``kimi_k3/amd/dspark_mla.py``).

The drafter is built the way the engine builds it: ``K3DSparkForCausalLM`` from a
real ``VllmConfig`` whose speculative config selects TRITON_MLA for the draft,
with the real wrapper, ``MLAAttention`` and ``TritonMLAImpl``. Doubled are only
what needs a GPU: the platform's backend and CU queries (a ROCm platform cannot
be imported without a GPU), the ``_C`` custom ops, the Triton q/kv RMSNorm and
decode kernels and the AITER fused decode. The ROCm kernels themselves are checked in
``tests/models/kimi_k3/test_amd_dspark_mla.py``.
"""

import json
import math

import pytest
import torch

import vllm._custom_ops as ops
from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.config import (
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.registry import ModelRegistry
from vllm.models.kimi_k3.amd import dspark_mla as amd_dspark_mla
from vllm.models.kimi_k3.amd import mla as amd_mla
from vllm.models.kimi_k3.amd.dspark_mla import K3DSparkForCausalLM
from vllm.models.kimi_k3.amd.linear import KimiMLP
from vllm.models.kimi_k3.amd.mla import (
    KimiK3MultiHeadLatentAttentionWrapper,
    rocm_aiter_ops,
)
from vllm.models.kimi_k3.nvidia import dspark_mla as nvidia_dspark_mla
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
from vllm.v1.attention.backends.mla.prefill.selector import (
    _auto_select_mla_prefill_backend,
)
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl
from vllm.v1.attention.selector import _cached_get_attn_backend
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.worker.gpu.spec_decode.dspark.utils import draft_runs_uncompiled
from vllm.v1.worker.utils import bind_kv_cache_to_layers
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

# The fixtures below tear down what they set up.
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

TARGET_LAYERS = 61
BLOCK_SIZE = 16
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
# kv_lora_rank, rope dim and heads of the ROCm target's AITER MLA fast path.
PRODUCTION_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=32)


@pytest.fixture
def rocm_platform(monkeypatch):
    """The platform hooks MLAAttention asks, answered as on ROCm: the draft's
    attention backend (its speculative config's TRITON_MLA) is honoured, the
    GPU has MI300X's CU count, and dense prefill (never run by a draft) is
    the CPU one. The selector caches are cleared around the test, as
    tests/kernels/attention/test_attention_selector.py and
    tests/v1/attention/test_mla_prefill_selector.py do."""
    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda backend, attn_selector_config, num_heads=None: backend.get_path(),
    )
    monkeypatch.setattr(current_platform, "num_compute_units", lambda *_: 304)
    monkeypatch.setattr(
        current_platform,
        "get_mla_prefill_backend_cls",
        lambda _: MLAPrefillBackendEnum.CPU.get_class(),
    )
    # No CUDA runtime on a CPU host: nothing is being captured.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _cached_get_attn_backend.cache_clear()
    _auto_select_mla_prefill_backend.cache_clear()
    yield
    _cached_get_attn_backend.cache_clear()
    _auto_select_mla_prefill_backend.cache_clear()


@pytest.fixture
def tp1_cpu(tmp_path):
    """A single-rank gloo TP group (as tests/models/multimodal/
    test_conformer_encoder.py) and a CPU workspace."""
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp_path / 'dist'}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    init_workspace_manager(torch.device("cpu"))
    yield
    reset_workspace_manager()
    destroy_model_parallel()
    destroy_distributed_environment()


class RecordingOps:
    """The GPU kernels the drafter and MLAAttention launch, recorded. The two
    RoPE kernels negate q_pe and k_pe in place, so a test can tell whether
    the attention receives what the launch wrote."""

    def __init__(self):
        self.rope_launches: list[dict] = []
        self.cache_writes: list[dict] = []
        self.grouped_writes: list[tuple] = []
        self.rope_cache_writes: list[dict] = []
        self.qkv_norms: list[tuple] = []

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
        out.copy_(x)  # Values are not checked.

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, **kwargs):
        self.cache_writes.append(
            dict(k_pe=k_pe.clone(), kv_cache=kv_cache, slot_mapping=slot_mapping)
            | kwargs
        )

    def concat_and_cache_mla_grouped(self, *args):
        self.grouped_writes.append(args)

    def concat_and_cache_mla_rope_fused(
        self,
        positions,
        q_pe,
        k_pe,
        kv_c,
        cos_sin_cache,
        is_neox,
        slot_mapping,
        kv_cache,
        kv_cache_dtype,
        kv_cache_scale,
    ):
        self.rope_cache_writes.append(
            dict(
                positions=positions,
                q_pe=q_pe,
                query=q_pe.clone(),
                key=k_pe.clone(),
                kv_c=kv_c,
                cos_sin_cache=cos_sin_cache,
                is_neox=is_neox,
                slot_mapping=slot_mapping,
                kv_cache=kv_cache,
                kv_cache_dtype=kv_cache_dtype,
                scale=kv_cache_scale,
            )
        )
        q_pe.neg_()
        k_pe.neg_()

    def fused_q_kv_rmsnorm(self, q_c, kv_c, q_weight, kv_weight, eps):
        self.qkv_norms.append((q_c, kv_c, q_weight, kv_weight, eps))
        return q_c.clone(), kv_c.clone()  # Values are not checked.


@pytest.fixture
def kernels(rocm_platform, monkeypatch) -> RecordingOps:
    recorder = RecordingOps()
    for name in (
        "rotary_embedding",
        "rms_norm",
        "concat_and_cache_mla",
        "concat_and_cache_mla_grouped",
        "concat_and_cache_mla_rope_fused",
    ):
        monkeypatch.setattr(ops, name, getattr(recorder, name))
    monkeypatch.setattr(amd_mla, "fused_q_kv_rmsnorm", recorder.fused_q_kv_rmsnorm)
    return recorder


@pytest.fixture
def mqa_calls(monkeypatch) -> list[torch.Tensor]:
    """The Triton decode kernel: records the query MLAAttention hands it."""
    calls: list[torch.Tensor] = []

    def forward_mqa(self, q, kv_cache, attn_metadata, layer):
        calls.append(q)
        q_nope = q[0] if isinstance(q, tuple) else q
        return q_nope.new_zeros(*q_nope.shape[:2], self.kv_lora_rank), None

    monkeypatch.setattr(TritonMLAImpl, "forward_mqa", forward_mqa)
    return calls


def _speculative_config(tmp_path, cache_dtype="auto", **overrides):
    """A DSpark speculative config of a small K3 draft on a Llama target."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=4,
                num_hidden_layers=TARGET_LAYERS,
                vocab_size=64,
            )
        )
    )
    draft_config = dict(
        architectures=["K3DSparkModel"],
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
    K3DSparkConfig(**(draft_config | overrides)).save_pretrained(draft)
    model_config = ModelConfig(
        model=str(target), skip_tokenizer_init=True, dtype="bfloat16"
    )
    return SpeculativeConfig(
        method="dspark",
        model=str(draft),
        num_speculative_tokens=3,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        attention_backend="TRITON_MLA",
        kv_cache_dtype=cache_dtype,
    )


def _draft_vllm_config(tmp_path, cache_dtype="auto", **overrides) -> VllmConfig:
    """The draft's VllmConfig, as the proposer derives it from the target's."""
    speculative_config = _speculative_config(tmp_path, cache_dtype, **overrides)
    return speculative_config.apply_draft_overrides(
        VllmConfig(
            model_config=speculative_config.target_model_config,
            speculative_config=speculative_config,
            device_config=DeviceConfig("cpu"),
        )
    )


@pytest.fixture
def build_draft(tmp_path, rocm_platform, tp1_cpu):
    """Build, initialise and post-process the ROCm drafter; bind KV caches."""

    def build(cache_dtype="auto", post_process=True, **overrides):
        vllm_config = _draft_vllm_config(tmp_path, cache_dtype, **overrides)
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(torch.bfloat16),
        ):
            draft = K3DSparkForCausalLM(vllm_config=vllm_config)
        # Parameters start as torch.empty: give every test the same weights.
        generator = torch.Generator().manual_seed(0)
        for param in draft.parameters():
            param.data.normal_(std=0.02, generator=generator)
        if post_process:
            with set_current_vllm_config(vllm_config):
                process_weights_after_loading(
                    draft, vllm_config.model_config, torch.device("cpu")
                )
        head_size = overrides.get("kv_lora_rank", 16) + overrides.get(
            "qk_rope_head_dim", 8
        )
        dtype = torch.bfloat16 if cache_dtype == "auto" else torch.uint8
        bind_kv_cache_to_layers(
            {
                name: torch.zeros(4, BLOCK_SIZE, head_size, dtype=dtype)
                for name in draft.get_draft_kv_cache_layer_names()
            },
            vllm_config.compilation_config.static_forward_context,
        )
        draft.vllm_config = vllm_config
        return draft

    return build


def _block_metadata(num_tokens, num_decode_tokens=None):
    """A non-causal draft block of one request (decode only, unless fewer
    decode tokens are given) in slots 0..num_tokens - 1."""
    slots = torch.arange(num_tokens)
    metadata = MLACommonMetadata(
        num_reqs=1,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        num_actual_tokens=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens]),
        slot_mapping=slots,
        num_decodes=1,
        num_decode_tokens=num_tokens
        if num_decode_tokens is None
        else num_decode_tokens,
        num_prefills=0,
        causal=False,
        decode=MLACommonDecodeMetadata(
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            seq_lens=torch.tensor([num_tokens]),
            dcp_tot_seq_lens=None,
        ),
    )
    return metadata, slots


def _decode(draft, attn, positions, hidden_states, with_slots=True):
    """One non-causal draft block (decode only) through ``attn``; without
    slots, as in a profiling run, the layer has no cache rows to write."""
    metadata, slots = _block_metadata(positions.numel())
    name = attn.mla_attn.layer_name
    with set_forward_context(
        {name: metadata},
        draft.vllm_config,
        slot_mapping={name: slots} if with_slots else {},
    ):
        return attn(positions=positions, hidden_states=hidden_states)


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
    draft = build_draft(rope_parameters=dict(rope_parameters))
    expected_rope = _nvidia_rope(draft.config, rope_type)
    for layer in draft.model.layers:
        attn = layer.self_attn
        assert attn.rotary_emb.is_neox_style is False
        assert attn.rotary_emb.cos_sin_cache.dtype == torch.float32
        assert torch.equal(attn.rotary_emb.cos_sin_cache, expected_rope.cos_sin_cache)
        # NVIDIA: qk_head_dim**-0.5, times mscale**2 for YaRN only.
        assert attn.mla_attn.scale == pytest.approx(16**-0.5 * scale_multiplier)


def test_k3_dspark_rocm_rope_table_stays_fp32(build_draft, kernels, mqa_calls):
    """The context-KV precompute reads the fp32 cos/sin table NVIDIA uses,
    before and after draft forwards (a default rope module re-binds its table
    to the activation dtype on its first forward); the fused RoPE + cache
    write reads that table rounded to the activation dtype, which the kernel
    requires."""
    draft = build_draft(rope_parameters=dict(DEFAULT_ROPE))
    expected = _nvidia_rope(draft.config, "default").cos_sin_cache

    def precompute():
        draft.precompute_and_store_context_kv(
            torch.randn(3, 32, dtype=torch.bfloat16), torch.tensor([0, 1, 2]), None
        )
        return kernels.rope_launches.pop()["cos_sin_cache"]

    before = precompute()
    for step in range(3):
        for layer in draft.model.layers:
            _decode(
                draft,
                layer.self_attn,
                torch.tensor([step, 7]),
                torch.randn(2, 32, dtype=torch.bfloat16),
            )
    after = precompute()

    assert kernels.rope_launches == []
    assert len(kernels.rope_cache_writes) == 3 * len(draft.model.layers)
    rope_emb = draft.model.layers[0].self_attn.rotary_emb
    for table in before, after:
        assert table is rope_emb.cos_sin_cache
    assert before.dtype == torch.float32
    assert torch.equal(before, expected)
    for write in kernels.rope_cache_writes:
        assert write["cos_sin_cache"].dtype == torch.bfloat16
        assert torch.equal(write["cos_sin_cache"], expected.to(torch.bfloat16))


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_k3_dspark_rocm_rope_and_cache_write_are_one_launch(
    cache_dtype, build_draft, kernels, mqa_calls
):
    """A layer forward rotates q_pe and k_pe and writes the layer's cache
    rows in one launch of concat_and_cache_mla_rope_fused, in place on the
    query the decode kernel then reads; no separate RoPE or cache write."""
    draft = build_draft(cache_dtype=cache_dtype, rope_parameters=dict(YARN))
    attn = draft.model.layers[0].self_attn
    positions = torch.tensor([0, 5000, 100000])

    _decode(draft, attn, positions, torch.randn(3, 32, dtype=torch.bfloat16))

    assert kernels.rope_launches == [] and kernels.cache_writes == []
    (write,) = kernels.rope_cache_writes
    assert write["positions"] is positions
    assert write["is_neox"] is False
    assert write["kv_cache"] is attn.mla_attn.kv_cache
    assert torch.equal(write["slot_mapping"], torch.arange(3))
    assert write["kv_cache_dtype"] == cache_dtype
    assert write["scale"] is attn.mla_attn._k_scale
    assert write["key"].shape == (3, 8)
    assert write["kv_c"].shape == (3, 16)
    ((_, q_pe),) = mqa_calls
    assert q_pe.dtype == torch.bfloat16
    assert torch.equal(q_pe, -write["query"])


def test_k3_dspark_rocm_rope_without_cache_rows_still_rotates(
    build_draft, kernels, mqa_calls
):
    """A forward with no slot mapping (a profiling run) has no cache rows to
    write; its RoPE is still applied, by the rope module's launch."""
    draft = build_draft(rope_parameters=dict(YARN))
    attn = draft.model.layers[0].self_attn

    _decode(
        draft,
        attn,
        torch.tensor([1, 2]),
        torch.randn(2, 32, dtype=torch.bfloat16),
        with_slots=False,
    )

    assert kernels.rope_cache_writes == [] and kernels.cache_writes == []
    (launch,) = kernels.rope_launches
    assert launch["cos_sin_cache"] is attn.rotary_emb.cos_sin_cache
    ((_, q_pe),) = mqa_calls
    assert torch.equal(q_pe, -launch["query"])


def test_k3_dspark_rocm_qkv_norms_are_one_launch(build_draft, kernels, mqa_calls):
    """Without AITER the q_a and kv_a RMSNorms are one launch of the Triton
    fused_q_kv_rmsnorm, as in NVIDIA's K3 MLA, not two rms_norm launches."""
    draft = build_draft()
    attn = draft.model.layers[0].self_attn
    hidden_states = torch.randn(2, 32, dtype=torch.bfloat16)
    norms_before = len(kernels.qkv_norms)

    _decode(draft, attn, torch.tensor([1, 2]), hidden_states)

    ((q_c, kv_c, q_weight, kv_weight, eps),) = kernels.qkv_norms[norms_before:]
    assert q_c.shape == (2, 16) and kv_c.shape == (2, 16)
    assert q_weight.data_ptr() == attn.q_a_layernorm.weight.data_ptr()
    assert kv_weight.data_ptr() == attn.kv_a_layernorm.weight.data_ptr()
    assert eps == attn.q_a_layernorm.variance_epsilon


def test_k3_dspark_rocm_wrapper_takes_per_rank_heads(build_draft, monkeypatch):
    # TP=2 needs two ranks; the drafter reads the TP size once, here. (The
    # weights, sharded for one rank, are not post-processed for two.)
    monkeypatch.setattr(
        amd_dspark_mla, "get_tensor_model_parallel_world_size", lambda: 2
    )
    draft = build_draft(post_process=False)
    attn = draft.model.layers[0].self_attn

    assert isinstance(attn, KimiK3MultiHeadLatentAttentionWrapper)
    assert attn.num_heads == attn.mla_attn.num_heads == 2
    assert attn.mla_attn.non_causal_multi_token_decode is True
    assert attn.mla_attn.kv_b_proj is attn.kv_b_proj
    # The projections shard the global head count over TP themselves.
    assert attn.q_b_proj.output_size == 4 * 16
    assert attn.kv_b_proj.output_size == 4 * (8 + 8)
    assert attn.o_proj.input_size == 4 * 8
    assert attn.o_proj.reduce_results is False


def test_k3_dspark_rocm_drafter_takes_the_draft_kernels():
    """The ROCm drafter is not torch.compiled, and opts in: under a compiled
    target, DSparkSpeculator builds and runs it on vLLM's kernels, as
    --enforce-eager does."""
    assert not issubclass(
        K3DSparkForCausalLM.model_cls, TorchCompileWithNoGuardsWrapper
    )
    assert draft_runs_uncompiled(K3DSparkForCausalLM)


def test_k3_dspark_rocm_kv_cache_layer_names(build_draft):
    draft = build_draft(post_process=False)
    names = draft.get_draft_kv_cache_layer_names()
    layers = draft.vllm_config.compilation_config.static_forward_context

    assert names == [
        f"model.layers.{TARGET_LAYERS + i}.self_attn.attn" for i in range(2)
    ]
    for name, layer in zip(names, draft.model.layers):
        assert layers[name] is layer.self_attn.mla_attn
        assert layer.self_attn.prefix == name.removesuffix(".attn")
        assert type(layer.mlp) is KimiMLP  # the ROCm one
    # The loader sees the NVIDIA drafter's MLA parameter names.
    assert {n for n, _ in draft.model.layers[0].self_attn.named_parameters()} == {
        "fused_qkv_a_proj.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }


def test_k3_dspark_rocm_never_takes_identity_rope_fused_decode(
    build_draft, kernels, mqa_calls, monkeypatch
):
    """The ROCm wrapper's fused decode applies an identity RoPE (it was written
    for the NoPE target). Its predicate reads the global AITER MLA switch, not
    the layer's own backend: with AITER MLA on for the target, production
    shapes and an fp8 KV cache, a draft layer running TRITON_MLA qualifies.
    Only the layer's rotary embedding rules it out, so a decode block still
    goes through MLAAttention with RoPE applied."""
    monkeypatch.setattr(rocm_aiter_ops, "is_mla_enabled", lambda: True)
    fused_calls = []
    # The AITER kernel it launches: recorded.
    monkeypatch.setattr(
        KimiK3MultiHeadLatentAttentionWrapper,
        "_fused_decode",
        lambda self, *args: fused_calls.append(args),
    )
    draft = build_draft(cache_dtype="fp8", **PRODUCTION_MLA)
    attn = draft.model.layers[0].self_attn
    assert attn.mla_attn.attn_backend.get_name() == "TRITON_MLA"
    assert attn.mla_attn.kv_cache_dtype == "fp8"

    _decode(draft, attn, torch.tensor([3, 4]), torch.randn(2, 32, dtype=torch.bfloat16))

    assert fused_calls == []
    assert len(mqa_calls) == len(kernels.rope_cache_writes) == 1


def test_k3_dspark_rocm_kv_cache_spec_groups_with_target_mla(build_draft):
    """The draft's MLAAttention layers share one KV-cache group with the K3
    ROCm target's MLA layers (AITER MLA, fp8), as the engine needs."""
    draft = build_draft(cache_dtype="fp8", **PRODUCTION_MLA)
    vllm_config = draft.vllm_config
    target_spec = MLAAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=576,
        dtype=current_platform.fp8_dtype(),
        cache_dtype_str="fp8",
    )
    kv_cache_spec = {
        f"model.layers.{i}.self_attn.attn": target_spec for i in range(TARGET_LAYERS)
    }
    for name in draft.get_draft_kv_cache_layer_names():
        layer = vllm_config.compilation_config.static_forward_context[name]
        kv_cache_spec[name] = layer.get_kv_cache_spec(vllm_config)

    (group,) = get_kv_cache_groups(vllm_config, kv_cache_spec)
    assert sorted(group.layer_names) == sorted(kv_cache_spec)
    # One fp8 page layout, the target's.
    for name in draft.get_draft_kv_cache_layer_names():
        assert kv_cache_spec[name].page_size_bytes == target_spec.page_size_bytes


@pytest.mark.parametrize(
    ("cache_dtype", "grouped"),
    [
        ("fp8", True),
        # The grouped kernel rejects fp8_e5m2 on ROCm: per-layer fallback.
        ("fp8_e5m2", False),
    ],
)
def test_k3_dspark_rocm_grouped_context_kv_insert(
    cache_dtype, grouped, build_draft, kernels
):
    """The context KV goes into the inner MLAAttention's caches: grouped,
    with their scales, for the dtypes the ROCm grouped kernel accepts, else
    layer by layer through each MLAAttention's backend."""
    draft = build_draft(cache_dtype=cache_dtype)
    owners = [layer.self_attn.mla_attn for layer in draft.model.layers]

    slots = torch.tensor([0, 1, 2])
    draft.precompute_and_store_context_kv(
        torch.randn(3, 32, dtype=torch.bfloat16), torch.tensor([0, 1, 2]), slots
    )

    if grouped:
        (call,) = kernels.grouped_writes
        assert call[2].tolist() == [o.kv_cache.data_ptr() for o in owners]
        assert torch.equal(call[-2], torch.stack([o._k_scale for o in owners]))
        assert call[-1] == cache_dtype
        assert kernels.cache_writes == []
    else:
        assert kernels.grouped_writes == []
        assert len(kernels.cache_writes) == len(owners)
        for write, owner in zip(kernels.cache_writes, owners):
            assert write["kv_cache"] is owner.kv_cache
            assert torch.equal(write["slot_mapping"], slots)
            assert write["kv_cache_dtype"] == cache_dtype
            assert write["scale"] is owner._k_scale


def test_k3_dspark_rocm_weight_reload_keeps_context_kv_addresses(build_draft):
    """A weight reload ends in every module's post-load hook
    (finalize_model_weights), which rebuilds the stacked context-KV norm
    weights and fp8 scales of the ROCm drafter's inner MLAAttentions. Captured
    graphs read them by address: they are refilled, not replaced."""
    draft = build_draft(cache_dtype="fp8")
    model = draft.model
    norms, scales = model._context_kv_norm_weights, model._context_kv_scales
    addresses = (norms.data_ptr(), scales.data_ptr())

    # The reload writes new values into the same weights, then post-processes.
    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_a_layernorm.weight.data.fill_(1.0 + i)
    with set_current_vllm_config(draft.vllm_config):
        process_weights_after_loading(
            draft, draft.vllm_config.model_config, torch.device("cpu")
        )

    assert model._context_kv_norm_weights is norms
    assert model._context_kv_scales is scales
    assert (norms.data_ptr(), scales.data_ptr()) == addresses
    assert torch.equal(norms[:, 0], torch.tensor([1.0, 2.0], dtype=norms.dtype))
    owners = [layer.self_attn.mla_attn for layer in model.layers]
    assert torch.equal(scales, torch.stack([o._k_scale.reshape(()) for o in owners]))


def test_k3_dspark_registry_resolves_the_platforms_drafter():
    """vllm.models.kimi_k3 picks the platform's drafter when it is imported:
    the registry's K3DSparkModel is the ROCm drafter on ROCm and the NVIDIA
    one elsewhere (CUDA, XPU, CPU), as test_registry.py checks per platform."""
    expected = (
        K3DSparkForCausalLM
        if current_platform.is_rocm()
        else nvidia_dspark_mla.K3DSparkForCausalLM
    )
    assert ModelRegistry._try_load_model_cls("K3DSparkModel") is expected


def test_k3_dspark_draft_keeps_its_config(tmp_path):
    """DSparkSpeculatorConfig takes a draft whose class declares no speculator
    config for a DeepSeek-V4 draft and rewrites its model_type and
    architectures. The drafter the registry resolves on this platform must
    declare the config, so the K3 draft keeps its own."""
    from vllm.v1.worker.gpu.spec_decode.dspark.config import DSparkSpeculatorConfig

    draft = _speculative_config(tmp_path).draft_model_config

    assert draft.speculator_config_class == (
        f"{DSparkSpeculatorConfig.__module__}.{DSparkSpeculatorConfig.__qualname__}"
    )
    assert draft.hf_config.model_type == "k3_dspark"
    assert draft.architectures == ["K3DSparkModel"]
