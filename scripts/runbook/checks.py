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
    """What the served environment turns on: AITER, its FP8/FP4 BMM, its MLA
    decode (vLLM's VLLM_ROCM_USE_AITER_MLA defaults to on)."""
    on: bool
    bmm: bool
    mla: bool

    @classmethod
    def from_env(cls, env: dict[str, str]) -> AiterFlags:
        on = env.get("VLLM_ROCM_USE_AITER") == "1"
        bmm = any(env.get(f"VLLM_ROCM_USE_AITER_{k}BMM") == "1" for k in ("FP8", "FP4"))
        return cls(on, on and bmm, on and env.get("VLLM_ROCM_USE_AITER_MLA", "1") == "1")


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


EXPECTATIONS = (
    Expectation("AITER FP8/FP4 BMM for the absorb", "kernels",
                r"batched_gemm_a8w8|batched_gemm_afp4", "present",
                "with VLLM_ROCM_USE_AITER_FP8BMM/FP4BMM on, the absorb uses AITER's BMM",
                lambda flags: flags.bmm, "AITER BMM flags off"),
    Expectation("AITER fused RoPE + draft KV write", "kernels",
                r"_fused_qk_rope_cat_and_cache_mla_kernel", "present",
                "with AITER on, each draft layer's RoPE and KV-cache write are one "
                "launch of aiter's Triton fused_qk_rope_cat_and_cache_mla",
                lambda flags: flags.on, "AITER off"),
    Expectation("draft KV write through concat_and_cache_mla", "kernels",
                r"concat_and_cache_mla_kernel", "present",
                "with AITER off, MLAAttention writes the draft KV cache with vLLM's cache op",
                lambda flags: not flags.on, "AITER on: the fused launch writes it"),
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
