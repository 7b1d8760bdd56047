# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

from typing import ClassVar

import torch

import vllm.envs as envs
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    MultipleOf,
    max_decode_query_len,
)
from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
from vllm.v1.attention.ops.triton_mla_block_decode import (
    decode_attention_fwd_mla_block,
    mla_block_decode_num_kv_splits,
)
from vllm.v1.kv_cache_interface import (
    get_kv_cache_spec_sliding_window,
    is_quantized_kv_cache,
)
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

logger = init_logger(__name__)

# num_kv_splits selection (shared by forward_mqa and the workspace reservation
# so the two cannot drift). Both are hardware dependent.
_MIN_WORK_PER_SPLIT = 512
_SPLIT_OCCUPANCY_MULTIPLIER = 2


def _compute_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    # Power of 2 to avoid excessive kernel instantiations, capped by an SM-based
    # maximum (occupancy multiplier allows multiple blocks per SM
    # for latency hiding). Host arithmetic: no Triton needed.
    ideal_splits = next_power_of_2(max(1, max_seq_len // _MIN_WORK_PER_SPLIT))
    max_splits = sm_count * _SPLIT_OCCUPANCY_MULTIPLIER
    return min(ideal_splits, max_splits)


def _reserve_attn_logits_workspace(
    vllm_config: VllmConfig,
    max_decode_rows: int,
    q_num_heads: int,
    kv_lora_rank: int,
    sliding_window: int | None = None,
) -> None:
    """Pre-size the shared workspace for the decode split-KV attn logits.

    Reserving at the worst case (max KV length -> max num_kv_splits,
    max_decode_rows) before warmup/cudagraph capture means the per-call
    ``get_simultaneous`` in ``forward_mqa`` never has to grow the buffer at
    runtime (which would raise once the workspace is locked). Like
    ``forward_mqa``, the KV length is clamped to the layer's sliding window.
    """
    if not is_workspace_manager_initialized():
        return
    max_kv_len = vllm_config.model_config.max_model_len
    if sliding_window is not None:
        max_kv_len = min(max_kv_len, sliding_window)
    max_splits = _compute_num_kv_splits(
        max_kv_len,
        current_platform.num_compute_units(),
    )
    current_workspace_manager().get_simultaneous(
        ((max_decode_rows, q_num_heads, max_splits, kv_lora_rank + 1), torch.float32),
    )


class TritonMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # forward_mqa decodes a uniform multi-token block: a causal one flattened
    # to one decode row per query token, a non-causal one (a draft block)
    # with the block kernel, so both take the decode path.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    supports_non_causal_multi_token_decode: ClassVar[bool] = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # DCP local sequence lengths are not advanced between draft steps.
        self.supports_draft_decode_metadata_update = self.dcp_world_size == 1
        # forward_mqa decodes query_len rows per request, and query_len is
        # bounded by the reorder threshold. DCP all-gathers the query heads
        # before forward_mqa.
        _reserve_attn_logits_workspace(
            vllm_config,
            vllm_config.scheduler_config.max_num_seqs * self.reorder_batch_threshold,
            self.num_heads * self.dcp_world_size,
            self.mla_dims.kv_lora_rank,
            get_kv_cache_spec_sliding_window(kv_cache_spec),
        )

    def update_draft_decode_metadata(self, _metadata: MLACommonMetadata) -> None:
        pass


class TritonMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
    ]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        if block_size is None:
            return True
        return block_size % 16 == 0

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type["TritonMLAImpl"]:
        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type["TritonMLAMetadataBuilder"]:
        return TritonMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        # Decode only (windowed DSpark drafts); prefill raises.
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        # DSpark's non-causal blocks take decode_attention_fwd_mla_block in
        # TritonMLAImpl.forward_mqa (windowed ones the flattened
        # decode_attention_fwd). Enables the non-causal AMD MLA path.
        return True


class TritonMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA Specific Arguments
        **mla_args,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )

        unsupported_features = [alibi_slopes, logits_soft_cap]
        if any(unsupported_features):
            raise NotImplementedError(
                "TritonMLAImpl does not support one of the following: "
                "alibi_slopes, logits_soft_cap"
            )
        # Each decode row attends to the last `decode_sliding_window` keys.
        self.decode_sliding_window = sliding_window
        assert sliding_window is None or self.dcp_world_size == 1, (
            "Sliding-window Triton MLA does not support decode context "
            "parallelism; for a draft model, set "
            "draft_decode_context_parallel_size=1."
        )

        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                "Encoder self-attention and "
                "encoder/decoder cross-attention "
                "are not implemented for "
                "TritonMLAImpl"
            )

        if current_platform.is_cuda():
            cap = current_platform.get_device_capability()
            cap_str = cap.as_version_str() if cap is not None else "unknown"
            dev = current_platform.get_device_name()
            if self.kv_cache_dtype.startswith("fp8") and not (
                current_platform.has_device_capability(89)
            ):
                suggested = (
                    "float16" if (cap is None or cap.to_int() < 80) else "bfloat16"
                )
                raise ValueError(
                    f"FP8 KV cache is not supported by the Triton MLA backend "
                    f"on {dev} (compute capability {cap_str}); native FP8 "
                    f"(fp8e4nv) requires SM89+. Re-run with "
                    f"--kv-cache-dtype {suggested}."
                )
            if self.kv_cache_dtype == "bfloat16" and not (
                current_platform.has_device_capability(80)
            ):
                raise ValueError(
                    f"bfloat16 KV cache is not supported by the Triton MLA "
                    f"backend on {dev} (compute capability {cap_str}); "
                    f"bfloat16 requires SM80+. Re-run with "
                    f"--kv-cache-dtype float16."
                )

        # For FP8 KV cache, we dequantize to BF16 on load inside the
        # Triton kernel. Tell the common layer not to quantize queries
        # to FP8 — we handle FP8 KV cache with BF16 queries (Mode 1).
        if is_quantized_kv_cache(self.kv_cache_dtype):
            self.supports_quant_query_input = False

        self._sm_count = current_platform.num_compute_units()
        self._vllm_config = get_current_vllm_config()
        # The most KV splits a request's block decode may take: what the
        # workspace reserves for max_model_len (_reserve_attn_logits_workspace).
        # decode_attention_fwd_mla_block may split short contexts finer than
        # _compute_num_kv_splits does.
        model_config = self._vllm_config.model_config
        self._max_block_kv_splits = (
            _compute_num_kv_splits(model_config.max_model_len, self._sm_count)
            if model_config is not None
            else self._sm_count * _SPLIT_OCCUPANCY_MULTIPLIER
        )

    def reserve_workspace(self) -> None:
        # The builder reserves after memory profiling; reserve its upper bound
        # here so the KV cache is sized around it.
        vllm_config = self._vllm_config
        _reserve_attn_logits_workspace(
            vllm_config,
            vllm_config.scheduler_config.max_num_seqs
            * max_decode_query_len(vllm_config),
            self.num_heads * self.dcp_world_size,
            self.kv_lora_rank,
            self.decode_sliding_window,
        )

    def forward_mha(self, *args, **kwargs) -> None:
        if self.decode_sliding_window is not None:
            # Windowed DSpark drafts only run non-causal decode blocks.
            raise NotImplementedError("Sliding-window Triton MLA prefill")
        return super().forward_mha(*args, **kwargs)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert kv_c_and_k_pe_cache.numel() > 0
        assert attn_metadata.decode is not None

        # MLAAttention may hand over [ql_nope | q_pe] as two tensors: the block
        # kernel reads them in place, the flattened path concatenates them.
        q_parts = q
        q_nope = q[0] if isinstance(q, tuple) else q
        B = q_nope.shape[0]
        q_num_heads = q_nope.shape[1]
        dtype, device = q_nope.dtype, q_nope.device
        o = torch.zeros(B, q_num_heads, self.kv_lora_rank, dtype=dtype, device=device)
        lse = torch.zeros(B, q_num_heads, dtype=dtype, device=device)

        block_table = attn_metadata.decode.block_table
        seq_lens = attn_metadata.decode.seq_lens
        # decode_attention_fwd has no causal flag: it launches one program per
        # row of q and reads that row's KV extent from seq_lens, so intra-block
        # causality is expressed as per-row extents. Deriving query_len from the
        # tensors the kernel indexes keeps the three row counts in step.
        num_decodes = seq_lens.shape[0]
        query_len, remainder = divmod(B, num_decodes) if num_decodes else (1, 0)
        assert remainder == 0, (
            f"non-uniform decode block: {B} query rows over {num_decodes} requests"
        )
        # A non-causal draft block: every row of a request attends the same
        # span, so decode_attention_fwd_mla_block reads it once for them all.
        # A windowed layer's block stays on decode_attention_fwd, which applies
        # the window: the block kernel attends the whole context, and its
        # splits are planned for max_model_len while the workspace is reserved
        # from the window.
        block_decode = (
            query_len > 1
            and not attn_metadata.causal
            and self.decode_sliding_window is None
        )
        if block_decode:
            # The builder rejects non-causal blocks under DCP
            # (supports_non_causal_multi_token_dcp is False).
            assert self.dcp_world_size == 1, (
                "non-causal multi-token decode is not supported with DCP"
            )

        # For batch invariance, use only 1 split to ensure deterministic reduction
        if envs.VLLM_BATCH_INVARIANT:
            num_kv_splits = 1
        elif block_decode:
            num_kv_splits = mla_block_decode_num_kv_splits(
                q_nope,
                kv_c_and_k_pe_cache,
                num_decodes,
                attn_metadata.max_seq_len,
                self._sm_count,
                self._max_block_kv_splits,
            )
        else:
            max_kv_len = attn_metadata.max_seq_len
            if self.decode_sliding_window is not None:
                max_kv_len = min(max_kv_len, self.decode_sliding_window)
            num_kv_splits = _compute_num_kv_splits(max_kv_len, self._sm_count)

        # NOTE: the +1 stores the LogSumExp (LSE) that the stage2 kernel uses to
        # merge partial attention outputs across splits. The scratch is served
        # from the shared workspace (reserved at max in the metadata builder), so
        # there is no per-call allocation on the decode hot path. Fall back to a
        # direct allocation when the workspace manager is not initialized (e.g.
        # unit tests without a GPUModelRunner).
        logits_shape = (B, q_num_heads, num_kv_splits, self.kv_lora_rank + 1)
        if is_workspace_manager_initialized():
            (attn_logits,) = current_workspace_manager().get_simultaneous(
                (logits_shape, torch.float32),
            )
        else:
            attn_logits = torch.empty(logits_shape, dtype=torch.float32, device=device)

        # Add a head dim of 1
        kv_c_and_k_pe_cache = kv_c_and_k_pe_cache.unsqueeze(2)
        kv_c_cache = kv_c_and_k_pe_cache[..., : self.kv_lora_rank]
        PAGE_SIZE = kv_c_and_k_pe_cache.size(1)

        if block_decode:
            decode_attention_fwd_mla_block(
                q_parts,
                kv_c_and_k_pe_cache,
                o,
                lse,
                block_table,
                seq_lens,
                attn_logits,
                self.scale,
                PAGE_SIZE,
                layer._k_scale,
                self._sm_count,
            )
            return o, lse
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        if query_len > 1:
            # One decode row per token.
            block_table = block_table.repeat_interleave(query_len, dim=0)
            if attn_metadata.causal:
                # Per-row extents are offsets off the global sequence length;
                # under DCP seq_lens is this rank's local slice instead.
                assert self.dcp_world_size == 1, (
                    "causal multi-token decode is not supported with DCP"
                )
                # Row t attends the prefix plus block tokens 0..t. Clamp holds
                # padding rows at extent 0; the kernel skips them either way
                # (split_kv_end == split_kv_start).
                offsets = torch.arange(
                    1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype
                )
                seq_lens = (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
            else:
                # A windowed non-causal block: every row sees the same window.
                seq_lens = seq_lens.repeat_interleave(query_len)

        # Run MQA — always pass layer scales. When KV cache is
        # BF16 the kernel's `if dtype.is_fp8()` check is a no-op.
        decode_attention_fwd(
            q,
            kv_c_and_k_pe_cache,
            kv_c_cache,
            o,
            lse,
            block_table,
            seq_lens,
            attn_logits,
            num_kv_splits,
            self.scale,
            PAGE_SIZE,
            k_scale=layer._k_scale,
            v_scale=layer._k_scale,
            is_mla=True,
            sliding_window=self.decode_sliding_window,
        )

        return o, lse
