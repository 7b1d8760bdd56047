"""vLLM's own tests of the drafter, as the release has them, pass on the stack.

Patch 1 moves the K3 DSpark drafter into a platform-neutral base. Tests
written against 0.34.0 (and vLLM main's, which keep doing so) reach helpers
through ``vllm.models.kimi_k3.nvidia.dspark_mla``: those names must stay
importable there. The release's test file runs here, unchanged, against the
patched tree (in a process of its own); only the tests a patch changes on
purpose may fail, each listed with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.support.pristine import PROJECT_ROOT, pristine_source

TREE = PROJECT_ROOT / "build" / "vllm"
TEST_FILE = "tests/models/test_dspark_mla.py"
CHANGED_BY_THE_STACK = {
    "test_k3_dspark_uses_replicated_markov_head": (
        "patch 1: it replaces the drafter's layer classes on the NVIDIA module; "
        "they live in the base now, and patch 1's version of the test replaces "
        "them there"
    ),
}


def test_release_tests_of_the_drafter_pass_on_the_stack(tmp_path: Path):
    test_file = tmp_path / TEST_FILE
    test_file.parent.mkdir(parents=True)
    test_file.write_text(pristine_source(TEST_FILE))
    report = tmp_path / "report.xml"
    # The tree first; what the test run put on the path (its read tracker)
    # stays, made absolute for the scratch folder.
    inherited = [str(Path(p).resolve()) for p in
                 os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TREE), *inherited])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", str(test_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        name = case.get("name", "").split("[")[0]
        outcomes.setdefault(name, set()).add(
            "failed" if failed else "skipped" if skipped else "passed")
    failed = {name for name, seen in outcomes.items() if "failed" in seen}
    assert failed == set(CHANGED_BY_THE_STACK), result.stdout[-3000:]
    passed = [name for name, seen in outcomes.items() if seen == {"passed"}]
    assert "test_context_kv_weights_are_loaded_as_merged_linear_shards" in passed
