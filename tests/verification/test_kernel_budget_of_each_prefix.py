"""No tree of the stack launches more kernels per draft step than the release.

Each patch lands upstream on its own, in series order, so every prefix of the
stack is a vLLM that users run. This file measures the tree on PYTHONPATH
(``kernel_budget.py`` says what counts) against vLLM 0.34.0 in every KV cache
and mode (the release's counts as ``test_kernel_budget.py`` pins and checks
them), for what each platform runs with it: NVIDIA the NVIDIA module, ROCm
what the registry gives ``K3DSparkModel`` there (the NVIDIA module until the
dispatch patch). ``make test`` runs it in each prefix row (that prefix's
worktree) and in the verification row (the whole stack); the table of every
prefix is ``python -m tests.verification.kernel_budget --prefixes``.
"""

from __future__ import annotations

import pytest

from tests.verification import kernel_budget as kb
from tests.verification.test_kernel_budget import PINS


@pytest.fixture(scope="module")
def budget(rocm) -> dict[str, dict]:
    """The tree's measurements, and the release's as pinned: test_kernel_budget.py
    measures the release in every run (verification row) and fails unless it
    equals the pins, so measuring it again here, once per prefix, would only
    repeat that (about 30 s of CPU a prefix)."""
    release = {
        c.baseline.id: {
            "counts": {
                phase: kb.parse_pin(ops) for phase, ops in PINS[c.baseline.id].items()
            }
        }
        for c in kb.TREE_CONFIGS
    }
    return {**kb.measure_configs(rocm, kb.TREE_CONFIGS), **release}


def test_no_platform_launches_more_than_with_the_release(budget):
    above = kb.above_the_release(budget)
    assert not above, (
        "this tree makes a draft step launch more kernels than vLLM 0.34.0:\n  "
        + "\n  ".join(above)
    )


def test_a_tree_above_the_release_is_caught(budget):
    """The comparison sees one more launch in one configuration."""
    config = kb.TREE_CONFIGS[0]
    worse = {**budget, config.id: {"counts": dict(budget[config.id]["counts"])}}
    release_layer = budget[config.baseline.id]["counts"]["layer"]
    worse[config.id]["counts"]["layer"] = {
        **release_layer,
        "aten::clone": release_layer.get("aten::clone", 0) + 1,
    }
    assert {line.split(":")[0] for line in kb.above_the_release(worse)} == {config.id}
