"""Tile study of `_fwd_mla_block_kernel_stage1` for MI300 and MI355, on CPU.

The launch the wrapper makes at one production shape (16 heads x 6 draft
tokens: a 96-row block, page 64, KV cache under 2 GiB) is compiled again with
candidate tiles in place of the wrapper's: rows per program (BLOCK_M), KV
tokens per iteration (BLOCK_N), warps, stages and the AMD options.

1. Every tile with the wrapper's options.
2. For the wrapper's tile and, per KV dtype and row count, the tile that fits
   with the most waves a SIMD and the largest KV step: each option varied on
   its own (waves_per_eu, matrix_instr_nonkdim, kpack, the fp8 reload).
3. The best 3 fitting tiles per KV dtype and row count again at page 16
   (per-token page gather when BLOCK_N > 16) and with a KV cache over 2 GiB
   (no buffer loads); the first that fits at all three is reported.

A tile fits when it compiles within the CU's LDS without spills or scratch and
a workgroup fits a CU. What is fastest among them is for the hardware: the
runbook times them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from scripts.perf.amd_resources import shapes
from scripts.perf.amd_resources.kernel_tree import Launch, rocm_modules
from scripts.perf.amd_resources.report import render
from scripts.perf.amd_resources.resources import Resources, compile_all
from scripts.perf.amd_resources.targets import Arch

KERNEL = "_fwd_mla_block_kernel_stage1"
SHAPE = {"page": 64, "heads": 16, "query_len": 6, "kv_storage": "KV<2G"}
OTHER_SHAPES = {"page 16": {**SHAPE, "page": 16}, "KV>2G": {**SHAPE, "kv_storage": "KV>2G"}}
BLOCK_MS = (16, 32, 64)
BLOCK_NS = (16, 32, 64)
NUM_WARPS = (4, 8)
NUM_STAGES = (1, 2)
KVS = ("bf16", "fp8")


@dataclass(frozen=True)
class Tile:
    kv: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int
    matrix_instr_nonkdim: int
    kpack: int
    reload_fp8_v: bool

    def overrides(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "waves_per_eu": self.waves_per_eu,
                "matrix_instr_nonkdim": self.matrix_instr_nonkdim, "kpack": self.kpack,
                "RELOAD_FP8_V": self.reload_fp8_v}

    def label(self) -> str:
        text = (f"{self.kv} {self.block_m}x{self.block_n} {self.num_warps}w "
                f"{self.num_stages}s wpe{self.waves_per_eu} mfma{self.matrix_instr_nonkdim} "
                f"kpack{self.kpack}")
        return text + (" reload" if self.reload_fp8_v else "")


def production_tile(launch: Launch, kv: str) -> Tile:
    """The tile and options the wrapper launched with."""
    k = launch.kwargs
    return Tile(kv, k["BLOCK_M"], k["BLOCK_N"], k["num_warps"], k["num_stages"],
                k.get("waves_per_eu", 0), k.get("matrix_instr_nonkdim", 0), k.get("kpack", 1),
                k["RELOAD_FP8_V"])


def base_launches(load, tree: Path, arch: Arch, shape: dict = SHAPE) -> dict[str, Launch]:
    """The wrapper's stage-1 launch at `shape`, per KV dtype."""
    wanted = [{**shape, "kv": kv} for kv in KVS]
    launches = shapes.attention_launches(load, tree, arch, wanted, paths=("block",))
    return {launch.shape["kv"]: launch for launch in launches if launch.name == KERNEL}


def with_overrides(launch: Launch, overrides: dict, label: str) -> Launch:
    """The launch with constexprs and options replaced."""
    return dataclasses.replace(launch, kwargs={**launch.kwargs, **overrides},
                               shape={**launch.shape, "tile": label})


def compile_tiles(base: dict[str, Launch], tiles: list[Tile], arch: Arch,
                  jobs: int) -> list[Resources]:
    return compile_all([with_overrides(base[t.kv], t.overrides(), t.label()) for t in tiles],
                       arch, jobs)


def parse_tile(spec: str) -> tuple[str, dict]:
    """'kv=fp8,BLOCK_M=64,num_warps=8' -> ('fp8', {'BLOCK_M': 64, 'num_warps': 8})."""
    kv, overrides = "bf16", {}
    for item in filter(None, spec.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--tile {spec!r}: expected NAME=VALUE items, e.g. "
                             "kv=fp8,BLOCK_M=64,BLOCK_N=16,num_warps=8,num_stages=1")
        if name == "kv":
            if value not in KVS:
                raise ValueError(f"--tile {spec!r}: kv is one of {', '.join(KVS)}")
            kv = value
        elif value in ("True", "False"):
            overrides[name] = value == "True"
        else:
            overrides[name] = int(value)
    return kv, overrides


def compile_specs(tree: Path, arch: Arch, specs: list[str], jobs: int) -> list[Resources]:
    """Stage 1 at the study's shape, with each spec's overrides on the wrapper's
    launch; every spec compiled on its own."""
    parsed = [parse_tile(spec) for spec in specs]
    with rocm_modules(tree, arch) as load:
        base = base_launches(load, tree, arch)
        return compile_all([with_overrides(base[kv], overrides, spec)
                            for spec, (kv, overrides) in zip(specs, parsed)], arch, jobs)


def first_round(production: Tile) -> list[Tile]:
    """Every tile with the wrapper's options."""
    return [dataclasses.replace(production, kv=kv, block_m=m, block_n=n, num_warps=w,
                                num_stages=s, reload_fp8_v=False)
            for kv, m, n, w, s in itertools.product(KVS, BLOCK_MS, BLOCK_NS, NUM_WARPS,
                                                     NUM_STAGES)]


def second_round(tiles: list[Tile], arch: Arch) -> list[Tile]:
    """Each option of the tiles varied on its own."""
    out: list[Tile] = []
    for tile in tiles:
        variations = [{"waves_per_eu": 0}, {"waves_per_eu": 2}, {"matrix_instr_nonkdim": 32}]
        if arch.name == "gfx942":  # gfx950 overwrites kpack with 1
            variations.append({"kpack": 1 if tile.kpack != 1 else 2})
        if tile.kv == "fp8":
            variations.append({"reload_fp8_v": not tile.reload_fp8_v})
        for variation in variations:
            varied = dataclasses.replace(tile, **variation)
            if varied != tile and varied not in out and varied not in tiles:
                out.append(varied)
    return out


def fits(result: Resources, arch: Arch) -> bool:
    return not result.violations(arch)


RANKED = 3  # tiles per KV dtype and row count tried at the other shapes


def ranked_per_rows(pairs: list[tuple[Tile, Resources]], arch: Arch,
                    count: int = RANKED) -> list[Tile]:
    """Per KV dtype and BLOCK_M, the `count` fitting tiles (BLOCK_N, warps, stages;
    each with its best options, the first tried on a tie) with the most waves a
    SIMD, then the largest KV step, then the most stages, then the fewest warps."""
    by_tile: dict[tuple, tuple[tuple, Tile]] = {}
    for tile, result in pairs:
        if fits(result, arch):
            score = (result.waves_per_simd, tile.block_n, tile.num_stages, -tile.num_warps)
            key = (tile.kv, tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)
            if key not in by_tile or score > by_tile[key][0]:
                by_tile[key] = (score, tile)
    ranked: dict[tuple[str, int], list[tuple[tuple, Tile]]] = {}
    for (kv, block_m, *_), entry in by_tile.items():
        ranked.setdefault((kv, block_m), []).append(entry)
    return [tile for key in sorted(ranked)
            for _, tile in sorted(ranked[key], key=lambda x: x[0], reverse=True)[:count]]


HEADERS = ("tile (KV M x N, warps, stages, options)", "LDS KiB", "VGPR", "AGPR", "alloc",
           "scratch B", "spills V/S", "waves/SIMD", "WG/CU", "with LDS", "KV passes", "verdict")


def verdict(result: Resources, arch: Arch) -> str:
    return "; ".join(result.violations(arch)) or "fits"


def row(tile: Tile, result: Resources, arch: Arch) -> list[str]:
    passes = str(-(-SHAPE["heads"] * SHAPE["query_len"] // tile.block_m))
    if result.error:
        return [tile.label(), *["-"] * 9, passes, verdict(result, arch)[:70]]
    return [tile.label(), f"{result.lds / 1024:g}", str(result.vgprs), str(result.agprs),
            str(result.allocated_vgprs), str(result.scratch),
            f"{result.vgpr_spills}/{result.sgpr_spills}", str(result.waves_by_registers),
            str(result.workgroups_per_cu), str(result.waves_per_simd), passes,
            verdict(result, arch)]


@dataclass
class Study:
    arch: Arch
    pairs: list[tuple[Tile, Resources]]  # rounds 1 and 2
    ranked: list[Tile]
    elsewhere: dict[str, list[Resources]]  # round 3: the ranked tiles at OTHER_SHAPES

    def best(self) -> list[Tile]:
        """Per KV dtype and BLOCK_M, the first ranked tile that fits everywhere."""
        best: dict[tuple[str, int], Tile] = {}
        for i, tile in enumerate(self.ranked):
            if all(fits(rs[i], self.arch) for rs in self.elsewhere.values()):
                best.setdefault((tile.kv, tile.block_m), tile)
        return list(best.values())


def study(tree: Path, arch: Arch, jobs: int) -> Study:
    with rocm_modules(tree, arch) as load:
        base = base_launches(load, tree, arch)
        production = [production_tile(base[kv], kv) for kv in KVS]
        tiles = first_round(production[0])
        pairs = list(zip(tiles, compile_tiles(base, tiles, arch, jobs)))
        more = second_round(production + ranked_per_rows(pairs, arch, 1), arch)
        pairs += zip(more, compile_tiles(base, more, arch, jobs))
        ranked = ranked_per_rows(pairs, arch)
        elsewhere = {name: compile_tiles(base_launches(load, tree, arch, shape), ranked, arch,
                                         jobs)
                     for name, shape in OTHER_SHAPES.items()}
    return Study(arch, pairs, ranked, elsewhere)


def report(result: Study, markdown: bool) -> str:
    arch = result.arch
    lines = [f"{arch.name} ({arch.gpu}, {arch.lds_bytes // 1024} KiB LDS a CU): {KERNEL} at "
             f"{SHAPE['heads']} heads x {SHAPE['query_len']} tokens, page {SHAPE['page']}, "
             f"{SHAPE['kv_storage']}; KV passes = programs that read the KV for the block",
             render(HEADERS, [row(t, r, arch) for t, r in result.pairs], markdown),
             f"{sum(fits(r, arch) for _, r in result.pairs)} of {len(result.pairs)} tiles fit",
             "", f"{arch.name}: the {RANKED} best ranked fitting tiles per KV dtype and rows "
             "(most waves, then largest KV step, most stages, fewest warps), elsewhere:"]
    rows = []
    for i, tile in enumerate(result.ranked):
        cells = [tile.label()]
        for name in OTHER_SHAPES:
            other = result.elsewhere[name][i]
            cells.append(f"{verdict(other, arch)}, {other.vgprs} VGPR, "
                         f"{other.waves_per_simd} waves")
        rows.append(cells)
    lines.append(render(("tile", *OTHER_SHAPES), rows, markdown))
    lines += ["", f"{arch.name}: first ranked tile that fits everywhere, per KV dtype and rows:"]
    lines += [f"  {tile.label()}" for tile in result.best()]
    return "\n".join(lines)


def main(tree: Path, archs: list[Arch], markdown: bool, json_path: Path | None,
         jobs: int) -> None:
    everything = {}
    for arch in archs:
        result = study(tree, arch, jobs)
        print("\n" + report(result, markdown))
        everything[arch.name] = {
            "tiles": [{"tile": dataclasses.asdict(t), **r.to_json()} for t, r in result.pairs],
            "ranked": [dataclasses.asdict(t) for t in result.ranked],
            "best": [dataclasses.asdict(t) for t in result.best()],
            "elsewhere": {name: [r.to_json() for r in rs]
                          for name, rs in result.elsewhere.items()}}
    if json_path:
        json_path.write_text(json.dumps(everything, indent=1))
