"""Both drafters with tensor parallelism: 2 CPU ranks over gloo (issue 9, item 11).

K3 runs TP=8 on MI300/MI355. Here two ranks (``harness/tensor_parallel.py``)
load the same synthetic checkpoint through ``load_weights`` under emulated ROCm
(gfx942), with vLLM's CPU communicator, and run the drafter on the same inputs
as a single-rank run of it. Checked per rank:

* the loaded weights are exactly this rank's shard of the full checkpoint
  (stated below from the layer types, not read from vLLM);
* the query each attention layer receives is the single-rank query's slice of
  this rank's heads (bit-exact in the first layer, whose input is replicated);
* the latent ``kv_c`` / ``k_pe`` inputs are identical on every rank;
* the output of every all-reduce (``fused_allreduce_rms_norm``: after the
  row-parallel ``o_proj`` and after the MLP) equals the single-rank output
  within bf16 rounding (``_tolerance``) and is identical on every rank.

Both drafter modules run: the AMD one (its platform) and the NVIDIA one, whose
``MultiHeadLatentAttention`` takes the global head count and shards it itself
(the AMD drafter divides by the TP size before building its wrapper). The
NVIDIA drafter cannot be built on this machine's own platform (vLLM's
``UnspecifiedPlatform`` selects no attention backend) nor on an emulated
``CudaPlatform`` (it imports CUDA-linked extensions), so it runs under the same
emulated ROCm. ``test_checks_catch`` runs every check on deliberately broken
TP runs (``PERTURBATIONS``) and requires it to fail.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.verification.conftest import DRAFTERS
from tests.verification.harness import tensor_parallel as TP

MODE = "rocm-gfx942"


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """All runs, once: both ranks of every drafter, reference and TP."""
    return TP.run(MODE, DRAFTERS)


def _tolerance(reference: torch.Tensor) -> float:
    """Two bf16 ulps at the tensor's largest magnitude. Each rank rounds its
    partial sum to bf16 before the all-reduce adds them (rounded again), where
    the single rank rounds the whole sum once; later layers inherit that
    difference. Measured: at most one ulp. A wrong shard or a missing
    all-reduce moves outputs by tens of percent."""
    largest = float(reference.float().abs().max())
    return 2 * 2.0 ** (math.floor(math.log2(largest)) - 7)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    err = float((got.float() - want.float()).abs().max())
    assert got.shape == want.shape and err <= _tolerance(want), (
        f"{what}: max error {err:.4g} > {_tolerance(want):.4g} (shape "
        f"{tuple(got.shape)} vs {tuple(want.shape)})"
    )
    return err


def _rows(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(TP.WORLD_SIZE, dim=dim)[rank]


def expected_weight(name: str, ckpt: dict, rank: int) -> torch.Tensor | None:
    """This rank's shard of the full checkpoint for a runtime parameter, or
    None for parameters derived after loading. Column-parallel layers keep a
    contiguous block of output rows (q_b/kv_b: whole heads; gate and up each
    their own block), row-parallel ones a block of input columns; the latent
    projections are replicated (``disable_tp``), as are norms and heads."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None:
        if name == "model.context_kv_proj.weight":
            kv_a = sorted(k for k in ckpt if k.endswith("kv_a_proj_with_mqa.weight"))
            return torch.cat([ckpt[k] for k in kv_a])
        return ckpt[name.removeprefix("model.")]
    p, rest = f"layers.{m[1]}.", m[2]
    if rest.endswith(("W_UK_T", "W_UV")):
        return None
    sharded = {
        "self_attn.q_b_proj.weight": lambda: _rows(ckpt[p + rest], rank),
        "self_attn.kv_b_proj.weight": lambda: _rows(ckpt[p + rest], rank),
        "self_attn.o_proj.weight": lambda: _rows(ckpt[p + rest], rank, dim=1),
        "self_attn.fused_qkv_a_proj.weight": lambda: torch.cat(
            [
                ckpt[p + "self_attn.q_a_proj.weight"],
                ckpt[p + "self_attn.kv_a_proj_with_mqa.weight"],
            ]
        ),
        "mlp.gate_up_proj.weight": lambda: torch.cat(
            [
                _rows(ckpt[p + "mlp.gate_proj.weight"], rank),
                _rows(ckpt[p + "mlp.up_proj.weight"], rank),
            ]
        ),
        "mlp.down_proj.weight": lambda: _rows(ckpt[p + rest], rank, dim=1),
    }
    return sharded[rest]() if rest in sharded else ckpt[p + rest]


def check_weights(ranks: list[dict], run: str, which: str) -> None:
    for rank, result in enumerate(ranks):
        single, tp = result["single", which], result[run, which]
        assert tp["weights"].keys() == single["weights"].keys()
        for name, got in tp["weights"].items():
            want = expected_weight(name, tp["checkpoint"], rank)
            if want is None:  # W_UK_T / W_UV: this rank's heads (dim 0)
                want = _rows(single["weights"][name], rank)
            assert torch.equal(got, want), f"rank {rank}: {name} is not its shard"


def check_queries(ranks: list[dict], run: str, which: str) -> list[float]:
    errors = []
    for rank, result in enumerate(ranks):
        single, tp = result["single", which], result[run, which]
        for layer, (got, full) in enumerate(zip(tp["q"], single["q"])):
            want = _rows(full, rank, dim=1)
            what = f"rank {rank} layer {layer} query heads"
            if layer == 0:
                assert torch.equal(got, want), f"{what} differ from the slice"
            errors.append(_assert_close(got, want, what))
    return errors


def check_latent_replicated(ranks: list[dict], run: str, which: str) -> None:
    for rank, result in enumerate(ranks):
        single, tp = result["single", which], result[run, which]
        for key in ("kv_c", "k_pe"):
            for layer, got in enumerate(tp[key]):
                first = ranks[0][run, which][key][layer]
                assert torch.equal(got, first), (
                    f"{key} of layer {layer} differs between rank 0 and {rank}"
                )
                want = single[key][layer]
                if layer == 0:
                    assert torch.equal(got, want), f"{key} differs from single rank"
                _assert_close(got, want, f"rank {rank} layer {layer} {key}")


def check_all_reduced(ranks: list[dict], run: str, which: str) -> list[float]:
    errors = []
    for rank, result in enumerate(ranks):
        single, tp = result["single", which], result[run, which]
        assert len(tp["reduced"]) == len(single["reduced"])
        pairs = list(zip(tp["reduced"], single["reduced"]))
        for i, ((normed, residual), (want_n, want_r)) in enumerate(pairs):
            what = f"rank {rank} all-reduce {i}"
            errors.append(_assert_close(normed, want_n, f"{what} normed"))
            errors.append(_assert_close(residual, want_r, f"{what} residual"))
            other = ranks[0][run, which]["reduced"][i][0]
            assert torch.equal(normed, other), f"{what} differs from rank 0's"
        errors.append(_assert_close(tp["out"], single["out"], f"rank {rank} output"))
    return errors


def test_ranks_run_emulated_rocm_with_the_cpu_communicator(ranks):
    assert [r["platform"] for r in ranks] == ["RocmPlatform"] * TP.WORLD_SIZE
    assert [r["communicator"] for r in ranks] == ["CpuCommunicator"] * TP.WORLD_SIZE


@pytest.mark.parametrize("which", DRAFTERS)
def test_each_rank_loads_its_shard_of_the_checkpoint(ranks, which):
    check_weights(ranks, "tp", which)


@pytest.mark.parametrize("which", DRAFTERS)
def test_query_heads_are_the_single_rank_slice(ranks, which, record_property):
    errors = check_queries(ranks, "tp", which)
    record_property(f"measure:tp_query_max_err[{which}]", max(errors))


@pytest.mark.parametrize("which", DRAFTERS)
def test_latent_kv_inputs_are_replicated(ranks, which):
    check_latent_replicated(ranks, "tp", which)


@pytest.mark.parametrize("which", DRAFTERS)
def test_all_reduced_outputs_match_single_rank(ranks, which, record_property):
    errors = check_all_reduced(ranks, "tp", which)
    record_property(f"measure:tp_all_reduce_max_err[{which}]", max(errors))


@pytest.mark.parametrize("which", DRAFTERS)
@pytest.mark.parametrize(
    ("check", "perturbation"),
    [
        (check_weights, "wrong_head_shard"),
        (check_queries, "wrong_head_shard"),
        (check_latent_replicated, "unreplicated_kv"),
        (check_all_reduced, "no_all_reduce"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_checks_catch(ranks, which, check, perturbation):
    """Each check fails on a TP run with the defect it guards against: the
    last rank loads rank 0's q_b_proj rows; the last rank's kv_a_layernorm
    differs; the fused all-reduce is skipped on every rank."""
    with pytest.raises(AssertionError):
        check(ranks, perturbation, which)
