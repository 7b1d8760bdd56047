"""pytest plugin: the whole pytest process runs under emulated ROCm.

Load it with ``-p rocm_emulation.plugin`` and ``<project>/tests`` on
``PYTHONPATH`` (``scripts/testing/testrun.py`` does both for the "(ROCm)" rows). Before
anything imports vLLM, it makes vLLM's real ``RocmPlatform`` the current
platform and gives the compiled ops the drafter touches CPU bodies, with the
verification harness's ``platform.activate``. ``K3_ROCM_ARCH`` picks the
emulated GPU: ``gfx942`` (MI300, the default) or ``gfx950`` (MI355).

The emulation cannot be undone within a process, so a run on the default
platform is a separate pytest invocation without this plugin.
"""

from __future__ import annotations

import os

import pytest

from verification.harness import platform

ARCH_ENV = "K3_ROCM_ARCH"
ARCHS = ("gfx942", "gfx950")


def emulated_mode() -> str:
    arch = os.environ.get(ARCH_ENV, "gfx942")
    if arch not in ARCHS:
        raise pytest.UsageError(
            f"{ARCH_ENV}={arch!r} is not an emulated ROCm GPU; use one of {ARCHS}"
        )
    return f"rocm-{arch}"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before conftest.py files load: vLLM's tests/conftest.py imports vLLM,
    # which resolves and caches the current platform.
    try:
        platform.activate(emulated_mode())
    except RuntimeError as exc:
        raise pytest.UsageError(f"rocm_emulation: {exc}") from None


def pytest_report_header(config):
    return f"platform: vLLM RocmPlatform emulated on CPU ({platform.active_mode()})"
