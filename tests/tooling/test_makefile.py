"""The Makefile front door passes through to `python3 -m scripts` and guards its arguments."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.tooling.conftest import PYTHON, REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def make(project, *args):
    return subprocess.run(["make", "-s", "-C", str(REPO), f"PYTHON={PYTHON}", *args],
                          env=project.env(), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("target, usage", [
    ("rebase", "usage: make rebase VLLM_VERSION=x.y.z"),
    ("install-overlay", "usage: make install-overlay TARGET=<folder containing vllm/>"),
], ids=["rebase", "install-overlay"])
def test_make_targets_with_a_required_variable_print_usage(project, target, usage):
    result = make(project, target)
    assert result.returncode != 0
    assert usage in result.stdout + result.stderr
    assert not (project.root / "build").exists()


def test_make_apply_and_check_drive_the_temporary_project(project):
    result = make(project, "apply", "check")
    assert result.returncode == 0, result.stderr
    assert "check OK: 0 patch(es)" in result.stdout
    assert project.tree.is_dir()
    # The real project's build/ is not where the work happened.
    assert str(project.tree) in result.stdout
