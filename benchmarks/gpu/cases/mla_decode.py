"""Triton MLA decode of a non-causal draft block, as TritonMLAImpl.forward_mqa
calls it (vllm/v1/attention/backends/mla/triton_mla.py).

The K3 DSpark drafter decodes a non-causal block of `query_len` tokens per
request with the latent KV cache of MLA (512 latent + 64 rope). vLLM 0.34.0
flattens the block to one decode row per token and calls
`decode_attention_fwd` (the grouped kernel reads a request's KV once per row
and per 16 heads); the patched tree reads it once per tile of the request's
query_len x heads rows (`decode_attention_fwd_mla_block`). `bind` does what
each tree's forward_mqa does, so `pristine` is the flat path and `patched` the
new one; query_len 1 takes the flat path in both.

Two regimes:

* production (the primary table, and the runner's SHAPES): DSpark drafts under
  FULL CUDA graphs captured with attention metadata for max_seq_len =
  max_model_len (vllm/v1/worker/gpu/spec_decode/dflash/cudagraph.py), so
  whatever forward_mqa decides on the host from max_seq_len (the split count)
  is decided for MAX_MODEL_LEN and the padded batch, and replayed over the
  real, ragged lengths. Pages of 16 (TRITON_MLA takes multiples of 16) and 64.
* per-step (secondary): the split count chosen for each shape's own longest
  context, as an eager call would; uniform lengths, pages of 64.

Beside the trees, `reshape`: the release's grouped decode fed a request's
query_len x heads rows as its heads (`bind_reshape`), the simplest alternative
to a block kernel, in the same run.

A case module of the GPU benchmark runner (FILES, SHAPES, make_inputs, bind,
same_output; see benchmarks/gpu/run.py), plus `roofline(shape)`: the bytes the
attention must read at least once and its FLOPs, which `main()` divides by the
copy bandwidth and the bf16 GEMM peak measured in the same run. `main()` runs
the case on its own, from a package laid out like the runner's
(trees/<label>/vllm/..., with stand-ins for vllm.triton_utils and
vllm.platforms):

    python3 build/gpubench/cases/mla_decode.py [--regime production|per-step]
        [--shape TEXT] [--check] [--variant NAME:STATEMENT] [--sweep]
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import statistics
import sys
from pathlib import Path

import torch

FILES = (
    "vllm/v1/attention/ops/triton_decode_attention.py",
    "vllm/v1/attention/ops/triton_mla_block_decode.py",
)
OPS = "vllm.v1.attention.ops.triton_decode_attention"  # the flat path
# The block kernel; revisions before it had a module of its own kept it in OPS.
BLOCK_OPS = "vllm.v1.attention.ops.triton_mla_block_decode"

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
# fp8 is the platform's: e4m3fn on NVIDIA, e4m3fnuz on MI300.
FP8 = torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}
# vLLM's own split heuristic in forward_mqa (_compute_num_kv_splits): the
# scratch is sized for it, and the flat path uses it.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2
# The longest context the server accepts: graphs are captured for it, and
# the workspace holds the scratch of its split count.
MAX_MODEL_LEN = 131072


def _ragged(count: int, shortest: int, longest: int) -> tuple[int, ...]:
    """`count` lengths spread log-uniformly over [shortest, longest], the
    first one the longest (a fixed draw, the same in every run)."""
    draw = random.Random(f"{count}/{shortest}/{longest}")
    lens = [
        round(math.exp(draw.uniform(math.log(shortest), math.log(longest))))
        for _ in range(count - 1)
    ]
    return (longest, *lens)


def _shape(batch: str, lens, query_len: int, heads: int, kv: str, page: int,
           regime: str) -> dict:
    return {
        "name": f"{batch:<17} q{query_len} h{heads:<2} {kv:<4} p{page}",
        "batch": batch,
        "lens": tuple(lens),
        "query_len": query_len,
        "num_heads": heads,
        "kv_dtype": kv,
        "page_size": page,
        # What forward_mqa's host side sees as max_seq_len.
        "planned_len": MAX_MODEL_LEN if regime == "production" else max(lens),
        "regime": regime,
    }


# Batches as the drafter sees them: one request, a uniform batch, a padded
# one (CUDA graphs pad the batch with requests of length 0), ragged ones.
PRODUCTION_BATCHES = (
    ("1 x 4k", (4096,)),
    ("1 x 32k", (32768,)),
    ("16 x 32k", (32768,) * 16),
    ("12+4pad x 16k", (16384,) * 12 + (0,) * 4),
    ("16 ragged 1-64k", _ragged(16, 1024, 65536)),
    ("32 ragged .5-100k", _ragged(32, 500, 102400)),
    ("64 ragged .1-32k", _ragged(64, 100, 32768)),
)
# (query_len, heads per rank): K3's 64 heads at TP 8, 4, 2 and 1; 16 x 6 and
# 32 x 3 are 96-row blocks.
PRODUCTION_BLOCKS = ((5, 8), (6, 16), (3, 32), (7, 64))

# TP 8 (8 heads per rank) on every batch; the wider blocks on one request,
# a uniform batch and two ragged ones.
WIDE_BATCHES = ("1 x 32k", "16 x 32k", "16 ragged 1-64k", "64 ragged .1-32k")

PRODUCTION_SHAPES = tuple(
    _shape(batch, lens, q, h, kv, page, "production")
    for page in (16, 64)
    for kv in ("bf16", "fp8")
    for q, h in PRODUCTION_BLOCKS
    for batch, lens in PRODUCTION_BATCHES
    if h == 8 or batch in WIDE_BATCHES
) + tuple(
    # Plain decode takes the flat path in both trees.
    _shape(batch, lens, 1, h, "bf16", 16, "production")
    for batch, lens in (("1 x 4k", (4096,)), ("64 ragged .1-32k", _ragged(64, 100, 32768)))
    for h in (8, 64)
)

PER_STEP_SHAPES = tuple(
    _shape(f"{r} x {c // 1024}k", (c,) * r, q, h, kv, 64, "per-step")
    for r, contexts in ((1, (4096, 32768, 131072)), (16, (16384, 65536)), (64, (8192, 32768)))
    for c in contexts
    for q in (4, 7)
    for h in (8, 64)
    for kv in ("bf16", "fp8")
)

SHAPES = PRODUCTION_SHAPES


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def flat_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    ideal = 1 << max(0, math.ceil(math.log2(max(1, max_seq_len // MIN_WORK_PER_SPLIT))))
    return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def make_inputs(shape: dict, device: torch.device, generator: torch.Generator) -> dict:
    """One forward_mqa call: the query, a paged latent cache holding every
    request's pages in shuffled order, the block table and lengths."""
    lens, page = shape["lens"], shape["page_size"]
    query_len, heads = shape["query_len"], shape["num_heads"]
    pages = [-(-n // page) for n in lens]
    num_pages = max(1, sum(pages))
    cache = torch.randn(
        num_pages, page, HEAD_SIZE, generator=generator, device=device,
        dtype=torch.bfloat16,
    ).to(KV_DTYPES[shape["kv_dtype"]])
    order = torch.randperm(num_pages, generator=generator, device=device).int()
    block_table = torch.zeros(len(lens), max(1, max(pages)), dtype=torch.int32,
                              device=device)
    start = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = order[start : start + n]
        start += n
    # Scaled so that attention is peaked and the output check is sensitive.
    q = 4 * torch.randn(
        len(lens) * query_len, heads, HEAD_SIZE, generator=generator,
        device=device, dtype=torch.bfloat16,
    )
    return dict(
        q=q,
        kv_cache=cache,
        block_table=block_table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        planned_len=shape["planned_len"],
        k_scale=torch.tensor([0.75], dtype=torch.float32, device=device),
        scale=HEAD_SIZE**-0.5,
        sm_count=num_sms(device),
    )


def scratch(x: dict, splits: int) -> torch.Tensor:
    """The attention scratch vLLM's workspace hands out: allocated at the
    first (warm-up) call with this split count, reused under graph capture."""
    key = f"attn_logits x{splits}"
    if key not in x:
        q = x["q"]
        x[key] = torch.empty(
            *q.shape[:2], splits, KV_LORA_RANK + 1, dtype=torch.float32, device=q.device
        )
    return x[key]


def bind(load):
    """forward_mqa of the tree, from the allocation of its outputs on."""
    ops = load(OPS)
    try:
        block_ops = load(BLOCK_OPS)
    except ModuleNotFoundError:
        block_ops = ops
    block_decode = getattr(block_ops, "decode_attention_fwd_mla_block", None)
    takes_sms = block_decode is not None and (
        "num_sms" in inspect.signature(block_decode).parameters
    )

    def call(x: dict):
        q, kv_cache = x["q"], x["kv_cache"]
        o = torch.zeros(*q.shape[:2], KV_LORA_RANK, dtype=q.dtype, device=q.device)
        lse = torch.zeros(q.shape[:2], dtype=q.dtype, device=q.device)
        block_table, seq_lens = x["block_table"], x["seq_lens"]
        num_reqs, sm_count = seq_lens.shape[0], x["sm_count"]
        query_len = q.shape[0] // num_reqs
        if block_decode is not None and query_len > 1:
            splits = block_ops.mla_block_decode_num_kv_splits(
                q,
                kv_cache,
                num_reqs,
                x["planned_len"],
                sm_count,
                flat_num_kv_splits(MAX_MODEL_LEN, sm_count),
            )
        else:
            splits = flat_num_kv_splits(x["planned_len"], sm_count)
        attn_logits = scratch(x, splits)
        cache = kv_cache.unsqueeze(2)
        page_size = cache.size(1)
        if block_decode is not None and query_len > 1:
            extra = (sm_count,) if takes_sms else ()
            block_decode(
                q, cache, o, lse, block_table, seq_lens, attn_logits, x["scale"],
                page_size, x["k_scale"], *extra,
            )
            return o, lse
        if query_len > 1:
            block_table = block_table.repeat_interleave(query_len, dim=0)
            seq_lens = seq_lens.repeat_interleave(query_len)
        ops.decode_attention_fwd(
            q,
            cache,
            cache[..., :KV_LORA_RANK],
            o,
            lse,
            block_table,
            seq_lens,
            attn_logits,
            splits,
            x["scale"],
            page_size,
            k_scale=x["k_scale"],
            v_scale=x["k_scale"],
            is_mla=True,
        )
        return o, lse

    call.ops = block_ops
    return call


def bind_reshape(load):
    """The simplest alternative to a block kernel: every row of a non-causal
    draft block sees its request's whole KV, so the tree's grouped decode
    (decode_attention_fwd) can take a request's query_len x heads rows as its
    heads, one row of block table and length per request, no new kernel."""
    ops = load(OPS)

    def call(x: dict):
        q, kv_cache = x["q"], x["kv_cache"]
        num_reqs = x["seq_lens"].shape[0]
        tokens, heads = q.shape[:2]
        rows = tokens // num_reqs * heads
        splits = flat_num_kv_splits(x["planned_len"], x["sm_count"])
        o = torch.zeros(num_reqs, rows, KV_LORA_RANK, dtype=q.dtype, device=q.device)
        lse = torch.zeros(num_reqs, rows, dtype=q.dtype, device=q.device)
        attn_logits = scratch(x, splits).view(num_reqs, rows, splits, KV_LORA_RANK + 1)
        cache = kv_cache.unsqueeze(2)
        ops.decode_attention_fwd(
            q.view(num_reqs, rows, HEAD_SIZE),
            cache,
            cache[..., :KV_LORA_RANK],
            o,
            lse,
            x["block_table"],
            x["seq_lens"],
            attn_logits,
            splits,
            x["scale"],
            cache.size(1),
            k_scale=x["k_scale"],
            v_scale=x["k_scale"],
            is_mla=True,
        )
        return o.view(tokens, heads, KV_LORA_RANK), lse.view(tokens, heads)

    call.ops = ops
    return call


def _real_rows(x: dict) -> torch.Tensor:
    """Query rows of requests with KV (padding requests have none)."""
    query_len = x["q"].shape[0] // x["seq_lens"].shape[0]
    return (x["seq_lens"] > 0).repeat_interleave(query_len)


def max_differences(a, b) -> tuple[float, float]:
    """Largest |difference| of the outputs and of the LSEs; NaN if either
    tree produced a non-finite value."""
    diffs = []
    for x, y in zip(a, b):
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            diffs.append(float("nan"))
        else:
            diffs.append((x.float() - y.float()).abs().max().item())
    return diffs[0], diffs[1]


def same_output(a, b) -> bool:
    """Equal within bf16 rounding: the trees sum in different orders, and both
    round outputs and LSEs to bf16 (LSEs near 10 have a step of 1/16).
    Padding rows (no KV) are NaN in both."""
    return all(
        torch.equal(x.isnan(), y.isnan())
        and torch.allclose(x.float(), y.float(), rtol=1.6e-2, atol=1e-2, equal_nan=True)
        for x, y in zip(a, b)
    )


def roofline(shape: dict) -> tuple[int, int]:
    """(bytes, FLOPs) of one call at the least: every KV entry read once, the
    query read and the output written once; QK over 576, PV over 512."""
    kv_bytes = 1 if shape["kv_dtype"] == "fp8" else 2
    tokens = sum(shape["lens"])
    rows_per_req = shape["query_len"] * shape["num_heads"]
    rows = len(shape["lens"]) * rows_per_req
    nbytes = tokens * HEAD_SIZE * kv_bytes + rows * (HEAD_SIZE + KV_LORA_RANK + 1) * 2
    flops = 2 * rows_per_req * tokens * (HEAD_SIZE + KV_LORA_RANK)
    return nbytes, flops


# --- standalone run -----------------------------------------------------------

HERE = Path(__file__).resolve().parent
# Candidate tiles for --sweep, by KV dtype (fp8?): _MLABlockTile arguments.
# ROCm: the tiles that compile for gfx942 and gfx950 without spills within the
# LDS (python -m scripts.perf.amd_resources --sweep); NVIDIA: the 64-row entries.
if torch.version.hip:
    SWEEP_TABLE = "for row in _TILES_ROCM.values(): row[{fp8}] = {tile}"
    SWEEP_TILES = {
        False: ("64, 16, 8, 1", "64, 16, 8, 2", "32, 16, 8, 2",
                "32, 16, 4, 1, waves_per_eu=1"),
        True: ("32, 16, 4, 1, waves_per_eu=1", "32, 16, 8, 2", "64, 16, 4, 2",
               "64, 16, 8, 2"),
    }
else:
    SWEEP_TABLE = "_TILES_LARGE_SMEM[(64, {fp8})] = {tile}"
    SWEEP_TILES = {
        False: ("64, 64, 8, 2", "64, 32, 8, 3", "64, 64, 8, 1"),
        True: ("64, 128, 8, 1", "64, 64, 8, 2, reload_fp8_v=True", "64, 64, 8, 1"),
    }


def sweep_variants() -> list[str]:
    """NAME:STATEMENT per candidate tile; NAME is '<kv>-t<index>'."""
    return [
        f"{'fp8' if fp8 else 'bf16'}-t{i}:"
        + SWEEP_TABLE.format(fp8=fp8, tile=f"_MLABlockTile({tile})")
        for fp8, tiles in SWEEP_TILES.items()
        for i, tile in enumerate(tiles)
    ]


SWEEP_SHAPES = ("16 x 32k&q5 h8 ", "16 ragged&q5 h8 ", "1 x 32k&q5 h8 ",
                "16 x 32k&q6 h16", "16 x 32k&q7 h64")


# The runner's folder: this file sits in its cases/ (build/gpubench/cases/).
RUNNER = HERE.parent
TREES = RUNNER / "trees"


def load_tree(label: str):
    """load(name) of one tree: every call makes a module of its own (so
    variants can change one copy), importing that tree's vllm modules
    (run.py's Tree), whatever the other trees hold."""
    if str(RUNNER) not in sys.path:
        sys.path.insert(0, str(RUNNER))
    from run import Tree

    return Tree(label, TREES / label).load_copy


def tree_labels() -> list[str]:
    """The package's trees in the manifest's order (pristine, before,
    patched, then any --rev)."""
    import json

    return [t["label"] for t in json.loads((RUNNER / "trees.json").read_text())["trees"]]


def variant(label: str, spec: str):
    """(name, call) of `NAME:STATEMENT`: the tree's kernel module with the
    statement run in it, e.g. 'm64:_MIN_SPLIT_TOKENS = 64'."""
    name, _, statement = spec.partition(":")
    load = load_tree(label)
    module = load(BLOCK_OPS)
    exec(statement, vars(module))  # noqa: S102 - the user's own command line
    return name, bind(lambda wanted: module if wanted == BLOCK_OPS else load(wanted))


def median_ms(fn, repeats: int = 20) -> float:
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes/s read and written by a 4 GiB device-to-device copy."""
    src = torch.randn(2**31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)


def matmul_peak() -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ b
    mm_ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (mm_ms * 1e-3)


def input_sets(shape: dict, device: torch.device) -> list[dict]:
    """Enough sets to span 3 L2 caches (at least one), so that no replay finds
    its KV in L2."""
    first = make_inputs(shape, device, torch.Generator(device).manual_seed(0))
    kv = first["kv_cache"].numel() * first["kv_cache"].element_size()
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    count = max(1, min(16, math.ceil(3 * l2 / kv)))
    return [first] + [
        make_inputs(shape, device, torch.Generator(device).manual_seed(s))
        for s in range(1, count)
    ]


def time_calls(calls: dict, sets: list[dict], repeats: int) -> dict[str, list[float]]:
    """ms per call of each callable, graphs replayed in turns; at least 2 ms
    of work per graph replay."""
    once = {name: median_ms(lambda c=c: c(sets[0]), 3) for name, c in calls.items()}
    per_graph = max(1, min(20, math.ceil(2.0 / max(1e-3, min(once.values())))))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the runner's
    from timing import capture

    graphs = {name: capture(c, sets, per_graph, warmup=1) for name, c in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / per_graph)
    return samples


def run_shape(shape: dict, calls: dict, bandwidth: float, peak: float, repeats: int,
              results: dict | None = None) -> str:
    """One table line: the flat path's ms, then per other call its ms,
    speed-up and % of the bound (patched also its time over before's,
    replay by replay); the bound; each call's output check. `results` gets
    the shape's medians and bound, for the summary."""
    device = torch.device("cuda")
    sets = input_sets(shape, device)
    out_flat = calls["pristine"](sets[0])
    checks, working = [], {"pristine": calls["pristine"]}
    for name, c in calls.items():
        if name == "pristine":
            continue
        try:
            out = c(sets[0])
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            checks.append(f"{name} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        working[name] = c
        real = _real_rows(sets[0])
        d_o, d_lse = max_differences(
            (out[0][real], out[1][real]), (out_flat[0][real], out_flat[1][real])
        )
        ok = same_output(out, out_flat)
        checks.append(f"{name} {'ok' if ok else 'MISMATCH'} o {d_o:.1e} lse {d_lse:.1e}")
    times = time_calls(working, sets, repeats)
    nbytes, flops = roofline(shape)
    t_mem, t_flop = nbytes / bandwidth * 1e3, flops / peak * 1e3
    bound, kind = max((t_mem, "mem"), (t_flop, "flop"))
    medians = {n: statistics.median(t) for n, t in times.items()}
    if results is not None:
        results[shape["name"]] = {"shape": shape, "ms": medians, "bound": bound}
    cells = [f"{shape['name']:<36}", f"{medians['pristine']:8.3f}"]
    for name in working:
        if name == "pristine":
            continue
        t = medians[name]
        ratio = statistics.median(b / n for b, n in zip(times["pristine"], times[name]))
        cell = f"{name:>8} {t:8.3f} {ratio:5.2f}x {100 * bound / t:5.1f}%"
        if name == "patched" and "before" in times:
            vs = statistics.median(p / b for p, b in zip(times[name], times["before"]))
            cell += f" {vs:5.2f}/before"
        cells.append(cell)
    cells += [f"{bound:7.3f} {kind:<4}", "; ".join(checks)]
    del sets
    torch.cuda.empty_cache()
    return "  ".join(cells)


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}" if values else "-"


def summary(results: dict, trees: list[str]) -> list[str]:
    """What the kernel's goals ask of `patched`, over the block shapes
    (query_len > 1): its time against each other tree's and against the
    envelope (the best of the trees but pristine: before and any --rev; not
    the --variant copies), its speed-up over flat at >= 16k context, fp8
    against bf16 at the same shape, and % of the bound per head count."""
    block = {n: r for n, r in results.items()
             if r["shape"]["query_len"] > 1 and "patched" in r["ms"]}
    lines = []
    others = [t for t in trees if t not in ("pristine", "patched")]
    for label in [*others, "envelope"] if len(others) > 1 else others:
        ratio = {n: r["ms"]["patched"] / (r["ms"][label] if label != "envelope" else
                                          min(r["ms"][o] for o in others if o in r["ms"]))
                 for n, r in block.items() if label == "envelope" or label in r["ms"]}
        worst = sorted(ratio, key=ratio.get, reverse=True)[:5]
        lines.append(f"patched / {label}: {_span(list(ratio.values()))} over {len(ratio)} "
                     f"shapes, slower (> 1.03) at {sum(v > 1.03 for v in ratio.values())}; "
                     "worst: " + ", ".join(f"{n.strip()} {ratio[n]:.2f}" for n in worst))
    for label in ["patched", *others]:
        long = [r["ms"]["pristine"] / r["ms"][label] for r in block.values()
                if label in r["ms"] and max(r["shape"]["lens"]) >= 16384]
        lines.append(f"{label} over flat at >= 16k context: {_span(long)}x over "
                     f"{len(long)} shapes, {sum(v < 3 for v in long)} under 3x")
    pairs = [(r["ms"]["patched"], results[n.replace("fp8 ", "bf16")]["ms"]["patched"])
             for n, r in block.items() if r["shape"]["kv_dtype"] == "fp8"
             and n.replace("fp8 ", "bf16") in results]
    lines.append(f"patched fp8 / bf16 at the same shape: {_span([f / b for f, b in pairs])} "
                 f"over {len(pairs)} pairs, fp8 slower (> 1.03) at "
                 f"{sum(f / b > 1.03 for f, b in pairs)}")
    for heads in sorted({r["shape"]["num_heads"] for r in block.values()}):
        for kv in ("bf16", "fp8"):
            pct = [100 * r["bound"] / r["ms"]["patched"] for r in block.values()
                   if r["shape"]["num_heads"] == heads and r["shape"]["kv_dtype"] == kv
                   and max(r["shape"]["lens"]) >= 16384]
            if pct:
                lines.append(f"patched % of bound, {heads} heads, {kv}, >= 16k: "
                             f"{_span(pct, '{:.1f}')}")
    return lines


def kernel_resources(ops) -> list[str]:
    """Registers, spills and shared memory of each compiled variant of the
    block kernel (best effort: Triton's cache layout is internal)."""
    found = set()
    try:
        for cache in ops._fwd_mla_block_kernel_stage1.device_caches.values():
            for key, kernel in cache[0].items():
                meta = kernel.metadata
                found.add(
                    f"{meta.num_warps} warps {meta.num_stages} stages: "
                    f"{kernel.n_regs} regs {kernel.n_spills} spills "
                    f"{meta.shared // 1024} KiB ({str(key)[:160]})"
                )
    except Exception as e:  # noqa: BLE001
        return [f"unknown ({type(e).__name__})"]
    return sorted(found)


def check_ragged(flat, new) -> bool:
    """New vs flat on small ragged batches: page sizes 1/16/64, query_len 2-8,
    8-64 heads, bf16 and fp8, a padding request of length 0 at the end, the
    scratch sized for MAX_MODEL_LEN (as captured) and for the batch."""
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(1)
    draw = torch.Generator().manual_seed(1)  # the lengths, on the host
    worst, cases, bad = 0.0, 0, 0
    for page in (1, 16, 64):
        for query_len, heads in ((2, 8), (4, 16), (7, 64), (6, 16), (3, 32), (8, 8)):
            for kv in ("bf16", "fp8"):
                for planned in ("batch", "max_model_len"):
                    lens = torch.randint(1, 3000, (5,), generator=draw).tolist() + [0]
                    shape = _shape("ragged", lens, query_len, heads, kv, page, "per-step")
                    x = make_inputs(shape, device, g)
                    if planned == "max_model_len":
                        x["planned_len"] = MAX_MODEL_LEN
                    a, b = flat(x), new(x)
                    real = _real_rows(x)
                    d_o, d_lse = max_differences((b[0][real], b[1][real]),
                                                 (a[0][real], a[1][real]))
                    ok = same_output(b, a)
                    cases += 1
                    bad += not ok
                    if not ok:
                        print(f"MISMATCH page {page} q{query_len} h{heads} {kv} "
                              f"{planned}: o {d_o:.2e} lse {d_lse:.2e}", flush=True)
                    worst = max(worst, d_o if d_o == d_o else float("inf"))
    print(f"ragged check: {cases} cases, {bad} mismatches, max |o diff| {worst:.2e}",
          flush=True)
    return bad == 0


def calls_for(shape: dict, calls: dict) -> dict:
    """The calls that differ on this shape: a sweep variant '<kv>-t<i>' only
    changes the tile of that KV dtype."""
    return {name: call for name, call in calls.items()
            if "-t" not in name or name.startswith(shape["kv_dtype"] + "-")}


def best_tiles(medians: dict) -> dict[str, tuple[str, float, float]]:
    """Per KV dtype: (best candidate tile, its geometric mean ms, the shipped
    tile's), over the sweep shapes of that dtype."""
    def geomean(name: str, names: list[str]) -> float:
        return math.prod(medians[n][name] for n in names) ** (1 / len(names))

    best = {}
    for fp8, tiles in SWEEP_TILES.items():
        kv = "fp8" if fp8 else "bf16"
        names = [n for n, m in medians.items() if f"{kv}-t0" in m]
        if names:
            scores = {tile: geomean(f"{kv}-t{i}", names) for i, tile in enumerate(tiles)}
            tile = min(scores, key=scores.get)
            best[kv] = (tile, scores[tile], geomean("patched", names))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", choices=("production", "per-step"),
                        default="production")
    parser.add_argument("--shape", action="append",
                        help="shapes whose name contains this (repeatable; "
                        "A&B: both A and B)")
    parser.add_argument("--check", action="store_true", help="ragged batches only")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:STATEMENT, a copy of the patched kernel module "
                        "with the statement run in it (repeatable)")
    parser.add_argument("--sweep", action="store_true",
                        help="the candidate tiles (SWEEP_TILES) on SWEEP_SHAPES, "
                        "and the best per KV dtype")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    import triton

    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    peak = matmul_peak()
    device = torch.device("cuda")
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
    print(
        f"{torch.cuda.get_device_name()} {arch.split(':')[0]}; torch "
        f"{torch.__version__}, Triton {triton.__version__}; {num_sms(device)} SMs"
    )
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write of a 4 GiB "
        f"device copy), bf16 peak {peak / 1e12:.0f} TFLOP/s (8192^3 matmul)"
    )
    pristine = bind(load_tree("pristine"))
    patched = bind(load_tree("patched"))
    if args.check:
        return 0 if check_ragged(pristine, patched) else 1
    calls = {"pristine": pristine, "patched": patched}
    # The other trees of the package: before (the previous landed revision)
    # and any gpubench --rev LABEL=REV.
    calls.update((label, bind(load_tree(label))) for label in tree_labels()
                 if label not in calls)
    # The alternative a maintainer tries first, on the release's own kernel.
    calls["reshape"] = bind_reshape(load_tree("pristine"))
    specs = list(args.variant) + (sweep_variants() if args.sweep else [])
    calls.update(variant("patched", spec) for spec in specs)
    shapes = PRODUCTION_SHAPES if args.regime == "production" else PER_STEP_SHAPES
    wanted = args.shape or (SWEEP_SHAPES if args.sweep else None)
    shapes = [s for s in shapes if not wanted or any(
        all(part in s["name"] for part in t.split("&")) for t in wanted)]
    print(f"{args.regime} regime: split counts planned for "
          + ("max_model_len " + str(MAX_MODEL_LEN) if args.regime == "production"
             else "each shape's longest context"))
    print("shape                                 flat ms  [tree  ms  speed-up  "
          "% of bound]  bound ms  check (vs flat, max |diff|)", flush=True)
    results: dict = {}
    for shape in shapes:
        line = run_shape(shape, calls_for(shape, calls), bandwidth, peak,
                         args.repeats, results)
        print(line, flush=True)
    print()
    for line in summary(results, [*tree_labels(), "reshape"]):
        print(line, flush=True)
    if args.sweep:
        medians = {name: r["ms"] for name, r in results.items()}
        for kv, (tile, best, shipped) in best_tiles(medians).items():
            # One line per KV dtype, read by the hardware runbook's report.
            print(f"best tile {arch.split(':')[0] or 'cuda'} {kv}: _MLABlockTile({tile}) "
                  f"{best:.4f} ms (geometric mean; shipped tile {shipped:.4f} ms)")
    for name, call in calls.items():
        if name != "pristine":
            for line in kernel_resources(call.ops):
                print(f"{name} kernel: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
