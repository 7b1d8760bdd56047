"""The draft layer's RoPE + MLA KV-cache write three ways, at the K3 DSpark
drafter's shapes, on an NVIDIA GPU standing in for MI300/MI355.

* unfused: the two launches of vLLM 0.34.0 a layer makes without a fusion,
  `rotary_embedding_kernel` (csrc/pos_encoding_kernels.cu; in place on the
  strided q_pe and k_pe views, fp32 YaRN table) then
  `concat_and_cache_mla_kernel` (csrc/cache_kernels.cu);
* vllm-fused: vLLM 0.34.0's `concat_and_cache_mla_rope_fused_kernel`
  (csrc/cache_kernels_fused.cu), what the ROCm drafter launches
  (`KimiK3MultiHeadLatentAttentionWrapper._rope_kv_cache_write_and_attend`):
  q_pe and k_pe rotated in place and the cache row written in one launch. The
  kernel requires the table in the query's dtype (a bf16 copy of the fp32
  table) and rotates in bf16;
* aiter: aiter's Triton `fused_qk_rope_cat_and_cache_mla`, read from the
  installed `amd-aiter` wheel (the package builder copies the modules it
  imports, hashed, into aiter/ of the package; the package's aiter/__init__.py
  is empty, so nothing of aiter's ROCm-only __init__ runs), called with the
  arguments the stack's former AITER patch used (fp32 table halves, a new q).

vLLM's kernels are the release's text (cut from the release files in csrc/ of
the package) JIT-built with torch.utils.cpp_extension for this GPU and
launched with the release's grid and block (the host wrappers in BINDING
transcribe the release's host functions for the tensors here; torch's stable
ABI, which the release's host code uses, is not needed).

Shapes: K3 MLA (kv_lora_rank 512, rope 64, qk_nope_head_dim 128, so q rows
of 192), 8, 16, 32 and 64 heads (K3 at TP 8 to TP 1); a draft block of 5
tokens per request, 1/4/16/64 requests (5/20/80/320 tokens); pages of 16 and
64; KV cache bf16 or fp8 (e4m3fn here; e4m3fnuz on MI300), k_scale 0.75;
positions drawn over the whole 131072-row YaRN table (factor 32 over 4096,
theta 50000, interleaved, fp32), each request's block at consecutive
positions in its own shuffled pages.

Correctness (first input set of each shape): every path against a float64
rotation by the fp32 table, in representable steps of the output dtype (q_pe,
k_pe, the cache's rope part) and as a relative error; the cache's nope part
against kv_c_normed stored as the path stores it; every other byte of each
cache still the poison fill. Bounds: unfused and aiter rotate in fp32 and
round once (at most one bf16 step from the float64 result where |x| >= 2^-4);
vllm-fused rounds the table to bf16 and rounds each product and the
difference: its relative error must stay under 4e-3 (its steps are printed),
and its cache rows must hold the k_pe it rotated, as stored.

A case module of the GPU benchmark runner (run.py skips it: it has no
`bind`); run on its own from the built package:

    python3 build/gpubench/cases/aiter_rope_cache.py [--shape TEXT] [--repeats N]
        [--no-bmm]

`--no-bmm` leaves out the check of aiter's FP8 BMM (the absorb kernel vLLM's
rocm_aiter_ops.triton_fp8_bmm calls) on this GPU.

NVIDIA only: the unfused path is built from the release's CUDA sources (on
ROCm, vLLM's own build of them is what the drafter calls; this case does not
hipify them and stops there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# No vLLM Python files: the package builder copies CSRC from the release tree
# (pristine) and the AITER modules, with what they import, from the installed
# amd-aiter wheel.
FILES: tuple[str, ...] = ()
CSRC = (
    "csrc/pos_encoding_kernels.cu",
    "csrc/cache_kernels.cu",
    "csrc/cache_kernels_fused.cu",
    "csrc/core/cuda_compat.h",
    "csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh",
    "csrc/core/vec_dtypes/vec_dtypes.h",
    "csrc/core/vec_dtypes/dtype_generic.cuh",
    "csrc/core/vec_dtypes/dtype_float16.cuh",
    "csrc/core/vec_dtypes/dtype_float32.cuh",
    "csrc/core/vec_dtypes/dtype_bfloat16.cuh",
    "csrc/core/vec_dtypes/dtype_fp8.cuh",
)
AITER = (
    "aiter.ops.triton.fused_kv_cache",
    "aiter.ops.triton.batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant",
)

KV_LORA_RANK = 512
ROPE_DIM = 64
NOPE_DIM = 128  # qk_nope_head_dim: q rows are 128 + 64
Q_LORA_RANK = 1536  # k_pe is a view of fused_qkv_a_proj's (T, 1536 + 576) output
BLOCK_TOKENS = 5
CONTEXT = 2048  # tokens of context per request (where its pages lie)
K_SCALE = 0.75
# The K3 DSpark checkpoint's YaRN (tests/models/kimi_k3/test_amd_dspark_mla.py).
YARN = dict(theta=50000.0, factor=32.0, original_max=4096, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)
FP8 = torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn
KV_DTYPES = ("bf16", "fp8")

SHAPES = tuple(
    {
        "name": f"{reqs:>2} req x {BLOCK_TOKENS} tok, {heads:>2} heads, page {page:>2}, {kv}",
        "reqs": reqs,
        "tokens": reqs * BLOCK_TOKENS,
        "heads": heads,
        "page": page,
        "kv": kv,
    }
    for kv in KV_DTYPES
    for heads in (8, 16, 32, 64)
    for page in (16, 64)
    for reqs in (1, 4, 16, 64)
)

HERE = Path(__file__).resolve().parent
# The runner's folder: this file sits in its cases/ (build/gpubench/cases/).
RUNNER = HERE.parent


# --- the YaRN table (vLLM's DeepseekScalingRotaryEmbedding, on the CPU) --------


def yarn_cos_sin_cache() -> torch.Tensor:
    """(original_max * factor, 64) fp32 [cos | sin], as
    DeepseekScalingRotaryEmbedding._compute_cos_sin_cache builds it."""
    dim, base, factor = ROPE_DIM, YARN["theta"], YARN["factor"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(YARN["original_max"] / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    def get_mscale(scale: float, mscale: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    low = max(math.floor(correction_dim(YARN["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(YARN["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    mscale = get_mscale(factor, YARN["mscale"]) / get_mscale(factor, YARN["mscale_all_dim"])
    t = torch.arange(YARN["original_max"] * factor, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)


# --- inputs ----------------------------------------------------------------------


def make_cache(shape: dict, device) -> torch.Tensor:
    """The layer's KV cache, (blocks, page, 576), poisoned with 0xFF bytes
    (NaN in bf16 and in e4m3fn): every request's CONTEXT tokens of pages."""
    pages = shape["reqs"] * math.ceil((CONTEXT + BLOCK_TOKENS) / shape["page"]) + 1
    dtype = torch.bfloat16 if shape["kv"] == "bf16" else torch.uint8  # vLLM stores fp8 as bytes
    cache = torch.empty(pages, shape["page"], KV_LORA_RANK + ROPE_DIM, dtype=dtype, device=device)
    cache.view(torch.uint8).fill_(0xFF)
    return cache


def make_inputs(shape: dict, device, generator: torch.Generator, table: torch.Tensor) -> dict:
    """One draft step's inputs of one layer: q (T, heads, 192) as q_b_proj's
    output, kv_c_normed (T, 512), k_pe (T, 1, 64) a view of the
    fused_qkv_a_proj output, positions and slots of each request's block
    (consecutive positions after a random context, in that request's own
    shuffled pages)."""
    reqs, heads, page = shape["reqs"], shape["heads"], shape["page"]
    tokens = reqs * BLOCK_TOKENS

    def randn(*size):
        return torch.randn(*size, generator=generator, device=device).to(torch.bfloat16)

    q = randn(tokens, heads * (NOPE_DIM + ROPE_DIM)).view(tokens, heads, NOPE_DIM + ROPE_DIM)
    qkv_lora = randn(tokens, Q_LORA_RANK + KV_LORA_RANK + ROPE_DIM)
    k_pe = qkv_lora[:, Q_LORA_RANK + KV_LORA_RANK:].unsqueeze(1)
    kv_c_normed = randn(tokens, KV_LORA_RANK)
    max_pos = table.shape[0]
    starts = torch.randint(0, max_pos - BLOCK_TOKENS, (reqs, 1), generator=generator,
                           device=device)
    positions = (starts + torch.arange(BLOCK_TOKENS, device=device)).view(-1)
    # Request r owns pages [r * per_req, (r + 1) * per_req), shuffled; its
    # block sits at a random context length in them.
    per_req = math.ceil((CONTEXT + BLOCK_TOKENS) / page)
    order = torch.randperm(reqs * per_req, generator=generator, device=device).view(reqs, per_req)
    ctx = torch.randint(0, CONTEXT, (reqs, 1), generator=generator, device=device)
    logical = ctx + torch.arange(BLOCK_TOKENS, device=device)  # (reqs, block)
    pages_of = torch.gather(order, 1, logical // page)
    slots = (pages_of * page + logical % page).view(-1).to(torch.int64)
    return dict(q=q, kv_c_normed=kv_c_normed, k_pe=k_pe, qkv_lora=qkv_lora,
                positions=positions.to(torch.int64), slots=slots)


def input_bytes(x: dict) -> int:
    t = x["q"], x["kv_c_normed"], x["qkv_lora"], x["positions"], x["slots"]
    return sum(v.numel() * v.element_size() for v in t)


# --- the fused path (aiter) -------------------------------------------------------


def load_aiter():
    """aiter's Triton modules from the package's aiter/ (an empty
    aiter/__init__.py there: the wheel's needs ROCm)."""
    if str(RUNNER) not in sys.path:
        sys.path.insert(0, str(RUNNER))
    import aiter

    folder = Path(aiter.__file__).resolve().parent
    if folder != RUNNER / "aiter":
        raise RuntimeError(f"aiter imported from {folder}, not the package's {RUNNER / 'aiter'}")
    import aiter.ops.triton.fused_kv_cache as fused_kv_cache

    return fused_kv_cache


def fused_call(fused_kv_cache, shape: dict, table_cos, table_sin, k_scale):
    """What K3DSparkMLAAttention._rope_and_cache_write does (kv_cache already
    the (-1, 1, 576) view, fp8 as the platform's dtype)."""
    quantized = shape["kv"] == "fp8"
    heads = shape["heads"]

    def call(x: dict, cache: torch.Tensor):
        q, tokens = x["q"], x["q"].shape[0]
        view = cache.view(-1, 1, cache.shape[-1])
        if quantized:
            view = view.view(FP8)
        q_out, _, k_pe_out, _ = fused_kv_cache.fused_qk_rope_cat_and_cache_mla(
            q[:, :, :NOPE_DIM],
            q[:, :, NOPE_DIM:],
            x["kv_c_normed"].unsqueeze(1),
            x["k_pe"],
            view,
            x["slots"],
            x["positions"],
            table_cos,
            table_sin,
            k_scale,
            False,  # interleaved (GPT-J) rotation, as the K3 rope
            apply_scale=quantized,
            q_out=q.new_empty((tokens, heads, NOPE_DIM + ROPE_DIM)),
        )
        return q_out, k_pe_out

    return call


# --- the unfused path (vLLM 0.34.0's CUDA kernels) --------------------------------

BINDING = r"""
// The two launches of vLLM 0.34.0 that aiter's fused kernel replaces. The
// kernels are the release's text (release_kernels.cuh, cut from
// csrc/pos_encoding_kernels.cu and csrc/cache_kernels.cu); these host
// wrappers transcribe the release's host functions rotary_embedding and
// concat_and_cache_mla (same grid, block and arguments) for 1-D positions,
// bf16 activations, an fp32 cos/sin table and kv_cache_dtype "auto" or "fp8",
// with torch's ATen API in place of its stable ABI.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_compat.h"
#include "quantization/w8a8/fp8/nvidia/quant_utils.cuh"
#include "release_kernels.cuh"

void rotary_embedding(torch::Tensor positions, torch::Tensor query,
                      torch::Tensor key, int64_t head_size,
                      torch::Tensor cos_sin_cache, bool is_neox) {
  const int64_t rope_dim_offset = 0;
  const bool inverse = false;
  int64_t num_tokens = positions.numel();
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong);
  TORCH_CHECK(query.size(0) == num_tokens && key.size(0) == num_tokens);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 &&
              key.scalar_type() == at::kBFloat16 &&
              cos_sin_cache.scalar_type() == at::kFloat);
  int query_hidden_size = query.numel() / num_tokens;
  int key_hidden_size = key.numel() / num_tokens;
  TORCH_CHECK(query_hidden_size % head_size == 0);
  TORCH_CHECK(key_hidden_size % head_size == 0);
  int num_heads = query_hidden_size / head_size;
  int num_kv_heads = key_hidden_size / head_size;
  TORCH_CHECK(num_heads % num_kv_heads == 0);
  int rot_dim = cos_sin_cache.size(1);
  int64_t query_stride = query.stride(0);
  int64_t key_stride = key.stride(0);
  TORCH_CHECK((rot_dim + rope_dim_offset) <= head_size);
  int64_t head_stride = (query.dim() == 3) ? query.stride(-2) : head_size;
  dim3 grid(num_tokens);
  dim3 block(std::min<int64_t>(num_heads * rot_dim / 2, 512));
  const at::cuda::OptionalCUDAGuard device_guard(device_of(query));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // VLLM_STABLE_DISPATCH_FLOATING_TYPES: BFloat16 query, Float cache.
  using query_t = c10::BFloat16;
  using cache_t = float;
  auto* q = reinterpret_cast<query_t*>(query.data_ptr());
  auto* k = reinterpret_cast<query_t*>(key.data_ptr());
  if (is_neox) {
    vllm::rotary_embedding_kernel<query_t, cache_t, true><<<grid, block, 0, stream>>>(
        positions.data_ptr<int64_t>(), q, k, cos_sin_cache.data_ptr<float>(),
        rot_dim, query_stride, key_stride, head_stride, num_heads, num_kv_heads,
        head_size, rope_dim_offset, inverse);
  } else {
    vllm::rotary_embedding_kernel<query_t, cache_t, false><<<grid, block, 0, stream>>>(
        positions.data_ptr<int64_t>(), q, k, cos_sin_cache.data_ptr<float>(),
        rot_dim, query_stride, key_stride, head_stride, num_heads, num_kv_heads,
        head_size, rope_dim_offset, inverse);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void concat_and_cache_mla(torch::Tensor kv_c, torch::Tensor k_pe,
                          torch::Tensor kv_cache, torch::Tensor slot_mapping,
                          const std::string& kv_cache_dtype, torch::Tensor scale,
                          bool skip_scale) {
  int num_tokens = slot_mapping.size(0);
  int kv_lora_rank = kv_c.size(1);
  int pe_dim = k_pe.size(1);
  int block_size = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(2) == kv_lora_rank + pe_dim);
  TORCH_CHECK(kv_c.scalar_type() == at::kBFloat16 && k_pe.scalar_type() == at::kBFloat16);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && scale.scalar_type() == at::kFloat);
  int kv_c_stride = kv_c.stride(0);
  int k_pe_stride = k_pe.stride(0);
  int block_stride = kv_cache.stride(0);
  int entry_stride = kv_cache.stride(1);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(kv_c));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dim3 grid(num_tokens);
  dim3 block(std::min(kv_lora_rank, 512));
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* s = scale.data_ptr<float>();
  // DISPATCH_BY_KV_CACHE_DTYPE with BFloat16 sources: "auto" is
  // (__nv_bfloat16, __nv_bfloat16, kAuto), "fp8"/"fp8_e4m3" is
  // (__nv_bfloat16, uint8_t, kFp8E4M3).
  auto* c = reinterpret_cast<const __nv_bfloat16*>(kv_c.data_ptr());
  auto* p = reinterpret_cast<const __nv_bfloat16*>(k_pe.data_ptr());
#define LAUNCH(CACHE_T, KV_DTYPE, SKIP)                                            \
  vllm::concat_and_cache_mla_kernel<__nv_bfloat16, CACHE_T, KV_DTYPE, SKIP>        \
      <<<grid, block, 0, stream>>>(c, p, reinterpret_cast<CACHE_T*>(kv_cache.data_ptr()), \
                                   slots, block_stride, entry_stride, kv_c_stride, \
                                   k_pe_stride, kv_lora_rank, pe_dim, block_size, s)
  if (kv_cache_dtype == "auto") {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16);
    if (skip_scale) {
      LAUNCH(__nv_bfloat16, vllm::Fp8KVCacheDataType::kAuto, true);
    } else {
      LAUNCH(__nv_bfloat16, vllm::Fp8KVCacheDataType::kAuto, false);
    }
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    TORCH_CHECK(kv_cache.scalar_type() == at::kByte);
    if (skip_scale) {
      LAUNCH(uint8_t, vllm::Fp8KVCacheDataType::kFp8E4M3, true);
    } else {
      LAUNCH(uint8_t, vllm::Fp8KVCacheDataType::kFp8E4M3, false);
    }
  } else {
    TORCH_CHECK(false, "kv_cache_dtype ", kv_cache_dtype, ": only auto and fp8 here");
  }
#undef LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// concat_and_cache_mla_rope_fused (csrc/cache_kernels_fused.cu) for bf16
// q/k, a bf16 table (the release checks it matches q's dtype), interleaved or
// NeoX, kv_cache_dtype "auto" or "fp8": the release's grid, block and
// template arguments (VLLM_STABLE_DISPATCH_FLOATING_TYPES gives c10::BFloat16,
// DISPATCH_BY_KV_CACHE_DTYPE __nv_bfloat16 / uint8_t).
void concat_and_cache_mla_rope_fused(
    torch::Tensor positions, torch::Tensor q_pe, torch::Tensor k_pe,
    torch::Tensor kv_c, torch::Tensor cos_sin_cache, bool is_neox,
    torch::Tensor slot_mapping, torch::Tensor kv_cache,
    const std::string& kv_cache_dtype, torch::Tensor scale) {
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK(q_pe.dim() == 3 && k_pe.dim() == 2 && kv_c.dim() == 2);
  TORCH_CHECK(q_pe.scalar_type() == at::kBFloat16 &&
              k_pe.scalar_type() == at::kBFloat16 &&
              kv_c.scalar_type() == at::kBFloat16 &&
              cos_sin_cache.scalar_type() == at::kBFloat16);
  const int num_q_heads = q_pe.size(1);
  const int rot_dim = q_pe.size(2);
  const int kv_lora_rank = kv_c.size(1);
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == kv_lora_rank + rot_dim);
  int block_size = kv_cache.size(1);
  int block_stride = kv_cache.stride(0);
  int entry_stride = kv_cache.stride(1);
  int rope_block_size = std::min(num_q_heads * rot_dim / 2, 512);
  int thread_block_size = std::min(std::max(rope_block_size, kv_lora_rank), 512);
  dim3 grid(num_tokens, 1, 1);
  dim3 block(thread_block_size, 1, 1);
  const at::cuda::OptionalCUDAGuard device_guard(device_of(q_pe));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  using qk_t = c10::BFloat16;
#define LAUNCH_FUSED(NEOX, CACHE_T, KV_DTYPE)                                     \
  vllm::concat_and_cache_mla_rope_fused_kernel<qk_t, qk_t, NEOX, __nv_bfloat16,  \
                                               CACHE_T, KV_DTYPE>                \
      <<<grid, block, 0, stream>>>(                                               \
          positions.data_ptr<int64_t>(), reinterpret_cast<qk_t*>(q_pe.data_ptr()), \
          reinterpret_cast<qk_t*>(k_pe.data_ptr()),                               \
          reinterpret_cast<const qk_t*>(kv_c.data_ptr()),                         \
          reinterpret_cast<const qk_t*>(cos_sin_cache.data_ptr()), rot_dim,       \
          q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), kv_c.stride(0),         \
          num_q_heads, reinterpret_cast<CACHE_T*>(kv_cache.data_ptr()),           \
          slot_mapping.data_ptr<int64_t>(), block_stride, entry_stride,           \
          kv_lora_rank, block_size, scale.data_ptr<float>())
  if (kv_cache_dtype == "auto") {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16);
    if (is_neox) {
      LAUNCH_FUSED(true, __nv_bfloat16, vllm::Fp8KVCacheDataType::kAuto);
    } else {
      LAUNCH_FUSED(false, __nv_bfloat16, vllm::Fp8KVCacheDataType::kAuto);
    }
  } else if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") {
    TORCH_CHECK(kv_cache.scalar_type() == at::kByte);
    if (is_neox) {
      LAUNCH_FUSED(true, uint8_t, vllm::Fp8KVCacheDataType::kFp8E4M3);
    } else {
      LAUNCH_FUSED(false, uint8_t, vllm::Fp8KVCacheDataType::kFp8E4M3);
    }
  } else {
    TORCH_CHECK(false, "kv_cache_dtype ", kv_cache_dtype, ": only auto and fp8 here");
  }
#undef LAUNCH_FUSED
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_embedding", &rotary_embedding);
  m.def("concat_and_cache_mla", &concat_and_cache_mla);
  m.def("concat_and_cache_mla_rope_fused", &concat_and_cache_mla_rope_fused);
}
"""

# vLLM's build flags for these files (cmake/utils.cmake, CMakeLists.txt:
# torch's nvcc flags without the no-half-operators ones, ENABLE_FP8,
# RelWithDebInfo's -O2 -DNDEBUG).
NVCC_FLAGS = ["-O2", "-DNDEBUG", "-DENABLE_FP8", "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]


def _block_after(text: str, start: int, path: str) -> str:
    """text[start:] up to the brace that closes the first '{' after start."""
    opening = text.index("{", start)
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise RuntimeError(f"{path}: unbalanced braces after offset {start}")


def release_kernels(csrc: Path) -> str:
    """The release's device code of the two launches, cut from its files:
    pos_encoding_kernels.cu's whole `namespace vllm` block (the rotary kernel
    and its two helpers) and cache_kernels.cu's concat_and_cache_mla_kernel
    template."""
    pos_path, cache_path = csrc / "pos_encoding_kernels.cu", csrc / "cache_kernels.cu"
    pos = pos_path.read_text()
    start = pos.index("namespace vllm {")
    end = pos.index("}  // namespace vllm", start) + len("}  // namespace vllm")
    cache = cache_path.read_text()
    found = re.search(r"template <[^>]*>\s*__global__ void concat_and_cache_mla_kernel\(",
                      cache)
    if found is None:
        raise RuntimeError(f"{cache_path}: no concat_and_cache_mla_kernel template")
    kernel = _block_after(cache, found.start(), str(cache_path))
    fused_path = csrc / "cache_kernels_fused.cu"
    fused = fused_path.read_text()
    found = re.search(r"template <[^>]*>\s*__global__ void "
                      r"concat_and_cache_mla_rope_fused_kernel\(", fused)
    if found is None:
        raise RuntimeError(f"{fused_path}: no concat_and_cache_mla_rope_fused_kernel")
    fused_kernel = _block_after(fused, found.start(), str(fused_path))

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]

    return (f"// Cut from {pos_path.name} (sha256 {digest(pos_path)}), {cache_path.name} "
            f"(sha256 {digest(cache_path)}) and {fused_path.name} (sha256 "
            f"{digest(fused_path)}) by aiter_rope_cache.py.\n#pragma once\n\n"
            f"{pos[start:end]}\n\nnamespace vllm {{\n\n{kernel}\n\n{fused_kernel}\n\n"
            f"}}  // namespace vllm\n")


def build_release_ops(csrc: Path, build_dir: Path | None = None, verbose: bool = False):
    """JIT-build the extension (BINDING + the release kernels) for this GPU."""
    from torch.utils.cpp_extension import load

    build_dir = build_dir or Path(tempfile.mkdtemp(prefix="k3-release-rope-cache-"))
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "release_kernels.cuh").write_text(release_kernels(csrc))
    source = build_dir / "release_rope_cache.cu"
    source.write_text(BINDING)
    return load(name="k3_release_rope_cache", sources=[str(source)],
                extra_include_paths=[str(csrc), str(build_dir)],
                extra_cuda_cflags=NVCC_FLAGS, build_directory=str(build_dir),
                verbose=verbose)


def unfused_calls(ops, shape: dict, table: torch.Tensor, k_scale: torch.Tensor):
    """(rope, cache, both): the unfused path's launches, as the drafter's base
    forward makes them (K3DSparkRotaryEmbedding, then do_kv_cache_update)."""
    kv_dtype = "auto" if shape["kv"] == "bf16" else "fp8"

    def rope(x: dict, cache: torch.Tensor):
        ops.rotary_embedding(x["positions"], x["q"][:, :, NOPE_DIM:], x["k_pe"], ROPE_DIM,
                             table, False)

    def write(x: dict, cache: torch.Tensor):
        ops.concat_and_cache_mla(x["kv_c_normed"], x["k_pe"].squeeze(1), cache, x["slots"],
                                 kv_dtype, k_scale, False)

    def both(x: dict, cache: torch.Tensor):
        rope(x, cache)
        write(x, cache)
        return x["q"], x["k_pe"]

    return rope, write, both


def vllm_fused_call(ops, shape: dict, table_bf16: torch.Tensor, k_scale: torch.Tensor):
    """What the ROCm drafter launches: concat_and_cache_mla_rope_fused on the
    bf16 copy of the table, in place on q_pe and k_pe."""
    kv_dtype = "auto" if shape["kv"] == "bf16" else "fp8"

    def call(x: dict, cache: torch.Tensor):
        ops.concat_and_cache_mla_rope_fused(
            x["positions"], x["q"][:, :, NOPE_DIM:], x["k_pe"].squeeze(1), x["kv_c_normed"],
            table_bf16, False, x["slots"], cache, kv_dtype, k_scale)
        return x["q"], x["k_pe"]

    return call


# --- correctness ---------------------------------------------------------------------


def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Sign-magnitude float bits as integers ordered like the values, so that
    adjacent representable values differ by 1."""
    bits = bits.to(torch.int64) & ((1 << width) - 1)
    sign = bits >> (width - 1)
    magnitude = bits & ((1 << (width - 1)) - 1)
    return torch.where(sign == 1, -magnitude, magnitude)


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable steps between elements of two bf16 or 8-bit float tensors."""
    if a.element_size() == 2:
        return (_ordered(a.view(torch.int16), 16) - _ordered(b.view(torch.int16), 16)).abs()
    return (_ordered(a.view(torch.uint8), 8) - _ordered(b.view(torch.uint8), 8)).abs()


def rotation_reference(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor):
    """float64 interleaved rotation of (T, H, 64) by the table's rows."""
    cos, sin = table[positions].double().chunk(2, dim=-1)
    cos, sin = cos.repeat_interleave(2, -1)[:, None], sin.repeat_interleave(2, -1)[:, None]
    x = x.double()
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


PATHS = ("unfused", "vllm-fused", "aiter")
# Paths that rotate in fp32 and round once: at most this many steps from the
# float64 rotation. vllm-fused's steps are measured and printed.
ROUNDED_ONCE = ("unfused", "aiter")


# Steps from the float64 result are counted where |result| >= STEP_FLOOR: near
# zero a bf16 or fp8 step is tiny, and an absolute error of one rounding at
# the inputs' scale spans thousands of them.
STEP_FLOOR = 2.0**-4


def steps_where_large(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> int:
    """Most representable steps between got and want where |ref| >= STEP_FLOOR."""
    large = ref.abs() >= STEP_FLOOR
    return int(steps_apart(got[large], want[large]).max()) if bool(large.any()) else 0


def _fresh_copy(x: dict) -> dict:
    copy = {k: v.clone() for k, v in x.items()}
    copy["k_pe"] = copy["qkv_lora"][:, Q_LORA_RANK + KV_LORA_RANK:].unsqueeze(1)
    return copy


def check_path(shape: dict, x: dict, path, table: torch.Tensor, k_scale: float,
               device) -> dict:
    """One path on a copy of input set `x` with a fresh poisoned cache, against
    a float64 rotation by the fp32 table."""
    copy = _fresh_copy(x)
    cache = make_cache(shape, device)
    q_out, k_out = path(copy, cache)
    torch.cuda.synchronize()
    positions, slots = x["positions"], x["slots"]
    ref_q = rotation_reference(x["q"][:, :, NOPE_DIM:], positions, table)
    ref_k = rotation_reference(x["k_pe"], positions, table).squeeze(1)
    rows = cache.view(-1, cache.shape[-1])
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
    untouched[slots] = False
    poison_kept = bool((rows[untouched].view(torch.uint8) == 0xFF).all())
    written = rows[slots]
    if shape["kv"] == "fp8":
        written = written.view(FP8)
        want_rope = (ref_k / k_scale).to(FP8)
        want_nope = (x["kv_c_normed"].float() / k_scale).to(FP8)
    else:
        want_rope, want_nope = ref_k.bfloat16(), x["kv_c_normed"]
    rope_scale = k_scale if shape["kv"] == "fp8" else 1.0
    q_pe_out, k_pe_out = q_out[:, :, NOPE_DIM:], k_out.squeeze(1)
    return {
        "q steps": steps_where_large(q_pe_out, ref_q.bfloat16(), ref_q),
        "k_pe steps": steps_where_large(k_pe_out, ref_k.bfloat16(), ref_k),
        "cache rope steps": steps_where_large(written[:, KV_LORA_RANK:], want_rope,
                                              ref_k / rope_scale),
        "cache nope steps": int(steps_apart(written[:, :KV_LORA_RANK], want_nope).max()),
        # The cache's rope part against the path's own rotated k_pe, stored.
        "cache rope vs k_pe steps": int(steps_apart(
            written[:, KV_LORA_RANK:],
            (k_pe_out.float() / rope_scale).to(FP8) if shape["kv"] == "fp8" else k_pe_out,
        ).max()),
        "q max abs err": float((q_pe_out.double() - ref_q).abs().max()),
        "k_pe max abs err": float((k_pe_out.double() - ref_k).abs().max()),
        "q nope kept": torch.equal(q_out[:, :, :NOPE_DIM], x["q"][:, :, :NOPE_DIM]),
        "no nan": not bool(written.float().isnan().any()),
        "poison kept": poison_kept,
        "q_pe rel err": relative(q_out[:, :, NOPE_DIM:], ref_q),
        "k_pe rel err": relative(k_out.squeeze(1), ref_k),
    }


def path_ok(name: str, r: dict) -> bool:
    structural = r["q nope kept"] and r["no nan"] and r["poison kept"]
    nope_bound = 0 if r["kv"] == "bf16" else 1
    if name in ROUNDED_ONCE:
        rope = r["q steps"] <= 1 and r["k_pe steps"] <= 1 and r["cache rope steps"] <= 1
    else:
        # Rotated in bf16 math: its error is measured (printed), bounded only
        # as a relative error; the cache holds the rotated k_pe as stored.
        rope = (r["q_pe rel err"] < 4e-3 and r["k_pe rel err"] < 4e-3
                and r["cache rope vs k_pe steps"] <= (1 if r["kv"] == "fp8" else 0))
    return structural and rope and r["cache nope steps"] <= nope_bound


# --- aiter's FP8 BMM on this GPU ----------------------------------------------------------

# MI300X's "small" entry of aiter's tuned config for this kernel (configs/gemm/
# MI300X-BATCHED_GEMM-A8W8-A_PER_TOKEN_GROUP_PREQUANT_W_PER_BATCHED_TENSOR_QUANT.json).
BMM_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 1, "num_warps": 8,
              "num_stages": 2, "waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 2,
              "cache_modifier": ".cg"}
AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bmm_check(device) -> list[str]:
    """aiter's FP8 BMM (what rocm_aiter_ops.triton_fp8_bmm calls) at K3's absorb
    sizes, 8 heads, e4m3fn weights: through the wrapper as vLLM calls it, with
    MI300X's config, and the kernel launched directly without the AMD-only
    options; each compiled result against a float64 reference."""
    import triton

    import aiter.ops.triton.batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant as bmm  # noqa: E501
    from aiter.ops.triton._triton_kernels import (
        batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant as kernels,
    )

    wrapper = bmm.batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant
    kernel = kernels._batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel
    lines = []
    g = torch.Generator(device=device).manual_seed(5)
    heads = 8
    for name, (n, k) in {"W_K": (512, 128), "W_V": (128, 512)}.items():
        m = 5 * 16  # a draft block of 5 tokens x 16 requests
        w = torch.randn(heads, n, k, generator=g, device=device) * k**-0.5
        w_scale = (w.abs().amax() / torch.finfo(FP8).max).float().reshape(1)
        wq = (w / w_scale).to(FP8)
        x = torch.randn(m, heads, k, generator=g, device=device).bfloat16().transpose(0, 1)
        exact = torch.bmm(x.double(), (wq.double() * w_scale.double()).transpose(1, 2))
        exact = exact.transpose(0, 1)  # transpose_bm: (M, B, N)
        for how in ("wrapper", "wrapper+config"):
            try:
                config = dict(BMM_CONFIG) if how == "wrapper+config" else None
                out = wrapper(x, wq, w_scale, group_size=128, transpose_bm=True, config=config)
                _sync(device)
                lines.append(f"{name} {how}: ran, relative error {relative(out, exact):.4f}")
            except Exception as e:  # noqa: BLE001 - the finding is the error
                lines.append(f"{name} {how}: {type(e).__name__}: {str(e)[:160]}")
        # The wrapper's launch without the AMD-only options.
        config = {k_: v for k_, v in BMM_CONFIG.items() if k_ not in AMD_ONLY_OPTIONS}
        config["BLOCK_SIZE_K"] = 128
        wt = wq.transpose(1, 2)
        out = torch.empty((m, heads, n), dtype=torch.bfloat16, device=device)
        dtype_max = torch.finfo(wq.dtype).max

        def grid(meta):
            return (heads, triton.cdiv(m, meta["BLOCK_SIZE_M"]) * triton.cdiv(n, meta["BLOCK_SIZE_N"]))

        try:
            compiled = kernel[grid](x, wt, out, w_scale, None, m, n, k, x.stride(0), x.stride(1),
                                x.stride(2), wt.stride(0), wt.stride(1), wt.stride(2),
                                    out.stride(1), out.stride(0), out.stride(2), 0, False,
                                    DTYPE_MAX=dtype_max, DTYPE_MIN=-dtype_max, **config)
            _sync(device)
        except Exception as e:  # noqa: BLE001 - the finding is the error
            lines.append(f"{name} kernel without {', '.join(AMD_ONLY_OPTIONS)}: "
                         f"{type(e).__name__}: {str(e)[:300]}")
            continue
        found = sorted(set(re.findall(r"(wgmma\.[a-z0-9._]+|mma\.sync\.[a-z0-9._]+)",
                                      getattr(compiled, "asm", {}).get("ptx", ""))))
        mma = f"; PTX matrix instructions {found[:3]}"
        lines.append(f"{name} kernel without {', '.join(AMD_ONLY_OPTIONS)}: ran, M={m} N={n} "
                     f"K={k}, relative error {relative(out, exact):.4f} (bound 2**-4){mma}")
    return lines


# --- timing ---------------------------------------------------------------------------


def run_shape(shape: dict, fused_kv_cache, ops, table, cos, sin, args, device) -> dict:
    import timing

    k_scale = torch.tensor([K_SCALE], dtype=torch.float32, device=device)
    rope, write, both = unfused_calls(ops, shape, table, k_scale)
    paths = {
        "unfused": both,
        "vllm-fused": vllm_fused_call(ops, shape, table.to(torch.bfloat16), k_scale),
        "aiter": fused_call(fused_kv_cache, shape, cos, sin, k_scale),
    }
    gen = torch.Generator(device=device)
    first = make_inputs(shape, device, gen.manual_seed(0), table)
    checks = {}
    for name, path in paths.items():
        r = check_path(shape, first, path, table, K_SCALE, device)
        r["kv"] = shape["kv"]
        r["ok"] = path_ok(name, r)
        checks[name] = r
    count = timing.input_set_count(input_bytes(first), timing.l2_cache_bytes())
    sets = [first] + [make_inputs(shape, device, gen.manual_seed(s), table)
                      for s in range(1, count)]
    cache = make_cache(shape, device)  # one cache, as one layer's
    calls = {name: (lambda x, path=path: path(x, cache)) for name, path in paths.items()}
    graphs = {name: timing.capture(c, sets, args.calls) for name, c in calls.items()}
    micros = timing.replay_micros(graphs, args.calls, args.repeats)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(micros[a], micros[b]))

    result = {
        "checks": checks,
        "ok": all(r["ok"] for r in checks.values()),
        "us": {name: statistics.median(v) for name, v in micros.items()},
        "p10-p90": {name: statistics.quantiles(v, n=10, method="inclusive")[::8]
                    for name, v in micros.items()},
        "vllm/unfused": ratio("vllm-fused", "unfused"),
        "aiter/unfused": ratio("aiter", "unfused"),
        "aiter/vllm": ratio("aiter", "vllm-fused"),
        "sets": len(sets),
    }
    del graphs, sets, calls
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", help="shapes whose name contains this")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=100, help="replays per graph")
    parser.add_argument("--no-bmm", action="store_true")
    parser.add_argument("--build-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(RUNNER))  # timing.py

    import triton

    if torch.version.hip:
        print("error: on ROCm, time against the installed vLLM's own ops; this case builds "
              "the release's CUDA kernels (NVIDIA only)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    manifest = json.loads((RUNNER / "trees.json").read_text())
    backend = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
          f"{triton.__version__}, {backend}")
    print("  (NVIDIA, standing in for MI300/MI355: Triton's CUDA backend and vLLM's CUDA "
          "kernels, not ROCm's; fp8 is e4m3fn)")
    aiter_info = manifest.get("aiter", {})
    print(f"  fused: aiter {aiter_info.get('version', '?')} Triton "
          "fused_qk_rope_cat_and_cache_mla")
    for path, digest in sorted(aiter_info.get("files", {}).items()):
        print(f"    {path} sha256 {digest[:12]}")
    csrc_info = manifest.get("csrc", {})
    print(f"  unfused: rotary_embedding + concat_and_cache_mla, CUDA, from "
          f"{csrc_info.get('rev', '?')} ({csrc_info.get('commit', '?')[:12]})")
    fused_kv_cache = load_aiter()
    build_log = os.environ.get("K3_VERBOSE_BUILD") == "1"
    ops = build_release_ops(RUNNER / "csrc", args.build_dir, verbose=build_log)
    print("  release kernels built with nvcc " + " ".join(NVCC_FLAGS), flush=True)
    table = yarn_cos_sin_cache().to(device)
    cos, sin = table.chunk(2, dim=-1)
    shapes = [s for s in SHAPES if not args.shape or any(t in s["name"] for t in args.shape)]
    print(f"  {args.calls} calls per CUDA graph, {args.repeats} replays, microseconds per call "
          "(median); ratios = median of replay-by-replay ratios", flush=True)
    header = (f"{'shape':<42} {'unfused':>8} {'vllm':>7} {'aiter':>7} {'vllm/unf':>8} "
              f"{'aiter/unf':>9} {'aiter/vllm':>10}  check (steps from fp64 where |x| >= 2^-4: "
              "q, k_pe, cache rope; unfused | vllm | aiter)")
    print(header)
    print("-" * len(header))
    failed = 0
    results = {}
    for shape in shapes:
        r = run_shape(shape, fused_kv_cache, ops, table, cos, sin, args, device)
        results[shape["name"]] = r
        us = r["us"]
        failed += not r["ok"]
        steps = " | ".join(
            f"{c['q steps']},{c['k_pe steps']},{c['cache rope steps']}"
            for c in (r["checks"][p] for p in PATHS))
        bad = [p for p in PATHS if not r["checks"][p]["ok"]]
        print(f"{shape['name']:<42} {us['unfused']:>8.2f} {us['vllm-fused']:>7.2f} "
              f"{us['aiter']:>7.2f} {r['vllm/unfused']:>8.3f} {r['aiter/unfused']:>9.3f} "
              f"{r['aiter/vllm']:>10.3f}  {'ok' if not bad else 'MISMATCH ' + ','.join(bad)} "
              f"{steps}", flush=True)
    print()
    for name in PATHS:
        cs = [r["checks"][name] for r in results.values()]
        if not cs:
            continue
        print(f"{name}: q_pe rel err vs fp64 {min(c['q_pe rel err'] for c in cs):.2e}-"
              f"{max(c['q_pe rel err'] for c in cs):.2e}, k_pe {min(c['k_pe rel err'] for c in cs):.2e}-"
              f"{max(c['k_pe rel err'] for c in cs):.2e}; max abs err q_pe "
              f"{max(c['q max abs err'] for c in cs):.2e}, k_pe "
              f"{max(c['k_pe max abs err'] for c in cs):.2e}; max steps (|x| >= 2^-4) q "
              f"{max(c['q steps'] for c in cs)}, "
              f"k_pe {max(c['k_pe steps'] for c in cs)}, cache rope bf16 "
              f"{max([c['cache rope steps'] for c in cs if c['kv'] == 'bf16'] or [0])}, fp8 "
              f"{max([c['cache rope steps'] for c in cs if c['kv'] == 'fp8'] or [0])}")
    for key in ("vllm/unfused", "aiter/unfused", "aiter/vllm"):
        vals = [r[key] for r in results.values()]
        if vals:
            print(f"{key}: {min(vals):.3f}-{max(vals):.3f} over {len(vals)} shapes")
    print(f"{failed} shape(s) with a failed check")
    if not args.no_bmm:
        print("\naiter FP8 BMM (rocm_aiter_ops.triton_fp8_bmm's kernel) on this GPU:")
        for line in bmm_check(device):
            print(f"  {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
