"""The drafter on several tensor-parallel CPU ranks, next to its single-rank run.

``run(mode, drafters)`` (pytest side; imports no vLLM) starts ``WORLD_SIZE``
rank processes. Each one emulates ``mode``'s platform (``platform.activate``),
then

1. builds every drafter alone (TP=1) and runs it on fixed inputs: the
   single-rank reference, computed in every rank so no tensor crosses ranks;
2. joins the ``WORLD_SIZE``-rank gloo world (one ``file://`` rendezvous) and
   builds every drafter again with TP over all ranks, from the same synthetic
   checkpoint through ``load_weights``, and runs it on the same inputs;
3. repeats 2 once per entry of ``PERTURBATIONS``, each a deliberate defect the
   checks in ``test_tensor_parallel.py`` must catch.

A run records what every layer's attention core receives (query, latent
``kv_c``, ``k_pe``), the output of every fused all-reduce + RMSNorm, and the
loaded weights. The attention core itself is a GPU kernel, replaced by
``mla_core``: MLA over the draft block, computed per head from the rank's own
``kv_b_proj`` shard, so a head's output depends on that head only, as in the
real kernel.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

WORLD_SIZE = 2
NUM_TOKENS = 6
# Deliberate defects, each applied to one whole TP run (see _perturb).
PERTURBATIONS = ("wrong_head_shard", "unreplicated_kv", "no_all_reduce")
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def run(mode: str, drafters: list[str], timeout: float = 600) -> list[dict]:
    """Records of every rank: ``{(run, drafter): record}`` with run
    ``"single"``, ``"tp"`` or a perturbation name."""
    with tempfile.TemporaryDirectory(prefix="k3-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = []
        for rank in range(WORLD_SIZE):
            out = os.path.join(tmp, f"rank{rank}.pkl")
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115
            spec = dict(
                mode=mode, rank=rank, init_file=init_file, out=out, drafters=drafters
            )
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(PROJECT_ROOT)]
                + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__, repr(spec)],
                cwd=PROJECT_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append((proc, out, log))
        try:
            _wait_all(procs, mode, timeout)
            results = []
            for _, out, _ in procs:
                with open(out, "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            for proc, _, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()


def _wait_all(procs, mode: str, timeout: float) -> None:
    """Wait for every rank; the first one to fail is reported (the others,
    then stuck in a collective, are killed by the caller)."""
    deadline = time.monotonic() + timeout
    while True:
        for rank, (proc, _, log) in enumerate(procs):
            if proc.poll() not in (None, 0):
                log.seek(0)
                raise RuntimeError(
                    f"TP rank {rank} ({mode}) exited {proc.returncode}:\n"
                    + log.read()[-6000:]
                )
        if all(proc.returncode == 0 for proc, _, _ in procs):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"TP ranks ({mode}) still running after {timeout} s")
        time.sleep(0.2)


# --------------------------------------------------------------------------
# Inside a rank process.


def mla_core(q, kv_c, k_pe, kv_b_weight, qk_nope_head_dim, v_head_dim, scale):
    """Non-causal MLA over the block, per head: [T, H, nope+rope] queries and
    the replicated latent [T, R] / [T, rope]; ``kv_b_weight`` holds this rank's
    H heads ([H * (nope + v), R]). Returns [T, H * v] in q's dtype."""
    T, H, _ = q.shape
    w = kv_b_weight.float().view(H, qk_nope_head_dim + v_head_dim, -1)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
    q_nope, q_pe = q.float().split(
        [qk_nope_head_dim, q.shape[-1] - qk_nope_head_dim], dim=-1
    )
    latent = kv_c.float()
    scores = torch.einsum("thd,hdr,sr->hts", q_nope, w_uk, latent)
    scores += torch.einsum("thp,sp->hts", q_pe, k_pe.float().reshape(T, -1))
    probs = (scores * scale).softmax(dim=-1)
    out = torch.einsum("hts,sr,hvr->thv", probs, latent, w_uv)
    return out.reshape(T, H * v_head_dim).to(q.dtype)


def _install_recorders(draft, record: dict) -> None:
    """Replace every layer's attention core by ``mla_core`` (recording its
    inputs) and record the outputs of every all-reduce + RMSNorm."""
    cfg = draft.hf_config
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    for layer in draft.layers:
        attn = layer.self_attn

        def core(q, kv_c, k_pe, attn=attn):
            record["q"].append(q.clone())
            record["kv_c"].append(kv_c.clone())
            record["k_pe"].append(k_pe.reshape(q.shape[0], -1).clone())
            return mla_core(
                q,
                kv_c,
                k_pe,
                attn.kv_b_proj.weight,
                cfg.qk_nope_head_dim,
                cfg.v_head_dim,
                scale,
            )

        if hasattr(attn, "mla_attn"):
            # AMD: the wrapper hands the generic MLAAttention its inputs. Its
            # fused RoPE + cache write needs a bound cache and a forward
            # context; it shards nothing (per-rank heads come from the
            # wrapper), so the rope module rotates here and the core attends.
            attn._rope_in_kv_cache_write = False

            def forward(q, kv_c_normed, k_pe, output_shape=None, core=core, **_):
                return core(q, kv_c_normed, k_pe).view(output_shape)

            attn.mla_attn.forward = forward
        else:
            # NVIDIA: MultiHeadLatentAttention._attention is its core.
            def attention(positions, q, kv_c_normed, k_pe, attn_out, core=core):
                attn_out.copy_(core(q, kv_c_normed, k_pe))

            attn._attention = attention

    def after_all_reduce(module, args, output):
        record["reduced"].append(tuple(t.clone() for t in output))

    # The norms that fused_allreduce_rms_norm applies to all-reduced sums:
    # every post-attention norm, every input norm but the first (which sees
    # the replicated embedding), and the final norm.
    model = draft.model.model
    norms = [model.layers[0].post_attention_layernorm]
    for layer in model.layers[1:]:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    norms.append(model.final_norm)
    for norm in norms:
        norm.register_forward_hook(after_all_reduce)


def _weights(draft) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in draft.model.named_parameters()}


def _perturb(
    draft, perturbation: str | None, rank: int
) -> contextlib.AbstractContextManager:
    """Apply a deliberate defect, so every check can be seen to fail; the
    returned context holds it for the forward pass. A defect that changes the
    collectives applies on every rank (no rank may wait for another)."""
    last = rank == WORLD_SIZE - 1
    attn = draft.layers[0].self_attn
    if perturbation == "wrong_head_shard" and last:
        # The last rank loads rank 0's query heads: a wrong q_b_proj shard.
        rows = draft.checkpoint["layers.0.self_attn.q_b_proj.weight"]
        attn.q_b_proj.weight.data.copy_(rows[: attn.q_b_proj.weight.shape[0]])
    elif perturbation == "unreplicated_kv" and last:
        # The last rank normalizes the latent KV with another weight.
        attn.kv_a_layernorm.weight.data.mul_(1.5)
    elif perturbation == "no_all_reduce":
        from vllm.models.common.ops import fused_allreduce_rms_norm

        return mock.patch.object(
            fused_allreduce_rms_norm, "tensor_model_parallel_all_reduce", lambda x: x
        )
    elif perturbation not in (None, *PERTURBATIONS):
        raise ValueError(f"unknown perturbation {perturbation!r}")
    return contextlib.nullcontext()


def _run(which: str, rank: int, perturbation: str | None = None) -> dict:
    from . import drafter as D
    from . import reference

    cls = D.drafter_cls(which)
    # Both front ends normalize the two latents in one Triton kernel.
    from vllm.models.kimi_k3.amd import mla as amd_mla
    from vllm.models.kimi_k3.nvidia import mla as nvidia_mla

    nvidia_mla.fused_q_kv_rmsnorm = reference.fused_q_kv_rmsnorm
    amd_mla.fused_q_kv_rmsnorm = reference.fused_q_kv_rmsnorm
    draft = D.build(cls=cls)
    defect = _perturb(draft, perturbation, rank)
    record: dict = dict(q=[], kv_c=[], k_pe=[], reduced=[])
    _install_recorders(draft, record)
    cfg = draft.hf_config
    g = torch.Generator().manual_seed(11)
    embeds = torch.randn(NUM_TOKENS, cfg.hidden_size, generator=g).to(torch.bfloat16)
    positions = torch.arange(40, 40 + NUM_TOKENS)
    with D.config_context(draft.vllm_config), torch.inference_mode(), defect:
        record["out"] = draft.model(None, positions, inputs_embeds=embeds).clone()
    record["weights"] = _weights(draft)
    record["checkpoint"] = draft.checkpoint
    return record


def _rank_main(spec: dict) -> None:
    from . import platform

    platform.activate(spec["mode"])
    rank = spec["rank"]
    from vllm.platforms import current_platform

    from . import drafter as D

    result: dict = {"platform": type(current_platform).__name__}
    for which in spec["drafters"]:
        result["single", which] = _run(which, rank)
    D.leave_dist()
    # initialize_model_parallel reads the current config (as build does).
    with D.config_context(D.make_vllm_config(D.make_hf_config())):
        D.init_dist(world_size=WORLD_SIZE, rank=rank, init_file=spec["init_file"])
    from vllm.distributed import get_tp_group

    result["communicator"] = type(get_tp_group().device_communicator).__name__
    for which in spec["drafters"]:
        result["tp", which] = _run(which, rank)
        for perturbation in PERTURBATIONS:
            result[perturbation, which] = _run(which, rank, perturbation)
    with open(spec["out"], "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    import ast

    try:
        _rank_main(ast.literal_eval(sys.argv[1]))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
