"""The ROCm K3 DSpark drafter in the AITER FP8 BMM regime on emulated MI300 and MI355.

``VLLM_ROCM_USE_AITER=1`` and ``VLLM_ROCM_USE_AITER_FP8BMM=1`` on gfx942 and on
gfx950 (every test runs on both: ``arch``), the other AITER features that need HIP kernels off by their own flags, checked
doubles where vLLM has none (``harness/aiter_drafter.py`` says which and why).
The drafter is the class vLLM's registry gives ``K3DSparkModel`` on ROCm
(``vllm/models/kimi_k3/amd/dspark_mla.py``), built and loaded on the synthetic
checkpoint of ``harness/drafter.py`` (2 draft layers, 4 heads, kv_lora_rank
32, qk_nope_head_dim 16, v_head_dim 16).

Processes:

* ``regime``: an AITER-on zygote, Triton compiled for the arch but compiling
  and launching nothing (each launch's kernel cache key is recorded): load,
  the 1..1024 pre-compile loop in full, launch counts;
* ``rocm``/``rocm950``: the usual AITER-off zygotes, for the launch counts
  without AITER;
* two interpreter workers, AITER on and AITER off, running aiter's and
  vLLM's Triton kernels in Triton's interpreter: draft logits and tokens.

Tolerance of the logits (AITER on against AITER off, same checkpoint, same
inputs). The only arithmetic that differs is the absorb: both BMMs of each
layer take fp8 (e4m3fnuz on gfx942, e4m3fn on gfx950) operands, the weight per tensor, the activation per
token group of 128. e4m3 keeps 3 mantissa bits, so each operand's relative
rounding error is at most 2**-4 and the product's relative (Frobenius) error
stays under 2**-4 (deliverable 1 measured 0.036 RMS at K3's sizes). That
error enters the logits only through the attention branch, which is added to
the residual stream and normalised before the LM head: the draft logits'
relative Frobenius error must be at most 2**-4, the final hidden state's
(two BMMs in series per layer, two layers) at most 2**-3. It must also be
above zero: a bit-identical result means the fp8 path did not run. Greedy
tokens: wherever the AITER-off top-1 logit leads the runner-up by more than
twice the largest logit deviation, the argmax cannot change, so those tokens
must agree (the sequential Markov step makes later tokens depend on earlier
ones: positions after a disagreement are not compared).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.verification.harness import aiter_drafter as R
from tests.verification.harness import drafter as D
from tests.verification.harness.zygote import Zygote

ABSORB_SITES = {
    "_prepare_mqa_query",
    "_v_up_proj",
}  # MLAAttention's two absorbs (0.34.0)
LOGITS_TOL = 2.0**-4
HIDDEN_TOL = 2.0**-3
CACHES = ("auto", "fp8")
DERIVED = {"W_K", "W_K_scale", "W_V", "W_V_scale", "W_UK_T", "W_UV"}


@pytest.fixture(scope="module", params=R.ARCHES)
def arch(request) -> str:
    """The emulated GPU: gfx942 (MI300) or gfx950 (MI355)."""
    return request.param


@pytest.fixture(scope="module")
def regime(arch):
    zygote = Zygote(f"rocm-{arch}", aiter=True)
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture(scope="module")
def aiter_off(arch, request):
    """The session's AITER-off zygote of the same arch."""
    return request.getfixturevalue({"gfx942": "rocm", "gfx950": "rocm950"}[arch])


# --- 1. build and load -----------------------------------------------------------


def load_job() -> dict:
    from vllm._aiter_ops import rocm_aiter_ops

    from tests.verification.harness import drafter as D

    layers: dict = {}
    with R.per_layer_precompile(layers):
        draft, _ = R.build_draft(interpreted=False)
    owners = draft.cache_layers()
    out = {
        "class": f"{type(draft.model).__module__}.{type(draft.model).__qualname__}",
        "registry": D.drafter_class().__module__,
        # Parameters never loaded (the absorb weights are derived from kv_b_proj;
        # the target's embedding and LM head are aliased in by the runner).
        "missing": sorted(
            n
            for n, _ in draft.model.named_parameters()
            if n not in draft.loaded
            and n.rsplit(".", 1)[-1] not in DERIVED
            and not n.startswith(("model.embed_tokens.", "lm_head."))
        ),
        "layers": [],
        "precompile": {
            name: {
                "calls": rec["calls"],
                "kernels": sorted({k for k, _ in rec["launches"]}),
                "launches": len(rec["launches"]),
            }
            for name, rec in layers.items()
        },
        "fp8bmm_kernel": rocm_aiter_ops.triton_fp8_bmm.__module__,
    }
    for owner in owners:
        w_uk, w_uv = _split_kv_b(owner)
        out["layers"].append(
            {
                "name": owner.layer_name,
                "fp8bmm": owner.is_aiter_triton_fp8_bmm_enabled,
                "fp4bmm": owner.is_aiter_triton_fp4_bmm_enabled,
                "W_K": (str(owner.W_K.dtype), tuple(owner.W_K.shape)),
                "W_V": (str(owner.W_V.dtype), tuple(owner.W_V.shape)),
                "W_UK_T": getattr(owner, "W_UK_T", None) is not None,
                # Dequantized weights against the bf16 ones they quantize.
                "W_K_error": _relative(
                    owner.W_K.float() * owner.W_K_scale, w_uk.transpose(0, 1)
                ),
                "W_V_error": _relative(
                    owner.W_V.float() * owner.W_V_scale, w_uv.permute(1, 2, 0)
                ),
            }
        )
    return out


def _split_kv_b(owner):
    """W_UK (L, N, P) and W_UV (L, N, V) from kv_b_proj, as vLLM splits it."""
    w = owner.kv_b_proj.weight.float().T  # (L, N * (P + V))
    w = w.view(
        owner.kv_lora_rank, owner.num_heads, owner.qk_nope_head_dim + owner.v_head_dim
    )
    return w[..., : owner.qk_nope_head_dim], w[..., owner.qk_nope_head_dim :]


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got - exact).norm() / exact.norm())


def test_drafter_loads_in_the_fp8_bmm_regime(regime, arch, record_property):
    r = regime.call(load_job)
    fp8 = str(R.FP8_DTYPES[arch])
    assert r["class"] == "vllm.models.kimi_k3.amd.dspark_mla.K3DSparkForCausalLM"
    assert r["registry"] == "vllm.models.kimi_k3.amd.dspark_mla"
    assert not r["missing"], r["missing"]
    assert r["fp8bmm_kernel"] == "vllm._aiter_ops"
    assert len(r["layers"]) == R.NUM_LAYERS
    for layer in r["layers"]:
        assert layer["fp8bmm"] is True and not layer["fp4bmm"], layer
        # (heads, L, P) and (heads, V, L): kv_lora_rank 32, nope 16, v 16, 4 heads.
        assert layer["W_K"] == (fp8, (4, 32, 16)), layer
        assert layer["W_V"] == (fp8, (4, 16, 32)), layer
        assert not layer["W_UK_T"], "the bf16 absorb weight was kept"
        # One per-tensor e4m3 rounding: at most 2**-4 relative per element.
        for key in ("W_K_error", "W_V_error"):
            assert 0 < layer[key] <= 2.0**-4, (key, layer)
        record_property(
            f"measure:{layer['name']} W_K/W_V fp8 error",
            f"{layer['W_K_error']:.4f}/{layer['W_V_error']:.4f}",
        )
    # The whole pre-compile loop ran, through aiter's kernel: M = 1..1024 for W_K and W_V.
    assert set(r["precompile"]) == {layer["name"] for layer in r["layers"]}
    for name, rec in r["precompile"].items():
        by_weight: dict = {}
        for x_shape, w_shape in rec["calls"]:
            by_weight.setdefault(w_shape, []).append(x_shape[1])
        assert sorted(by_weight) == [(4, 16, 32), (4, 32, 16)], (
            name,
            sorted(by_weight),
        )
        for ms in by_weight.values():
            assert ms == list(range(1, R.PRECOMPILE_BATCH_SIZES + 1))
        assert rec["kernels"] == [R.FP8_BMM_KERNEL], rec["kernels"]
        assert rec["launches"] == 2 * R.PRECOMPILE_BATCH_SIZES


# --- 2. the absorb on aiter's BMM -------------------------------------------------


def launch_job() -> dict:
    """What each draft layer launches in one draft block (the kernel budget's
    stand-ins: a Triton launch is recorded as ``triton::<kernel>``, not run;
    the attention kernel is one ``attention::triton_mla_decode``)."""
    from vllm.model_executor.layers.linear import LinearBase

    from tests.verification import kernel_budget
    from tests.verification.harness.launches import LaunchCounter

    kernel_budget._install_stand_ins()
    draft, _ = R.build_draft(interpreted=False)
    counter = LaunchCounter(
        sites_under="vllm/model_executor/layers/attention/mla_attention.py"
    )
    R.draft_step(draft)  # steady state
    R.draft_step(draft, counter)
    phases = [f"layer{i}" for i in range(R.NUM_LAYERS)]
    return {
        "counts": {p: dict(counter.counts.get(p, {})) for p in phases},
        "sites": {
            p: {
                op: {s.rsplit(" ", 1)[-1]: n for s, n in sites.items()}
                for op, sites in counter.sites.get(p, {}).items()
            }
            for p in phases
        },
        # The linear layers a decode step runs: all but kv_b_proj, whose weight
        # the absorbs carry (W_K/W_V).
        "linears": [
            sum(
                isinstance(m, LinearBase) and not name.endswith("kv_b_proj")
                for name, m in layer.named_modules()
            )
            for layer in draft.layers
        ],
    }


def test_absorb_launches_aiters_fp8_bmm(regime, aiter_off, record_property):
    with ThreadPoolExecutor(2) as pool:
        on_future = pool.submit(regime.call, launch_job)
        off = aiter_off.call(launch_job)
        on = on_future.result()
    triton_bmm = f"triton::{R.FP8_BMM_KERNEL}"
    for phase, counts in on["counts"].items():
        i = int(phase.removeprefix("layer"))
        sites = on["sites"][phase]
        # aiter's BMM twice (W_K absorb in _prepare_mqa_query, W_V absorb in _v_up_proj) ...
        assert counts.get(triton_bmm) == 2, counts
        assert sites[triton_bmm] == dict.fromkeys(ABSORB_SITES, 1), sites[triton_bmm]
        # ... and no torch BMM/GEMM for them: no bmm at all, and the mm's are
        # the layer's linear layers, none launched from MLAAttention.
        assert "aten::bmm" not in counts, counts
        assert counts.get("aten::mm") == on["linears"][i], (counts, on["linears"])
        assert set(sites.get("aten::mm", {})) == {"?"}, sites.get("aten::mm")
        # AITER off, the same layer runs the absorbs on aten::bmm.
        off_counts, off_sites = off["counts"][phase], off["sites"][phase]
        assert off_counts.get("aten::bmm") == 2 and triton_bmm not in off_counts, (
            off_counts
        )
        assert set(off_sites["aten::bmm"]) == ABSORB_SITES, off_sites["aten::bmm"]
        record_property(
            f"measure:{phase} launches AITER on/off",
            f"{sum(counts.values())}/{sum(off_counts.values())}",
        )
        record_property(f"measure:{phase} AITER on", dict(sorted(counts.items())))
        record_property(f"measure:{phase} AITER off", dict(sorted(off_counts.items())))


# --- 3. logits and tokens against the AITER-off path ------------------------------------


def numerics_job(cache: str) -> dict:
    """A draft step, then the same step again from the same caches with each
    layer's RoPE and cache write unfused (the wrapper's
    ``_rope_in_kv_cache_write`` off: the rope module's ``ops.rotary_embedding``,
    then MLAAttention's ``concat_and_cache_mla``), both steps' caches and the
    compiled ops each step called."""
    from tests.verification.harness import interpreter, ops

    start = time.perf_counter()
    R.CALLS.clear()  # the worker runs one job per cache dtype
    draft, precompile = R.build_draft(cache, interpreted=True)
    attns = [layer.self_attn for layer in draft.layers]
    initial = [c.clone() for c in draft.caches]
    ops.calls.clear()
    out = R.draft_step(draft)
    out["ops"] = dict(ops.calls)
    out["rope_in_kv_cache_write"] = [bool(a._rope_in_kv_cache_write) for a in attns]
    out["rope_is_neox"] = [
        (bool(a._rope_is_neox), bool(a.rotary_emb.is_neox_style)) for a in attns
    ]
    out["caches"] = [c.clone() for c in draft.caches]
    for cache_now, cache_before in zip(draft.caches, initial, strict=True):
        cache_now.copy_(cache_before)
    for attn in attns:
        attn._rope_in_kv_cache_write = False
    ops.calls.clear()
    out["unfused"] = R.draft_step(draft)
    out["unfused"]["ops"] = dict(ops.calls)
    out["unfused"]["caches"] = [c.clone() for c in draft.caches]
    out["fp8bmm"] = [
        bool(o.is_aiter_triton_fp8_bmm_enabled) for o in draft.cache_layers()
    ]
    out["precompile_calls"] = len(precompile)
    out["seconds"] = time.perf_counter() - start
    out["interpreted"] = interpreter.INTERPRETER_ENV["TRITON_INTERPRET"]
    return out


@pytest.fixture(scope="module")
def numerics(arch) -> dict:
    def run(world):
        with R.interpreter_pool(world, arch) as pool:
            return dict(zip(CACHES, pool.map(numerics_job, CACHES), strict=True))

    with ThreadPoolExecutor(2) as threads:
        on, off = threads.map(run, ("on", "off"))
    return {"on": on, "off": off}


@pytest.mark.parametrize("cache", CACHES)
def test_draft_logits_and_tokens_agree_with_aiter_off(numerics, cache, record_property):
    on, off = numerics["on"][cache], numerics["off"][cache]
    assert (
        on["fp8bmm"] == [True] * R.NUM_LAYERS
        and off["fp8bmm"] == [False] * R.NUM_LAYERS
    )
    # The loop was recorded (2 x 1024 calls per layer), not run in the interpreter.
    assert on["precompile_calls"] == R.NUM_LAYERS * 2 * R.PRECOMPILE_BATCH_SIZES
    # The prefill double is never reached by a decode-only draft block; the
    # dual-RMSNorm double runs once per layer (q_a and kv_a norms).
    assert on["prefill_calls"] == 0 and on["norm_calls"] == R.NUM_LAYERS
    # Each step's logits with the AITER-off previous token on both sides (the
    # Markov bias of a diverged chain is not a numerical difference).
    prevs = [off["anchor"], *off["tokens"][:-1]]
    logits_error = _relative(
        on["base_logits"] + on["markov_bias"][prevs],
        off["base_logits"] + off["markov_bias"][prevs],
    )
    hidden_error = _relative(on["hidden"], off["hidden"])
    record_property(f"measure:{cache} logits relative error", f"{logits_error:.4f}")
    record_property(f"measure:{cache} hidden relative error", f"{hidden_error:.4f}")
    assert 0 < logits_error <= LOGITS_TOL, logits_error
    assert 0 < hidden_error <= HIDDEN_TOL, hidden_error
    # Greedy tokens, step by step with the AITER-off previous token for both
    # (DSpark's Markov bias depends on it): where the AITER-off top-1 leads by
    # more than twice the largest deviation of that step's logits, the
    # argmax cannot differ.
    decided, agree, margins, deviations = 0, 0, [], []
    for i, prev in enumerate(prevs):
        step_on = on["base_logits"][i] + on["markov_bias"][prev]
        step_off = off["base_logits"][i] + off["markov_bias"][prev]
        deviation = float((step_on - step_off).abs().max())
        top2 = step_off.topk(2).values
        margin = float(top2[0] - top2[1])
        margins.append(round(margin, 3))
        deviations.append(round(deviation, 3))
        agree += int(step_on.argmax() == step_off.argmax())
        if margin > 2 * deviation:
            decided += 1
            assert int(step_on.argmax()) == int(step_off.argmax()), (
                i,
                margin,
                deviation,
            )
    assert decided >= 1, (margins, deviations)
    record_property(
        f"measure:{cache} greedy tokens on/off; steps decided, agreeing; margins; deviations",
        f"{on['tokens']}/{off['tokens']}; {decided}, {agree} of {len(prevs)}; {margins}; {deviations}",
    )


# --- 5. RoPE and the cache write in one launch of vLLM's fused op -------------------


def _pair_norms(rope: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Each element's rotation pair's norm: (x[i], x[i + half]) with neox,
    else (x[2i], x[2i + 1]), as the rotation pairs them."""
    half = rope.shape[-1] // 2
    if is_neox:
        a, b = rope[..., :half], rope[..., half:]
        norm = (a.square() + b.square()).sqrt()
        return torch.cat([norm, norm], dim=-1)
    a, b = rope[..., 0::2], rope[..., 1::2]
    norm = (a.square() + b.square()).sqrt()
    return torch.stack([norm, norm], dim=-1).flatten(-2)


@pytest.mark.parametrize("world", ("on", "off"))
@pytest.mark.parametrize("cache", CACHES)
def test_fused_rope_and_cache_write_match_the_unfused_path(
    numerics, arch, world, cache, record_property
):
    """AITER on and off, each draft layer rotates q_pe and k_pe and writes its
    cache rows in one launch of vLLM's ``concat_and_cache_mla_rope_fused``
    (the harness runs its CPU body, ``reference.concat_and_cache_mla_rope_fused``),
    and that agrees with the wrapper's unfused path on the same step (its
    ``_rope_in_kv_cache_write`` off: ``ops.rotary_embedding`` on the fp32
    table, then ``concat_and_cache_mla``).

    The fused op rotates in bf16: the table rounded to bf16 (at most
    2**-9 relative), each product and the sum rounded (2**-9 each). For a pair
    (a, b) rotated by (c, s), |a c| + |b s| is at most the pair's norm after
    the rotation, so the fused element is within 3 * 2**-9 of that norm of the
    exact rotation of the same fp32 table, the unfused one (fp32, one
    rounding) within 2**-9: they are at most 2**-7 of the pair's norm apart.
    The first layer rotates the same q_pe/k_pe on both paths, so its block
    rows' rope part must hold that elementwise (the pair's norm taken from the
    unfused row, slack 2**-4 for its own rounding), and its nope part (kv_c,
    written as given) is equal. An fp8 cache rounds each side once more: plus
    one e4m3 step (2**-3 of the value) and the subnormal step. The context rows
    (the context-KV precompute, the same on both paths) are equal in every
    layer. Later layers read the first layer's attention, so their block rows,
    the hidden state and the logits differ more: with AITER off (bf16
    arithmetic throughout) within a relative (Frobenius) error of 2**-6
    (measured at most 7.0e-3), an fp8 cache's rows within 2**-4 (one e4m3
    rounding); with AITER on, the fp8 absorb re-rounds the perturbed
    activations to e4m3, within 2**-4 (its bound above; measured at most
    2.9e-2 for a cache, 2.0e-2 for the hidden state and the logits)."""
    step = numerics[world][cache]
    unfused = step["unfused"]
    layers = R.NUM_LAYERS
    assert step["rope_in_kv_cache_write"] == [True] * layers
    assert all(fused == module for fused, module in step["rope_is_neox"])
    # The fused step launches the fused op once per layer and no separate
    # cache write; the unfused step no fused op, one cache write and one more
    # rotary launch per layer.
    fused_ops, unfused_ops = step["ops"], unfused["ops"]
    assert fused_ops.get("concat_and_cache_mla_rope_fused") == layers, fused_ops
    assert "concat_and_cache_mla_rope_fused" not in unfused_ops, unfused_ops
    assert unfused_ops.get("concat_and_cache_mla", 0) == (
        fused_ops.get("concat_and_cache_mla", 0) + layers
    ), (fused_ops, unfused_ops)
    assert unfused_ops.get("rotary_embedding", 0) == (
        fused_ops.get("rotary_embedding", 0) + layers
    ), (fused_ops, unfused_ops)
    record_property(
        f"measure:{world} {cache} ops fused/unfused", f"{fused_ops}/{unfused_ops}"
    )

    hidden_error = _relative(step["hidden"], unfused["hidden"])
    logits_error = _relative(step["base_logits"], unfused["base_logits"])
    differing = [
        int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
        for a, b in zip(step["caches"], unfused["caches"], strict=True)
    ]
    record_property(
        f"measure:{world} {cache} fused/unfused cache bytes differing", differing
    )
    rank = D.DIMS["kv_lora_rank"]
    dtype = torch.bfloat16 if cache == "auto" else R.FP8_DTYPES[arch]
    # The block's slots; the context's before them, the sentinel's after.
    block = slice(R.CONTEXT_TOKENS, R.CONTEXT_TOKENS + R.BLOCK_TOKENS)
    fused_rows, unfused_rows = (
        [c.view(dtype).flatten(0, -2) for c in caches]
        for caches in (step["caches"], unfused["caches"])
    )
    for a, b in zip(fused_rows, unfused_rows, strict=True):
        for rows in (slice(None, block.start), slice(block.stop, None)):
            assert torch.equal(a[rows].view(torch.uint8), b[rows].view(torch.uint8))
    first, first_unfused = fused_rows[0][block].float(), unfused_rows[0][block].float()
    assert torch.equal(first[:, :rank], first_unfused[:, :rank])
    rope, rope_unfused = first[:, rank:], first_unfused[:, rank:]
    pairs = _pair_norms(rope_unfused, step["rope_is_neox"][0][0])
    bound = 2.0**-7 * (1 + 2.0**-4) * pairs
    if cache != "auto":
        subnormal_step = torch.finfo(dtype).smallest_normal * 2.0**-3
        bound = bound + 2.0**-3 * rope_unfused.abs() + subnormal_step
    excess = (rope - rope_unfused).abs() - bound
    assert excess.max() <= 0, (float(excess.max()), rope, rope_unfused)
    if cache == "auto":  # bit-identical: the bf16 rotation did not run
        assert not torch.equal(rope, rope_unfused)
    cache_errors = [
        _relative(a[block].float(), b[block].float())
        for a, b in zip(fused_rows, unfused_rows, strict=True)
    ]
    record_property(
        f"measure:{world} {cache} fused/unfused block rows, hidden, logits relative error",
        f"{[f'{e:.2e}' for e in cache_errors]}, {hidden_error:.2e}, {logits_error:.2e}",
    )
    out_tol = 2.0**-6 if world == "off" else 2.0**-4
    cache_tol = out_tol if cache == "auto" else 2.0**-4
    assert max(cache_errors) <= cache_tol, cache_errors
    assert hidden_error <= out_tol and logits_error <= out_tol


# --- 4. the draft layers' share of the load-time pre-compilation --------------------


def precompile_job() -> dict:
    import torch

    layers: dict = {}
    with R.per_layer_precompile(layers):
        R.build_draft(interpreted=False)
    seen: set = set()
    per_layer = {}
    for name, rec in layers.items():
        keys = [key for _, key in rec["launches"]]
        per_layer[name] = {
            "launches": len(keys),
            "variants": len(set(keys)),
            "new_variants": len(set(keys) - seen),
            "seconds": rec["seconds"],
        }
        seen |= set(keys)
    torch.manual_seed(0)
    k3 = R.k3_precompile_keys()
    return {
        "layers": per_layer,
        "k3": {w: (len(k), len(set(k))) for w, k in k3.items()},
    }


def test_precompile_share_of_the_draft_layers(regime, record_property):
    r = regime.call(precompile_job)
    names = list(r["layers"])
    assert len(names) == R.NUM_LAYERS
    for i, name in enumerate(names):
        layer = r["layers"][name]
        assert layer["launches"] == 2 * R.PRECOMPILE_BATCH_SIZES, layer
        # Only a handful of Triton variants (M buckets x specialisations) ...
        assert 0 < layer["variants"] < 100, layer
        # ... compiled once per process: a further layer of the same shapes adds none.
        if i:
            assert layer["new_variants"] == 0, layer
        record_property(
            f"measure:{name} pre-compile launches, variants, new, host s",
            f"{layer['launches']}, {layer['variants']}, {layer['new_variants']}, {layer['seconds']:.2f}",
        )
    for weight, (calls, variants) in r["k3"].items():
        assert calls == R.PRECOMPILE_BATCH_SIZES and 0 < variants < 100
        record_property(
            f"measure:K3-size {weight} pre-compile calls, variants",
            f"{calls}, {variants}",
        )
