"""The runbook's verdicts: kernel expectations of a profile, and the accuracy gate."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from scripts.runbook.parse import Accuracy, Trace

# --- profile: docs/hardware-runbook.md, step 2 ---------------------------------


@dataclass(frozen=True)
class AiterFlags:
    """What a served environment turns on, as vLLM 0.34.0 reads it: AITER, the
    absorb's FP8 BMM, its FP4 BMM (gfx950 only, and taking precedence over FP8),
    the target's AITER MLA decode (VLLM_ROCM_USE_AITER_MLA defaults to on)."""
    on: bool
    fp8bmm: bool
    fp4bmm: bool
    mla: bool

    @classmethod
    def from_env(cls, env: dict[str, str], gcn_arch: str) -> AiterFlags:
        on = env.get("VLLM_ROCM_USE_AITER", "").lower() in ("1", "true")

        def flag(name: str, default: str = "0") -> bool:
            return on and env.get(f"VLLM_ROCM_USE_AITER_{name}", default).lower() in (
                "1", "true")

        fp4 = flag("FP4BMM") and gcn_arch.startswith("gfx950")
        return cls(on, flag("FP8BMM") and not fp4, fp4, flag("MLA", "1"))

    @property
    def bmm(self) -> bool:
        return self.fp8bmm or self.fp4bmm


@dataclass(frozen=True)
class Expectation:
    name: str
    where: str  # "kernels", "runtime" or "cpu_ops" of the trace
    pattern: str  # regex on names
    rule: str  # "present", "absent" or "once-per-draft"
    why: str
    # When it is checked, from the served flags; otherwise "not checked: <skip>".
    applies: Callable[[AiterFlags], bool] = lambda flags: True
    skip: str = ""


# aiter's Triton BMM kernels of vLLM's MLA absorb (`rocm_aiter_ops.triton_fp8_bmm`,
# `batched_gemm_a16wfp4`).
_FP8_BMM = r"batched_gemm_a8w8"
_FP4_BMM = r"batched_gemm_a16wfp4|batched_gemm_afp4"

EXPECTATIONS = (
    Expectation("AITER FP8 BMM for the absorb", "kernels", _FP8_BMM, "present",
                "with VLLM_ROCM_USE_AITER_FP8BMM on, the absorb is aiter's Triton FP8 BMM",
                lambda flags: flags.fp8bmm, "FP8 BMM off"),
    Expectation("AITER FP4 BMM for the absorb", "kernels", _FP4_BMM, "present",
                "with VLLM_ROCM_USE_AITER_FP4BMM on (gfx950), the absorb is aiter's Triton "
                "FP4 BMM", lambda flags: flags.fp4bmm, "FP4 BMM off, or not gfx950"),
    Expectation("no AITER BMM with its flags off", "kernels", f"{_FP8_BMM}|{_FP4_BMM}",
                "absent", "with the BMM flags off, the absorb is torch's bmm",
                lambda flags: not flags.bmm, "an AITER BMM flag is on"),
    Expectation("fused RoPE + draft KV write", "kernels",
                r"concat_and_cache_mla_rope_fused_kernel", "present",
                "AITER on and off, each draft layer's RoPE and KV-cache write are one "
                "launch of vLLM's concat_and_cache_mla_rope_fused"),
    Expectation("no separate RoPE launch in the draft layers", "kernels",
                r"rotary_embedding_kernel", "once-per-draft",
                "the draft layers rotate in the fused launch: vLLM's rotary_embedding runs "
                "only in the context precompute, once per draft step (the K3 target has no "
                "RoPE); rotary_embedding then concat_and_cache_mla per layer would be more"),
    Expectation("no HIPified NVIDIA decode kernel", "kernels",
                r"fusedKimiK3MLADecodeQConcatKVCacheKernel", "absent",
                "the NVIDIA module's fused decode concat must not run on ROCm"),
    Expectation("no hipPointerGetAttribute calls", "runtime",
                r"hipPointerGetAttribute", "absent",
                "the HIPified NVIDIA kernel's launcher makes them"),
    Expectation("one grouped context-KV launch per draft step", "kernels",
                r"concat_and_cache_mla_grouped", "once-per-draft",
                "one concat_and_cache_mla_grouped per context precompute (auto/bf16/fp8 caches)"),
    Expectation("no identity-RoPE fused decode (HIP)", "kernels",
                r"fused_qk_rope_concat_and_cache_mla", "absent",
                "the draft never takes the target's identity-RoPE fused decode",
                lambda flags: not flags.mla,
                "AITER MLA on: the target's own fused decode launches it"),
)
# The grouped count may exceed the drafts by the proposals no verification
# counted yet (the last one of each request) and by graph-capture warm-up.
_DRAFT_SLACK = 0.1


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def check_trace(trace: Trace, drafts: int | None, flags: AiterFlags) -> list[Verdict]:
    verdicts = []
    for e in EXPECTATIONS:
        names = getattr(trace, e.where)
        count = sum(1 for n in names if re.search(e.pattern, n))
        if not e.applies(flags):
            verdicts.append(Verdict(e.name, True, f"not checked: {e.skip} ({count})"))
        elif e.rule == "present":
            verdicts.append(Verdict(e.name, count > 0, f"{count} launch(es)"))
        elif e.rule == "absent":
            verdicts.append(Verdict(e.name, count == 0, f"{count} found"))
        elif drafts is None:
            verdicts.append(Verdict(e.name, count > 0,
                                    f"{count} launch(es); draft count unknown"))
        else:
            low, high = drafts, math.ceil(drafts * (1 + _DRAFT_SLACK)) + 1
            verdicts.append(Verdict(e.name, low <= count <= high,
                                    f"{count} launch(es) for {drafts} draft step(s) "
                                    f"(expected {low}..{high})"))
    return verdicts


# What the report lists for the steps the flags switch: every kernel (or CPU
# op) name the trace has for each, target and draft layers alike (one trace
# holds both), with its count.
ROLES = (
    ("absorb", "kernels", f"{_FP8_BMM}|{_FP4_BMM}"),
    ("absorb", "cpu_ops", r"^aten::(bmm|matmul)$"),
    ("RoPE", "kernels", r"(?i)rotary_embedding|rope"),
    ("KV-cache write", "kernels", r"concat_and_cache_mla|cat_and_cache_mla|reshape_and_cache"),
)


def kernels_by_role(trace: Trace) -> dict[str, dict[str, int]]:
    """{role: {short name: launches}}; a CPU op's name keeps its `aten::`."""
    seen: dict[str, dict[str, int]] = {role: {} for role, _, _ in ROLES}
    for role, where, pattern in ROLES:
        for name in getattr(trace, where):
            if re.search(pattern, name):
                short = _short_name(name)
                seen[role][short] = seen[role].get(short, 0) + 1
    return seen


def _short_name(name: str) -> str:
    """A kernel's name without its return type, namespace noise and arguments."""
    name = re.sub(r"^void ", "", name).split("(")[0].split("<")[0]
    return name.rsplit("::", 1)[-1] if not name.startswith("aten::") else name


# --- accuracy gate: docs/hardware-runbook.md, step 3 ---------------------------


@dataclass
class Gate:
    config: str
    passed: bool
    lines: list[str]


def _stderr(acc: Accuracy, metric: str) -> float:
    """lm-eval's bootstrap stderr, or the binomial one when it reports none."""
    reported = acc.stderrs.get(metric)
    if reported is not None:
        return reported
    p = acc.scores[metric]
    return math.sqrt(max(p * (1 - p), 1e-12) / acc.samples)


def accuracy_gate(candidate: Accuracy, reference: Accuracy, sigmas: float) -> Gate:
    """The candidate matches the reference on every gsm8k metric within
    `sigmas` standard errors of the difference (two-sided)."""
    passed, lines = True, []
    for metric, score in candidate.scores.items():
        ref = reference.scores[metric]
        noise = sigmas * math.hypot(_stderr(candidate, metric), _stderr(reference, metric))
        ok = abs(score - ref) <= noise
        passed &= ok
        lines.append(f"{metric}: {score:.4f} vs {ref:.4f} (difference {score - ref:+.4f}, "
                     f"noise ±{noise:.4f}) {'ok' if ok else 'OUTSIDE NOISE'}")
    return Gate(candidate.config, passed, lines)


# --- the draft's attention backend: docs/hardware-runbook.md, step 4c ----------

DRAFT_RULE = ("TRITON_MLA unless ROCM_AITER_MLA is both correct (its non-causal decode "
              "matched TRITON_MLA's in the device test) and faster: its mean ITL (time per "
              "decode step: one draft block and its verification) lower by more than "
              "{margin:.0%} in geometric mean over the cells, with an acceptance length no "
              "more than {margin:.0%} lower")


def _geomean_ratio(num: list[float], den: list[float]) -> float:
    return math.exp(sum(math.log(a / b) for a, b in zip(num, den)) / len(num))


def draft_backend_verdict(correct: bool, triton: list[dict], aiter: list[dict],
                          margin: float) -> dict:
    """Which backend a K3 draft should use on gfx950 with AITER on, by DRAFT_RULE,
    from each backend's cells (same order: mean_itl_ms, acceptance_length)."""
    def verdict(backend: str, reason: str, **figures) -> dict:
        return {"backend": backend, "reason": reason, **figures}

    if not correct:
        return verdict("TRITON_MLA", "ROCM_AITER_MLA's non-causal decode was not shown to "
                       "match TRITON_MLA's (device test failed, skipped or not run)")
    keys = ("mean_itl_ms", "acceptance_length")
    if not triton or len(triton) != len(aiter) or any(
            not c.get(k) for c in triton + aiter for k in keys):
        return verdict("TRITON_MLA", "no complete A/B of the two backends' serving runs")
    speedup = _geomean_ratio([c["mean_itl_ms"] for c in triton],
                             [c["mean_itl_ms"] for c in aiter])
    acceptance = _geomean_ratio([c["acceptance_length"] for c in aiter],
                                [c["acceptance_length"] for c in triton])
    figures = {"speedup": speedup, "acceptance_ratio": acceptance}
    if acceptance < 1 - margin:
        return verdict("TRITON_MLA", f"ROCM_AITER_MLA's acceptance length is "
                       f"{1 - acceptance:.1%} lower", **figures)
    if speedup <= 1 + margin:
        return verdict("TRITON_MLA", f"ROCM_AITER_MLA is {speedup - 1:+.1%} faster per decode "
                       f"step, not more than {margin:.0%}", **figures)
    return verdict("ROCM_AITER_MLA", f"correct, and {speedup - 1:.1%} faster per decode step "
                   f"(acceptance {acceptance - 1:+.1%})", **figures)
