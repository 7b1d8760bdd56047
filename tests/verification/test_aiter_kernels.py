"""aiter's Triton kernels that the ROCm drafter reaches with AITER on, run in
Triton's interpreter on CPU under the emulated ROCm platform, against torch.

The workers (``harness/aiter.py``: ``interpreter_pool``) emulate MI300
(gfx942, fp8 e4m3fnuz) or MI355 (gfx950: aiter's FP4 kernels refuse any other
arch) with the aiter stand-in installed: only ``aiter.ops.triton`` imports,
its package ``__init__`` (HIP) never runs. Shapes are the K3 DSpark draft
layer's absorbs (kv_lora_rank 512, qk_nope_head_dim 128, v_head_dim 128),
8 and 64 heads, a few tokens.

Tolerances. Each kernel is checked against a torch model of the same
arithmetic (same quantization, fp32 accumulation), so what is left is the
output rounding, at most one bf16 ulp (2**-7 of the value) where the torch
model rounds at another point than the kernel, plus fp32 summation order, far
below that. (The workers round fp32 -> bf16 casts to nearest, as compiled
Triton does: ``rounded_bf16_casts``.) The quantization error itself is bounded
separately against the unquantized bf16 product, as a relative Frobenius
error: e4m3 keeps 3 mantissa bits (relative rounding error at most 2**-4 per
operand, about 0.036 RMS for the product), bound 2**-4; e2m1 keeps one
(at most 2**-2 per operand for elements near their block's maximum, more for
the small ones MXFP4 flushes), bound 0.25.

Every comparison is shown able to fail: each test also checks that its
reference, perturbed by one element, is rejected (``_fails_on_perturbed``).
"""

from __future__ import annotations

import pytest
import torch

from tests.verification.harness import aiter as aiter_harness

KV_LORA_RANK = 512
QK_NOPE = 128
V_HEAD = 128
BF16_ULP = 2.0**-7


@pytest.fixture(scope="module")
def gfx942():
    with aiter_harness.interpreter_pool("gfx942") as pool:
        yield pool


@pytest.fixture(scope="module")
def gfx950():
    with aiter_harness.interpreter_pool("gfx950") as pool:
        yield pool


def assert_matches(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    got, expected = got.float(), expected.float()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.isfinite(got).all(), "non-finite output"
    excess = (got - expected).abs() - (atol + rtol * expected.abs())
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
        f"{worst}: got {got.flatten()[worst].item()}, want {expected.flatten()[worst].item()}"
    )


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact.float()).norm() / exact.float().norm())


def _fails_on_perturbed(check, got: torch.Tensor, expected: torch.Tensor) -> None:
    """``check(got, expected')`` must fail when one element of the reference
    moves by 5% of the largest (one cache byte flips for fp8 caches)."""
    bad = expected.clone()
    flat = bad.view(-1) if bad.is_contiguous() else bad.reshape(-1)
    i = flat.numel() // 3
    if bad.dtype in (torch.float8_e4m3fnuz, torch.float8_e4m3fn, torch.uint8):
        flat.view(torch.uint8)[i] ^= 0x10
    else:
        flat[i] += 0.05 * float(expected.float().abs().max())
    if not bad.is_contiguous():
        bad = flat.view(bad.shape)
    with pytest.raises(AssertionError):
        check(got, bad)


# --- FP8 batched GEMM: vLLM's rocm_aiter_ops.triton_fp8_bmm (gfx942) --------


def _fp8_bmm_job(case: tuple[int, int, int, int]):
    """One absorb BMM as MLAAttention runs it with VLLM_ROCM_USE_AITER_FP8BMM:
    (heads, tokens, k) x (heads, n, k) -> (tokens, heads, n), the weight
    quantized by vLLM's own ``dynamic_per_batched_tensor_quant``."""
    from vllm.model_executor.layers.attention.mla_attention import (
        dynamic_per_batched_tensor_quant,
    )
    from vllm.platforms import current_platform

    heads, tokens, k, n = case
    gen = torch.Generator().manual_seed(heads * 1000 + tokens * 10 + k)
    x = torch.randn(heads, tokens, k, generator=gen).bfloat16()
    w = (torch.randn(heads, n, k, generator=gen) * k**-0.5).bfloat16()
    wq, w_scale = dynamic_per_batched_tensor_quant(w, dtype=current_platform.fp8_dtype())
    out = aiter_harness.fp8_bmm()(x, wq, w_scale, group_size=128, transpose_bm=True)
    return x, w, wq, w_scale, out


def fp8_bmm_reference(x, wq, w_scale, group_size=128):
    """The kernel's arithmetic in torch: each token's K split in groups of
    ``group_size``, each group scaled to the fp8 range by its absmax and
    rounded to fp8, products summed in fp32, times both scales."""
    fp8 = wq.dtype
    fp8_max = torch.finfo(fp8).max
    heads, tokens, k = x.shape
    out = torch.zeros(heads, tokens, wq.shape[1])
    for g in range(0, k, group_size):
        a = x[:, :, g : g + group_size].float()
        scale = a.abs().amax(-1, keepdim=True).clamp(min=1e-10) * (1.0 / fp8_max)
        aq = (a * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(fp8).float()
        out += torch.bmm(aq, wq[:, :, g : g + group_size].float().transpose(1, 2)) * scale
    return (out * w_scale).transpose(0, 1)  # (tokens, heads, n)


FP8_CASES = {
    # name: (heads, tokens, k, n)
    "k_absorb-8h": (8, 3, QK_NOPE, KV_LORA_RANK),  # q_nope x W_K
    "k_absorb-64h": (64, 1, QK_NOPE, KV_LORA_RANK),
    "v_absorb-8h": (8, 3, KV_LORA_RANK, V_HEAD),  # attention out x W_V (4 groups)
}


def _probe_fp8_kernel(_):
    import inspect

    from aiter.ops.triton._triton_kernels import (
        batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant as m,
    )
    from vllm._aiter_ops import rocm_aiter_ops

    kernel = m._batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel
    src = inspect.getsource(rocm_aiter_ops.triton_fp8_bmm)
    while type(kernel).__name__ != "InterpretedFunction" and hasattr(kernel, "fn"):
        kernel = kernel.fn  # through @triton.heuristics
    return "batched_gemm_a8w8_a_per_token_group_prequant" in src, type(kernel).__name__


def test_fp8_bmm_is_aiters_triton_kernel_in_the_interpreter(gfx942):
    names_it, kind = gfx942.map(_probe_fp8_kernel, [None])[0]
    assert names_it, "vLLM's triton_fp8_bmm no longer calls aiter's kernel"
    assert kind == "InterpretedFunction", kind


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_bmm_matches_torch(gfx942, name):
    x, w, wq, w_scale, out = gfx942.map(_fp8_bmm_job, [FP8_CASES[name]])[0]
    assert wq.dtype == torch.float8_e4m3fnuz  # MI300's fp8
    assert out.dtype == torch.bfloat16
    expected = fp8_bmm_reference(x, wq, w_scale)

    def check(got, want):
        assert_matches(got, want, rtol=BF16_ULP, atol=1e-3 * float(want.abs().max()))

    check(out, expected)
    _fails_on_perturbed(check, out, expected)
    exact = torch.einsum("htk,hnk->thn", x.float(), w.float())
    assert relative_error(out, exact) <= 2.0**-4


# --- FP4 (MXFP4) on gfx950 ----------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 as aiter's quantizer rounds it: per 32 elements a power-of-two
    scale 2**(floor(log2(absmax rounded to a power of two)) - 2), elements to
    the nearest e2m1 value (ties away from zero), saturating at 6. Returns
    (codes, one e2m1 nibble per element, sign in bit 3; scales, biased e8m0)."""
    *lead, k = x.shape
    blocks = x.float().reshape(*lead, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    bits = amax.view(torch.int32)
    rounded = ((bits + 0x200000) & 0x7F800000).view(torch.float32)
    exponent = (torch.log2(rounded).floor() - 2).clamp(-127, 127)
    scaled = blocks * torch.exp2(-exponent)
    mag = scaled.abs()
    # nearest grid value, ties away from zero
    dist = (mag.unsqueeze(-1) - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    code = torch.where(dist <= best + 0, torch.arange(8), -1).amax(-1)
    code = torch.where(mag >= 6.0, 7, code)
    code = code | (scaled < 0).to(torch.int64) << 3
    code = torch.where(mag == 0, 0, code)
    return code.reshape(*lead, k), (exponent + 127).to(torch.uint8).reshape(*lead, k // 32)


def mxfp4_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Unpack aiter's layout (two nibbles per byte, low nibble first)."""
    low, high = packed & 0xF, packed >> 4
    codes = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1).long()
    values = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    return values * scale


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1).long()


def _fp4_quant_job(case):
    heads, rows, k = case
    gen = torch.Generator().manual_seed(7 + heads)
    w = (torch.randn(heads, rows, k, generator=gen) * k**-0.5).bfloat16()
    packed, scales = aiter_harness.fp4_quant()(w)
    return w, packed, scales


def test_fp4_weight_quantizer_matches_torch(gfx950):
    # W_V's shape (heads, v_head_dim, kv_lora_rank): what vLLM quantizes for
    # the V absorb (W_K's is the same kernel over 4x the rows).
    w, packed, scales = gfx950.map(_fp4_quant_job, [(8, V_HEAD, KV_LORA_RANK)])[0]
    assert packed.dtype == torch.uint8 and packed.shape == (8, V_HEAD, KV_LORA_RANK // 2)
    codes, want_scales = mxfp4_reference(w)

    def check(got, want):
        assert torch.equal(got, want), f"{int((got != want).sum())} codes differ"

    assert torch.equal(scales.view(torch.uint8), want_scales)
    check(_unpack(packed), codes)
    bad = codes.clone()
    bad.view(-1)[bad.numel() // 3] ^= 1
    with pytest.raises(AssertionError):
        check(_unpack(packed), bad)
    assert relative_error(mxfp4_dequant(packed, scales.view(torch.uint8)), w) <= 0.25


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8)


def _fp4_bmm_job(case):
    """(heads, tokens, k) x (heads, n, k) -> (heads, tokens, n) through both of
    aiter's FP4 batched GEMMs; the weight quantized in torch (the quantizer is
    the test above), the activation by aiter (``afp4wfp4``) or in the kernel
    (``afp4wfp4_pre_quant``)."""
    from aiter.ops.triton.quant import dynamic_mxfp4_quant

    heads, tokens, k, n = case
    gen = torch.Generator().manual_seed(heads + tokens + k)
    x = torch.randn(heads, tokens, k, generator=gen).bfloat16()
    w = (torch.randn(heads, n, k, generator=gen) * k**-0.5).bfloat16()
    codes, w_scales = mxfp4_reference(w)
    w_packed = _pack(codes)
    bmms = aiter_harness.fp4_bmms()
    x_packed, x_scales = dynamic_mxfp4_quant(x.reshape(-1, k))
    x_packed = x_packed.view(heads, tokens, k // 2)
    x_scales = x_scales.view(heads, tokens, k // 32)
    out = {}
    y = torch.empty(heads, tokens, n, dtype=torch.bfloat16)
    bmms["afp4wfp4"](x_packed, w_packed, x_scales, w_scales, torch.bfloat16, y)
    out["afp4wfp4"] = y.clone()
    y = torch.empty(heads, tokens, n, dtype=torch.bfloat16)
    bmms["afp4wfp4_pre_quant"](x, w_packed, w_scales, torch.bfloat16, y)
    out["afp4wfp4_pre_quant"] = y.clone()
    return x, w, w_packed, w_scales, out


FP4_CASES = {
    "k_absorb-8h": (8, 3, QK_NOPE, KV_LORA_RANK),
    "v_absorb-8h": (8, 2, KV_LORA_RANK, V_HEAD),
}


@pytest.mark.parametrize("name", list(FP4_CASES))
def test_fp4_bmms_match_torch(gfx950, name):
    x, w, w_packed, w_scales, outs = gfx950.map(_fp4_bmm_job, [FP4_CASES[name]])[0]
    x_codes, x_scales = mxfp4_reference(x)
    xd = mxfp4_dequant(_pack(x_codes), x_scales)
    wd = mxfp4_dequant(w_packed, w_scales)
    expected = torch.bmm(xd, wd.transpose(1, 2))

    def check(got, want):
        assert_matches(got, want, rtol=BF16_ULP, atol=1e-3 * float(want.abs().max()))

    exact = torch.bmm(x.float(), w.float().transpose(1, 2))
    for kernel, out in outs.items():
        check(out, expected)
        assert relative_error(out, exact) <= 0.25, kernel
    _fails_on_perturbed(check, outs["afp4wfp4_pre_quant"], expected)


def _a16wfp4_probe(_):
    """vLLM 0.34.0's FP4 BMM entry point (``rocm_aiter_ops.batched_gemm_a16wfp4``)
    imports ``aiter.ops.triton.batched_gemm_a16wfp4``."""
    from vllm._aiter_ops import rocm_aiter_ops

    try:
        rocm_aiter_ops.batched_gemm_a16wfp4(None, None, None)
    except ModuleNotFoundError as exc:
        return exc.name
    return None


def test_vllm_fp4_bmm_entry_point_is_not_in_the_pinned_aiter(gfx950):
    """A fact deliverable 2 must handle: the pinned amd-aiter
    (0.1.7.post2.dev18) has the afp4wfp4 BMMs but not ``batched_gemm_a16wfp4``,
    which vLLM 0.34.0 calls. When this fails, the pin has it: test it."""
    assert gfx950.map(_a16wfp4_probe, [None])[0] == "aiter.ops.triton.batched_gemm_a16wfp4"

