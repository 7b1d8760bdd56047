"""Patch 9's rejection-sampler tests, with the kernels in Triton's interpreter.

vLLM's test file (tests/v1/sample/test_rejection_sampler_nonfinite_draft_probs.py
in the patched tree) runs the V1 rejection sampler compiled on a GPU and skips
without one. Here each of its tests runs unchanged in an interpreter worker
(harness/interpreter.py), with the file's device set to the CPU. On finite
draft rows, the patched recovery must give what the release's kernel gives:
the release's module is loaded from git beside the patched one.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
import torch

from tests.support.pristine import PROJECT_ROOT, pristine_source
from tests.verification.harness.interpreter import InterpreterPool

VLLM_TEST_FILE = (
    PROJECT_ROOT / "build/vllm/tests/v1/sample/test_rejection_sampler_nonfinite_draft_probs.py"
)
SAMPLER = "vllm/v1/sample/rejection_sampler.py"
KINDS = ("nan", "posinf", "all-neginf")
TESTS = [
    *(("test_recovered_token_is_drawn_from_the_target", kind) for kind in KINDS),
    ("test_a_finite_draft_row_keeps_its_residual", None),
    *(("test_rejection_sample_stays_lossless", kind) for kind in KINDS),
]


def _vllm_test_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("v1_nonfinite_draft_probs", VLLM_TEST_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    return module


def _run_vllm_test(case: tuple[str, str | None]) -> str:
    """In a worker: one test function of vLLM's file, on the CPU."""
    name, kind = case
    test = getattr(_vllm_test_module(), name)
    test(kind) if kind else test()
    return "passed"


def _recovered_both_ways(seed: int) -> tuple[list[int], list[int]]:
    """In a worker: recovered tokens of finite random drafts, patched and as
    the release's kernel recovers them, with the same seeded races."""
    from vllm.v1.sample import rejection_sampler as patched

    release = ModuleType("release_rejection_sampler")
    release.__file__ = SAMPLER
    sys.modules[release.__name__] = release  # for the kernels' source lookup
    exec(compile(pristine_source(SAMPLER), SAMPLER, "exec"), release.__dict__)
    tests = _vllm_test_module()
    gen = torch.Generator().manual_seed(seed)
    batch_size, vocab_size = 16, 300
    draft = torch.softmax(3 * torch.randn(batch_size, vocab_size, generator=gen), -1)
    target = torch.softmax(3 * torch.randn(batch_size, vocab_size, generator=gen), -1)
    draft[::4] = 0.0  # rows whose residual is the target
    out = []
    for module in (patched, release):
        out.append(module.sample_recovered_tokens(
            max_spec_len=1,
            num_draft_tokens=[1] * batch_size,
            cu_num_draft_tokens=torch.arange(1, batch_size + 1),
            draft_token_ids=torch.zeros(batch_size, dtype=torch.int64),
            draft_probs=draft,
            target_probs=target,
            sampling_metadata=tests._metadata(batch_size),
            device=torch.device("cpu"),
        ).tolist())
    return out[0], out[1]


@pytest.fixture(scope="module")
def results() -> dict:
    with InterpreterPool() as pool:
        outcomes = pool.map(_run_vllm_test, TESTS, return_errors=True)
        finite = pool.map(_recovered_both_ways, [0, 1], return_errors=True)
    return {"tests": dict(zip(TESTS, outcomes, strict=True)), "finite": finite}


def _ok(value):
    if isinstance(value, Exception):
        raise value
    return value


@pytest.mark.parametrize("case", TESTS, ids=lambda case: "-".join(filter(None, case)))
def test_vllm_test_passes_in_the_interpreter(results, case):
    assert _ok(results["tests"][case]) == "passed"


def test_finite_drafts_recover_as_the_release_does(results):
    for outcome in results["finite"]:
        patched, release = _ok(outcome)
        assert patched == release
