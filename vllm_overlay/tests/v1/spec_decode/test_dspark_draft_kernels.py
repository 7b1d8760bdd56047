# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSpark draft model runs vLLM's kernels under a compiled target.

The draft is never compiled, but it is built and run under the target's
compilation config. Under torch.compile with Inductor that config turns custom
ops off and puts vLLM IR ops on their native forms, which only Inductor fuses;
the draft must get what ``--enforce-eager`` gives instead, and the target must
keep its own config.
"""

import contextlib
import copy
from types import SimpleNamespace

import pytest

from vllm.config import (
    CompilationConfig,
    CompilationMode,
    DeviceConfig,
    KernelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.kernel import IrOpPriorityConfig
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.utils import (
    draft_compilation_config,
    draft_ir_op_priority,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


def _config(**kwargs) -> VllmConfig:
    return VllmConfig(device_config=DeviceConfig(device="cpu"), **kwargs)


def _enabled(op, vllm_config: VllmConfig) -> bool:
    with set_current_vllm_config(vllm_config):
        return op.enabled()


def _with_compilation(vllm_config: VllmConfig, compilation_config) -> VllmConfig:
    """What load_dspark_model hands the draft's construction."""
    draft = copy.copy(vllm_config)
    draft.compilation_config = compilation_config
    return draft


@pytest.mark.parametrize("user_ops", [[], ["-silu_and_mul"]])
def test_draft_builds_custom_ops_that_a_compiled_target_turns_off(user_ops):
    target = _config(compilation_config=CompilationConfig(custom_ops=user_ops))
    assert target.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert not _enabled(RMSNorm, target)

    draft = _with_compilation(
        target, draft_compilation_config(target.compilation_config)
    )

    assert _enabled(RMSNorm, draft)
    # An op the user turned off stays off.
    assert _enabled(SiluAndMul, draft) == ("-silu_and_mul" not in user_ops)
    # The target keeps its config, and the draft's layers register in the
    # target's forward context.
    assert "none" in target.compilation_config.custom_ops
    assert (
        draft.compilation_config.static_forward_context
        is target.compilation_config.static_forward_context
    )


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
