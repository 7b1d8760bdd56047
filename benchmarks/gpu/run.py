"""Pristine and patched vLLM kernels timed side by side on one GPU, in one run.

`python3 -m scripts gpubench` builds this runner with the kernel files of each
vLLM tree into build/gpubench/; it needs nothing but Python, torch and Triton,
so it also runs on machines whose image cannot hold the pinned vLLM:

    python3 build/gpubench/run.py [--case NAME] [--shape TEXT] [--list]

Layout of the built package:

    run.py, stats.py, timing.py   this runner
    cases/<name>.py               one module per case
    trees/<label>/vllm/...        each tree's files that a case calls, the vllm
                                  modules they import, and stand-ins for
                                  vllm.triton_utils and vllm.platforms
    trees.json                    label, revision and commit of each tree;
                                  `pristine` (the release) is the baseline

Adding a case is one file, benchmarks/gpu/cases/<name>.py, which defines:

    FILES: tuple[str, ...]
        The vLLM source files the case calls, relative to the tree root. The
        builder copies each one a tree has, and every vllm module it imports.
        A tree lacking all of them gets no row of numbers ("n/a").
    SHAPES: tuple[dict, ...]
        The shapes to measure; "name" labels the table row, the rest is the
        case's own.
    make_inputs(shape, device, generator) -> inputs
        One set of inputs on `device`, drawn with `generator`. The runner draws
        enough sets to span several L2 caches and rotates through them.
    bind(load) -> call
        The call under test for one tree: `load("vllm.a.b")` imports that
        tree's module (ModuleNotFoundError if the tree lacks it). `call(inputs)`
        must be capturable in a CUDA graph once warmed up (no host syncs).
    same_output(a, b) -> bool   (optional)
        Whether two trees' outputs on the same inputs agree; by default every
        tensor must be equal element for element.

A case without `bind` compares something other than the trees (e.g.
cases/aiter_rope_cache.py: aiter's fused kernel against the release's CUDA
kernels) and runs on its own (`python3 cases/<name>.py`); this runner skips
it. Such a case may name CSRC (release csrc/ files) and AITER (aiter modules)
for the package builder to copy (scripts/perf/gpubench.py).

Each call is captured 20 times (cycling through the input sets) into one CUDA
graph per tree, and the trees' graphs are replayed in turns; the table gives
microseconds per call (median, p10, p90 over the replays) and the replay-by-
replay ratio to the pristine tree.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from stats import BASELINE, Row, format_table, rows_for_shape  # noqa: E402


class Tree:
    """One vLLM tree of the package, importable while the others are not."""

    def __init__(self, label: str, root: Path):
        self.label, self.root = label, root
        self._modules: dict[str, ModuleType] = {}

    def load(self, name: str) -> ModuleType:
        with self._active():
            return importlib.import_module(name)

    def load_copy(self, name: str) -> ModuleType:
        """A copy of module `name` of its own (its imports are the tree's
        shared modules), so that a variant can change one copy."""
        with self._active():
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                raise ModuleNotFoundError(f"no module {name} in tree {self.label}", name=name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

    @contextmanager
    def _active(self) -> Iterator[None]:
        # Every tree is the package `vllm`: swap the modules of the others out.
        others = _pop_vllm_modules()
        sys.modules.update(self._modules)
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(str(self.root))
            self._modules = _pop_vllm_modules()
            sys.modules.update(others)


def _pop_vllm_modules() -> dict[str, ModuleType]:
    names = [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]
    return {name: sys.modules.pop(name) for name in names}


def load_case(name: str) -> ModuleType:
    path = HERE / "cases" / f"{name}.py"
    if not path.is_file():
        known = ", ".join(case_names()) or "none"
        raise SystemExit(f"no case {name!r} in {path.parent} (cases: {known})")
    spec = importlib.util.spec_from_file_location(f"gpubench_case_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_names() -> list[str]:
    return sorted(p.stem for p in (HERE / "cases").glob("*.py") if p.stem != "__init__")


def default_same_output(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(default_same_output, a, b))
    return a == b


def bind_trees(case: ModuleType, trees: list[Tree]) -> tuple[dict[str, Callable], dict]:
    calls, notes = {}, {}
    for tree in trees:
        try:
            calls[tree.label] = case.bind(tree.load)
        except ModuleNotFoundError as e:
            notes[tree.label] = f"not in this tree: {e.name}"
    return calls, notes


def run_case(case: ModuleType, trees: list[Tree], args: argparse.Namespace) -> list[Row]:
    import torch

    import timing

    device = torch.device("cuda")
    calls, notes = bind_trees(case, trees)
    same = getattr(case, "same_output", default_same_output)
    rows: list[Row] = []
    for shape in case.SHAPES:
        if args.shape and args.shape not in shape["name"]:
            continue
        progress(f"{shape['name']}: inputs")

        def draw(seed: int) -> Any:
            generator = torch.Generator(device=device).manual_seed(seed)
            return case.make_inputs(shape, device, generator)

        input_sets = [draw(0)]
        count = timing.input_set_count(timing.nbytes(input_sets[0]),
                                       timing.l2_cache_bytes())
        input_sets += [draw(seed) for seed in range(1, count)]

        progress(f"{shape['name']}: compile, check and capture ({len(input_sets)} input sets)")
        outputs = {label: call(input_sets[0]) for label, call in calls.items()}
        torch.cuda.synchronize()
        same_output = {label: bool(same(out, outputs[BASELINE]))
                       for label, out in outputs.items()
                       if label != BASELINE and BASELINE in outputs}
        graphs = {label: timing.capture(call, input_sets, args.calls)
                  for label, call in calls.items()}
        progress(f"{shape['name']}: replay")
        micros = timing.replay_micros(graphs, args.calls, args.repeats)
        times = {tree.label: micros.get(tree.label) for tree in trees}
        rows += rows_for_shape(shape["name"], times, same_output, notes)
        del graphs, outputs, input_sets
        torch.cuda.empty_cache()
    return rows


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def machine() -> str:
    import torch
    import triton

    name = torch.cuda.get_device_name()
    backend = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return f"{name}; torch {torch.__version__}, Triton {triton.__version__}, {backend}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", help="case to run (default: all)")
    parser.add_argument("--shape", default="", help="only shapes whose name contains this")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=50, help="replays per graph")
    parser.add_argument("--list", action="store_true", help="list cases and shapes")
    args = parser.parse_args(argv)

    manifest = json.loads((HERE / "trees.json").read_text())
    names = args.case or manifest["cases"]
    if args.list:
        for name in names:
            print(name)
            for shape in load_case(name).SHAPES:
                print(f"  {shape['name']}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("error: no GPU visible to torch here; run this on a GPU machine",
              file=sys.stderr)
        return 2
    trees = [Tree(t["label"], HERE / "trees" / t["label"]) for t in manifest["trees"]]
    print(machine())
    for tree in manifest["trees"]:
        print(f"  {tree['label']}: {tree['rev']} ({tree['commit'][:12]})")
    print(f"  {args.calls} calls per CUDA graph, {args.repeats} replays, "
          f"microseconds per call", flush=True)
    for name in names:
        case = load_case(name)
        if not hasattr(case, "bind"):  # it compares no trees: see its docstring
            print(f"\ncase {name}: runs on its own: python3 {HERE.name}/cases/{name}.py",
                  flush=True)
            continue
        rows = run_case(case, trees, args)
        print(format_table(f"\ncase {name}", rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
