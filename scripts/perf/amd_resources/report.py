"""Tables of compiled resources, as text or Markdown."""

from __future__ import annotations

from collections.abc import Iterable

from scripts.perf.amd_resources.resources import Resources

# Paths whose kernels the stack adds or changes: the check holds them to the
# GPU's limits. The flat path is the release's and the aiter path aiter's (the
# absorb with AITER's FP8 BMM on), shown for reference.
CHECKED_PATHS = ("block", "sampler")
PATH_NAMES = {"block": "block (patch 5)", "sampler": "sampler (patch 8)",
              "flat": "flat (release, ref.)", "aiter": "aiter FP8 BMM (ref.)"}
# Constexprs that are the same at every production shape (512 + 64 latent,
# 128 + 64 query head).
_FIXED_BLOCKS = {"BLOCK_DV", "BLOCK_DMODEL", "BLOCK_DPE", "BLOCK_D_nope", "BLOCK_DK_nope",
                 "BLOCK_D_pe", "BLOCK_D_HALF_pe"}

HEADERS = ("arch", "path", "kernel", "KV", "tile", "launch", "variants", "LDS KiB",
           "VGPR", "AGPR", "alloc", "scratch B", "spills V/S", "waves/SIMD", "with LDS")


def path_of(result: Resources) -> str:
    return result.shapes[0].get("path", "")


def is_checked(result: Resources) -> bool:
    return path_of(result) in CHECKED_PATHS


def _tile_sizes(result: Resources) -> dict[str, int]:
    return {name[len("BLOCK_"):].removeprefix("SIZE_"): value
            for name, value in result.constexprs.items()
            if name.startswith("BLOCK_") and name not in _FIXED_BLOCKS}


def tile(result: Resources) -> str:
    return " ".join(f"{name}{value}" for name, value in _tile_sizes(result).items()) or "-"


def launch_options(result: Resources) -> str:
    o = result.options
    if not o:
        return "-"
    text = f"{o['num_warps']}w {o['num_stages']}s"
    if o["waves_per_eu"]:
        text += f" wpe{o['waves_per_eu']}"
    if o["matrix_instr_nonkdim"]:
        text += f" mfma{o['matrix_instr_nonkdim']}"
    kpack = " kpack2->1" if any("kpack" in note for note in result.notes) else ""
    return text + (kpack or f" kpack{o['kpack']}")


def kernel_name(result: Resources) -> str:
    return result.kernel.strip("_").removesuffix("_kernel").replace("_kernel_", "_")


def _span(values: Iterable[int], scale: float = 1) -> str:
    values = sorted({round(v / scale, 1) if scale != 1 else v for v in values})
    show = [f"{v:g}" for v in values]
    return show[0] if len(show) == 1 else f"{show[0]}-{show[-1]}"


def summary_rows(results: list[Resources]) -> list[list[str]]:
    """One row per arch, path, kernel, tile and the KV caches its variants read,
    with the span of each figure over the variants; KV caches with the same
    figures share a row."""
    groups: dict[tuple, list[Resources]] = {}
    for r in results:
        if not r.error:
            groups.setdefault((r.arch, _PATH_ORDER.index(path_of(r)), kernel_name(r),
                               tuple(_tile_sizes(r).values()), tile(r), launch_options(r),
                               _kv_caches(r)), []).append(r)
    merged: dict[tuple, tuple[set[tuple[str, str]], int]] = {}
    for (arch, path, kernel, _, tile_text, launch, caches), members in sorted(groups.items()):
        figures = (_span((m.lds for m in members), 1024), _span(m.vgprs for m in members),
                   _span(m.agprs for m in members), _span(m.allocated_vgprs for m in members),
                   _span(m.scratch for m in members),
                   f"{_span(m.vgpr_spills for m in members)}/"
                   f"{_span(m.sgpr_spills for m in members)}",
                   _span(m.waves_by_registers for m in members),
                   _span(m.waves_per_simd for m in members))
        key = (arch, path, kernel, tile_text, launch, figures)
        seen, count = merged.get(key, (set(), 0))
        merged[key] = (seen | set(caches), count + len(members))
    return [[arch, PATH_NAMES[_PATH_ORDER[path]], kernel, _kv_label(caches), tile_text, launch,
             str(count), *figures]
            for (arch, path, kernel, tile_text, launch, figures), (caches, count) in merged.items()]


_PATH_ORDER = ("block", "sampler", "flat", "aiter")


def _kv_caches(result: Resources) -> tuple[tuple[str, str], ...]:
    """The KV caches (dtype, storage under or over 2 GiB) of a variant's shapes."""
    return tuple(sorted({(s["kv"], s["kv_storage"]) for s in result.shapes if "kv" in s}))


def _kv_label(caches: set[tuple[str, str]]) -> str:
    """{bf16, fp8} x {KV<2G} -> 'bf16/fp8 KV<2G'; both storages: the dtypes
    alone ('any' for both dtypes)."""
    if not caches:
        return "-"
    dtypes = sorted({dtype for dtype, _ in caches})
    storages = sorted({storage for _, storage in caches})
    if len(caches) != len(dtypes) * len(storages):
        return ", ".join(f"{dtype} {storage}" for dtype, storage in sorted(caches))
    names = "/".join(dtypes)
    if len(storages) > 1:
        return "any" if len(dtypes) > 1 else names
    return f"{names} {storages[0]}"


def render(headers: Iterable[str], rows: list[list[str]], markdown: bool) -> str:
    headers = list(headers)
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def notes(results: list[Resources]) -> list[str]:
    """The backend's warnings, once per arch and message, with the kernels."""
    seen: dict[tuple[str, str], set[str]] = {}
    for r in results:
        for note in r.notes:
            seen.setdefault((r.arch, note), set()).add(kernel_name(r))
    return [f"{arch}: {note} ({', '.join(sorted(kernels))})"
            for (arch, note), kernels in seen.items()]
