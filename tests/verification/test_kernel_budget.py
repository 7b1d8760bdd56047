"""The kernel budget of one K3 DSpark draft step, pinned (``kernel_budget.py``).

Every configuration's launches, per phase and op, must equal ``PINS``, so any
change in what a draft step launches fails here with the ops that changed.
After an intended change, regenerate the pins with

    .venv/bin/python -m tests.verification.kernel_budget --print-pins

and check the new table (``python -m tests.verification.kernel_budget``).
The AMD module must launch no op more often than the baseline (0.34.0's
NVIDIA module on ROCm) unless ``kernel_budget.ALLOWED_EXTRA`` gives the
cause, and no more kernels a layer in any mode. In vLLM's default (compiled)
config the ROCm drafter (which opts in to the compile-free draft) launches
what ``--enforce-eager`` launches, the NVIDIA module (which does not) the
release's forms, and the target's own layers what the release's launch. The counter itself is checked
first, in this process (it needs only torch).
"""

from __future__ import annotations

import pytest
import torch

from tests.verification import kernel_budget as kb
from tests.verification.harness.aiter_drafter import FP8_DTYPES
from tests.verification.harness.launches import LaunchCounter, opaque_launch

# Regenerate: .venv/bin/python -m tests.verification.kernel_budget --print-pins
PINS = {
    "baseline/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=6 aten::add=3 aten::bmm=2 aten::clone=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=8 aten::add=4 aten::bmm=2 aten::clone=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "baseline/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::bmm=2 aten::clone=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::silu_and_mul=1 aten::bmm=2 aten::clone=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "baseline/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=8 aten::add=3 aten::bmm=2 aten::clone=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=10 aten::add=4 aten::bmm=2 aten::clone=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "baseline/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::clone=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::clone=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=6 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=8 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=8 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=10 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx942/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx942/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx942/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx942/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx950/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx950/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx950/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "amd-aiter-gfx950/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::rms_norm=1 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "layer": "_C::fused_add_rms_norm=2 _C::silu_and_mul=1 _C_cache_ops::concat_and_cache_mla_rope_fused=1 aiter::_fused_qk_rmsnorm=1 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel=2",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia-aiter-gfx942/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=6 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=8 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia-aiter-gfx942/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia-aiter-gfx942/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=8 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=10 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia-aiter-gfx942/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia-aiter-gfx950/bf16/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=6 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 aten::_to_copy=8 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=4 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia-aiter-gfx950/bf16/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert=1 _C::silu_and_mul=1 aten::bmm=2 aten::mm=5 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
    "nvidia-aiter-gfx950/fp8/compiled": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=8 aten::add=3 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 aten::_to_copy=10 aten::add=4 aten::bmm=2 aten::mean=2 aten::mm=5 aten::mul=5 aten::pow=2 aten::rsqrt=2 aten::zeros=2 attention::triton_mla_decode=1 compiled::SiluAndMul.forward_native=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "aten::_to_copy=4 aten::add=2 aten::embedding=1 aten::mean=1 aten::mul=2 aten::pow=1 aten::rsqrt=1",
    },
    "nvidia-aiter-gfx950/fp8/eager": {
        "context_kv": "_C::rms_norm=1 _C::rotary_embedding=1 _C_cache_ops::concat_and_cache_mla_grouped=1 aten::clone=2 aten::copy_=1 aten::mm=1",
        "first_layer": "_C::fused_add_rms_norm=1 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::rms_norm=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "layer": "_C::fused_add_rms_norm=2 _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert=1 _C::silu_and_mul=1 aten::_to_copy=2 aten::bmm=2 aten::mm=5 aten::mul=1 aten::zeros=2 attention::triton_mla_decode=1 triton::FusedQKVRMSNormKernel.kernel=1",
        "model": "_C::fused_add_rms_norm=1 aten::embedding=1",
    },
}

# --------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------


def test_counter_counts_launches_not_views_or_noop_copies():
    x = torch.randn(4, 6)
    with LaunchCounter() as counter:
        y = x * 2  # launch
        rows = y.view(6, 4)[1:]  # 2 views
        rows.copy_(rows)  # same memory, same layout: no kernel
        y.add_(1)  # launch
        torch.empty(3)  # allocation
        y.t().contiguous()  # launch (a copy)
    assert counter.counts == {
        "all": {"aten::mul": 1, "aten::add_": 1, "aten::clone": 1}
    }


def test_counter_counts_copies_between_different_memory_and_host_data():
    x = torch.randn(4)
    with LaunchCounter() as counter:
        x[:2].copy_(x[2:])  # same storage, different offset: a kernel
        torch.tensor([1, 2])  # host data to the device
        x[0].item()  # device to host
    assert counter.counts == {
        "all": {
            "aten::copy_": 1,
            "aten::lift_fresh": 1,
            "aten::_local_scalar_dense": 1,
        }
    }


def test_counter_decomposes_composite_ops_under_inference_mode():
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    w = torch.randn(5, 6, dtype=torch.bfloat16)
    with torch.inference_mode(), LaunchCounter() as counter:
        x.to(torch.bfloat16)  # no-op
        x.to(torch.float32)  # one cast
        x.reshape(24)  # a view
        torch.nn.functional.linear(x, w)  # one GEMM
    assert counter.counts == {"all": {"aten::_to_copy": 1, "aten::mm": 1}}


@pytest.fixture(scope="module")
def test_ops():
    """A compiled-style op (CPU body) and a Python wrapper op (composite body),
    each running three ATen ops."""
    kernels = torch.library.Library("k3_budget_kernels", "DEF")
    wrappers = torch.library.Library("k3_budget_wrappers", "DEF")
    for lib, key in ((kernels, "CPU"), (wrappers, "CompositeExplicitAutograd")):
        lib.define("three(Tensor x) -> Tensor")
        lib.impl("three", lambda x: ((x + 1) * 2).neg(), key)
    yield torch.ops.k3_budget_kernels.three, torch.ops.k3_budget_wrappers.three


def test_counter_counts_a_custom_op_once_not_its_reference_body(test_ops):
    kernel, _ = test_ops
    x = torch.randn(3)
    with LaunchCounter() as counter:
        y = kernel(x)
    assert counter.counts == {"all": {"k3_budget_kernels::three": 1}}
    assert torch.equal(y, -((x + 1) * 2))  # the body did run


def test_counter_counts_what_a_python_custom_op_launches(test_ops):
    _, wrapper = test_ops
    x = torch.randn(3)
    with LaunchCounter(wrapper_namespaces=("k3_budget_wrappers",)) as counter:
        wrapper(x)
    assert counter.counts == {"all": {"aten::add": 1, "aten::mul": 1, "aten::neg": 1}}


def test_opaque_launch_is_one_launch_whatever_runs_inside():
    x = torch.randn(3)
    with LaunchCounter() as counter:
        counter.phase = "layer"
        with opaque_launch("triton::kernel"):
            x + 1
    with opaque_launch("outside any counter"):  # allowed, counts nothing
        pass
    assert counter.counts == {"layer": {"triton::kernel": 1}}


# --------------------------------------------------------------------------
# The budget
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(rocm) -> dict[str, dict]:
    """{config id: measurement} for every configuration."""
    with kb.pristine_zygote() as pristine, kb.aiter_zygotes() as aiter:
        return kb.measure_all(rocm, pristine, aiter=aiter)


@pytest.fixture(scope="module")
def budget(measured) -> dict[str, dict[str, dict[str, int]]]:
    """{config id: {phase: {op: count}}} for every configuration."""
    return {config_id: r["counts"] for config_id, r in measured.items()}


@pytest.mark.parametrize("config", kb.CONFIGS, ids=lambda c: c.id)
def test_launches_match_pins(budget, config):
    assert config.id in PINS, f"no pins for {config.id}: regenerate them"
    mismatches = kb.pin_mismatches(PINS[config.id], budget[config.id])
    assert not mismatches, (
        f"{config.id} launches differ from the pins:\n  "
        + "\n  ".join(mismatches)
        + "\nIf intended, regenerate PINS: "
        ".venv/bin/python -m tests.verification.kernel_budget --print-pins"
    )


def test_pins_cover_exactly_the_configurations():
    assert sorted(PINS) == sorted(c.id for c in kb.CONFIGS)


def test_amd_launches_no_op_more_than_baseline_without_a_cause(budget):
    unexplained = [
        f"{where}: {op} +{n}"
        for where, extra in kb.amd_extras(budget).items()
        for op, n in extra.items()
        if op not in kb.ALLOWED_EXTRA
    ]
    assert not unexplained, (
        "the AMD module launches these ops more often than the baseline; "
        "remove the launches or give the cause in ALLOWED_EXTRA:\n  "
        + "\n  ".join(unexplained)
    )


def test_every_allowed_extra_is_still_extra_and_has_known_causes(budget):
    extra_ops = {op for extra in kb.amd_extras(budget).values() for op in extra}
    stale = sorted(set(kb.ALLOWED_EXTRA) - extra_ops)
    assert not stale, (
        f"the AMD module no longer launches these more often than the "
        f"baseline: {stale}; remove them from ALLOWED_EXTRA"
    )
    for op, causes in kb.ALLOWED_EXTRA.items():
        assert causes and set(causes) <= set(kb.EXTRA_CAUSES), (op, causes)


def body_measure_with_an_extra_launch():
    """The AMD drafter with one more launch per layer (a copy of the
    attention input), as a regression would add it."""
    from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper

    forward = KimiK3MultiHeadLatentAttentionWrapper.forward

    def forward_with_a_copy(self, positions, hidden_states, *args, **kwargs):
        return forward(self, positions, hidden_states.clone(), *args, **kwargs)

    KimiK3MultiHeadLatentAttentionWrapper.forward = forward_with_a_copy
    return kb.measure(module="amd", cache="bf16", mode="compiled")["counts"]


def test_pins_catch_one_extra_launch(rocm):
    pinned = PINS["amd/bf16/compiled"]
    counts = rocm.call(body_measure_with_an_extra_launch)
    clones = {
        phase: kb.parse_pin(pinned[phase]).get("aten::clone", 0)
        for phase in ("first_layer", "layer")
    }
    assert kb.pin_mismatches(pinned, counts) == [
        f"{phase}: aten::clone pinned {n}, measured {n + 1} (+1)"
        for phase, n in clones.items()
    ]


def _layer(budget, config_id: str) -> int:
    return kb.launches(budget[config_id]["layer"])


@pytest.mark.parametrize("module", ["amd", *kb.AITER_MODULES.values()])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_draft_launches_the_eager_kernels_in_the_default_config(budget, module, cache):
    """0.34.0 builds and runs the draft under the target's compiled config:
    native PyTorch forms that nothing compiles (37 launches a layer against
    17 with --enforce-eager, bf16). The ROCm drafter opts in to the
    compile-free draft and does not."""
    compiled, eager = (
        budget[f"{module}/{cache}/{mode}"] for mode in ("compiled", "eager")
    )
    assert compiled == eager
    baseline = [budget[f"baseline/{cache}/{mode}"] for mode in ("compiled", "eager")]
    assert kb.launches(baseline[0]["layer"]) > kb.launches(baseline[1]["layer"])


@pytest.mark.parametrize("module", ["nvidia", *kb.NVIDIA_AITER_MODULES.values()])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_nvidia_module_keeps_the_release_forms_in_the_default_config(
    budget, module, cache
):
    """K3's NVIDIA drafters do not opt in to the compile-free draft: compiled,
    the NVIDIA module launches the release's forms (native RMSNorm, compiled
    SiluAndMul), less only the release's attention-input clones that the
    block decode reads in place."""
    for phase in kb.PHASE_TITLES:
        patched, release = (
            {
                op: n
                for op, n in budget[f"{m}/{cache}/compiled"][phase].items()
                if op != "aten::clone"
            }
            for m in (module, "baseline")
        )
        assert patched == release, phase


@pytest.mark.parametrize("module", ["amd", *kb.AITER_MODULES.values()])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_amd_layer_launches_no_more_than_the_baseline(budget, module, mode, cache):
    amd, baseline = (
        _layer(budget, f"{m}/{cache}/{mode}") for m in (module, "baseline")
    )
    assert amd <= baseline
    assert _layer(budget, "nvidia/bf16/eager") <= 15


@pytest.mark.parametrize("module", ["amd", *kb.AITER_MODULES.values()])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_amd_launches_no_more_than_the_nvidia_module(budget, module, mode, cache):
    """The ROCm drafter launches no more kernels a layer or a step than the
    patched NVIDIA module would on ROCm (the stack without the ROCm drafter
    and dispatch patches), with AITER off and in each arch's AITER regime:
    the drafter is worth dispatching to in every configuration."""
    amd = kb.Config(module, cache, mode)
    counts, nvidia = budget[amd.id], budget[amd.nvidia.id]
    assert kb.launches(counts["layer"]) <= kb.launches(nvidia["layer"])
    assert kb.launches(counts["first_layer"]) <= kb.launches(nvidia["first_layer"])
    assert kb.step_total(counts, kb.NUM_LAYERS) <= kb.step_total(nvidia, kb.NUM_LAYERS)


@pytest.mark.parametrize("module", ["amd", *kb.AITER_MODULES.values()])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_amd_layer_ropes_and_writes_its_cache_in_one_launch(
    budget, module, mode, cache
):
    """A layer's RoPE and KV-cache write are one launch of vLLM's
    concat_and_cache_mla_rope_fused, with AITER on or off; its q/kv norms one
    launch (Triton's fused_q_kv_rmsnorm, or aiter's with AITER on)."""
    layer = budget[f"{module}/{cache}/{mode}"]["layer"]
    assert layer.get(kb.ROPE_AND_CACHE, 0) == 1
    assert "_C::rotary_embedding" not in layer
    assert "_C_cache_ops::concat_and_cache_mla" not in layer
    assert "_C::rms_norm" not in layer
    norms = ("aiter::_fused_qk_rmsnorm", "triton::FusedQKVRMSNormKernel.kernel")
    assert sum(layer.get(op, 0) for op in norms) == 1


@pytest.mark.parametrize("arch", list(kb.AITER_MODULES))
@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize("cache", list(kb.CACHE_DTYPES))
def test_aiter_layer_runs_fp8_bmm(measured, budget, arch, mode, cache):
    """With AITER FP8 BMM on, both absorb BMMs of a layer are aiter's Triton
    kernel on the arch's fp8 weights, in place of the two aten::bmm: the layer
    launches what it launches with AITER off, at most 15."""
    config_id = f"{kb.AITER_MODULES[arch]}/{cache}/{mode}"
    assert measured[config_id]["setup"]["absorb"] == str(FP8_DTYPES[arch])
    layer = budget[config_id]["layer"]
    assert layer.get(kb.AITER_FP8_BMM, 0) == 2 and "aten::bmm" not in layer
    assert kb.launches(layer) == _layer(budget, f"amd/{cache}/{mode}")
    assert kb.launches(layer) <= 15


def body_measure_without_draft_kernels():
    """The AMD drafter built and run under the target's compiled config, as
    before the DSpark draft got its own kernels."""
    kb._dspark_draft_kernels = lambda cls: None
    return kb.measure(module="amd", cache="bf16", mode="compiled")["counts"]


def test_pins_catch_the_native_forms_coming_back(rocm):
    counts = rocm.call(body_measure_without_draft_kernels)
    assert kb.pin_mismatches(PINS["amd/bf16/compiled"], counts)
    assert kb.launches(counts["layer"]) > kb.launches(
        kb.parse_pin(PINS["amd/bf16/eager"]["layer"])
    )


def test_target_launches_what_the_release_launches(rocm):
    """What the draft's kernels replace stays native in the target's layers,
    built after the draft: no config of the draft reaches the target."""
    with kb.pristine_zygote() as pristine:
        release = pristine.call(kb.measure_target)
    patched = rocm.call(kb.measure_target)
    assert patched == release
    assert "_C::silu_and_mul" not in patched and "_C::rms_norm" not in patched
