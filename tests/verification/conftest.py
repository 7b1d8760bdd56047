"""Fixtures for the verification harness.

The pytest process never imports vLLM: everything that touches it runs in a
fork of an emulated-platform zygote (``harness/zygote.py``), one per platform
mode, started lazily and shared by the session.
"""

from __future__ import annotations

import pytest

from tests.verification.harness.zygote import Zygote

_ZYGOTES: dict[str, Zygote] = {}


def zygote(mode: str) -> Zygote:
    if mode not in _ZYGOTES:
        _ZYGOTES[mode] = Zygote(mode)
    return _ZYGOTES[mode]


@pytest.fixture(scope="session")
def rocm() -> Zygote:
    """Emulated MI300 (gfx942, fp8 e4m3fnuz)."""
    return zygote("rocm-gfx942")


@pytest.fixture(scope="session")
def rocm950() -> Zygote:
    """Emulated MI355 (gfx950, fp8 e4m3fn)."""
    return zygote("rocm-gfx950")


def pytest_sessionfinish(session, exitstatus):
    for z in _ZYGOTES.values():
        z.close()


def pytest_terminal_summary(terminalreporter):
    lines = []
    for report in (
        terminalreporter.getreports("")
        + terminalreporter.getreports("passed")
        + terminalreporter.getreports("failed")
    ):
        for key, value in getattr(report, "user_properties", []):
            if key.startswith("measure:"):
                lines.append(f"{report.nodeid}: {key[8:]} = {value}")
    if lines:
        terminalreporter.section("K3 DSpark verification measurements")
        for line in sorted(set(lines)):
            terminalreporter.write_line(line)


# Drafter modules to run every end-to-end check on.
DRAFTERS = ["nvidia", "amd"]
