"""CUDA-graph replay timing shared by the GPU benchmark cases.

Every call under test is captured N times into one CUDA graph, cycling through
several input sets so that the L2 cache does not hold a set from one call to
the next, and the graph is replayed between CUDA events. Launch overhead is
what graphs remove in serving too, so the time per call is the graph's time
divided by N.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

# Input sets together span at least this many L2 caches.
L2_SPANS = 3
MAX_INPUT_SETS = 64


def nbytes(value: Any) -> int:
    """Bytes held by the tensors in a (nested) input set."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def input_set_count(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate through: enough to span L2_SPANS caches,
    and at least two, so that no call finds the previous call's inputs."""
    if set_bytes <= 0:
        return 2
    wanted = math.ceil(L2_SPANS * l2_bytes / set_bytes)
    return max(2, min(MAX_INPUT_SETS, wanted))


def l2_cache_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0)) or 64 * 2**20


def capture(
    call: Callable[[Any], Any], input_sets: list[Any], calls: int, warmup: int = 2
) -> torch.cuda.CUDAGraph:
    """A graph of `calls` calls, input set i % len(input_sets) for call i.

    The warm-up runs compile every kernel (Triton's JIT cannot run during
    capture) and runs on a side stream, as torch asks before a capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for inputs in input_sets:
                call(inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    return graph


def replay_micros(
    graphs: Mapping[str, torch.cuda.CUDAGraph], calls: int, repeats: int
) -> dict[str, list[float]]:
    """Microseconds per call of each graph, one sample per replay.

    The graphs take turns within each repeat (the order rotating), so drift in
    clocks or load reaches every tree alike and ratios can be paired by repeat.
    """
    names = list(graphs)
    for graph in graphs.values():  # first replay uploads the graph
        graph.replay()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        events = {}
        for name in order:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            events[name] = (start, end)
        torch.cuda.synchronize()
        for name, (start, end) in events.items():
            samples[name].append(start.elapsed_time(end) * 1000.0 / calls)
    return samples
