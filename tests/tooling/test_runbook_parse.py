"""The runbook's readers and verdicts on the recorded samples (runbook_samples/)."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from scripts.runbook import checks, parse
from tests.tooling.runbook_fake import SAMPLES, decode_trace


def test_bench_result_reads_vllms_result_file():
    figures = parse.bench_result(SAMPLES / "bench_serve_result.json")
    assert figures["completed"] == 16 and figures["max_concurrency"] == 4
    assert figures["spec_decode_acceptance_length"] == 3.5
    assert figures["mean_tpot_ms"] == pytest.approx(1.1707802073416702)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("output_throughput"), "'output_throughput' is None, not a number"),
    (lambda d: d.update(mean_tpot_ms="fast"), "'mean_tpot_ms' is 'fast', not a number"),
    (lambda d: d.update(completed=0, failed=16), "no request completed (16 failed)"),
])
def test_bench_result_names_what_is_wrong(tmp_path, edit, message):
    data = json.loads((SAMPLES / "bench_serve_result.json").read_text())
    edit(data)
    path = tmp_path / "c4-o64.json"
    path.write_text(json.dumps(data))
    with pytest.raises(parse.ResultError, match=f"^{path}: ") as e:
        parse.bench_result(path)
    assert message in str(e.value)


def test_bench_result_without_spec_decode_metrics_has_no_acceptance(tmp_path):
    data = json.loads((SAMPLES / "bench_serve_result.json").read_text())
    for key in parse.SPEC_KEYS:
        data.pop(key)
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert parse.bench_result(tmp_path / "r.json")["spec_decode_acceptance_length"] is None


def _lm_eval_folder(tmp_path, edit=None):
    folder = tmp_path / "accuracy" / "B" / "moonshotai__Kimi-K3"
    folder.mkdir(parents=True)
    data = json.loads((SAMPLES / "lm_eval_results_gsm8k.json").read_text())
    if edit:
        edit(data)
    (folder / "results_2026-11-30T04-00-00.000001.json").write_text(json.dumps(data))
    (folder / "results_2026-11-29T04-00-00.000001.json").write_text("{}")  # an older run
    return folder.parent


def test_lm_eval_results_give_both_gsm8k_metrics_with_stderr(tmp_path):
    folder = _lm_eval_folder(tmp_path)
    acc = parse.lm_eval_gsm8k("B", parse.latest_lm_eval_results(folder))
    assert acc.scores == {"strict-match": 0.9219105382865808,
                          "flexible-extract": 0.9264594389689158}
    assert acc.stderrs["strict-match"] == 0.007390407591581522
    assert acc.samples == 1319


def test_lm_eval_na_stderr_falls_back_to_the_binomial_one(tmp_path):
    def no_stderr(data):
        data["results"]["gsm8k"]["exact_match_stderr,strict-match"] = "N/A"
    acc = parse.lm_eval_gsm8k("B", parse.latest_lm_eval_results(
        _lm_eval_folder(tmp_path, no_stderr)))
    assert acc.stderrs["strict-match"] is None
    p = acc.scores["strict-match"]
    assert checks._stderr(acc, "strict-match") == pytest.approx((p * (1 - p) / 1319) ** 0.5)


def test_lm_eval_without_gsm8k_is_named(tmp_path):
    folder = _lm_eval_folder(tmp_path, lambda d: d["results"].pop("gsm8k"))
    with pytest.raises(parse.ResultError, match="no results.gsm8k"):
        parse.lm_eval_gsm8k("B", parse.latest_lm_eval_results(folder))
    with pytest.raises(parse.ResultError, match="no lm-eval results_"):
        parse.latest_lm_eval_results(tmp_path / "accuracy" / "A")


def _accuracy(config, shift, stderr=0.0074, n=1319):
    scores = {"strict-match": 0.92 + shift, "flexible-extract": 0.926 + shift}
    return parse.Accuracy(config, scores, dict.fromkeys(scores, stderr), n, None)


@pytest.mark.parametrize("shift, passed", [(0.0, True), (0.02, True), (-0.02, True),
                                           (0.022, False), (-0.3, False)])
def test_gate_is_two_standard_errors_of_the_difference(shift, passed):
    # 2 * hypot(0.0074, 0.0074) = 0.0209
    gate = checks.accuracy_gate(_accuracy("B", shift), _accuracy("ref", 0.0), 2.0)
    assert gate.passed is passed
    assert gate.lines[0].startswith(f"strict-match: {0.92 + shift:.4f} vs 0.9200")


def test_repetitive_outputs_are_counted():
    assert parse.repetitive_fraction(SAMPLES / "lm_eval_samples_gsm8k.jsonl") == 0.5


def test_junit_counts_and_skip_reasons():
    run = parse.junit(SAMPLES / "pytest_junit.xml")
    assert (run.passed, run.failed) == (4, 0)
    assert run.skipped == [(
        "tests.v1.spec_decode.test_rejection_sampler_nonfinite_draft::"
        "test_interpreted_kernel_matches", "vLLM does not enable Triton's interpreter here")]


def test_chrome_trace_reads_kernels_runtime_and_ops_also_gzipped(tmp_path):
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(decode_trace(3), f)
    trace = parse.chrome_trace(path)
    assert len(trace.kernels) == 3 * 5
    assert trace.runtime.count("hipGraphLaunch") == 3
    assert "_C_cache_ops::concat_and_cache_mla_grouped" in trace.cpu_ops


def test_a_trace_that_is_not_one_is_named(tmp_path):
    shutil.copyfile(SAMPLES / "pytest_junit.xml", tmp_path / "x.pt.trace.json")
    with pytest.raises(parse.ResultError, match="not valid JSON"):
        parse.chrome_trace(tmp_path / "x.pt.trace.json")


# The runbook's serve environment: AITER and its FP8 BMM on, AITER MLA on (default).
AITER_FP8BMM = checks.AiterFlags(on=True, fp8bmm=True, fp4bmm=False, mla=True)
AITER_OFF = checks.AiterFlags(on=False, fp8bmm=False, fp4bmm=False, mla=False)


def _verdicts(trace, drafts=4, flags=AITER_FP8BMM):
    return {v.name: v for v in checks.check_trace(trace, drafts, flags)}


def test_the_decode_step_sample_meets_every_expectation():
    verdicts = _verdicts(parse.Trace(**_names(decode_trace(4))))
    assert all(v.ok for v in verdicts.values()), verdicts


def _names(trace: dict) -> dict:
    out = {"kernels": [], "runtime": [], "cpu_ops": []}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            key = {"kernel": "kernels", "cuda_runtime": "runtime", "cpu_op": "cpu_ops"}[e["cat"]]
            out[key].append(e["name"])
    return out


def test_the_nvidia_module_on_rocm_fails_the_expectations():
    """What A's trace looks like: the HIPified fused decode kernel, its pointer
    queries, and a per-layer context-KV insert instead of the grouped one."""
    names = _names(decode_trace(4))
    names["kernels"] = [k for k in names["kernels"] if "grouped" not in k and "a8w8" not in k]
    names["kernels"] += ["void fusedKimiK3MLADecodeQConcatKVCacheKernel<__hip_bfloat16, "
                         "false, false, true, 64>(...)"] * 4
    names["runtime"] += ["hipPointerGetAttribute"] * 8
    verdicts = _verdicts(parse.Trace(**names))
    failed = {name for name, v in verdicts.items() if not v.ok}
    assert failed == {"AITER FP8 BMM for the absorb", "no HIPified NVIDIA decode kernel",
                      "no hipPointerGetAttribute calls",
                      "one grouped context-KV launch per draft step"}


def test_grouped_launches_must_match_the_draft_steps():
    names = _names(decode_trace(4))
    assert _verdicts(parse.Trace(**names), drafts=4)[
        "one grouped context-KV launch per draft step"].ok
    # Five launches per step (one per draft layer) is not "grouped".
    grouped = [k for k in names["kernels"] if "grouped" in k]
    names["kernels"] += grouped * 4
    verdict = _verdicts(parse.Trace(**names), drafts=4)[
        "one grouped context-KV launch per draft step"]
    assert not verdict.ok and verdict.detail == (
        "20 launch(es) for 4 draft step(s) (expected 4..6)")


def test_aiter_bmm_is_not_required_when_its_flags_are_off():
    names = _names(decode_trace(2))
    names["kernels"] = [k for k in names["kernels"] if "a8w8" not in k]
    flags = checks.AiterFlags(on=True, fp8bmm=False, fp4bmm=False, mla=True)
    verdicts = _verdicts(parse.Trace(**names), drafts=2, flags=flags)
    verdict = verdicts["AITER FP8 BMM for the absorb"]
    assert verdict.ok and verdict.detail.startswith("not checked")
    assert verdicts["no AITER BMM with its flags off"].ok
    # An AITER BMM that runs with its flags off fails.
    leaked = _verdicts(parse.Trace(**_names(decode_trace(2))), drafts=2, flags=flags)
    assert not leaked["no AITER BMM with its flags off"].ok


@pytest.mark.parametrize("env, arch, flags", [
    ({}, "gfx942", (False, False, False, False)),
    ({"VLLM_ROCM_USE_AITER": "1"}, "gfx942", (True, False, False, True)),
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP8BMM": "1"}, "gfx942",
     (True, True, False, True)),
    # vLLM honours the FP4 BMM on gfx950 only, and there it wins over FP8.
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "1"}, "gfx942",
     (True, False, False, True)),
    ({"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "1",
      "VLLM_ROCM_USE_AITER_FP8BMM": "1"}, "gfx950:sramecc+:xnack-", (True, False, True, True)),
    # The BMM switches mean nothing with AITER off; vLLM also reads "true".
    ({"VLLM_ROCM_USE_AITER": "0", "VLLM_ROCM_USE_AITER_FP8BMM": "1"}, "gfx942",
     (False, False, False, False)),
    ({"VLLM_ROCM_USE_AITER": "true", "VLLM_ROCM_USE_AITER_MLA": "0"}, "gfx942",
     (True, False, False, False)),
])
def test_flags_are_read_as_vllm_reads_them(env, arch, flags):
    got = checks.AiterFlags.from_env(env, arch)
    assert (got.on, got.fp8bmm, got.fp4bmm, got.mla) == flags


def test_the_fp4_regime_needs_aiters_fp4_bmm():
    fp4 = checks.AiterFlags(on=True, fp8bmm=False, fp4bmm=True, mla=True)
    names = _names(decode_trace(2))  # FP8 BMM kernels: not the FP4 ones
    assert not _verdicts(parse.Trace(**names), drafts=2, flags=fp4)[
        "AITER FP4 BMM for the absorb"].ok
    names["kernels"] = [k.replace("_batched_gemm_a8w8_a_per_token_group_prequant_w_per_"
                                  "batched_tensor_quant_kernel", "_batched_gemm_a16wfp4_kernel")
                        for k in names["kernels"]]
    assert _verdicts(parse.Trace(**names), drafts=2, flags=fp4)[
        "AITER FP4 BMM for the absorb"].ok


FUSED = ("void vllm::concat_and_cache_mla_rope_fused_kernel<c10::BFloat16, c10::BFloat16, "
         "false, unsigned short, unsigned short, (vllm::Fp8KVCacheDataType)0>")


def test_the_report_names_the_kernels_of_absorb_rope_and_cache_write():
    served = checks.kernels_by_role(parse.Trace(**_names(decode_trace(2))))
    assert served == {
        "absorb": {"_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_"
                   "kernel": 2},
        "RoPE": {"rotary_embedding_kernel": 2, "concat_and_cache_mla_rope_fused_kernel": 2},
        "KV-cache write": {"concat_and_cache_mla_grouped_kernel": 2,
                           "concat_and_cache_mla_rope_fused_kernel": 2}}
    off = checks.kernels_by_role(parse.Trace(**_names(decode_trace(
        2, {"VLLM_ROCM_USE_AITER": "0"}))))
    assert off["absorb"] == {"aten::bmm": 2}
    # AITER off, the draft's RoPE and cache write are the same fused launch.
    assert off["RoPE"] == served["RoPE"]
    assert off["KV-cache write"] == served["KV-cache write"]


@pytest.mark.parametrize("flags", [AITER_FP8BMM, AITER_OFF], ids=["aiter-fp8bmm", "aiter-off"])
def test_the_draft_rope_and_kv_write_are_one_fused_launch(flags):
    """AITER on and off: the draft layers' RoPE and KV write are vLLM's
    concat_and_cache_mla_rope_fused (a trace without it fails), and the only
    rotary_embedding launch is the context precompute's, once per draft step
    (the unfused path, rotary_embedding then concat_and_cache_mla in each
    draft layer, fails)."""
    names = _names(decode_trace(2, None if flags.on else {"VLLM_ROCM_USE_AITER": "0"}))
    fused, rope = "fused RoPE + draft KV write", "no separate RoPE launch in the draft layers"
    verdicts = _verdicts(parse.Trace(**names), drafts=2, flags=flags)
    assert verdicts[fused].ok and verdicts[rope].ok, (verdicts[fused], verdicts[rope])
    assert FUSED in " ".join(names["kernels"])
    # Two draft layers a step, each with its own rotary and cache launches.
    unfused = dict(names, kernels=[
        new for k in names["kernels"]
        for new in ([k.replace("concat_and_cache_mla_rope_fused", "rotary_embedding"),
                     k.replace("concat_and_cache_mla_rope_fused", "concat_and_cache_mla")] * 2
                    if "rope_fused" in k else [k])])
    verdicts = _verdicts(parse.Trace(**unfused), drafts=2, flags=flags)
    assert not verdicts[fused].ok and not verdicts[rope].ok, (verdicts[fused], verdicts[rope])
    # aiter's fused Triton kernel (the dropped path) is not vLLM's.
    aiters = dict(names, kernels=[
        "_fused_qk_rope_cat_and_cache_mla_kernel" if "rope_fused" in k else k
        for k in names["kernels"]])
    assert not _verdicts(parse.Trace(**aiters), drafts=2, flags=flags)[fused].ok


def test_the_identity_rope_fused_decode_is_checked_only_with_aiter_mla_off():
    names = _names(decode_trace(2))
    names["kernels"] += ["fused_qk_rope_concat_and_cache_mla_kernel<...>"]
    check = "no identity-RoPE fused decode (HIP)"
    assert _verdicts(parse.Trace(**names), drafts=2)[check].detail.startswith("not checked")
    flags = checks.AiterFlags(on=True, fp8bmm=True, fp4bmm=False, mla=False)
    assert not _verdicts(parse.Trace(**names), drafts=2, flags=flags)[check].ok


@pytest.mark.parametrize("text, rows", [
    ("noise\ncase,impl,us\nmla_decode,grouped,41.2\nmla_decode,per_layer,57.9\n", 2),
    ('log line\n[{"case": "mla_decode", "us": 41.2}]\n', 1),
    ('{"results": [{"case": "a"}, {"case": "b"}, {"case": "c"}]}', 3),
    ("nothing tabular here\n", 0),
])
def test_kernel_benchmark_output_is_read_leniently(text, rows):
    assert len(parse.kernel_table(text)) == rows


def test_served_backends_reads_vllms_selection_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO [rocm.py:828] Using TRITON_MLA backend (selected via --attention-backend).\n"
        "INFO [rocm.py:919] Found incompatible backend(s) [ROCM_AITER_MLA] with decoder. "
        "Overriding with TRITON_MLA out of potential backends: ['TRITON_MLA'].\n"
        "INFO [rocm.py:928] Using ROCM_AITER_MLA backend out of potential backends: "
        "['ROCM_AITER_MLA', 'TRITON_MLA'].\n")
    assert parse.served_backends(log) == ["TRITON_MLA", "ROCM_AITER_MLA"]
    assert parse.served_backends(tmp_path / "none.log") == []


_CELLS = [{"mean_itl_ms": 100.0, "acceptance_length": 3.0},
          {"mean_itl_ms": 150.0, "acceptance_length": 3.0}]


def _faster(cells, speedup, acceptance=1.0):
    return [{"mean_itl_ms": c["mean_itl_ms"] / speedup,
             "acceptance_length": c["acceptance_length"] * acceptance} for c in cells]


@pytest.mark.parametrize("correct, aiter, backend, reason", [
    (True, _faster(_CELLS, 1.05), "ROCM_AITER_MLA", "correct, and 5.0% faster"),
    (True, _faster(_CELLS, 1.02), "TRITON_MLA", "ROCM_AITER_MLA is +2.0% faster"),
    (False, _faster(_CELLS, 1.5), "TRITON_MLA", "ROCM_AITER_MLA's non-causal decode was not"),
    (True, _faster(_CELLS, 1.5, 0.9), "TRITON_MLA", "ROCM_AITER_MLA's acceptance length is "
                                                   "10.0% lower"),
    (True, _CELLS[:1], "TRITON_MLA", "no complete A/B"),
])
def test_draft_backend_verdict(correct, aiter, backend, reason):
    verdict = checks.draft_backend_verdict(correct, _CELLS, aiter, 0.03)
    assert verdict["backend"] == backend and verdict["reason"].startswith(reason)
