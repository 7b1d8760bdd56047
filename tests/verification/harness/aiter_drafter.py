"""The ROCm K3 DSpark drafter in the AITER BMM regime (issue 29, deliverable 2).

The regime is what an MI300 (gfx942) or MI355 (gfx950) user gets with
``VLLM_ROCM_USE_AITER=1`` and ``VLLM_ROCM_USE_AITER_FP8BMM=1``: the MLA absorb
BMMs (W_K before the attention, W_V after it) run aiter's Triton
``batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant``
on fp8 weights (the platform's: e4m3fnuz on gfx942, e4m3fn on gfx950) that
``MLAAttention.process_weights_after_loading`` quantizes, and pre-compiles for
batch sizes 1..1024. MI355's FP4 BMM regime needs aiter's
``batched_gemm_a16wfp4``, which the pinned aiter does not have.

Everything else AITER would switch on needs aiter's HIP/CK/asm kernels, which
cannot run on CPU. Where vLLM has a flag for it, the flag is off
(``FP8BMM_ENV``); where it has none, a double checked against a torch
reference stands in (``register_drafter_doubles``):

* ``aiter.ops.fused_qk_norm_rope_cache_quant._fused_qk_rmsnorm`` (HIP), behind
  ``torch.ops.vllm.fused_mla_dual_rms_norm``: the ROCm K3 MLA wrapper takes it
  whenever ``rocm_aiter_ops.is_enabled()`` (no sub-flag). Module absent from
  the pinned aiter as well.
* ``aiter.flash_attn_varlen_func`` (CK): the MLA *prefill* backend
  ``ROCM_AITER_FA`` is chosen whenever AITER is on (no sub-flag; its
  constructor imports the op). Draft blocks are decode-only: it is never
  called, which ``draft_step`` checks.

Two kinds of process run the regime:

* an AITER-on **zygote** (``Zygote(mode, aiter=True)``), Triton compiled (not
  interpreted) for the emulated target: ``compile_nothing`` turns every
  Triton launch into a record of the kernel cache key Triton computed for it
  (its real binder: specialisations, constexprs, options) and skips the
  compile and the launch. It builds and loads the drafter with the full
  1..1024 pre-compile loop, and counts a draft step's launches;
* **interpreter workers** (``interpreter_pool``), in the AITER-on and the
  AITER-off world, that run aiter's and vLLM's Triton kernels in Triton's
  interpreter for the logits. There the pre-compile loop is recorded, not run
  (``recorded_precompile``): its outputs are discarded by vLLM, and each call
  would take the interpreter seconds.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Iterator

import torch

from . import aiter as aiter_harness

# The emulated GPUs of the regime, and the fp8 type each quantizes the absorb
# weights to (the platform's).
ARCHES = ("gfx942", "gfx950")
FP8_DTYPES = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
MODE = "rocm-gfx942"
# aiter's FP8 BMM kernel, as Triton and the launch counter name it.
FP8_BMM_KERNEL = (
    "_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel"
)
PRECOMPILE_BATCH_SIZES = 1024  # MLAAttention.process_weights_after_loading

# VLLM_ROCM_USE_AITER=1 is set by platform.activate(mode, aiter=True).
FP8BMM_ENV = {
    "VLLM_ROCM_USE_AITER_FP8BMM": "1",
    "VLLM_ROCM_USE_AITER_FP4BMM": "0",
    # ROCM_AITER_MLA (asm decode) -> TRITON_MLA, what the stack's block decode targets.
    "VLLM_ROCM_USE_AITER_MLA": "0",
    # IR rms_norm "aiter" (CK) and the AITER linear paths (hipBLASLt tgemm,
    # Triton gemm_a16w16 only for tuned shapes).
    "VLLM_ROCM_USE_AITER_RMSNORM": "0",
    "VLLM_ROCM_USE_AITER_LINEAR": "0",
    "VLLM_ROCM_USE_AITER_TRITON_GEMM": "0",
    # Not reached by the drafter; off so that nothing else asks for HIP.
    "VLLM_ROCM_USE_AITER_MHA": "0",
    "VLLM_ROCM_USE_AITER_MOE": "0",
    "VLLM_ROCM_USE_AITER_CUSTOM_AR": "0",
    "VLLM_ROCM_USE_AITER_TRITON_ROPE": "0",
}


# --- doubles for aiter's HIP/CK ops that no vLLM flag turns off ---------------


def fused_qk_rmsnorm(
    q_out=None,
    q=None,
    q_weight=None,
    q_eps=None,
    k_out=None,
    k=None,
    k_weight=None,
    k_eps=None,
):
    """Double of aiter's HIP ``_fused_qk_rmsnorm`` (two RMSNorms in one
    launch): fp32 statistics, the normalised row rounded to the input dtype,
    then times the weight, as vLLM's rms_norm kernel. Written independently
    of the reference (one fp32 pass over both inputs' sums of squares)."""
    outs = []
    for x, w, eps, out in ((q, q_weight, q_eps, q_out), (k, k_weight, k_eps, k_out)):
        xf = x.float()
        inv = (xf.square().sum(-1, keepdim=True) / x.shape[-1] + eps).rsqrt()
        y = (xf * inv).to(x.dtype) * w
        if out is not None:
            out.copy_(y)
            y = out
        outs.append(y)
    return outs[0], outs[1]


def _rms_norm_reference(
    q_out=None,
    q=None,
    q_weight=None,
    q_eps=None,
    k_out=None,
    k=None,
    k_weight=None,
    k_eps=None,
):
    def norm(x, w, eps):
        return (
            torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
            * w
        )

    return norm(q, q_weight, q_eps), norm(k, k_weight, k_eps)


def _rms_norm_cases():
    def case(tokens, q_dim, k_dim, seed, strided):
        def make():
            g = torch.Generator().manual_seed(seed)
            # As the wrapper passes them: column slices of one projection.
            both = (torch.randn(tokens, q_dim + k_dim + 16, generator=g) * 3).bfloat16()
            q, k = (
                (both[:, :q_dim], both[:, q_dim : q_dim + k_dim])
                if strided
                else (
                    both[:, :q_dim].contiguous(),
                    both[:, q_dim : q_dim + k_dim].contiguous(),
                )
            )
            qw = (1 + 0.2 * torch.randn(q_dim, generator=g)).bfloat16()
            kw = (1 + 0.2 * torch.randn(k_dim, generator=g)).bfloat16()
            return (), dict(q=q, q_weight=qw, q_eps=1e-6, k=k, k_weight=kw, k_eps=1e-5)

        return make

    return [
        case(4, 48, 32, 1, True),
        case(10, 1536, 512, 2, False),
        case(1, 48, 32, 3, True),
    ]


def _within_one_bf16_ulp(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        # The two differ only in fp32 summation order before one rounding.
        torch.testing.assert_close(g.float(), e.float(), rtol=2.0**-7, atol=1e-6)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    return_lse=False,
    out=None,
    **unused,
):
    """Double of aiter's CK ``flash_attn_varlen_func`` (what the ROCm MLA
    prefill backend calls): per sequence, softmax(q k^T * scale) v in fp32,
    causal masks aligned bottom-right (flash-attention's convention); lse is
    (heads, total_q)."""
    assert not unused, f"not modelled: {sorted(unused)}"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    o = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k[ks:ke].float()) * scale
        if causal:
            lq, lk = qe - qs, ke - ks
            row = torch.arange(lq).unsqueeze(1) + (lk - lq)
            s = s.masked_fill(torch.arange(lk).unsqueeze(0) > row, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(s, -1)
        o[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[ks:ke].float()).to(
            q.dtype
        )
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def _attention_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale=None,
    causal=False,
    return_lse=False,
    **_,
):
    outs, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi, ki, vi = (t.float().transpose(0, 1) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        mask = None
        if causal:
            lq, lk = qe - qs, ke - ks
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=softmax_scale
            )
            .transpose(0, 1)
            .to(q.dtype)
        )
        s = (qi @ ki.transpose(1, 2)) * softmax_scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        lses.append(torch.logsumexp(s, -1))
    o = torch.cat(outs)
    return (o, torch.cat(lses, dim=1)) if return_lse else o


def _attention_cases():
    def case(seqs_q, seqs_k, causal, lse, seed):
        def make():
            g = torch.Generator().manual_seed(seed)
            heads = 4
            q = torch.randn(sum(seqs_q), heads, 24, generator=g).bfloat16()
            k = torch.randn(sum(seqs_k), heads, 24, generator=g).bfloat16()
            v = torch.randn(sum(seqs_k), heads, 16, generator=g).bfloat16()
            cu_q = torch.tensor(
                [0, *torch.tensor(seqs_q).cumsum(0).tolist()], dtype=torch.int32
            )
            cu_k = torch.tensor(
                [0, *torch.tensor(seqs_k).cumsum(0).tolist()], dtype=torch.int32
            )
            return (), dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                softmax_scale=0.2,
                causal=causal,
                return_lse=lse,
            )

        return make

    return [
        case([3, 5], [3, 5], True, False, 1),  # run_prefill_new_tokens
        case([3, 5], [3, 5], True, True, 2),
        case([2, 4], [7, 9], False, True, 3),  # run_prefill_context_chunk
    ]


def _attention_close(got, expected) -> None:
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected)
    torch.testing.assert_close(
        got[0].float(), expected[0].float(), rtol=2.0**-7, atol=1e-3
    )
    for g, e in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


CALLS: Counter[str] = Counter()  # calls of the doubles, in this process


def _counted(name, fn):
    """The double, counted in ``CALLS``; under a LaunchCounter it is one
    launch (``aiter::<name>``), as the HIP op it stands in for."""
    from .launches import opaque_launch

    def double(*args, **kwargs):
        CALLS[name] += 1
        with opaque_launch(f"aiter::{name.rsplit('.', 1)[-1]}"):
            return fn(*args, **kwargs)

    double.__name__ = fn.__name__
    return double


DOUBLES = {
    "aiter.ops.fused_qk_norm_rope_cache_quant._fused_qk_rmsnorm": (
        fused_qk_rmsnorm,
        _rms_norm_reference,
        _rms_norm_cases,
        _within_one_bf16_ulp,
    ),
    "aiter.flash_attn_varlen_func": (
        flash_attn_varlen_func,
        _attention_reference,
        _attention_cases,
        _attention_close,
    ),
}


def register_drafter_doubles() -> None:
    """Each double checked against its torch reference, then stood in."""
    for qualname, (double, reference, cases, compare) in DOUBLES.items():
        aiter_harness.register_double(
            qualname,
            _counted(qualname, double),
            reference=reference,
            cases=cases(),
            compare=compare,
        )
    CALLS.clear()  # the checks are not the drafter's calls


# --- the worlds ----------------------------------------------------------------


def activate_regime(mode: str = MODE, env: dict[str, str] | None = None) -> None:
    """The AITER-on world in the FP8 BMM regime (before vLLM is imported)."""
    from . import platform

    os.environ.update(FP8BMM_ENV if env is None else env)
    platform.activate(mode, aiter=True)
    register_drafter_doubles()


def activate_aiter_off(mode: str = MODE) -> None:
    from . import platform

    platform.activate(mode)


# Triton kernel cache keys this process computed and did not compile:
# [(kernel name, key)], in call order.
SKIPPED: list[tuple[str, str]] = []


def compile_nothing() -> None:
    """Compiled (not interpreted) Triton in an emulated process: each launch
    binds its arguments with Triton's own binder for the emulated target
    (gfx942 or gfx950) and computes the kernel cache key; this records the key and
    skips the compile and the launch (``knobs.runtime.jit_cache_hook``
    returning True: ``JITFunction.run`` returns before launching). A GPU
    compiles once per distinct key and process."""
    from triton import knobs
    from triton.runtime import driver

    def record(*, key, fn, **_):
        SKIPPED.append((fn.name.rsplit(".", 1)[-1], str(key)))
        return True

    knobs.runtime.jit_cache_hook = record
    driver.active.get_current_stream = lambda device=None: 0


# --- interpreter workers ---------------------------------------------------------


def _prepare(world: str, arch: str) -> None:
    activate = {"on": activate_regime, "off": activate_aiter_off}[world]
    activate(f"rocm-{arch}")


def interpreter_pool(world: str, arch: str = "gfx942"):
    """One spawned interpreter worker in ``world`` ("on": the FP8 BMM regime,
    "off": AITER off) on the emulated ``arch``, with aiter's interpreter
    workarounds (they also apply to vLLM's kernels, in both worlds alike) and
    bf16 dots widened."""
    from .interpreter import InterpreterPool, widen_bf16_dots

    return InterpreterPool(
        widen_bf16_dots,
        *aiter_harness.INTERPRETER_WORKAROUNDS,
        prepare=functools.partial(_prepare, world, arch),
        workers=1,
    )


@contextlib.contextmanager
def recorded_precompile(record: list) -> Iterator[None]:
    """During weight processing, ``rocm_aiter_ops.triton_fp8_bmm`` calls are
    recorded (X's shape, the weight's shape and dtype, keyword arguments) and
    only the first of each (weight, M bucket) pair runs; vLLM discards their
    outputs. For the interpreter; the zygote runs the whole loop."""
    from vllm._aiter_ops import rocm_aiter_ops

    real = rocm_aiter_ops.__dict__["triton_fp8_bmm"]
    fn = real.__func__ if isinstance(real, staticmethod) else real
    ran: set = set()

    def recording(X, WQ, w_scale, **kwargs):
        record.append((tuple(X.shape), tuple(WQ.shape), str(WQ.dtype), dict(kwargs)))
        bucket = (tuple(WQ.shape), 1 if X.shape[1] == 1 else 2)
        if bucket in ran:
            return None
        ran.add(bucket)
        return fn(X, WQ, w_scale, **kwargs)

    rocm_aiter_ops.triton_fp8_bmm = staticmethod(recording)
    try:
        yield
    finally:
        rocm_aiter_ops.triton_fp8_bmm = real


# --- a draft step ------------------------------------------------------------------

CONTEXT_TOKENS = 10
BLOCK_TOKENS = 4
NUM_LAYERS = 2


def build_draft(cache: str = "auto", *, interpreted: bool):
    """The registry's drafter on the synthetic checkpoint, with the target's
    embedding and LM head as the runner aliases them."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    from . import drafter as D

    precompile: list = []
    with recorded_precompile(precompile) if interpreted else contextlib.nullcontext():
        draft = D.build(
            rope="yarn", cache_dtype=cache, num_layers=NUM_LAYERS, eager=True
        )
    D.allocate_caches(draft)
    cfg = draft.hf_config
    g = torch.Generator().manual_seed(11)
    with D.config_context(draft.vllm_config):
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size)
    embed.weight.data.copy_(torch.randn(embed.weight.shape, generator=g))
    lm_head.weight.data.copy_(
        torch.randn(lm_head.weight.shape, generator=g) * cfg.hidden_size**-0.5
    )
    draft.model.model.embed_tokens = embed
    draft.model.lm_head = lm_head
    return draft, precompile


def draft_step(draft, counter=None) -> dict:
    """Context KV, one non-causal draft block of BLOCK_TOKENS, the draft
    logits and greedy tokens as DSpark's sequential Markov sampling picks
    them. ``counter``: a LaunchCounter active over the block forward only
    (phases by layer)."""
    from vllm.forward_context import set_forward_context

    from . import drafter as D

    cfg = draft.hf_config
    # The context at positions 0..9 in slots 0..9, the block after it: the
    # attention reads exactly what the context-KV precompute and the block
    # wrote (never the caches' sentinel fill).
    states, _ = D.context_inputs(cfg, CONTEXT_TOKENS)
    positions = torch.arange(CONTEXT_TOKENS)
    context_slots = torch.arange(CONTEXT_TOKENS, dtype=torch.int64)
    seq_len = CONTEXT_TOKENS + BLOCK_TOKENS
    block_ids = torch.tensor([5, 17, 17, 17][:BLOCK_TOKENS])
    block_positions = torch.arange(CONTEXT_TOKENS, seq_len)
    block_slots = torch.arange(CONTEXT_TOKENS, seq_len, dtype=torch.int64)
    names = [owner.layer_name for owner in draft.cache_layers()]
    if counter is not None:
        for i, layer in enumerate(draft.layers):
            layer.register_forward_pre_hook(
                lambda *_, i=i: setattr(counter, "phase", f"layer{i}")
            )
            layer.register_forward_hook(lambda *_: setattr(counter, "phase", "model"))
    with (
        D.config_context(draft.vllm_config),
        set_forward_context(
            {name: D.decode_metadata(BLOCK_TOKENS, seq_len) for name in names},
            draft.vllm_config,
            slot_mapping={name: block_slots for name in names},
        ),
        torch.inference_mode(),
    ):
        draft.model.precompute_and_store_context_kv(states, positions, context_slots)
        with counter if counter is not None else contextlib.nullcontext():
            hidden = draft.model(block_ids, block_positions)
        base = draft.model.compute_draft_logits(hidden[1:]).float()
        vocab = torch.arange(base.shape[-1])
        # The Markov bias of each previous token (weights outside the absorb).
        bias = draft.model.markov_bias(draft.model.markov_embed(vocab)).float()
        prev, tokens, logits = int(block_ids[0]), [], []
        for i in range(BLOCK_TOKENS - 1):
            step = base[i] + bias[prev]
            logits.append(step)
            prev = int(step.argmax())
            tokens.append(prev)
    return {
        "hidden": hidden.float(),
        "logits": torch.stack(logits),
        "tokens": tokens,
        "base_logits": base,
        "markov_bias": bias,
        "anchor": int(block_ids[0]),
        "prefill_calls": CALLS["aiter.flash_attn_varlen_func"],
        "norm_calls": CALLS[
            "aiter.ops.fused_qk_norm_rope_cache_quant._fused_qk_rmsnorm"
        ],
    }


# --- load-time pre-compilation (in the AITER-on zygote: compile_nothing) ------------


@contextlib.contextmanager
def per_layer_precompile(layers: dict) -> Iterator[None]:
    """``layers[layer_name]``: the SKIPPED entries (Triton launches: kernel,
    cache key) and the ``triton_fp8_bmm`` calls (X shape, weight shape) that
    each MLAAttention's ``process_weights_after_loading`` made, and its time."""
    import time

    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    pwal = MLAAttention.process_weights_after_loading
    real = rocm_aiter_ops.__dict__["triton_fp8_bmm"]
    fn = real.__func__ if isinstance(real, staticmethod) else real
    calls: list = []

    def recording(X, WQ, w_scale, **kwargs):
        calls.append((tuple(X.shape), tuple(WQ.shape)))
        return fn(X, WQ, w_scale, **kwargs)

    def recorded_pwal(self):
        first, first_call = len(SKIPPED), len(calls)
        start = time.perf_counter()
        pwal(self)
        layers[self.layer_name] = {
            "launches": SKIPPED[first:],
            "calls": calls[first_call:],
            "seconds": time.perf_counter() - start,
        }

    MLAAttention.process_weights_after_loading = recorded_pwal
    rocm_aiter_ops.triton_fp8_bmm = staticmethod(recording)
    try:
        yield
    finally:
        MLAAttention.process_weights_after_loading = pwal
        rocm_aiter_ops.triton_fp8_bmm = real


# K3's MLA absorb at its real sizes (kv_lora_rank 512, qk_nope_head_dim 128,
# v_head_dim 128): W_K (heads, 512, 128), W_V (heads, 128, 512).
K3_ABSORB = {"W_K": (512, 128), "W_V": (128, 512)}


def k3_precompile_keys(heads: int = 8) -> dict[str, list[str]]:
    """The Triton cache keys of MLAAttention's pre-compile loop (M = 1..1024,
    the same ``triton_fp8_bmm`` calls on ``torch.empty`` inputs) at K3's
    absorb sizes; the head count is a grid dimension, not part of the key."""
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.model_executor.layers.attention.mla_attention import (
        dynamic_per_batched_tensor_quant,
    )
    from vllm.platforms import current_platform

    keys: dict[str, list[str]] = {}
    for name, (n, k) in K3_ABSORB.items():
        w, scale = dynamic_per_batched_tensor_quant(
            torch.randn(heads, n, k).bfloat16(), dtype=current_platform.fp8_dtype()
        )
        first = len(SKIPPED)
        for m in range(1, PRECOMPILE_BATCH_SIZES + 1):
            x = torch.empty((heads, m, k), dtype=torch.bfloat16)
            rocm_aiter_ops.triton_fp8_bmm(
                x, w, scale, group_size=128, transpose_bm=True
            )
        keys[name] = [key for _, key in SKIPPED[first:]]
    return keys
