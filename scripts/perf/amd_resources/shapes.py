"""The launches the stack's kernel wrappers make at the drafter's production shapes.

Each wrapper is the tree's own function, called with meta tensors (shapes,
dtypes and storage sizes, no data) as vLLM's callers pass them on ROCm; what it
launches is recorded (kernel_tree.record_launches), never run.

- Patch 5, `decode_attention_fwd_mla_block` (stage 1 and its stage 2), and the
  flat path it replaces, `decode_attention_fwd(is_mla=True)` on the block
  flattened to one row per token (0.34.0's grouped kernel and stage 2: what
  ROCm runs today), called as `TritonMLAImpl.forward_mqa` calls them.
- Patch 8, `rejection_sample`, as the GPU model runner's rejection sampler
  calls it, the draft logits in the speculator's `DraftLogitsCache`.
- With AITER's FP8 BMM on (`VLLM_ROCM_USE_AITER=1`,
  `VLLM_ROCM_USE_AITER_FP8BMM=1`), the drafter's MLA absorb runs aiter's
  Triton batched GEMM (`rocm_aiter_ops.triton_fp8_bmm`), which
  `MLAAttention.process_weights_after_loading` pre-compiles for 1..1024
  tokens with W_K and W_V: every one of those launches, from the installed
  aiter package (its Triton kernels only, through the test harness's stand-in
  for the package: its `__init__` needs a ROCm install).
"""

from __future__ import annotations

import ast
import importlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import triton

from scripts.perf.amd_resources.kernel_tree import Launch, record_launches
from scripts.perf.amd_resources.targets import Arch

DECODE_ATTENTION = "vllm.v1.attention.ops.triton_decode_attention"
BLOCK_DECODE = "vllm.v1.attention.ops.triton_mla_block_decode"
TRITON_MLA = "vllm/v1/attention/backends/mla/triton_mla.py"
REJECTION_SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
DRAFT_LOGITS = "vllm.v1.worker.gpu.spec_decode.draft_logits"

# K3 (per tensor-parallel rank) and its DSpark drafter.
KV_LORA_RANK = 512
ROPE_DIM = 64
HEADS_PER_RANK = (8, 16, 32, 64)
QUERY_LENS = tuple(range(2, 9))  # draft block of query_len tokens
PAGE_SIZES = (16, 64)
# Graphs are captured at max_model_len with a padded batch, and the split
# count chosen then is replayed (issue 18, section 2).
CAPTURE_REQUESTS = 16
# The block path at other batch sizes too: Triton specializes an integer
# argument equal to 1 or divisible by 16, so 1, 3 and 16 requests compile every
# variant any batch size gets (the kernels take no constexpr from it).
BLOCK_BATCH_SIZES = (1, 3, CAPTURE_REQUESTS)
MAX_MODEL_LEN = 131072
# Triton's AMD backend turns loads into buffer loads only for a tensor whose
# storage is under 2 GiB. vLLM's per-layer KV cache is either, by GPU memory
# and model: both are compiled.
KV_STORAGE_BYTES = {"KV<2G": 1 << 30, "KV>2G": 4 << 30}
# The absorb's batched GEMMs: W_K (heads, kv_lora_rank, qk_nope_head_dim) and
# W_V (heads, v_head_dim, kv_lora_rank), as process_weights_after_loading
# lays them out, pre-compiled for every token count up to this.
QK_NOPE_HEAD_DIM = V_HEAD_DIM = 128
AITER_PRECOMPILED_TOKENS = 1024
AITER_FP8_BMM = ("aiter.ops.triton.batched_gemm_a8w8_a_per_token_group_prequant_w_per_"
                 "batched_tensor_quant")
VOCAB_SIZE = 163840
NUM_SPECULATIVE_STEPS = 6
SAMPLER_REQUESTS = 16


def _meta(*size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device="meta")


def kv_dtypes(arch: Arch) -> dict[str, torch.dtype]:
    return {"bf16": torch.bfloat16, "fp8": getattr(torch, arch.fp8_dtype)}


def attention_shapes(arch: Arch) -> Iterator[dict]:
    for storage, kv, page, heads, query_len in itertools.product(
            KV_STORAGE_BYTES, kv_dtypes(arch), PAGE_SIZES, HEADS_PER_RANK, QUERY_LENS):
        yield {"kv": kv, "page": page, "heads": heads, "query_len": query_len,
               "kv_storage": storage}


def flat_split_count(tree: Path) -> Callable[[int, int], int]:
    """triton_mla.py's _compute_num_kv_splits, read from the tree (the module
    itself needs all of vLLM): the function and the constants it names."""
    path = tree / TRITON_MLA
    module = ast.parse(path.read_text(), str(path))
    wanted = {"_compute_num_kv_splits"}
    body = []
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            wanted |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            body.append(node)
    constants = [node for node in module.body if isinstance(node, ast.Assign)
                 and all(isinstance(t, ast.Name) and t.id in wanted for t in node.targets)]
    if not body:
        raise LookupError(f"{path}: no _compute_num_kv_splits (forward_mqa's split count)")
    namespace = {"triton": triton, "next_power_of_2": triton.next_power_of_2}
    exec(compile(ast.Module(constants + body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_compute_num_kv_splits"]


def attention_launches(load, tree: Path, arch: Arch, shapes: Iterable[dict] | None = None,
                       paths: tuple[str, ...] = ("block", "flat")) -> list[Launch]:
    """Block path and flat path, as forward_mqa launches them, for every shape
    (default: every production shape)."""
    ops = {"flat": load(DECODE_ATTENTION), "block": load(BLOCK_DECODE)}
    flat_splits = flat_split_count(tree)(MAX_MODEL_LEN, arch.compute_units)
    launches = []
    for shape in attention_shapes(arch) if shapes is None else shapes:
        for path in paths:
            for reqs in BLOCK_BATCH_SIZES if path == "block" else (CAPTURE_REQUESTS,):
                with record_launches() as recorded:
                    _forward_mqa(ops[path], path, shape, flat_splits, arch, reqs)
                for launch in recorded:
                    launch.shape = {**shape, "path": path}
                launches += recorded
    return launches


def _forward_mqa(ops, path: str, shape: dict, flat_splits: int, arch: Arch,
                 reqs: int = CAPTURE_REQUESTS) -> None:
    """The attention call of TritonMLAImpl.forward_mqa (backends/mla/triton_mla.py)
    on one of its two paths, for a captured batch of `reqs` requests at `shape`."""
    query_len, heads, page = shape["query_len"], shape["heads"], shape["page"]
    rows, width = reqs * query_len, KV_LORA_RANK + ROPE_DIM
    dtype = kv_dtypes(arch)[shape["kv"]]
    num_pages = KV_STORAGE_BYTES[shape["kv_storage"]] // (page * width * dtype.itemsize)
    q = _meta(rows, heads, width, dtype=torch.bfloat16)
    cache = _meta(num_pages, page, width, dtype=dtype)
    kv = cache.unsqueeze(2)  # forward_mqa adds the head dim of 1 after the split count
    o = _meta(rows, heads, KV_LORA_RANK, dtype=torch.bfloat16)
    lse = _meta(rows, heads, dtype=torch.bfloat16)
    block_table = _meta(reqs, MAX_MODEL_LEN // page, dtype=torch.int32)
    seq_lens = _meta(reqs, dtype=torch.int32)
    kv_scale = _meta((), dtype=torch.float32)
    sm_scale = width ** -0.5  # a float argument: the JIT never specializes on it
    if path == "block":
        splits = ops.mla_block_decode_num_kv_splits(q, cache, reqs, MAX_MODEL_LEN,
                                                    arch.compute_units, flat_splits)
        logits = _meta(rows, heads, splits, KV_LORA_RANK + 1, dtype=torch.float32)
        ops.decode_attention_fwd_mla_block(q, kv, o, lse, block_table, seq_lens, logits,
                                           sm_scale, page, kv_scale, arch.compute_units)
        return
    logits = _meta(rows, heads, flat_splits, KV_LORA_RANK + 1, dtype=torch.float32)
    ops.decode_attention_fwd(
        q, kv, kv[..., :KV_LORA_RANK], o, lse,
        block_table.repeat_interleave(query_len, dim=0),
        seq_lens.repeat_interleave(query_len), logits, flat_splits, sm_scale, page,
        k_scale=kv_scale, v_scale=kv_scale, is_mla=True)


def sampler_launches(load) -> list[Launch]:
    """rejection_sample, standard and block verification, with draft logits
    (probabilistic drafts, bf16 as the drafter caches them) and one-hot drafts,
    with and without skip_masked_vocab_blocks (the runner sets it for a batch
    with a request that may mask logits, e.g. top-k or top-p; a constexpr of
    the resample kernel).

    The draft logits are a replicated DraftLogitsCache (row_mapping None), as
    the speculator builds it for K3: a batch-sharded one needs a target with
    `compute_logits_local`, which K3's lacks."""
    sampler = load(REJECTION_SAMPLER)
    draft_logits_cache = load(DRAFT_LOGITS).DraftLogitsCache
    reqs, steps = SAMPLER_REQUESTS, NUM_SPECULATIVE_STEPS
    logits_rows = reqs * (steps + 1)
    launches = []
    for method, drafts, skip_masked in itertools.product(
            ("standard", "block"), ("logits", "one-hot"), (False, True)):
        cache = None
        if drafts == "logits":
            cache = draft_logits_cache(reqs, steps, VOCAB_SIZE, dtype=torch.bfloat16,
                                       fill=0.0, device="meta")
        with record_launches() as recorded:
            sampler.rejection_sample(
                _meta(logits_rows, VOCAB_SIZE, dtype=torch.float32), cache,
                _meta(logits_rows, dtype=torch.int32),
                _meta(reqs + 1, dtype=torch.int32), _meta(logits_rows, dtype=torch.int64),
                _meta(reqs, dtype=torch.int32), _meta(logits_rows, dtype=torch.int32),
                _meta(logits_rows, dtype=torch.int32), _meta(reqs, dtype=torch.float32),
                _meta(reqs, dtype=torch.int64), steps,
                use_block_verification=method == "block",
                skip_masked_vocab_blocks=skip_masked)
        for launch in recorded:
            launch.shape = {"path": "sampler", "method": method, "drafts": drafts,
                            "skip_masked": skip_masked}
        launches += recorded
    return launches


def aiter_fp8_bmm_launches(arch: Arch) -> list[Launch]:
    """aiter's FP8 batched GEMM as MLAAttention pre-compiles it with AITER's FP8
    BMM on (mla_attention.py, process_weights_after_loading): bf16 activations
    of 1..1024 tokens against W_K and W_V, quantized to the platform's fp8,
    per head count."""
    from tests.verification.harness import aiter

    aiter.install_stand_in()
    module = importlib.import_module(AITER_FP8_BMM)
    bmm = getattr(module, AITER_FP8_BMM.rsplit(".", 1)[1])
    fp8 = kv_dtypes(arch)["fp8"]
    scale = _meta(1, dtype=torch.float32)
    launches = []
    for heads in HEADS_PER_RANK:
        weights = {"W_K": (heads, KV_LORA_RANK, QK_NOPE_HEAD_DIM),
                   "W_V": (heads, V_HEAD_DIM, KV_LORA_RANK)}
        for name, size in weights.items():
            weight = _meta(*size, dtype=fp8)
            with record_launches() as recorded:
                for tokens in range(1, AITER_PRECOMPILED_TOKENS + 1):
                    x = _meta(heads, tokens, size[2], dtype=torch.bfloat16)
                    bmm(x, weight, scale, group_size=128, transpose_bm=True)
            for launch in recorded:
                launch.shape = {"path": "aiter", "heads": heads, "weight": name}
            launches += recorded
    return launches
