# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import copy
from collections import Counter
from dataclasses import fields

import torch.nn as nn

from vllm.config import ModelConfig, ParallelConfig, VllmConfig, replace
from vllm.config.compilation import CompilationConfig, CompilationMode
from vllm.config.kernel import IrOpPriorityConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.utils import get_draft_load_config
from vllm.models.deepseek_v4.common.eplb_util import dspark_draft_supports_eplb
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.worker.gpu.spec_decode.utils import get_pp_safe_draft_load_config

logger = init_logger(__name__)


def _resolve_dspark_attention_backend(
    draft_model_config: ModelConfig,
    draft_backend: AttentionBackendEnum | None,
    target_backend: AttentionBackendEnum | None,
) -> AttentionBackendEnum | None:
    if draft_backend is not None:
        return draft_backend
    # DeepSeek-V4(.1) draft layers share the target's KV-cache layout. Other
    # DSpark architectures may use a different attention kind.
    if draft_model_config.hf_config.model_type in ("deepseek_v4", "deepseek_v41"):
        if target_backend is not None:
            logger.info_once(
                "Using the target model's %s attention backend for the "
                "DeepSeek-V4 DSpark drafter.",
                target_backend.name,
            )
        return target_backend
    return None


def _get_dspark_parallel_config(
    parallel_config: ParallelConfig,
    tensor_parallel_size: int,
    draft_model_config: ModelConfig,
) -> ParallelConfig:
    enable_draft_eplb = parallel_config.enable_eplb and dspark_draft_supports_eplb(
        draft_model_config
    )
    if parallel_config.enable_eplb and not enable_draft_eplb:
        logger.warning_once(
            "EPLB is disabled for the DSpark draft model (%s). EPLB remains "
            "enabled for the target model.",
            draft_model_config.hf_config.model_type,
        )

    if enable_draft_eplb:
        return replace(
            parallel_config,
            pipeline_parallel_size=1,
            tensor_parallel_size=tensor_parallel_size,
            enable_elastic_ep=False,
        )

    return replace(
        parallel_config,
        pipeline_parallel_size=1,
        tensor_parallel_size=tensor_parallel_size,
        enable_eplb=False,
        eplb_config=replace(
            parallel_config.eplb_config,
            num_redundant_experts=0,
        ),
        enable_elastic_ep=False,
    )


# A DSpark draft model is built and run under the target's compilation config.
# Under torch.compile with Inductor (vLLM's default) that config turns custom
# ops off and puts vLLM IR ops on their native implementations, forms meant for
# Inductor to fuse. A drafter that is compiled too (Qwen3, Qwen3-Omni, Gemma 4,
# Muse Spark, MiniMax, XPress) gets that fusion; one that runs uncompiled would
# run each RMSNorm as 6-8 eager PyTorch kernels, so it can opt in to what
# --enforce-eager gives it instead: custom ops on, IR ops on vLLM's kernels.
# The uncompiled drafters that do not opt in (K3's NVIDIA ones, DeepSeek-V4,
# Mistral Large 4) keep the target's config, as before.


def draft_runs_uncompiled(model_cls: type[nn.Module]) -> bool:
    """Whether a drafter runs uncompiled, so that it takes vLLM's kernels: its
    class says so (`dspark_draft_runs_uncompiled = True`). A drafter that says
    nothing is taken as compiled and keeps the target's config."""
    return getattr(model_cls, "dspark_draft_runs_uncompiled", False) is True


def draft_compilation_config(
    compilation_config: CompilationConfig,
) -> CompilationConfig:
    """The target's compilation config with every custom op on (ops the user
    disabled stay off), for an uncompiled drafter. A shallow copy: the
    draft's layers still register in the target's forward context; the record
    of the custom ops built is the draft's own."""
    draft = copy.copy(compilation_config)
    disabled = [op for op in compilation_config.custom_ops if op.startswith("-")]
    draft.custom_ops = ["all", *disabled]
    draft.enabled_custom_ops = Counter()
    draft.disabled_custom_ops = Counter()
    return draft


def draft_ir_op_priority(vllm_config: VllmConfig) -> IrOpPriorityConfig:
    """The IR op priority for the draft's forward: the platform's choice
    without a compiler, for each op whose target priority starts with the
    native implementation; an op the target runs on a kernel (AITER, or a
    user's choice) keeps the target's list."""
    eager = copy.copy(vllm_config)
    eager.compilation_config = copy.copy(vllm_config.compilation_config)
    eager.compilation_config.mode = CompilationMode.NONE
    compile_free = current_platform.get_default_ir_op_priority(eager)
    target = vllm_config.kernel_config.ir_op_priority
    priorities = {}
    for field in fields(IrOpPriorityConfig):
        priority = getattr(target, field.name)
        if not priority or priority[0] == "native":
            priority = getattr(compile_free, field.name)
        priorities[field.name] = priority
    return IrOpPriorityConfig(**priorities)


def load_dspark_model(target_model: nn.Module, vllm_config: VllmConfig) -> nn.Module:
    speculative_config = vllm_config.speculative_config
    assert speculative_config is not None
    draft_model_config = speculative_config.draft_model_config

    from vllm.compilation.backends import set_model_tag
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.utils import get_draft_quant_config
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import (
        get_target_lm_head,
        maybe_share_target_embed,
        share_target_lm_head,
    )

    draft_attention_backend = _resolve_dspark_attention_backend(
        draft_model_config,
        speculative_config.attention_backend,
        vllm_config.attention_config.backend,
    )

    # An uncompiled drafter takes vLLM's kernels; a compiled one keeps the
    # target's compilation config, which its graphs are built for.
    draft_overrides = {}
    if draft_runs_uncompiled(get_model_cls(draft_model_config)):
        draft_overrides["compilation_config"] = draft_compilation_config(
            vllm_config.compilation_config
        )
    draft_vllm_config = replace(
        vllm_config,
        parallel_config=_get_dspark_parallel_config(
            vllm_config.parallel_config,
            speculative_config.draft_parallel_config.tensor_parallel_size,
            draft_model_config,
        ),
        attention_config=replace(
            vllm_config.attention_config,
            use_non_causal=dflash_has_any_non_causal(draft_model_config.hf_config),
            backend=draft_attention_backend,
        ),
        cache_config=(
            replace(
                vllm_config.cache_config,
                cache_dtype=speculative_config.kv_cache_dtype,
            )
            if speculative_config.kv_cache_dtype is not None
            else vllm_config.cache_config
        ),
        load_config=get_pp_safe_draft_load_config(get_draft_load_config(vllm_config)),
        **draft_overrides,
    )
    # VllmConfig post-init restores the target's quant config because the target
    # config is retained for DSpark's target-layer metadata, so we must override it.
    draft_vllm_config.quant_config = get_draft_quant_config(vllm_config)

    with set_model_tag("dspark_head"):
        draft_model = get_model(
            vllm_config=draft_vllm_config, model_config=draft_model_config
        )

    target_language_model = (
        target_model.get_language_model()
        if hasattr(target_model, "get_language_model")
        else target_model
    )
    target_inner = target_language_model.model
    draft_inner = draft_model.model
    target_vocab_size = vllm_config.model_config.get_vocab_size()

    if draft_model_config.get_vocab_size() <= target_vocab_size:
        maybe_share_target_embed(draft_model, draft_inner, target_inner)

    draft_output_vocab_size = (
        getattr(draft_model_config.hf_config, "draft_vocab_size", None)
        or draft_model_config.get_vocab_size()
    )
    share_target_lm_head(
        draft_model,
        get_target_lm_head(target_model, target_language_model),
        speculative_config.draft_lm_head_quantization,
        can_share=draft_output_vocab_size == target_vocab_size,
    )

    return draft_model
