"""Patch 8's rejection-sampler tests, with the kernels in Triton's interpreter.

vLLM's test file (tests/v1/spec_decode/test_rejection_sampler_nonfinite_draft.py
in the patched tree) runs ``rejection_sample`` compiled on a GPU and skips
without one. Its test functions take the sampler as an argument
``(rejection_sample, method, ...)``; here they run unchanged, each with a
sampler that splits the batch over the interpreter workers
(harness/interpreter.py).

The file's inputs are ``rejection_sample``'s keyword arguments, with the draft
logits as a tensor, ``draft_logits`` (and, for a batch-sharded cache, its
``draft_logits_row_mapping``); the sampler hands them to ``rejection_sample``
in a ``DraftLogitsCache``, which it takes since vLLM 0.34.0.

The file is compiled without its ``vllm`` imports (it needs them only for its
GPU skip mark, which is dropped too), so that this process never imports vLLM;
the workers import it, from the tree on PYTHONPATH. Asserts are rewritten as
pytest rewrites them in vLLM's tree.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import itertools
from types import ModuleType

import pytest
import torch
from _pytest.assertion.rewrite import rewrite_asserts

from tests.support.pristine import PROJECT_ROOT
from tests.verification.harness.interpreter import (
    NUM_WORKERS,
    InterpreterPool,
    stand_in_libdevice_log1p,
)

VLLM_TEST_FILE = (
    PROJECT_ROOT / "build/vllm/tests/v1/spec_decode/test_rejection_sampler_nonfinite_draft.py"
)


def _is_vllm_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "vllm"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "vllm" for alias in node.names)
    return False


def _is_pytestmark(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assign) and any(
        getattr(target, "id", None) == "pytestmark" for target in node.targets
    )


class _WithoutVllmLoader(importlib.abc.Loader):
    """Executes a test file without its vLLM imports and module marks; fails
    on any other use of a name those imports bound."""

    def exec_module(self, module: ModuleType) -> None:
        path = module.__spec__.origin
        source = open(path, "rb").read()
        tree = ast.parse(source, path)
        dropped = [node for node in tree.body if _is_vllm_import(node)]
        tree.body = [
            node
            for node in tree.body
            if not _is_vllm_import(node) and not _is_pytestmark(node)
        ]
        vllm_names = {
            (alias.asname or alias.name).split(".")[0]
            for node in dropped
            for alias in node.names
        }
        used = vllm_names & {
            node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
        }
        if used:
            raise ImportError(
                f"{path} uses {sorted(used)} from vLLM beyond its skip mark: this "
                "process never imports vLLM; run those parts in the workers"
            )
        rewrite_asserts(tree, source, path)
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)


def _load_vllm_test(path) -> ModuleType:
    name = f"k3_vllm_test_{path.stem}"
    spec = importlib.util.spec_from_file_location(
        name, path, loader=_WithoutVllmLoader()
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VLLM_TESTS = _load_vllm_test(VLLM_TEST_FILE)


def _vllm_test_params() -> list:
    """(test name, its parameters) for each test function and each combination
    of its parametrize marks (one of them over ``method``)."""
    params = []
    for name, function in vars(VLLM_TESTS).items():
        if not name.startswith("test_"):
            continue
        # Marks apply bottom-up: the innermost decorator's comes first.
        marks = [m for m in function.pytestmark if m.name == "parametrize"]
        axes = []
        for mark in marks:
            argname, values = mark.args
            assert isinstance(argname, str) and "," not in argname, (
                f"{name}: one argument per parametrize mark, not {argname!r}"
            )
            axes.append([(argname, value) for value in values])
        assert "method" in {axis[0][0] for axis in axes}, f"{name} has no method mark"
        for combination in itertools.product(*axes):
            kwargs = dict(combination)
            test_id = "-".join(str(value) for _, value in combination)
            params.append(pytest.param(name, kwargs, id=f"{name}[{test_id}]"))
    return params


# rejection_sample's arguments with one entry per logit and per request; the
# others are indexed by request slot (idx_mapping; the draft logits through
# their row mapping) or are scalars.
PER_LOGIT = (
    "target_logits",
    "draft_sampled",
    "pos",
    "expanded_idx_mapping",
    "expanded_local_pos",
    "contexts",
    "watermarking_skip_mask",
)
PER_REQUEST = ("idx_mapping",)


def _split_requests(inputs: dict, num_batches: int) -> list[dict]:
    """The batch as (at most) `num_batches` batches of consecutive requests;
    requests are verified independently, so their outputs concatenate to the
    batch's."""
    cu_num_logits = inputs["cu_num_logits"]
    num_reqs = len(cu_num_logits) - 1
    bounds = torch.linspace(0, num_reqs, num_batches + 1).long().tolist()
    batches = []
    for first, end in zip(bounds[:-1], bounds[1:], strict=True):
        if first == end:
            continue
        lo, hi = cu_num_logits[first].item(), cu_num_logits[end].item()
        batch = dict(inputs, cu_num_logits=cu_num_logits[first : end + 1] - lo)
        for name in PER_LOGIT:
            if inputs.get(name) is not None:
                batch[name] = inputs[name][lo:hi]
        for name in PER_REQUEST:
            batch[name] = inputs[name][first:end]
        batches.append(batch)
    return batches


def _rejection_sample(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """In a worker: vLLM's rejection_sample, in the interpreter, the draft
    logits (and their row mapping) handed over in a DraftLogitsCache."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    inputs = dict(inputs)
    draft_logits = inputs.pop("draft_logits")
    row_mapping = inputs.pop("draft_logits_row_mapping", None)
    cache = None
    if draft_logits is not None:
        cache = DraftLogitsCache(
            1, 1, 1, dtype=draft_logits.dtype, fill=0.0, device=draft_logits.device
        )
        cache.values = draft_logits
        cache.row_mapping = row_mapping
    return rejection_sampler_utils.rejection_sample(draft_logits_cache=cache, **inputs)


@pytest.fixture(scope="module")
def rejection_sample():
    with InterpreterPool(stand_in_libdevice_log1p) as pool:

        def run(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
            batches = _split_requests(inputs, NUM_WORKERS)
            sampled, num_sampled = zip(*pool.map(_rejection_sample, batches), strict=True)
            return torch.cat(sampled), torch.cat(num_sampled)

        yield run


@pytest.mark.parametrize(("test", "params"), _vllm_test_params())
def test_vllm_test_in_interpreter(rejection_sample, test: str, params: dict):
    getattr(VLLM_TESTS, test)(rejection_sample, **params)
