"""The pytest plugin that runs vLLM's own tests under emulated ROCm
(``tests/rocm_emulation/plugin.py``, used by make test's "(ROCm)" rows).

Each case runs a probe test file in a pytest process of its own, the way the
rows do: with ``<project>/tests`` on ``PYTHONPATH`` and ``-p
rocm_emulation.plugin``, or without the plugin (the default-platform rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os

import torch


def test_probe():
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    drafter = ModelRegistry._try_load_model_cls("K3DSparkModel")
    seen = dict(
        platform=type(current_platform).__name__,
        is_rocm=current_platform.is_rocm(),
        arch=torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        if current_platform.is_rocm() else None,
        fp8=str(current_platform.fp8_dtype()) if current_platform.is_rocm() else None,
        gpu_available=torch.cuda.is_available(),
        drafter=drafter.__module__,
    )
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(seen, f)
"""


def _run_probe(tmp_path: Path, *, plugin: bool, arch: str | None = None):
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if k != "K3_ROCM_ARCH"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PROJECT_ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PROBE_OUT"] = str(out)
    if arch is not None:
        env["K3_ROCM_ARCH"] = arch
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if plugin:
        cmd += ["-p", "rocm_emulation.plugin"]
    proc = subprocess.run(
        [*cmd, "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    seen = json.loads(out.read_text()) if out.exists() else None
    return proc, seen


@pytest.mark.parametrize(
    ("arch", "fp8"),
    [(None, "torch.float8_e4m3fnuz"), ("gfx950", "torch.float8_e4m3fn")],
    ids=["default-gfx942", "gfx950"],
)
def test_plugin_makes_vllm_see_rocm(tmp_path, arch, fp8):
    proc, seen = _run_probe(tmp_path, plugin=True, arch=arch)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seen == dict(
        platform="RocmPlatform",
        is_rocm=True,
        arch=arch or "gfx942",
        fp8=fp8,
        gpu_available=False,  # tensors stay on the CPU
        drafter="vllm.models.kimi_k3.amd.dspark_mla",
    )


def test_without_the_plugin_vllm_sees_this_machine(tmp_path):
    """The default-platform rows: no emulation leaks into their processes."""
    proc, seen = _run_probe(tmp_path, plugin=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seen["is_rocm"] is False and seen["platform"] != "RocmPlatform"
    assert seen["drafter"] == "vllm.models.kimi_k3.nvidia.dspark_mla"


def test_unknown_arch_is_one_clear_line(tmp_path):
    proc, seen = _run_probe(tmp_path, plugin=True, arch="gfx90a")
    assert seen is None
    assert proc.returncode == 4  # pytest's usage error
    assert "K3_ROCM_ARCH='gfx90a' is not an emulated ROCm GPU" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
