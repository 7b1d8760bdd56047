"""No tree of the stack launches more kernels per draft step than the release.

Each patch lands upstream on its own, in series order, so every prefix of the
stack is a vLLM that users run. This file measures the tree on PYTHONPATH
(``kernel_budget.py`` says what counts) against vLLM 0.33.0 in every KV cache
and mode, for what each platform runs with it: NVIDIA the NVIDIA module, ROCm
what the registry gives ``K3DSparkModel`` there (the NVIDIA module until the
dispatch patch). ``make test`` runs it in each prefix row (that prefix's
worktree) and in the verification row (the whole stack); the table of every
prefix is ``python -m tests.verification.kernel_budget --prefixes``.
"""

from __future__ import annotations

import pytest

from tests.verification import kernel_budget as kb


@pytest.fixture(scope="module")
def budget(rocm) -> dict[str, dict]:
    with kb.pristine_zygote() as release:
        return kb.measure_all(rocm, release, kb.TREE_CONFIGS)


def test_no_platform_launches_more_than_with_the_release(budget):
    above = kb.above_the_release(budget)
    assert not above, (
        "this tree makes a draft step launch more kernels than vLLM 0.33.0:\n  "
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
