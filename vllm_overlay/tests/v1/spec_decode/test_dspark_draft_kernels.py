# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An uncompiled DSpark drafter runs vLLM's kernels under a compiled target.

A drafter is built and run under the target's compilation config. Under
torch.compile with Inductor that config turns custom ops off and puts vLLM IR
ops on their native forms, which only Inductor fuses: a drafter that is
compiled too keeps that config and its graphs, untouched; one that runs
uncompiled and opts in gets what ``--enforce-eager`` gives instead, and one
that does not opt in (K3's NVIDIA drafters) keeps the target's, as before. The
target keeps its own config, and shares no record of built ops with the draft.
"""

import contextlib
import json
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch.nn as nn

from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.config import (
    CompilationConfig,
    CompilationMode,
    DeviceConfig,
    KernelConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.kernel import IrOpPriorityConfig
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.registry import ModelRegistry
from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
from vllm.models.kimi_k3.nvidia.specialized_decode.drafter.model import (
    SpecializedK3DSparkForCausalLM,
)
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark import utils as dspark_utils
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.utils import (
    draft_ir_op_priority,
    draft_runs_uncompiled,
)

pytestmark = pytest.mark.cpu_test

# The drafters DSparkSpeculator loads, by registry architecture.
DSPARK_DRAFTERS = sorted(
    arch
    for arch in ModelRegistry.get_supported_archs()
    if "DSpark" in arch or "XPress" in arch
)
# Opted in. K3DSparkModel is the platform's K3 drafter: ROCm's opts in; the
# NVIDIA ones (K3DSparkModel elsewhere, and the SM100 specialized decode's
# subclass) keep the target's config.
UNCOMPILED_DRAFTERS = {"K3DSparkModel"} if current_platform.is_rocm() else set()
# Every registered drafter is classified: a new one fails here until it is.
COMPILED_DRAFTERS = {
    "DFlashQwen3XPressModel",
    "DSparkMiniMaxDraftModel",
    "Gemma4DSparkModel",
    "MuseSparkDSparkModel",
    "Qwen3DSparkModel",
    "Qwen3OmniDSparkModel",
    "Qwen3XPressModel",
}
# Uncompiled, but not (yet) opted in: they keep the target's config.
NOT_OPTED_IN_DRAFTERS = {
    "DSparkDraftModel",
    "DSparkV41DraftModel",
    "K3DSparkModel",
    "MistralLarge4DSparkModel",
} - UNCOMPILED_DRAFTERS
# Registered drafters whose package imports only on CUDA or ROCm.
CUDA_ALIKE_ONLY_DRAFTERS = {"MistralLarge4DSparkModel"}


class _OptedInDrafter(nn.Module):
    """An uncompiled drafter that opts in."""

    dspark_draft_runs_uncompiled = True


def _config(**kwargs) -> VllmConfig:
    return VllmConfig(device_config=DeviceConfig(device="cpu"), **kwargs)


def _enabled(op, vllm_config) -> bool:
    with set_current_vllm_config(vllm_config):
        return op.enabled()


def _drafter_cls(arch: str) -> type[nn.Module]:
    if arch in CUDA_ALIKE_ONLY_DRAFTERS and not current_platform.is_cuda_alike():
        pytest.skip(f"{arch} imports only on CUDA or ROCm")
    model_cls = ModelRegistry._try_load_model_cls(arch)
    assert model_cls is not None, arch
    return model_cls


def test_every_drafter_is_classified():
    classified = UNCOMPILED_DRAFTERS | COMPILED_DRAFTERS | NOT_OPTED_IN_DRAFTERS
    assert set(DSPARK_DRAFTERS) == classified


@pytest.mark.parametrize("arch", DSPARK_DRAFTERS)
def test_only_uncompiled_drafters_take_the_draft_kernels(arch: str):
    model_cls = _drafter_cls(arch)
    assert draft_runs_uncompiled(model_cls) == (arch in UNCOMPILED_DRAFTERS)
    inner = getattr(model_cls, "model_cls", None)
    if arch in COMPILED_DRAFTERS:
        assert issubclass(inner, TorchCompileWithNoGuardsWrapper)
    elif isinstance(inner, type):
        assert not issubclass(inner, TorchCompileWithNoGuardsWrapper)


def test_a_drafter_takes_the_draft_kernels_only_by_saying_so():
    """The opt-in is the class attribute, not a guess from the class's shape:
    an uncompiled inner model alone does not opt a drafter in."""

    class InnerModel(nn.Module):
        pass

    class SilentDrafter(nn.Module):
        model_cls = InnerModel

    assert not draft_runs_uncompiled(SilentDrafter)
    assert draft_runs_uncompiled(_OptedInDrafter)


def _target_config(tmp_path, **kwargs) -> VllmConfig:
    """A target's VllmConfig (vLLM's default: compiled) with a K3 DSpark
    draft: a small Llama target and a small K3 draft checkpoint config."""
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
                num_hidden_layers=4,
                vocab_size=64,
            )
        )
    )
    K3DSparkConfig(
        architectures=["K3DSparkModel"],
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=2,
        vocab_size=64,
        target_hidden_size=32,
        target_layer_ids=[1, 3],
        num_target_layers=2,
        markov_rank=4,
    ).save_pretrained(draft)
    model_config = ModelConfig(
        model=str(target), skip_tokenizer_init=True, dtype="bfloat16"
    )
    speculative_config = SpeculativeConfig(
        method="dspark",
        model=str(draft),
        num_speculative_tokens=3,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )
    return _config(
        model_config=model_config, speculative_config=speculative_config, **kwargs
    )


@pytest.fixture
def one_rank(tmp_path):
    """A single-rank gloo process group (as tests/models/multimodal/
    test_conformer_encoder.py), for the loader's pipeline-parallel checks."""
    try:
        with set_current_vllm_config(_config()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{tmp_path / 'distributed'}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=1)
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def _load_draft(target: VllmConfig, draft_cls: type) -> VllmConfig:
    """The VllmConfig that load_dspark_model builds the draft model under,
    through the real replace and VllmConfig.__post_init__. Doubles: the
    draft's class (the drafter under test) and its construction."""
    built = {}

    def get_model(*, vllm_config, model_config):
        built["config"] = vllm_config
        return SimpleNamespace(model=SimpleNamespace())

    with (
        patch("vllm.model_executor.model_loader.get_model", side_effect=get_model),
        patch(
            "vllm.model_executor.model_loader.utils.get_model_cls",
            return_value=draft_cls,
        ),
    ):
        dspark_utils.load_dspark_model(SimpleNamespace(model=nn.Module()), target)
    return built["config"]


@pytest.mark.parametrize("user_ops", [[], ["-silu_and_mul"]])
def test_loader_builds_an_uncompiled_drafter_on_custom_ops(
    tmp_path, one_rank, user_ops
):
    target = _target_config(
        tmp_path, compilation_config=CompilationConfig(custom_ops=user_ops)
    )
    assert target.compilation_config.mode == CompilationMode.VLLM_COMPILE
    target_ops = target.compilation_config.custom_ops.copy()
    eager = _config(
        compilation_config=CompilationConfig(
            mode=CompilationMode.NONE, custom_ops=user_ops.copy()
        )
    )

    draft = _load_draft(target, _OptedInDrafter)

    # The draft's layers are built on the custom ops --enforce-eager builds,
    # an op the user turned off included; the target's stay off.
    def built_ops(config):
        return {op.__name__: _enabled(op, config) for op in (RMSNorm, SiluAndMul)}

    assert built_ops(draft) == built_ops(eager)
    assert built_ops(eager)["RMSNorm"]
    assert not any(built_ops(target).values())
    assert target.compilation_config.custom_ops == target_ops
    # Its IR ops run on the kernels --enforce-eager picks
    # (DSparkSpeculator enters this priority around the draft's calls).
    assert draft_ir_op_priority(target) == eager.kernel_config.ir_op_priority
    # The draft's layers register in the target's forward context, but its
    # record of built ops is its own.
    target_config, draft_config = target.compilation_config, draft.compilation_config
    assert draft_config.static_forward_context is target_config.static_forward_context
    assert draft_config.enabled_custom_ops is not target_config.enabled_custom_ops
    assert draft_config.disabled_custom_ops is not target_config.disabled_custom_ops


@pytest.mark.parametrize(
    "drafter",
    [K3DSparkForCausalLM, SpecializedK3DSparkForCausalLM],
    ids=["nvidia", "nvidia-sm100-specialized"],
)
def test_loader_keeps_k3_nvidia_drafters_as_in_vllm_0_34(tmp_path, one_rank, drafter):
    """K3's NVIDIA drafters do not opt in: the draft is built under the
    target's own compilation config and runs under the target's IR op
    priority, as on vLLM 0.34.0."""
    target = _target_config(tmp_path)
    target_ops = target.compilation_config.custom_ops.copy()

    draft = _load_draft(target, drafter)

    assert draft.compilation_config.custom_ops == target_ops
    assert not _enabled(RMSNorm, draft)
    assert draft.compilation_config is target.compilation_config
    # DSparkSpeculator sets no draft IR op priority for it.
    assert not draft_runs_uncompiled(drafter)


@pytest.mark.parametrize("arch", sorted(set(DSPARK_DRAFTERS) - UNCOMPILED_DRAFTERS))
def test_loader_leaves_a_compiled_drafter_on_the_target_config(
    tmp_path, one_rank, arch: str
):
    """Its Inductor graphs are built from the config it is handed: the
    target's own object, untouched."""
    target = _target_config(tmp_path)
    before = target.compilation_config.custom_ops.copy()
    draft = _load_draft(target, _drafter_cls(arch))
    assert draft.compilation_config is target.compilation_config
    assert target.compilation_config.custom_ops == before
    assert not _enabled(RMSNorm, draft)


def test_draft_ir_ops_run_what_enforce_eager_runs():
    compiled = _config()
    eager = _config(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    assert draft_ir_op_priority(compiled) == eager.kernel_config.ir_op_priority
    # The target's own choice is left alone.
    assert draft_ir_op_priority(eager) == eager.kernel_config.ir_op_priority


def test_draft_keeps_an_ir_kernel_the_target_chose():
    target = _config(
        kernel_config=KernelConfig(
            ir_op_priority=IrOpPriorityConfig(rms_norm=["vllm_c", "native"])
        )
    )
    priority = draft_ir_op_priority(target)
    assert priority.rms_norm == target.kernel_config.ir_op_priority.rms_norm


def test_draft_forward_and_capture_run_under_the_draft_priority(monkeypatch):
    """The draft model is only called from propose and capture."""
    seen: list[tuple[str, bool]] = []
    inside = [False]

    @contextlib.contextmanager
    def set_priority():
        inside[0] = True
        yield
        inside[0] = False

    def record(name):
        return lambda self, *args, **kwargs: seen.append((name, inside[0]))

    monkeypatch.setattr(DFlashSpeculator, "propose", record("propose"))
    monkeypatch.setattr(DFlashSpeculator, "capture", record("capture"))
    speculator = object.__new__(DSparkSpeculator)
    speculator.draft_ir_op_priority = SimpleNamespace(set_priority=set_priority)

    speculator.propose(dummy_run=True)
    speculator.capture()

    assert seen == [("propose", True), ("capture", True)]
    assert not inside[0]

    # A compiled drafter runs under the target's priority.
    seen.clear()
    speculator.draft_ir_op_priority = None
    speculator.propose(dummy_run=True)
    speculator.capture()
    assert seen == [("propose", False), ("capture", False)]
