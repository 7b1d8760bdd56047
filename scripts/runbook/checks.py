"""The runbook's verdicts: kernel expectations of a profile, and the accuracy gate."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from scripts.runbook.parse import Accuracy, Trace

# --- profile: docs/hardware-runbook.md, step 2 ---------------------------------


@dataclass(frozen=True)
class Expectation:
    name: str
    where: str  # "kernels", "runtime" or "cpu_ops" of the trace
    pattern: str  # regex on names
    rule: str  # "present", "absent" or "once-per-draft"
    why: str


EXPECTATIONS = (
    Expectation("AITER FP8/FP4 BMM for the absorb", "kernels",
                r"batched_gemm_a8w8|batched_gemm_afp4", "present",
                "with VLLM_ROCM_USE_AITER_FP8BMM/FP4BMM on, the absorb uses AITER's BMM"),
    Expectation("draft KV write through concat_and_cache_mla", "kernels",
                r"concat_and_cache_mla_kernel", "present",
                "MLAAttention writes the draft KV cache with vLLM's cache op"),
    Expectation("no HIPified NVIDIA decode kernel", "kernels",
                r"fusedKimiK3MLADecodeQConcatKVCacheKernel", "absent",
                "the NVIDIA module's fused decode concat must not run on ROCm"),
    Expectation("no hipPointerGetAttribute calls", "runtime",
                r"hipPointerGetAttribute", "absent",
                "the HIPified NVIDIA kernel's launcher makes them"),
    Expectation("one grouped context-KV launch per draft step", "kernels",
                r"concat_and_cache_mla_grouped", "once-per-draft",
                "one concat_and_cache_mla_grouped per context precompute (auto/bf16/fp8 caches)"),
    Expectation("no AITER fused QK-RoPE + cache", "kernels",
                r"fused_qk_rope_concat_and_cache_mla", "absent",
                "out of scope for this change: its appearance means another path ran"),
)
# The grouped count may exceed the drafts by the proposals no verification
# counted yet (the last one of each request) and by graph-capture warm-up.
_DRAFT_SLACK = 0.1


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def check_trace(trace: Trace, drafts: int | None, bmm_flags_on: bool) -> list[Verdict]:
    verdicts = []
    for e in EXPECTATIONS:
        names = getattr(trace, e.where)
        count = sum(1 for n in names if re.search(e.pattern, n))
        if e.rule == "present" and e.name.startswith("AITER") and not bmm_flags_on:
            verdicts.append(Verdict(e.name, True, f"not checked: AITER BMM flags off ({count})"))
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
