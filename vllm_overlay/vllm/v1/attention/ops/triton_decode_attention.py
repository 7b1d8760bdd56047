# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

# Adapted from
# https://github.com/sgl-project/sglang/blob/9f635ea50de920aa507f486daafba26a5b837574/python/sglang/srt/layers/attention/triton_ops/decode_attention.py
# which was originally adapted from
# https://github.com/ModelTC/lightllm/blob/96353e868a840db4d103138caf15ed9dbea8c186/lightllm/models/deepseek2/triton_kernel/gqa_flash_decoding_stage1.py
# https://github.com/ModelTC/lightllm/blob/96353e868a840db4d103138caf15ed9dbea8c186/lightllm/models/deepseek2/triton_kernel/gqa_flash_decoding_stage2.py

# Changes:
# - Add support for page size >= 1.

# Copyright 2025 vLLM Team
# Copyright 2023-2024 SGLang Team
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Memory-efficient attention for decoding.
It supports page size >= 1.
"""

import functools
import logging
from dataclasses import dataclass, replace

import torch
from packaging import version

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.utils.math_utils import cdiv, next_power_of_2

is_hip_ = current_platform.is_rocm()

logger = logging.getLogger(__name__)

# Only print the following warnings when triton version < 3.2.0.
# The issue won't affect performance or accuracy.
if version.parse(triton.__version__) < version.parse("3.2.0"):
    logger.warning(
        "The following error message 'operation scheduled before its operands' "
        "can be ignored."
    )


@triton.jit
def tanh(x):
    # Tanh is just a scaled sigmoid
    return 2 * tl.sigmoid(2 * x) - 1


def _page_stride(buf, page_size):
    # Stride between pages. 4D buffers have a page dim; 3D buffers pack pages
    # along the token dim, so split it out first. Read the real stride (a
    # cross-layer view has gaps), don't assume PAGE_SIZE * token stride.
    if buf.ndim == 3:
        buf = buf.unflatten(-3, (-1, page_size))
    return buf.stride(-4)


@triton.jit
def _fwd_kernel_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    sm_scale,
    Req_to_tokens,
    B_Seqlen,
    Att_Out,
    stride_req_to_tokens_b,
    stride_qbs,
    stride_qh,
    stride_buf_kpbs,
    stride_buf_kbs,
    stride_buf_kh,
    stride_buf_vpbs,
    stride_buf_vbs,
    stride_buf_vh,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    k_scale,
    v_scale,
    kv_group_num: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    logit_cap: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)

    cur_kv_head = cur_head // kv_group_num

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lk
    mask_dv = offs_dv < Lv
    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
    cur_batch_req_idx = cur_batch

    off_q = cur_batch * stride_qbs + cur_head * stride_qh + offs_d
    q = tl.load(Q + off_q, mask=mask_d, other=0.0)

    kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)

    if split_kv_end > split_kv_start:
        ks = tl.load(k_scale)
        vs = tl.load(v_scale)
        for start_n in range(split_kv_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_page_number = tl.load(
                Req_to_tokens
                + stride_req_to_tokens_b * cur_batch_req_idx
                + offs_n // PAGE_SIZE,
                mask=offs_n < split_kv_end,
                other=0,
            ).to(tl.int64)  # page_number * page stride overflows int32
            kv_in_page = offs_n % PAGE_SIZE
            offs_buf_k = (
                (kv_page_number * stride_buf_kpbs + kv_in_page * stride_buf_kbs)[
                    :, None
                ]
                + cur_kv_head * stride_buf_kh
                + offs_d[None, :]
            )
            k = tl.load(
                K_Buffer + offs_buf_k,
                mask=(offs_n[:, None] < split_kv_end) & (mask_d[None, :]),
                other=0.0,
            )
            if k.dtype.is_fp8():
                k = (k.to(tl.float32) * ks).to(q.dtype)
            qk = tl.sum(q[None, :] * k, 1)
            qk *= sm_scale

            if logit_cap > 0:
                qk = logit_cap * tanh(qk / logit_cap)

            qk = tl.where(offs_n < split_kv_end, qk, float("-inf"))

            offs_buf_v = (
                (kv_page_number * stride_buf_vpbs + kv_in_page * stride_buf_vbs)[
                    :, None
                ]
                + cur_kv_head * stride_buf_vh
                + offs_dv[None, :]
            )
            v = tl.load(
                V_Buffer + offs_buf_v,
                mask=(offs_n[:, None] < split_kv_end) & (mask_dv[None, :]),
                other=0.0,
            )
            if v.dtype.is_fp8():
                v = (v.to(tl.float32) * vs).to(q.dtype)

            n_e_max = tl.maximum(tl.max(qk, 0), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max)
            acc *= re_scale
            acc += tl.sum(p[:, None] * v, 0)

            e_sum = e_sum * re_scale + tl.sum(p, 0)
            e_max = n_e_max

        offs_mid_o = (
            cur_batch.to(tl.int64) * stride_mid_ob
            + cur_head * stride_mid_oh
            + split_kv_id * stride_mid_os
            + offs_dv
        )

        tl.store(
            Att_Out + offs_mid_o,
            acc / e_sum,
            mask=(mask_dv),
        )

        offs_mid_o_1 = (
            cur_batch.to(tl.int64) * stride_mid_ob
            + cur_head * stride_mid_oh
            + split_kv_id * stride_mid_os
            + Lv
        )

        tl.store(
            Att_Out + offs_mid_o_1,
            e_max + tl.log(e_sum),
        )


def _decode_att_m_fwd(
    q,
    k_buffer,
    v_buffer,
    att_out,
    Req_to_tokens,
    B_Seqlen,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap,
    k_scale,
    v_scale,
):
    BLOCK = 64 if not is_hip_ else 8

    NUM_KV_SPLITS = num_kv_splits
    Lk = k_buffer.shape[-1]
    Lv = v_buffer.shape[-1]

    batch, head_num = q.shape[0], q.shape[1]

    grid = (batch, head_num, NUM_KV_SPLITS)
    kv_group_num = q.shape[1] // k_buffer.shape[-2]

    num_warps = 4
    if kv_group_num != 1:
        num_warps = 1 if is_hip_ else 2

    BLOCK_DMODEL = triton.next_power_of_2(Lk)
    BLOCK_DV = triton.next_power_of_2(Lv)

    _fwd_kernel_stage1[grid](
        q,
        k_buffer,
        v_buffer,
        sm_scale,
        Req_to_tokens,
        B_Seqlen,
        att_out,
        Req_to_tokens.stride(0),
        q.stride(0),
        q.stride(1),
        _page_stride(k_buffer, page_size),
        k_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        k_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        _page_stride(v_buffer, page_size),
        v_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        v_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        k_scale,
        v_scale,
        kv_group_num=kv_group_num,
        BLOCK_DMODEL=BLOCK_DMODEL,
        BLOCK_DV=BLOCK_DV,
        BLOCK_N=BLOCK,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        PAGE_SIZE=page_size,
        logit_cap=logit_cap,
        num_warps=num_warps,
        num_stages=2,
        Lk=Lk,
        Lv=Lv,
    )


@triton.jit
def _fwd_grouped_kernel_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    sm_scale,
    Req_to_tokens,
    B_Seqlen,
    Att_Out,
    stride_req_to_tokens_b,
    stride_qbs,
    stride_qh,
    stride_buf_kpbs,
    stride_buf_kbs,
    stride_buf_kh,
    stride_buf_vpbs,
    stride_buf_vbs,
    stride_buf_vh,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    k_scale,
    v_scale,
    kv_group_num: tl.constexpr,
    q_head_num: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    logit_cap: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    IS_MLA: tl.constexpr = False,
):
    cur_batch = tl.program_id(0)
    cur_head_id = tl.program_id(1)
    cur_kv_head = cur_head_id // tl.cdiv(kv_group_num, BLOCK_H)
    split_kv_id = tl.program_id(2)

    VALID_BLOCK_H: tl.constexpr = BLOCK_H if kv_group_num > BLOCK_H else kv_group_num
    cur_head = cur_head_id * VALID_BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = cur_head < (cur_head_id + 1) * VALID_BLOCK_H
    mask_h = mask_h & (cur_head < q_head_num)

    offs_d = tl.arange(0, BLOCK_DMODEL)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lk
    mask_dv = offs_dv < Lv
    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
    cur_batch_req_idx = cur_batch

    offs_q = cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(
        Q + offs_q,
        mask=(mask_h[:, None]) & (mask_d[None, :]),
        other=0.0,
        cache_modifier=".ca",
    )

    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_DMODEL + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < Lk
        off_qpe = (
            cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_dpe[None, :]
        )
        qpe = tl.load(
            Q + off_qpe,
            mask=(mask_h[:, None]) & (mask_dpe[None, :]),
            other=0.0,
            cache_modifier=".ca",
        )

    kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

    e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    if split_kv_end > split_kv_start:
        base_offs_k = cur_kv_head * stride_buf_kh + offs_d[:, None]
        base_offs_v = cur_kv_head * stride_buf_vh + offs_dv[None, :]
        if BLOCK_DPE > 0:
            base_offs_kpe = cur_kv_head * stride_buf_kh + offs_dpe[:, None]

        ks = tl.load(k_scale)
        vs = tl.load(v_scale)
        for start_n in tl.range(split_kv_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_page_number = tl.load(
                Req_to_tokens
                + stride_req_to_tokens_b * cur_batch_req_idx
                + offs_n // PAGE_SIZE,
                mask=offs_n < split_kv_end,
                other=0,
                cache_modifier=".ca",
            ).to(tl.int64)  # page_number * page stride overflows int32
            kv_off_k = (
                kv_page_number * stride_buf_kpbs + (offs_n % PAGE_SIZE) * stride_buf_kbs
            )

            # explicitly facilitate overlapping load/compute
            offs_buf_k = kv_off_k[None, :] + base_offs_k
            k = tl.load(
                K_Buffer + offs_buf_k,
                mask=(offs_n[None, :] < split_kv_end) & (mask_d[:, None]),
                other=0.0,
                cache_modifier=".cg",
            )

            if k.dtype.is_fp8():
                k = (k.to(tl.float32) * ks).to(q.dtype)
            qk = tl.dot(q, k.to(q.dtype))
            if BLOCK_DPE > 0:
                offs_buf_kpe = kv_off_k[None, :] + base_offs_kpe
                kpe = tl.load(
                    K_Buffer + offs_buf_kpe,
                    mask=(offs_n[None, :] < split_kv_end) & (mask_dpe[:, None]),
                    other=0.0,
                    cache_modifier=".cg",
                )
                if kpe.dtype.is_fp8():
                    kpe = (kpe.to(tl.float32) * ks).to(qpe.dtype)
                qk += tl.dot(qpe, kpe.to(qpe.dtype))
            qk *= sm_scale

            if logit_cap > 0:
                qk = logit_cap * tanh(qk / logit_cap)

            qk = tl.where(
                mask_h[:, None] & (offs_n[None, :] < split_kv_end), qk, float("-inf")
            )

            if not IS_MLA:
                kv_off_v = (
                    kv_page_number * stride_buf_vpbs
                    + (offs_n % PAGE_SIZE) * stride_buf_vbs
                )
                offs_buf_v = kv_off_v[:, None] + base_offs_v
                v = tl.load(
                    V_Buffer + offs_buf_v,
                    mask=(offs_n[:, None] < split_kv_end) & (mask_dv[None, :]),
                    other=0.0,
                )
                if v.dtype.is_fp8():
                    v = (v.to(tl.float32) * vs).to(q.dtype)
            else:
                # MLA uses a single c_kv.
                # loading the same c_kv to interpret it as v is not necessary.
                # transpose the existing c_kv (aka k) for the dot product.
                v = tl.trans(k)

            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            acc *= re_scale[:, None]
            acc += tl.dot(p.to(v.dtype), v)

            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max

        offs_mid_o = (
            cur_batch.to(tl.int64) * stride_mid_ob
            + cur_head[:, None] * stride_mid_oh
            + split_kv_id * stride_mid_os
            + offs_dv[None, :]
        )

        tl.store(
            Att_Out + offs_mid_o,
            acc / e_sum[:, None],
            mask=(mask_h[:, None]) & (mask_dv[None, :]),
        )

        offs_mid_o_1 = (
            cur_batch.to(tl.int64) * stride_mid_ob
            + cur_head * stride_mid_oh
            + split_kv_id * stride_mid_os
            + Lv
        )

        tl.store(
            Att_Out + offs_mid_o_1,
            e_max + tl.log(e_sum),
            mask=mask_h,
        )


def _decode_grouped_att_m_fwd(
    q,
    k_buffer,
    v_buffer,
    att_out,
    Req_to_tokens,
    B_Seqlen,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap,
    k_scale,
    v_scale,
    is_mla=False,
):
    # with is_mla there is only a single c_kv in smem.
    # could increase BLOCK or num_stages.
    Lk = k_buffer.shape[-1]
    Lv = v_buffer.shape[-1]

    # Align tile dimensions with latent rank for MLA to avoid shape mismatch.
    if is_mla:
        if not is_hip_ and Lk == 576:
            BLOCK_DMODEL = 512
            BLOCK_DPE = 64
        elif not is_hip_ and Lk == 288:
            BLOCK_DMODEL = 256
            BLOCK_DPE = 32
        else:
            BLOCK_DMODEL = triton.next_power_of_2(Lv)
            BLOCK_DPE = triton.next_power_of_2(Lk - Lv) if Lk > Lv else 0
    else:
        BLOCK_DMODEL = triton.next_power_of_2(Lk)
        BLOCK_DPE = 0
    BLOCK_DV = triton.next_power_of_2(Lv)

    BLOCK = 32
    if is_hip_:
        BLOCK = 16

    batch, head_num = q.shape[0], q.shape[1]
    kv_group_num = q.shape[1] // k_buffer.shape[-2]

    BLOCK_H = 16
    NUM_KV_SPLITS = num_kv_splits
    grid = (
        batch,
        triton.cdiv(head_num, min(BLOCK_H, kv_group_num)),
        NUM_KV_SPLITS,
    )

    extra_kargs = {}
    num_stages = 2
    if is_hip_:
        # https://rocm.docs.amd.com/en/latest/how-to/rocm-for-ai/inference-optimization/workload.html#mi300x-triton-kernel-performance-optimization
        # https://github.com/triton-lang/triton/blob/main/third_party/amd/backend/compiler.py
        extra_kargs = {"waves_per_eu": 1, "matrix_instr_nonkdim": 16, "kpack": 2}
        num_stages = 1
    elif not is_hip_ and BLOCK_DMODEL >= 1024:
        # Avoid shared memory overflow on NVIDIA when BLOCK_DMODEL is large
        # like non-MLA D_QK=576, BLOCK_DMODEL=1024, BLOCK_H=16
        # exceeds 101376 bytes limit
        num_stages = 1

    _fwd_grouped_kernel_stage1[grid](
        q,
        k_buffer,
        v_buffer,
        sm_scale,
        Req_to_tokens,
        B_Seqlen,
        att_out,
        Req_to_tokens.stride(0),
        q.stride(0),
        q.stride(1),
        _page_stride(k_buffer, page_size),
        k_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        k_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        _page_stride(v_buffer, page_size),
        v_buffer.stride(-3),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        v_buffer.stride(-2),  # Assume (..., PAGE_SIZE, NUM_HEADS, HEAD_DIM)
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        k_scale,
        v_scale,
        kv_group_num=kv_group_num,
        q_head_num=head_num,
        BLOCK_DMODEL=BLOCK_DMODEL,
        BLOCK_DPE=BLOCK_DPE,
        BLOCK_DV=BLOCK_DV,
        BLOCK_N=BLOCK,
        BLOCK_H=BLOCK_H,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        PAGE_SIZE=page_size,
        logit_cap=logit_cap,
        num_warps=4,
        num_stages=num_stages,
        Lk=Lk,
        Lv=Lv,
        IS_MLA=is_mla,
        **extra_kargs,
    )


@triton.jit
def _fwd_kernel_stage2(
    Mid_O,
    o,
    lse,
    B_Seqlen,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_obs,
    stride_oh,
    stride_lse_bs,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    Lv: tl.constexpr,
    OUTPUT_FP16: tl.constexpr = 0,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)

    cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)

    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv

    e_sum = 0.0
    e_max = -float("inf")
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)

    offs_v = cur_batch.to(tl.int64) * stride_mid_ob + cur_head * stride_mid_oh + offs_d
    offs_logic = cur_batch.to(tl.int64) * stride_mid_ob + cur_head * stride_mid_oh + Lv

    for split_kv_id in range(0, NUM_KV_SPLITS):
        kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
        split_kv_start = kv_len_per_split * split_kv_id
        split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)

        if split_kv_end > split_kv_start:
            tv = tl.load(
                Mid_O + offs_v + split_kv_id * stride_mid_os, mask=mask_d, other=0.0
            )
            tlogic = tl.load(Mid_O + offs_logic + split_kv_id * stride_mid_os)
            n_e_max = tl.maximum(tlogic, e_max)

            old_scale = tl.exp(e_max - n_e_max)
            acc *= old_scale
            exp_logic = tl.exp(tlogic - n_e_max)
            acc += exp_logic * tv

            e_sum = e_sum * old_scale + exp_logic
            e_max = n_e_max

    result = acc / e_sum
    if OUTPUT_FP16:
        result = result.to(tl.float16)
    tl.store(
        o + cur_batch * stride_obs + cur_head * stride_oh + offs_d,
        result,
        mask=mask_d,
    )
    lse_val = e_max + tl.log(e_sum)
    tl.store(
        lse + cur_batch * stride_lse_bs + cur_head,
        lse_val,
    )


def _decode_softmax_reducev_fwd(
    logits,
    q,
    o,
    lse,
    v_buffer,
    b_seq_len,
    num_kv_splits,
):
    batch, head_num = q.shape[0], q.shape[1]
    Lv = v_buffer.shape[-1]
    BLOCK_DV = triton.next_power_of_2(Lv)

    NUM_KV_SPLITS = num_kv_splits

    extra_kargs = {}
    if is_hip_:
        # https://rocm.docs.amd.com/en/docs-6.2.0/how-to/llm-fine-tuning-optimization/optimizing-triton-kernel.html
        # https://github.com/triton-lang/triton/blob/main/third_party/amd/backend/compiler.py
        extra_kargs = {"waves_per_eu": 4, "matrix_instr_nonkdim": 16, "kpack": 2}

    grid = (batch, head_num)
    _fwd_kernel_stage2[grid](
        logits,
        o,
        lse,
        b_seq_len,
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        o.stride(0),
        o.stride(1),
        lse.stride(0),
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        BLOCK_DV=BLOCK_DV,
        Lv=Lv,
        num_warps=4,
        num_stages=2,
        **extra_kargs,
    )


def decode_attention_fwd_normal(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
):
    _decode_att_m_fwd(
        q,
        k_buffer,
        v_buffer,
        attn_logits,
        req_to_token,
        b_seq_len,
        num_kv_splits,
        sm_scale,
        page_size,
        logit_cap,
        k_scale,
        v_scale,
    )
    _decode_softmax_reducev_fwd(
        attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits
    )


def decode_attention_fwd_grouped(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    is_mla=False,
):
    _decode_grouped_att_m_fwd(
        q,
        k_buffer,
        v_buffer,
        attn_logits,
        req_to_token,
        b_seq_len,
        num_kv_splits,
        sm_scale,
        page_size,
        logit_cap,
        k_scale,
        v_scale,
        is_mla=is_mla,
    )
    _decode_softmax_reducev_fwd(
        attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits
    )


def decode_attention_fwd(
    q,
    k_buffer,
    v_buffer,
    o,
    lse,
    req_to_token,
    b_seq_len,
    attn_logits,
    num_kv_splits,
    sm_scale,
    page_size=1,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
    is_mla=False,
):
    assert num_kv_splits == attn_logits.shape[2]

    if k_scale is None:
        k_scale = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    if v_scale is None:
        v_scale = torch.tensor(1.0, dtype=torch.float32, device=q.device)

    kv_group_num = q.shape[1] // v_buffer.shape[-2]

    if kv_group_num == 1:
        # MHA
        decode_attention_fwd_normal(
            q,
            k_buffer,
            v_buffer,
            o,
            lse,
            req_to_token,
            b_seq_len,
            attn_logits,
            num_kv_splits,
            sm_scale,
            page_size,
            logit_cap,
            k_scale,
            v_scale,
        )
    else:
        # GQA/MQA/MLA
        decode_attention_fwd_grouped(
            q,
            k_buffer,
            v_buffer,
            o,
            lse,
            req_to_token,
            b_seq_len,
            attn_logits,
            num_kv_splits,
            sm_scale,
            page_size,
            logit_cap,
            k_scale,
            v_scale,
            is_mla=is_mla,
        )


# Non-causal multi-token MLA decode (a speculative draft block).
#
# Every query row of a request attends the same KV span, so one program takes a
# tile of the request's query_len x num_heads rows and reads each KV tile once
# for all of them, with tl.dot on the whole row tile. The KV range is split
# across programs (split-K); a second kernel, below, merges the splits.
#
# Speculative drafters decode under CUDA graphs captured with max_seq_len =
# max_model_len and a padded batch, so what the host would derive from the
# lengths is wrong at every replay. The host sizes only the grid (from the
# batch size and the GPU) and the scratch (the most splits one request may
# take); both kernels share the batch's real KV out over the programs on the
# device (_mla_block_splits), busy programs first, so that short, long and
# ragged batches all keep the GPU full.


@dataclass(frozen=True)
class _MLABlockTile:
    block_m: int  # query rows per program
    block_n: int  # KV tokens per iteration
    num_warps: int
    num_stages: int
    # An fp8 tile is loaded a second time for PV (see the kernel).
    reload_fp8_v: bool = False
    # Programs of this tile that run at once on an SM (registers, shared
    # memory), for sizing the splits.
    programs_per_sm: int = 1
    # ROCm compiler options (see _mla_block_launch_options).
    waves_per_eu: int = 0


# Tiles measured best on an H200 (512 + 64 latent, pages of 64), by query rows
# per program and KV dtype. A 64-row tile needs 8 warps: its fp32 accumulator
# (64 x 512) is 128 registers a thread there. Shared memory at 576-wide rows:
# the query tile (72 KiB at 64 rows) plus the KV stages (bf16: 2 x 72 KiB;
# fp8: 72 KiB loaded to registers and converted into 144 KiB), 216 KiB in all,
# within the 227 KiB of Hopper and datacenter Blackwell. 32-row tiles: bf16
# 112 KiB and 4 warps (two programs an SM), fp8 108 KiB and 8 warps of 255
# registers (the register file: one an SM), as compiled for an H200.
_MLA_BLOCK_TILES_LARGE_SMEM = {
    (64, False): _MLABlockTile(64, 64, 8, 2),
    (64, True): _MLABlockTile(64, 128, 8, 1),
    (32, False): _MLABlockTile(32, 64, 4, 2, programs_per_sm=2),
    (32, True): _MLABlockTile(32, 64, 8, 3, reload_fp8_v=True),
}
_LARGE_SMEM_BYTES = 216 * 1024
# Elsewhere (A100: 164 KiB, consumer parts: ~100 KiB): 32 rows and 32 KV
# tokens, 70-74 KiB as compiled for an H200 (2 x 36 KiB of KV stages; the
# query tile passes through shared memory once).
_MLA_BLOCK_TILE_SMALL_SMEM = _MLABlockTile(32, 32, 4, 2, reload_fp8_v=True)
# ROCm, by architecture and KV dtype (fp8?): 16 KV tokens a tile, one stage
# where 64 KiB of LDS (CDNA3) allow no more. Chosen by compiling for each
# architecture (Triton 3.8): LDS, VGPRs and spills, and the waves per SIMD they
# leave; how fast they run is measured on the hardware, not here. bf16: 64
# rows in 8 warps, ~210 VGPRs and 64 KiB, two waves per SIMD, the KV read
# once per 64 rows. fp8 on gfx942: 32 rows in 4 warps (8 warps spill there),
# 32 KiB, one wave. fp8 on gfx950: 32 rows in 8 warps and two stages, ~210
# VGPRs, two waves (64 rows reach 254 of 256 VGPRs).
_MLA_BLOCK_TILES_ROCM = {
    "gfx942": {
        False: _MLABlockTile(64, 16, 8, 1),
        True: _MLABlockTile(32, 16, 4, 1, waves_per_eu=1),
    },
    "gfx950": {
        False: _MLABlockTile(64, 16, 8, 1),
        True: _MLABlockTile(32, 16, 8, 2),
    },
}

# Partial outputs a stage-2 program merges at once: 16K measured on an H200;
# 4K on ROCm, where larger tiles spill scalar registers (compiled for gfx942).
_MLA_BLOCK_MERGE_TILE = 4096 if is_hip_ else 16384
# A split reads at least this many KV tokens: loading its query tile and
# writing its partial output cost about as much as reading that much KV.
_MLA_BLOCK_MIN_SPLIT_TOKENS = 128


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    driver = triton.runtime.driver.active
    return driver.utils.get_device_properties(device_index)["max_shared_mem"]


@functools.cache
def _rocm_tiles() -> dict[bool, _MLABlockTile]:
    """This GPU's row of _MLA_BLOCK_TILES_ROCM (gfx942's for other archs)."""
    arch = triton.runtime.driver.active.get_current_target().arch
    return _MLA_BLOCK_TILES_ROCM.get(arch, _MLA_BLOCK_TILES_ROCM["gfx942"])


def _mla_block_launch_options(tile: _MLABlockTile) -> dict:
    """Compiler options of a tile: on ROCm, 16x16 MFMAs, and the waves per EU
    the tile asks for (0: as many as its registers allow)."""
    if not is_hip_:
        return {}
    options = {"matrix_instr_nonkdim": 16, "waves_per_eu": tile.waves_per_eu}
    if triton.runtime.driver.active.get_current_target().arch != "gfx950":
        options["kpack"] = 2  # gfx950 takes only 1, its default
    return options


def _mla_block_tile(
    rows: int, kv_dtype: torch.dtype, device: torch.device
) -> _MLABlockTile:
    """The tile for a request's `rows` query rows (query_len x num_heads)."""
    rows_per_tile = min(64, max(16, next_power_of_2(rows)))
    if is_hip_:
        tile = _rocm_tiles()[kv_dtype.itemsize == 1]
    elif device.type == "cuda" and (
        _max_shared_memory(device.index) >= _LARGE_SMEM_BYTES
    ):
        fp8 = kv_dtype.itemsize == 1
        tile = _MLA_BLOCK_TILES_LARGE_SMEM[(max(32, rows_per_tile), fp8)]
        small = _MLA_BLOCK_TILES_LARGE_SMEM[(32, fp8)]
        # 96 rows (16 heads x 6, 32 x 3) fill three 32-row tiles but leave a
        # quarter of two 64-row tiles empty: take the 32-row tile where two
        # of its programs share an SM.
        if rows % 64 and rows % 32 == 0 and small.programs_per_sm > 1:
            tile = small
    else:
        tile = _MLA_BLOCK_TILE_SMALL_SMEM
    return replace(tile, block_m=min(tile.block_m, rows_per_tile))


def mla_block_decode_num_kv_splits(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    num_reqs: int,
    max_seq_len: int,
    num_sms: int,
    max_kv_splits: int,
) -> int:
    """The most KV splits decode_attention_fwd_mla_block may give one request
    (the scratch is sized with it): enough for the longest request alone to
    fill the GPU twice over, a power of 2, at most max_kv_splits. How many
    each request takes is decided on the device, from the lengths."""
    rows = q.shape[0] // num_reqs * q.shape[1]
    tile = _mla_block_tile(rows, kv_buffer.dtype, q.device)
    slots = num_sms * tile.programs_per_sm
    wanted = min(
        cdiv(2 * slots, cdiv(rows, tile.block_m)),
        cdiv(max_seq_len, _MLA_BLOCK_MIN_SPLIT_TOKENS),
    )
    return max(1, min(next_power_of_2(wanted), max_kv_splits))


@triton.jit
def _mla_block_splits(
    Seq_Lens,
    num_reqs,
    row_tiles,
    slots,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
):
    """(offsets, lengths, KV splits) over the launch's requests, the same in
    both kernels. The KV is shared out for as many waves of `slots` programs
    as hold twice the requests' unsplit row tiles (one wave for a few
    requests), at least MIN_SPLIT_TOKENS a split and at most NUM_KV_SPLITS
    splits a request. Rounding up adds at most one program per request and
    row tile to the even share, so the busy programs number less than
    2 x (row tiles) + slots, which the stage-1 grid holds."""
    offs_r = tl.arange(0, BLOCK_REQS)
    lens = tl.load(Seq_Lens + offs_r, mask=offs_r < num_reqs, other=0)
    has_kv = lens > 0
    tiles = tl.sum(has_kv.to(tl.int64), 0) * row_tiles
    waves = tl.maximum(tl.cdiv(2 * tiles, slots), 1)
    work = tl.sum(lens.to(tl.int64), 0) * row_tiles
    # The share leaves room for the one extra program per row tile.
    share = tl.maximum(tl.cdiv(work, waves * slots - tiles), MIN_SPLIT_TOKENS)
    splits = tl.minimum(tl.cdiv(lens, share), NUM_KV_SPLITS)
    return offs_r, lens, tl.where(has_kv, splits, 0).to(tl.int32)


@triton.jit
def _mla_block_split_len(seq_len, num_splits, SPLIT_ALIGN: tl.constexpr):
    """KV tokens per split: the request's length evened out over its splits,
    a multiple of SPLIT_ALIGN (whole KV tiles)."""
    per_split = tl.cdiv(seq_len, tl.maximum(num_splits, 1))
    return tl.cdiv(per_split, SPLIT_ALIGN) * SPLIT_ALIGN


@triton.jit
def _fwd_mla_block_kernel_stage1(
    Q,
    Q_PE,
    KV_Buffer,
    sm_scale_log2,
    Block_Table,
    Seq_Lens,
    Att_Out,
    kv_scale,
    query_len,
    num_reqs,
    slots,
    stride_block_table,
    stride_q_token,
    stride_q_head,
    stride_qpe_token,
    stride_qpe_head,
    stride_kv_page,
    stride_kv_token,
    stride_mid_req,
    stride_mid_row,
    stride_mid_split,
    NUM_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    RELOAD_FP8_V: tl.constexpr,
):
    # Program (row_tile, item) takes split `item` of the launch's splits,
    # counted over the requests in order: the busy programs come first and
    # the rest of the grid (sized on the host, e.g. at graph capture) returns.
    row_tile = tl.program_id(0)
    item = tl.program_id(1)
    offs_r, lens, splits = _mla_block_splits(
        Seq_Lens,
        num_reqs,
        tl.num_programs(0),
        slots,
        NUM_KV_SPLITS,
        MIN_SPLIT_TOKENS,
        BLOCK_REQS,
    )
    ends = tl.cumsum(splits, 0)
    req = tl.sum((ends <= item).to(tl.int32), 0)
    this_req = offs_r == req
    seq_len = tl.sum(tl.where(this_req, lens, 0), 0)
    num_splits = tl.sum(tl.where(this_req, splits, 0), 0)
    split_kv_id = item - tl.sum(tl.where(this_req, ends, 0), 0) + num_splits
    split_len = _mla_block_split_len(seq_len, num_splits, BLOCK_N)
    split_kv_start = split_len * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + split_len, seq_len)

    if req < num_reqs and split_kv_end > split_kv_start:
        # Row m of the request is draft token m // NUM_HEADS, head m % NUM_HEADS.
        offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < query_len * NUM_HEADS
        token = req * query_len + offs_m // NUM_HEADS
        head = offs_m % NUM_HEADS
        offs_q = token * stride_q_token + head * stride_q_head
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < Lv
        q = tl.load(
            Q + offs_q[:, None] + offs_dv[None, :],
            mask=mask_m[:, None] & mask_dv[None, :],
            other=0.0,
        )
        if BLOCK_DPE > 0:
            offs_dpe = Lv + tl.arange(0, BLOCK_DPE)
            mask_dpe = offs_dpe < Lk
            offs_qpe = token * stride_qpe_token + head * stride_qpe_head
            q_pe = tl.load(
                Q_PE + offs_qpe[:, None] + (offs_dpe - Lv)[None, :],
                mask=mask_m[:, None] & mask_dpe[None, :],
                other=0.0,
            )

        # An fp8 cache is multiplied by its scale after the dots rather than
        # before: the latent is both K and V, read once in the query's dtype.
        # Like the grouped kernel, a 16-bit cache ignores the scale.
        KV_FP8: tl.constexpr = KV_Buffer.dtype.element_ty.is_fp8()
        scale = 1.0
        if KV_FP8:
            scale = tl.load(kv_scale)
        qk_scale = sm_scale_log2 * scale
        e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        block_table = Block_Table + req * stride_block_table
        # When pages hold whole KV tiles, tiles start on a multiple of BLOCK_N
        # (the first one masked below the split) and each reads one page.
        TILES_IN_PAGES: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
        loop_start = split_kv_start
        if TILES_IN_PAGES:
            loop_start = split_kv_start // BLOCK_N * BLOCK_N
        for start_n in tl.range(loop_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = (offs_n >= split_kv_start) & (offs_n < split_kv_end)
            if TILES_IN_PAGES:
                page = tl.load(block_table + start_n // PAGE_SIZE).to(tl.int64)
                offs_kv = (
                    page * stride_kv_page
                    + (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)) * stride_kv_token
                )
            else:
                pages = tl.load(
                    block_table + offs_n // PAGE_SIZE, mask=mask_n, other=0
                ).to(tl.int64)  # page number * page stride overflows int32
                offs_kv = (
                    pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_token
                )
            kv_ptrs = KV_Buffer + offs_kv[:, None] + offs_dv[None, :]
            mask_kv = mask_n[:, None] & mask_dv[None, :]
            kv = tl.load(kv_ptrs, mask=mask_kv, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(kv))
            if BLOCK_DPE > 0:
                k_pe = tl.load(
                    KV_Buffer + offs_kv[:, None] + offs_dpe[None, :],
                    mask=mask_n[:, None] & mask_dpe[None, :],
                    other=0.0,
                ).to(q.dtype)
                qk = tl.dot(q_pe, tl.trans(k_pe), qk)
            qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))

            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp2(e_max - n_e_max)
            p = tl.exp2(qk - n_e_max[:, None])
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            if KV_FP8 and RELOAD_FP8_V:
                # Loaded again for PV, from L1/L2: Triton copies a load with one
                # use asynchronously (pipelined); a converted tile with two uses
                # is loaded synchronously every iteration. Costlier than the
                # stall for 64-row tiles, which have no registers to spare.
                kv = tl.load(kv_ptrs, mask=mask_kv, other=0.0, cache_modifier=".ca").to(
                    q.dtype
                )
            acc = tl.dot(p.to(q.dtype), kv, acc * re_scale[:, None])
            e_max = n_e_max

        offs_mid = (
            req.to(tl.int64) * stride_mid_req
            + offs_m * stride_mid_row
            + split_kv_id * stride_mid_split
        )
        tl.store(
            Att_Out + offs_mid[:, None] + offs_dv[None, :],
            acc * (scale / e_sum[:, None]),
            mask=mask_m[:, None] & mask_dv[None, :],
        )
        # The LSE in natural-log units, as stage 2 and the callers expect.
        tl.store(
            Att_Out + offs_mid + Lv,
            (e_max + tl.log2(e_sum)) * 0.6931471805599453,
            mask=mask_m,
        )


@triton.jit
def _fwd_mla_block_kernel_stage2(
    Mid_O,
    Out,
    Lse,
    Seq_Lens,
    rows_per_req,
    num_reqs,
    row_tiles,
    slots,
    stride_mid_row,
    stride_mid_split,
    stride_o_row,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    Lv: tl.constexpr,
):
    # One program per query row and BLOCK_DV output columns reads all the
    # row's splits as one [BLOCK_SPLITS, BLOCK_DV] tile. _fwd_kernel_stage2
    # reads them one after the other, which took longer than stage 1 for a
    # single request split hundreds of ways.
    row = tl.program_id(0)
    dv_tile = tl.program_id(1)
    req = row // rows_per_req
    offs_r, lens, splits = _mla_block_splits(
        Seq_Lens,
        num_reqs,
        row_tiles,
        slots,
        NUM_KV_SPLITS,
        MIN_SPLIT_TOKENS,
        BLOCK_REQS,
    )
    seq_len = tl.load(Seq_Lens + req)
    num_splits = tl.sum(tl.where(offs_r == req, splits, 0), 0)
    split_len = _mla_block_split_len(seq_len, num_splits, SPLIT_ALIGN)
    mid = Mid_O + row.to(tl.int64) * stride_mid_row

    offs_s = tl.arange(0, BLOCK_SPLITS)
    # Stage 1 skipped (and did not write) the splits that start past the end;
    # so does every s >= NUM_KV_SPLITS, the padding of BLOCK_SPLITS.
    written = (offs_s * split_len < seq_len) & (offs_s < NUM_KV_SPLITS)
    split_lse = tl.load(
        mid + offs_s * stride_mid_split + Lv, mask=written, other=float("-inf")
    )
    e_max = tl.max(split_lse, 0)
    weight = tl.where(written, tl.exp(split_lse - e_max), 0.0)
    # A row without KV (a padding request) gets 0 / 0 and a -inf LSE, as from
    # _fwd_kernel_stage2.
    e_sum = tl.sum(weight, 0)

    offs_d = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv
    split_o = tl.load(
        mid + offs_s[:, None] * stride_mid_split + offs_d[None, :],
        mask=written[:, None] & mask_d[None, :],
        other=0.0,
    )
    o = tl.sum(weight[:, None] * split_o, 0) / e_sum
    tl.store(Out + row.to(tl.int64) * stride_o_row + offs_d, o, mask=mask_d)
    if dv_tile == 0:
        tl.store(Lse + row, e_max + tl.log(e_sum))


def decode_attention_fwd_mla_block(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    attn_logits: torch.Tensor,
    sm_scale: float,
    page_size: int,
    kv_scale: torch.Tensor,
    num_sms: int,
) -> None:
    """MLA decode of a non-causal block of query_len tokens per request.

    Equals decode_attention_fwd(is_mla=True) on the block flattened to one row
    per token (each row with its request's block table row and sequence
    length), up to floating-point reordering, but reads the KV once per tile
    of a request's rows instead of once per row and per 16 heads.

    q: [num_reqs * query_len, num_heads, Lk], a request's tokens adjacent, or
        its two parts ([..., Lv] latent, [..., Lk - Lv] rope), as MLAAttention
        hands them over (read in place: no concatenation).
    kv_buffer: the latent cache, [num_pages, page_size, 1, Lk]; the first Lv
        columns are the latent (K and V), the rest the rope part of K.
    o, lse: contiguous [num_reqs * query_len, num_heads(, Lv)] outputs.
    block_table, seq_lens: one row per request.
    attn_logits: contiguous fp32 scratch [num_reqs * query_len, num_heads,
        num_kv_splits, Lv + 1]; num_kv_splits bounds the splits of a request
        (see mla_block_decode_num_kv_splits).
    kv_scale: the scale of an fp8 cache (a 16-bit cache ignores it).
    num_sms: the GPU's SMs (CUs on ROCm), which the splits are sized to fill.
    """
    num_reqs = seq_lens.shape[0]
    Lv = o.shape[-1]
    q_nope, q_pe = q if isinstance(q, tuple) else (q[..., :Lv], q[..., Lv:])
    num_tokens, num_heads, _ = q_nope.shape
    Lk = Lv + q_pe.shape[-1]
    query_len = num_tokens // num_reqs
    rows = query_len * num_heads
    assert num_tokens == num_reqs * query_len

    tile = _mla_block_tile(rows, kv_buffer.dtype, q_nope.device)
    num_row_tiles = triton.cdiv(rows, tile.block_m)
    num_kv_splits = attn_logits.shape[2]
    # Programs of this tile that run at once on the GPU.
    slots = num_sms * tile.programs_per_sm
    # Per request, its rows are contiguous in the outputs and the scratch.
    mid = attn_logits.view(num_reqs, rows, *attn_logits.shape[2:])
    o_rows = o.view(num_reqs, rows, Lv)
    # Both kernels share the KV out alike (_mla_block_splits).
    splits = dict(
        NUM_KV_SPLITS=num_kv_splits,
        MIN_SPLIT_TOKENS=_MLA_BLOCK_MIN_SPLIT_TOKENS,
        BLOCK_REQS=triton.next_power_of_2(num_reqs),
    )

    # Programs per row tile: room for the most busy programs that
    # _mla_block_splits gives, from the batch size alone (graph-safe).
    grid_items = 2 * num_reqs + triton.cdiv(slots, num_row_tiles)
    _fwd_mla_block_kernel_stage1[(num_row_tiles, grid_items)](
        q_nope,
        q_pe,
        kv_buffer,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        block_table,
        seq_lens,
        mid,
        kv_scale,
        query_len,
        num_reqs,
        slots,
        block_table.stride(0),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        _page_stride(kv_buffer, page_size),
        kv_buffer.stride(-3),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2),
        NUM_HEADS=num_heads,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_DV=triton.next_power_of_2(Lv),
        BLOCK_DPE=triton.next_power_of_2(Lk - Lv) if Lk > Lv else 0,
        PAGE_SIZE=page_size,
        Lk=Lk,
        Lv=Lv,
        RELOAD_FP8_V=tile.reload_fp8_v,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **splits,
        **_mla_block_launch_options(tile),
    )
    # Stage 2 merges each row's splits, in tiles of at most
    # _MLA_BLOCK_MERGE_TILE partial outputs: many splits (a few requests)
    # take narrow column tiles.
    block_splits = triton.next_power_of_2(num_kv_splits)
    block_dv = min(
        triton.next_power_of_2(Lv), max(16, _MLA_BLOCK_MERGE_TILE // block_splits)
    )
    _fwd_mla_block_kernel_stage2[(num_reqs * rows, triton.cdiv(Lv, block_dv))](
        mid,
        o_rows,
        lse,
        seq_lens,
        rows,
        num_reqs,
        num_row_tiles,
        slots,
        mid.stride(1),
        mid.stride(2),
        o_rows.stride(1),
        SPLIT_ALIGN=tile.block_n,
        BLOCK_SPLITS=block_splits,
        BLOCK_DV=block_dv,
        Lv=Lv,
        num_warps=8 if block_splits * block_dv >= 8192 else 4,
        **splits,
    )
