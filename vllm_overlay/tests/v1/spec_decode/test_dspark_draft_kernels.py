# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An uncompiled DSpark drafter runs vLLM's kernels under a compiled target.

A drafter is built and run under the target's compilation config. Under
torch.compile with Inductor that config turns custom ops off and puts vLLM IR
ops on their native forms, which only Inductor fuses: a drafter that is
compiled too keeps that config and its graphs, untouched; one that runs
uncompiled (K3) gets what ``--enforce-eager`` gives instead. The target keeps
its own config, and shares no record of built ops with the draft.
"""

import contextlib
from contextlib import nullcontext
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
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.kernel import IrOpPriorityConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform
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
UNCOMPILED_DRAFTERS = {"K3DSparkModel"}
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
    "MistralLarge4DSparkModel",
}
# Registered drafters whose package imports only on CUDA or ROCm.
CUDA_ALIKE_ONLY_DRAFTERS = {"MistralLarge4DSparkModel"}


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

    class OptedInDrafter(nn.Module):
        dspark_draft_runs_uncompiled = True

    assert not draft_runs_uncompiled(SilentDrafter)
    assert draft_runs_uncompiled(OptedInDrafter)


def _load_draft(target: VllmConfig, draft_cls: type) -> SimpleNamespace:
    """The vllm config that load_dspark_model builds the draft with, and the
    target's config it was handed. Only the model's construction is replaced
    (as in tests/model_executor/test_qwen3_omni.py)."""
    built = {}

    def get_model(*, vllm_config, model_config):
        built["config"] = vllm_config
        return SimpleNamespace(model=SimpleNamespace())

    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(
                hf_config=SimpleNamespace(model_type="k3_dspark"),
                get_vocab_size=lambda: 8,
            ),
            draft_parallel_config=SimpleNamespace(tensor_parallel_size=1),
            attention_backend=None,
            kv_cache_dtype=None,
            draft_load_config=None,
            draft_lm_head_quantization=None,
        ),
        parallel_config=ParallelConfig(),
        attention_config=SimpleNamespace(backend=None),
        cache_config=SimpleNamespace(),
        load_config=SimpleNamespace(load_format="auto"),
        model_config=SimpleNamespace(get_vocab_size=lambda: 8),
        compilation_config=target.compilation_config,
    )

    def fake_replace(config, **changes):
        return SimpleNamespace(**{**vars(config), **changes})

    with (
        patch.object(dspark_utils, "replace", side_effect=fake_replace),
        patch(
            "vllm.v1.worker.gpu.spec_decode.eagle.utils.get_pp_group",
            return_value=SimpleNamespace(world_size=1),
        ),
        patch(
            "vllm.v1.worker.gpu.spec_decode.utils.get_pp_group",
            return_value=SimpleNamespace(world_size=1),
        ),
        patch("vllm.compilation.backends.set_model_tag", return_value=nullcontext()),
        patch("vllm.model_executor.model_loader.get_model", side_effect=get_model),
        patch(
            "vllm.model_executor.model_loader.utils.get_model_cls",
            return_value=draft_cls,
        ),
        patch(
            "vllm.model_executor.models.qwen3_dflash.dflash_has_any_non_causal",
            return_value=True,
        ),
        patch(
            "vllm.model_executor.models.utils.get_draft_quant_config",
            return_value=None,
        ),
    ):
        dspark_utils.load_dspark_model(SimpleNamespace(model=nn.Module()), vllm_config)
    return built["config"]


@pytest.mark.parametrize("user_ops", [[], ["-silu_and_mul"]])
def test_loader_builds_an_uncompiled_drafter_on_custom_ops(user_ops):
    k3_drafter = _drafter_cls("K3DSparkModel")
    target = _config(compilation_config=CompilationConfig(custom_ops=user_ops))
    assert target.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert not _enabled(RMSNorm, target)

    draft = _load_draft(target, k3_drafter)

    assert _enabled(RMSNorm, draft)
    # An op the user turned off stays off.
    assert _enabled(SiluAndMul, draft) == ("-silu_and_mul" not in user_ops)
    # The target keeps its config; the draft's layers register in the
    # target's forward context, but its record of built ops is its own.
    target_config, draft_config = target.compilation_config, draft.compilation_config
    assert "none" in target_config.custom_ops and draft_config is not target_config
    assert draft_config.static_forward_context is target_config.static_forward_context
    assert draft_config.enabled_custom_ops is not target_config.enabled_custom_ops
    assert draft_config.disabled_custom_ops is not target_config.disabled_custom_ops


@pytest.mark.parametrize("arch", sorted(set(DSPARK_DRAFTERS) - UNCOMPILED_DRAFTERS))
def test_loader_leaves_a_compiled_drafter_on_the_target_config(arch: str):
    """Its Inductor graphs are built from the config it is handed: the
    target's own object, untouched."""
    target = _config()
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
