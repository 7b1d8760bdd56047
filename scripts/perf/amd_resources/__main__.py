"""`.venv/bin/python -m scripts.perf.amd_resources`: the stack's Triton kernels compiled
for MI300 (gfx942) and MI355 (gfx950) on CPU; see scripts/perf/amd_resources/__init__.py.

Exit status 1 when a kernel of the stack (patch 8's sampler, patch 5's block
path) does not compile, needs more LDS than a CU has, or uses scratch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from scripts.common import Layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.perf.amd_resources",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=None,
                        help="vLLM tree whose files to compile (default: build/vllm)")
    parser.add_argument("--arch", action="append", choices=("gfx942", "gfx950"),
                        help="compile for this GPU only (default: both)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write every compiled variant to this file")
    parser.add_argument("--sweep", action="store_true",
                        help="the tile study of the block kernel's stage 1 instead")
    parser.add_argument("--tile", action="append", default=[], metavar="SPEC",
                        help="instead: the block kernel's stage 1 at the study's shape "
                        "with these constexprs/options, e.g. kv=fp8,BLOCK_M=64,num_warps=8 "
                        "(repeatable; exit 1 if one does not fit)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="compile in this many processes (default: up to 4)")
    args = parser.parse_args(argv)
    layout = Layout.default()
    tree = args.tree or layout.tree
    cache = layout.build_dir / "amd-resources"
    # Before Triton is imported: its cache keys on the kernel source, the
    # specialization and the options, so an unchanged kernel is not compiled again.
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton-cache")
    # Compiled, never interpreted (the stack's CPU tests set it for their workers).
    os.environ.pop("TRITON_INTERPRET", None)

    from scripts.perf.amd_resources import check, sweep
    from scripts.perf.amd_resources.targets import ARCHS

    archs = [a for a in ARCHS if not args.arch or a.name in args.arch]
    start = time.monotonic()
    if args.sweep:
        sweep.main(tree, archs, args.markdown, args.json, args.jobs)
        return 0
    if args.tile:
        return _tiles(tree, archs, args)
    results, failures = check.run(tree, archs, args.jobs)
    print(check.report(results, failures, args.markdown))
    print(f"\n{sum(len(r) for r in results.values())} variants compiled or read from "
          f"{cache.relative_to(layout.root) if cache.is_relative_to(layout.root) else cache}"
          f" in {time.monotonic() - start:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(
            {arch: [r.to_json() for r in rs] for arch, rs in results.items()}, indent=1))
    return 1 if failures else 0


def _tiles(tree: Path, archs: list, args) -> int:
    from scripts.perf.amd_resources import sweep
    from scripts.perf.amd_resources.report import render

    rows, found, everything = [], False, {}
    for arch in archs:
        results = sweep.compile_specs(tree, arch, args.tile, args.jobs)
        everything[arch.name] = [{**r.to_json(), "violations": r.violations(arch)}
                                 for r in results]
        for spec, r in zip(args.tile, results):
            found |= not sweep.fits(r, arch)
            rows.append([arch.name, spec, f"{r.lds / 1024:g}", str(r.vgprs), str(r.agprs),
                         str(r.allocated_vgprs), str(r.waves_per_simd),
                         sweep.verdict(r, arch)])
    print(render(("arch", "tile", "LDS KiB", "VGPR", "AGPR", "alloc", "waves/SIMD",
                  "verdict"), rows, args.markdown))
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
