"""Tests of the helpers inside the stack's vLLM test files.

A helper that a vLLM test relies on must be able to fail, but its own tests
are ours, not something to send upstream. The helper is compiled from the
patched tree's test file (without importing vLLM, which the pytest process of
this suite never does) and checked on fixtures that it must flag.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.support.pristine import PROJECT_ROOT

TREE = PROJECT_ROOT / "build" / "vllm"


def _compile_helper(test_file: str, helper: str, constants: tuple[str, ...]):
    """Return `helper` from `test_file`, compiled with the module constants it
    reads and the stdlib modules the file imports."""
    module = ast.parse((TREE / test_file).read_text())
    keep = [
        node
        for node in module.body
        if (isinstance(node, ast.FunctionDef) and node.name == helper)
        or (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) in constants for t in node.targets)
        )
    ]
    assert len(keep) == len(constants) + 1, f"{helper} or a constant moved"
    namespace: dict = {"ast": ast, "Path": Path, "torch": torch}
    exec(compile(ast.Module(keep, type_ignores=[]), test_file, "exec"), namespace)
    return namespace[helper]


@pytest.fixture(scope="module")
def platform_imports():
    return _compile_helper(
        "tests/models/test_dspark_mla_common.py",
        "_platform_imports",
        ("_KIMI_K3", "_COMMON_PACKAGE"),
    )


@pytest.mark.parametrize(
    "source",
    [
        "from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention",
        "import vllm.models.kimi_k3.amd.mla",
        "from vllm.models.kimi_k3 import K3DSparkForCausalLM",
        "from vllm.models.kimi_k3 import amd",
        "from ..nvidia.model import KimiMLP",
        "from .. import nvidia",
        "import importlib\nimportlib.import_module('vllm.models.kimi_k3.amd')",
    ],
)
def test_platform_import_check_flags_platform_imports(platform_imports, source):
    assert platform_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "from vllm.models.kimi_k3.common.mla_rope import get_k3_mla_rope",
        "from .mla_rope import get_k3_mla_rope",
        "import torch",
    ],
)
def test_platform_import_check_passes_shared_imports(platform_imports, source):
    assert platform_imports(source) == []


@pytest.fixture(scope="module")
def chi_square():
    test_file = "tests/v1/spec_decode/test_rejection_sampler_nonfinite_draft.py"
    assert_follows = _compile_helper(test_file, "_assert_follows", ("TARGET_PROBS",))
    return assert_follows, assert_follows.__globals__["TARGET_PROBS"]


def test_chi_square_helper_rejects_a_wrong_distribution(chi_square):
    """The rejection-sampler tests' goodness-of-fit check has the power to
    tell the target rows apart at their sample size (90 draws)."""
    assert_follows, target_probs = chi_square
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(target_probs[1], 90, True, generator=generator)
    assert_follows(tokens, target_probs[1], "right distribution")
    with pytest.raises(AssertionError):
        assert_follows(tokens, target_probs[0], "wrong distribution")
    with pytest.raises(AssertionError):
        assert_follows(torch.zeros(90, dtype=torch.int64), target_probs[1], "zeros")
