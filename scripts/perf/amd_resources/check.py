"""The check: every launch of the stack's wrappers at production shapes, compiled
for each AMD GPU, within that GPU's LDS and without scratch."""

from __future__ import annotations

from pathlib import Path

from scripts.perf.amd_resources import shapes
from scripts.perf.amd_resources.kernel_tree import rocm_modules
from scripts.perf.amd_resources.report import (
    HEADERS,
    PATH_NAMES,
    is_checked,
    kernel_name,
    notes,
    path_of,
    render,
    summary_rows,
)
from scripts.perf.amd_resources.resources import Resources, compile_all
from scripts.perf.amd_resources.targets import Arch


def production_resources(tree: Path, arch: Arch, jobs: int = 1) -> list[Resources]:
    with rocm_modules(tree, arch) as load:
        launches = (shapes.attention_launches(load, tree, arch) + shapes.sampler_launches(load)
                    + shapes.aiter_fp8_bmm_launches(arch))
        return compile_all(launches, arch, jobs)


def failures_of(results: list[Resources], arch: Arch) -> list[str]:
    """One line per variant of the stack's kernels that breaks a limit of `arch`."""
    return [f"{arch.name} {kernel_name(r)} {describe_shape(r.shapes[0])}: "
            + "; ".join(problems) for r in results if is_checked(r)
            for problems in [r.violations(arch)] if problems]


def describe_shape(shape: dict) -> str:
    """A variant's first shape (the others differ in what leaves the code alone)."""
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def run(tree: Path, archs: list[Arch], jobs: int = 1
        ) -> tuple[dict[str, list[Resources]], list[str]]:
    results, failures = {}, []
    for arch in archs:
        results[arch.name] = production_resources(tree, arch, jobs)
        failures += failures_of(results[arch.name], arch)
    return results, failures


def reference_findings(results: list[Resources]) -> list[str]:
    """One line per reference path, arch and kernel whose variants fail to
    compile or use scratch: how many, and the scratch they take."""
    found: dict[tuple[str, str, str], list[Resources]] = {}
    for r in results:
        if not is_checked(r) and (r.error or r.scratch or r.vgpr_spills or r.sgpr_spills):
            found.setdefault((PATH_NAMES[path_of(r)], r.arch, kernel_name(r)), []).append(r)
    lines = []
    for (path, arch, kernel), members in found.items():
        errors = sorted({m.error for m in members if m.error})
        scratch = sorted({m.scratch for m in members if not m.error})
        what = [f"does not compile: {errors[0]}"] if errors else []
        if scratch:
            span = f"{scratch[0]}-{scratch[-1]}" if len(scratch) > 1 else f"{scratch[0]}"
            what.append(f"scratch {span} B a lane")
        lines.append(f"reference {path} {arch} {kernel}: {len(members)} variant(s), "
                     + "; ".join(what))
    return lines


def report(results: dict[str, list[Resources]], failures: list[str], markdown: bool) -> str:
    import triton

    everything = [r for rs in results.values() for r in rs]
    lines = [f"AMD compile resources of the stack's kernels (Triton {triton.__version__}, "
             "AMD backend, compiled on CPU; python -m scripts.perf.amd_resources):",
             render(HEADERS, summary_rows(everything), markdown), ""]
    lines += [f"note: {line}" for line in notes(everything)]
    # The flat path is 0.34.0's and the aiter path aiter's: what they break is
    # shown, never a failure of the stack.
    lines += reference_findings(everything)
    if failures:
        lines += ["", f"FAILED: {len(failures)} variant(s) of the stack's kernels:"]
        lines += [f"  {line}" for line in failures]
    else:
        lines.append("every variant of the stack's kernels compiles within its GPU's LDS, "
                     "without scratch")
    return "\n".join(lines)
