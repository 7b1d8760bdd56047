"""The NVIDIA K3 DSpark drafter behaves exactly like pristine vLLM's.

Issue 3 ("Proof that CUDA behaviour did not change"): the platform-neutral
base extracted from `nvidia/dspark_mla.py` must leave the CUDA drafter
unchanged. One child process builds the drafter from the pristine release's
module and from the installed (patched) `vllm.models.kimi_k3.nvidia.dspark_mla`
and records, on CPU with custom ops replaced by recorders
(`harness/equivalence.py`, on the harness's synthetic draft):

* the module tree, parameter and buffer names, shapes and dtypes, the plain
  attributes of vLLM's layers inside it, and the NVIDIA module's public names;
* the weight mapper (class level and instance level, confidence head on and
  off) for every checkpoint name, and the weights `load_weights` produces;
* the arguments every submodule is constructed with;
* the custom-op calls (order and arguments) and resulting cache contents of
  `precompute_and_store_context_kv` for bf16/fp8 caches, uniform and
  non-uniform layouts, shared, per-layer, aliased and partial slot mappings,
  and cache rebinding (the pointer refresh);
* what every submodule receives and returns in `forward`, and the outputs of
  the causal-LM helpers (logits, Markov, confidence, layer names).

Each test below compares one of those records. The pytest process itself
never imports vLLM (the verification suite's rule).

Run from the project root with the vLLM under test importable, e.g.
`K3_PRISTINE_GIT_DIR=<repo with the base tag> PYTHONPATH=<vllm tree>
python -m pytest tests/verification/test_nvidia_equivalence.py`.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.verification.harness import equivalence as eq

PROJECT_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)

CONFIDENCE = pytest.mark.parametrize(
    "tag", ["no-confidence", "confidence"], ids=lambda t: t
)


@pytest.fixture(scope="module")
def results() -> dict:
    """Run every check once, in a child process that imports vLLM."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.pkl"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(PROJECT_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from tests.verification.harness.equivalence "
                "import main; main(sys.argv[1])",
                str(out),
            ],
            cwd=PROJECT_ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.fail(
                "equivalence child process failed:\n" + proc.stderr[-6000:],
                pytrace=False,
            )
        with open(out, "rb") as f:
            return pickle.load(f)


def _compare(results: dict, check: str, what: str):
    assert check in results, f"no result for {check}"
    outcome = results[check]
    if outcome[0] == "error":
        pytest.fail(f"{check} raised in the child process:\n{outcome[1]}")
    _, expected, actual = outcome
    eq.assert_equivalent(expected, actual, what)
    return expected


def test_every_check_ran(results):
    assert sorted(results) == sorted(eq_check_names())


def eq_check_names() -> list[str]:
    names = ["public_names"]
    for tag in ("no-confidence", "confidence"):
        names += [
            f"{kind}[{tag}]"
            for kind in (
                "module_tree",
                "constructors",
                "mapper",
                "load_weights",
                "forward",
            )
        ]
    names += [f"context_kv[{s.id}]" for s in eq.CONTEXT_KV_SCENARIOS]
    return names


def test_public_names(results):
    expected = _compare(results, "public_names", "public names")
    assert all(expected[name] == name for name in eq.PUBLIC_NAMES)


@CONFIDENCE
def test_module_tree(results, tag):
    _compare(results, f"module_tree[{tag}]", "module tree")


@CONFIDENCE
def test_submodule_constructor_arguments(results, tag):
    expected = _compare(
        results, f"constructors[{tag}]", "submodule constructor arguments"
    )
    assert expected["model.layers.0.self_attn"][0] == "MultiHeadLatentAttention"


@CONFIDENCE
def test_weight_mapper(results, tag):
    expected = _compare(results, f"mapper[{tag}]", "hf_to_vllm_mapper")
    # The scenario is meaningful: the instance keeps the head only when built.
    kept = expected["instance"]["confidence_head.proj.weight"] is not None
    assert kept == (tag == "confidence")


@CONFIDENCE
def test_load_weights(results, tag):
    _compare(results, f"load_weights[{tag}]", "load_weights")


@pytest.mark.parametrize("scenario", eq.CONTEXT_KV_SCENARIOS, ids=lambda s: s.id)
def test_precompute_and_store_context_kv(results, scenario):
    expected = _compare(
        results, f"context_kv[{scenario.id}]", "precompute_and_store_context_kv"
    )
    names = [name for name, _ in expected["calls"]]
    # The scenario is meaningful: the context path ran and reached the
    # insert path the scenario is meant to reach.
    assert "ops.rms_norm" in names and "ops.rotary_embedding" in names
    grouped = names.count("ops.concat_and_cache_mla_grouped")
    fallback = names.count("impl.do_kv_cache_update")
    if scenario.slots == "none":
        assert grouped == fallback == 0
    elif scenario.layout != "uniform" or scenario.slots == "with_none":
        assert grouped == 0 and fallback > 0
    else:
        assert grouped > 0 and fallback == 0


@CONFIDENCE
def test_forward_and_helpers(results, tag):
    expected = _compare(results, f"forward[{tag}]", "forward")
    assert any("self_attn" in name for name, _ in expected["calls"])
