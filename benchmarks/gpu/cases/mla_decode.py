"""Triton MLA decode of a non-causal draft block, as TritonMLAImpl.forward_mqa
calls it (vllm/v1/attention/backends/mla/triton_mla.py).

The K3 DSpark drafter decodes a non-causal block of `query_len` tokens per
request with the latent KV cache of MLA (512 latent + 64 rope, pages of 64).
vLLM 0.33.0 flattens the block to one decode row per token and calls
`decode_attention_fwd` (the grouped kernel reads a request's KV once per row
and per 16 heads); the patched tree reads it once per tile of the request's
query_len x heads rows (`decode_attention_fwd_mla_block`). `bind` does what
each tree's forward_mqa does, so `pristine` is the flat path and `patched` the
new one; query_len 1 takes the flat path in both.

A case module of the GPU benchmark runner (FILES, SHAPES, make_inputs, bind,
same_output; see benchmarks/gpu/run.py on the gpubench branch), plus
`roofline(shape)`: the bytes the attention must read at least once and its
FLOPs, which `main()` divides by the copy bandwidth and the bf16 GEMM peak
measured in the same run. `main()` runs the case on its own, from a package
laid out like the runner's (trees/<label>/vllm/..., with stand-ins for
vllm.triton_utils and vllm.platforms):

    python3 build/gpubench/cases/mla_decode.py [--shape TEXT] [--sweep] [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import torch

FILES = ("vllm/v1/attention/ops/triton_decode_attention.py",)
OPS = "vllm.v1.attention.ops.triton_decode_attention"

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
PAGE_SIZE = 64
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# vLLM's own split heuristic in forward_mqa (_compute_num_kv_splits): the
# scratch is sized for it, and the flat path uses it.
MIN_WORK_PER_SPLIT = 512
SPLIT_OCCUPANCY_MULTIPLIER = 2
# The workspace holds the scratch of the longest context the server accepts.
MAX_MODEL_LEN = 131072


def _shape(num_reqs: int, context: int, query_len: int, heads: int, kv: str) -> dict:
    name = f"{num_reqs:>2} x {context // 1024:>3}k q{query_len} h{heads:<2} {kv}"
    return {
        "name": name,
        "num_reqs": num_reqs,
        "context": context,
        "query_len": query_len,
        "num_heads": heads,
        "kv_dtype": kv,
    }


# Requests x context: short and long single requests, and batches up to the
# KV that fits a serving GPU. Query_len 1 is plain decode (both trees flat).
SHAPES = tuple(
    _shape(r, c, q, h, kv)
    for r, contexts in (
        (1, (4096, 32768, 131072)),
        (16, (16384, 65536)),
        (64, (8192, 32768)),
    )
    for c in contexts
    for q in (4, 7)
    for h in (8, 64)
    for kv in ("bf16", "fp8")
) + tuple(
    _shape(r, c, 1, h, "bf16") for r, c in ((1, 4096), (64, 32768)) for h in (8, 64)
)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def flat_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    ideal = 1 << max(0, math.ceil(math.log2(max(1, max_seq_len // MIN_WORK_PER_SPLIT))))
    return min(ideal, sm_count * SPLIT_OCCUPANCY_MULTIPLIER)


def make_inputs(shape: dict, device: torch.device, generator: torch.Generator) -> dict:
    """One forward_mqa call: the query, a paged latent cache with the pages of
    the requests shuffled, and the scratch vLLM's workspace would hand out."""
    num_reqs, context = shape["num_reqs"], shape["context"]
    query_len, heads = shape["query_len"], shape["num_heads"]
    pages_per_req = -(-context // PAGE_SIZE)
    num_pages = num_reqs * pages_per_req
    cache = torch.randn(
        num_pages,
        PAGE_SIZE,
        HEAD_SIZE,
        generator=generator,
        device=device,
        dtype=torch.bfloat16,
    )
    cache = cache.to(KV_DTYPES[shape["kv_dtype"]])
    block_table = torch.randperm(num_pages, generator=generator, device=device)
    block_table = block_table.to(torch.int32).view(num_reqs, pages_per_req)
    # Scaled so that attention is peaked and the output check is sensitive.
    q = 4 * torch.randn(
        num_reqs * query_len,
        heads,
        HEAD_SIZE,
        generator=generator,
        device=device,
        dtype=torch.bfloat16,
    )
    return dict(
        q=q,
        kv_cache=cache,
        block_table=block_table,
        seq_lens=torch.full((num_reqs,), context, dtype=torch.int32, device=device),
        max_seq_len=context,
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
    block_decode = getattr(ops, "decode_attention_fwd_mla_block", None)

    def call(x: dict):
        q, kv_cache = x["q"], x["kv_cache"]
        o = torch.zeros(*q.shape[:2], KV_LORA_RANK, dtype=q.dtype, device=q.device)
        lse = torch.zeros(q.shape[:2], dtype=q.dtype, device=q.device)
        block_table, seq_lens = x["block_table"], x["seq_lens"]
        num_reqs, sm_count = seq_lens.shape[0], x["sm_count"]
        query_len = q.shape[0] // num_reqs
        if block_decode is not None and query_len > 1:
            splits = ops.mla_block_decode_num_kv_splits(
                q,
                kv_cache,
                num_reqs,
                x["max_seq_len"],
                sm_count,
                flat_num_kv_splits(MAX_MODEL_LEN, sm_count),
            )
        else:
            splits = flat_num_kv_splits(x["max_seq_len"], sm_count)
        attn_logits = scratch(x, splits)
        cache = kv_cache.unsqueeze(2)
        page_size = cache.size(1)
        if block_decode is not None and query_len > 1:
            block_decode(
                q,
                cache,
                o,
                lse,
                block_table,
                seq_lens,
                attn_logits,
                x["scale"],
                page_size,
                x["k_scale"],
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

    call.ops = ops
    return call


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
    round outputs and LSEs to bf16 (LSEs near 10 have a step of 1/16)."""
    return all(
        torch.isfinite(x).all()
        and torch.isfinite(y).all()
        and torch.allclose(x.float(), y.float(), rtol=1.6e-2, atol=1e-2)
        for x, y in zip(a, b)
    )


def roofline(shape: dict) -> tuple[int, int]:
    """(bytes, FLOPs) of one call at the least: every KV entry read once, the
    query read and the output written once; QK over 576, PV over 512."""
    kv_bytes = 1 if shape["kv_dtype"] == "fp8" else 2
    tokens = shape["num_reqs"] * shape["context"]
    rows = shape["num_reqs"] * shape["query_len"] * shape["num_heads"]
    nbytes = tokens * HEAD_SIZE * kv_bytes + rows * (HEAD_SIZE + KV_LORA_RANK + 1) * 2
    flops = 2 * rows * shape["context"] * (HEAD_SIZE + KV_LORA_RANK)
    return nbytes, flops


# --- standalone run -----------------------------------------------------------

HERE = Path(__file__).resolve().parent
TREES = ("pristine", "patched")
# Candidate tiles of the patched kernel for --sweep, by class of row tile
# (64 rows, or 32 and fewer): KV tokens per iteration, warps, stages.
SWEEP_TILES = {
    64: ((64, 8, 2), (64, 8, 1), (128, 8, 1), (32, 8, 2), (32, 8, 3), (16, 8, 3)),
    32: ((32, 4, 2), (64, 4, 2), (64, 4, 1), (16, 4, 3), (32, 4, 3), (64, 8, 3)),
}
if torch.version.hip:  # one stage: CDNA3 has 64 KiB of LDS
    SWEEP_TILES = {
        64: ((16, 4, 1), (32, 4, 1), (16, 8, 1), (32, 8, 1), (64, 8, 1), (16, 8, 2)),
        32: ((16, 4, 1), (32, 4, 1), (16, 8, 1), (32, 8, 1), (64, 4, 1), (16, 4, 2)),
    }
SWEEP_SHAPES = (
    "16 x  64k q7 h8  bf16",
    "16 x  64k q7 h64 bf16",
    " 1 x 128k q7 h64 bf16",
    "64 x  32k q7 h64 fp8",
    "16 x  64k q7 h8  fp8",
    " 1 x   4k q4 h8  bf16",
    "16 x  64k q4 h8  bf16",
    "64 x  32k q4 h8  fp8",
    " 1 x  32k q4 h8  fp8",
)


def load_tree(label: str):
    """load(name) of one tree, for the kernel file only: each tree's copy is
    its own module; vllm.triton_utils/platforms stand-ins are shared. The
    trees sit next to this file, or next to the runner's cases/ folder."""
    trees = HERE / "trees" if (HERE / "trees").is_dir() else HERE.parent / "trees"
    root = trees / label
    if str(root) not in sys.path:
        sys.path.append(str(root))  # the stand-ins, identical in every tree

    def load(name: str):
        path = root / (name.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(f"{label}_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


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
    """ms per call of each callable, graphs replayed in turns; at least 1 ms
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


def run_shape(
    shape: dict,
    calls: dict,
    bandwidth: float,
    peak: float,
    repeats: int,
    medians: dict | None = None,
) -> str:
    device = torch.device("cuda")
    sets = input_sets(shape, device)
    out_flat = calls["pristine"](sets[0])
    checks, working = [], {}
    for name, c in calls.items():
        if name == "pristine":
            working[name] = c
            continue
        try:
            out = c(sets[0])
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            checks.append(f"{name} failed: {type(e).__name__}")
            continue
        working[name] = c
        d_o, d_lse = max_differences(out, out_flat)
        ok = same_output(out, out_flat)
        checks.append(f"{'ok' if ok else 'MISMATCH'} o {d_o:.1e} lse {d_lse:.1e}")
    calls = working
    times = time_calls(calls, sets, repeats)
    if medians is not None:
        medians[shape["name"]] = {n: statistics.median(t) for n, t in times.items()}
    nbytes, flops = roofline(shape)
    t_mem, t_flop = nbytes / bandwidth * 1e3, flops / peak * 1e3
    bound, kind = max((t_mem, "mem"), (t_flop, "flop"))
    base = statistics.median(times["pristine"])
    cells = [f"{shape['name']:<22}", f"{base:9.3f}"]
    for name in calls:
        if name == "pristine":
            continue
        t = statistics.median(times[name])
        ratio = statistics.median(b / n for b, n in zip(times["pristine"], times[name]))
        cells += [f"{name:>8} {t:9.3f} {ratio:6.2f}x {100 * bound / t:5.1f}%"]
    cells += [f"{bound:8.3f} {kind:<4}", "; ".join(checks)]
    del sets
    torch.cuda.empty_cache()
    return "  ".join(cells)


def kernel_resources(ops) -> str:
    """Registers, spills and shared memory of each compiled variant of the
    block kernel (best effort: Triton's cache layout is internal)."""
    found = []
    try:
        for cache in ops._fwd_mla_block_kernel_stage1.device_caches.values():
            for kernel in cache[0].values():
                found.append(
                    f"{kernel.n_regs} regs {kernel.n_spills} spills "
                    f"{kernel.metadata.shared // 1024} KiB"
                )
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"
    return ", ".join(sorted(set(found)))


def check_ragged(load_flat, load_new) -> None:
    """New vs flat on ragged batches: page sizes 1/16/64, query_len 2-8, 8-64
    heads, bf16 and fp8, padding requests of length 0 at the end."""
    flat, new = bind(load_flat), bind(load_new)
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(1)
    worst = 0.0
    cases = 0
    for page in (1, 16, 64):
        for query_len in (2, 4, 7):
            for heads in (8, 16, 64):
                for kv in ("bf16", "fp8"):
                    lens = torch.randint(1, 3000, (5,), generator=g, device=device)
                    lens = torch.cat([lens, lens.new_zeros(1)]).int()
                    pages = -(-int(lens.max()) // page)
                    cache = torch.randn(
                        6 * pages + 3, page, HEAD_SIZE, generator=g, device=device
                    ).to(KV_DTYPES[kv])
                    table = torch.randperm(6 * pages + 3, generator=g, device=device)
                    x = dict(
                        q=4
                        * torch.randn(
                            6 * query_len,
                            heads,
                            HEAD_SIZE,
                            generator=g,
                            device=device,
                            dtype=torch.bfloat16,
                        ),
                        kv_cache=cache,
                        seq_lens=lens,
                        max_seq_len=int(lens.max()),
                        block_table=table[: 6 * pages].int().view(6, pages),
                        k_scale=torch.tensor([0.5], device=device),
                        scale=HEAD_SIZE**-0.5,
                        sm_count=num_sms(device),
                    )
                    a, b = flat(x), new(x)
                    real = slice(0, 5 * query_len)
                    a_real, b_real = (a[0][real], a[1][real]), (b[0][real], b[1][real])
                    d_o, d_lse = max_differences(b_real, a_real)
                    pad_same = bool(
                        torch.equal(
                            a[0][real.stop :].isnan(), b[0][real.stop :].isnan()
                        )
                    )
                    cases += 1
                    print(
                        f"  page {page} q{query_len} h{heads} {kv}: o {d_o:.1e} "
                        f"lse {d_lse:.1e}",
                        flush=True,
                    )
                    if not same_output(b_real, a_real) or not pad_same:
                        print(
                            f"MISMATCH page {page} q{query_len} h{heads} {kv}: "
                            f"o {d_o:.2e} lse {d_lse:.2e} padding same {pad_same}"
                        )
                    worst = max(worst, d_o if d_o == d_o else float("inf"))
    print(f"ragged check: {cases} cases, max |o diff| {worst:.2e}", flush=True)


def tile_class(rows: int) -> int:
    return 64 if rows > 32 else 32


def with_tiles(load, choose) -> dict:
    """A patched call whose tile chooser is choose(class, kv_is_fp8); the
    table tile's other fields (rows, fp8 reload, programs per SM) are kept."""
    ops = load(OPS)
    original = ops._mla_block_tile

    def tile(rows, kv_dtype, device):
        n, warps, stages = choose(tile_class(rows), kv_dtype.itemsize == 1)
        return dataclasses.replace(
            original(rows, kv_dtype, device),
            block_n=n,
            num_warps=warps,
            num_stages=stages,
        )

    ops._mla_block_tile = tile
    return bind(lambda name: ops)


def sweep_calls(load) -> dict:
    """One patched call per candidate index (candidate i of each class)."""
    return {
        f"cand{i}": with_tiles(load, lambda c, fp8, i=i: SWEEP_TILES[c][i])
        for i in range(len(SWEEP_TILES[64]))
    }


def best_tiles(results: dict[str, dict[str, float]]) -> dict:
    """Per (class, fp8): the candidate with the smallest geometric mean time
    over the sweep shapes of that class."""
    chosen = {}
    for cls in SWEEP_TILES:
        for fp8 in (False, True):
            names = [
                n
                for n in results
                if tile_class(shape_rows(n)) == cls and n.endswith("fp8") == fp8
            ]
            if not names:
                continue
            scores = []
            for i in range(len(SWEEP_TILES[cls])):
                times = [results[n].get(f"cand{i}", float("inf")) for n in names]
                scores.append(math.prod(times) ** (1 / len(times)))
            chosen[(cls, fp8)] = SWEEP_TILES[cls][scores.index(min(scores))]
    return chosen


def shape_rows(name: str) -> int:
    shape = next(s for s in SHAPES if s["name"] == name)
    return shape["query_len"] * shape["num_heads"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", action="append", help="shapes whose name contains this"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="time candidate tiles, then every shape with the best",
    )
    parser.add_argument("--check", action="store_true", help="ragged batches only")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    import triton

    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    peak = matmul_peak()
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
        f"{triton.__version__}; {num_sms(torch.device('cuda'))} SMs"
    )
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write of a 4 GiB "
        f"device copy), bf16 peak {peak / 1e12:.0f} TFLOP/s (8192^3 matmul)"
    )
    if args.check:
        check_ragged(load_tree("pristine"), load_tree("patched"))
        return 0
    header = (
        "shape                     flat ms  [tree  new ms  speed-up  % of bound]"
        "  bound ms  check (new vs flat, max |diff|)"
    )
    pristine = bind(load_tree("pristine"))
    shapes = [
        s for s in SHAPES if not args.shape or any(t in s["name"] for t in args.shape)
    ]
    patched = bind(load_tree("patched"))
    if args.sweep:
        print(header, flush=True)
        results: dict = {}
        sweep = sweep_calls(load_tree("patched"))
        for shape in SHAPES:
            if shape["name"] in SWEEP_SHAPES:
                print(
                    run_shape(
                        shape,
                        {"pristine": pristine, **sweep},
                        bandwidth,
                        peak,
                        7,
                        results,
                    ),
                    flush=True,
                )
        for name, call in sweep.items():
            print(f"{name}: {kernel_resources(call.ops)}")
        chosen = best_tiles(results)
        print("chosen tiles (class, fp8) -> (block_n, warps, stages):", chosen)
        patched = with_tiles(
            load_tree("patched"), lambda c, fp8: chosen.get((c, fp8), SWEEP_TILES[c][0])
        )
    print(header, flush=True)
    for shape in shapes:
        print(
            run_shape(
                shape,
                {"pristine": pristine, "patched": patched},
                bandwidth,
                peak,
                args.repeats,
            ),
            flush=True,
        )
    print(f"patched kernels: {kernel_resources(patched.ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
