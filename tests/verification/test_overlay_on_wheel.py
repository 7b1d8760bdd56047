"""docker/Dockerfile.rocm-overlay's install step, run on the pinned wheel's real files.

A ROCm image of the pinned vLLM release holds the release's `vllm/` package in its
site-packages. These tests unpack the pinned wheel's `vllm/` into a scratch
site-packages folder and run the recipe's install RUN line exactly as written
(`sh -c`, with the recipe's STACK_DIR argument and a `python3` whose
site-packages is that folder). Then they check what the image build relies
on: the files equal the stack's (vllm_overlay/MANIFEST.json), the K3 DSpark
drafter resolves to the AMD class under emulated ROCm (what the recipe's
smoke step checks in the image), a second install writes nothing, and a
tampered or other-version vLLM is refused with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.common import Layout
from tests.verification.wheel_site import (
    pristine_site,
    replace_file,
    scratch_site,
    tree_state,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "docker" / "Dockerfile.rocm-overlay"
MANIFEST = json.loads((ROOT / "vllm_overlay" / "MANIFEST.json").read_text())
VLLM_ENTRIES = [e for e in MANIFEST["files"] if e["path"].startswith("vllm/")]
AMD_DRAFTER = "vllm.models.kimi_k3.amd.dspark_mla"
NVIDIA_DRAFTER = "vllm.models.kimi_k3.nvidia.dspark_mla"


def recipe_instructions(text: str, keyword: str) -> list[str]:
    """The recipe's instructions of one kind, continuation lines joined as Docker does."""
    joined = re.sub(r"\\\n", "", text)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.split(None, 1)[:1] == [keyword]]


def install_line() -> str:
    (line,) = [r for r in recipe_instructions(RECIPE.read_text(), "RUN")
               if "install-overlay" in r]
    return line


def smoke_line() -> str:
    (line,) = [r for r in recipe_instructions(RECIPE.read_text(), "RUN") if "rocm_smoke" in r]
    return line


def arg_default(name: str) -> str:
    (arg,) = [a for a in recipe_instructions(RECIPE.read_text(), "ARG")
              if a.startswith(f"{name}=")]
    return arg.split("=", 1)[1]


@pytest.fixture(scope="module")
def pristine() -> Path:
    return pristine_site(Layout.default())


@pytest.fixture
def site(pristine, tmp_path) -> Path:
    return scratch_site(pristine, tmp_path / "site-packages")


@pytest.fixture
def image_python(site, tmp_path) -> Path:
    """A `python3` for the RUN line: this venv's interpreter with `site` as its
    site-packages (first on sys.path, as the image's dist-packages is)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" '
                    f'exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def run_install(image_python: Path, workdir: Path | str = "/",
                line: str | None = None) -> subprocess.CompletedProcess:
    """The recipe's install RUN line, with the recipe's build arguments in the
    environment (STACK_DIR holding this project's vllm_overlay/ and scripts/,
    what the recipe's COPY lines put there), in the base image's WORKDIR."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "K3_PROJECT_ROOT")}
    env.update(PATH=f"{image_python}{os.pathsep}{env['PATH']}", STACK_DIR=str(ROOT),
               SMOKE_GCN_ARCH=arg_default("SMOKE_GCN_ARCH"))
    return subprocess.run(["/bin/sh", "-c", line or install_line()], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=300)


def drafter_dispatch(site: Path) -> dict:
    """Run the recipe's smoke check under emulated MI300 with `site` first on sys.path."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(site)!r}, {str(ROOT)!r}]
        from tests.verification.harness import platform
        platform.activate("rocm-gfx942")
        import vllm
        from scripts.image import rocm_smoke
        result = {{"vllm_file": vllm.__file__, "modules": rocm_smoke.resolved_drafter_modules()}}
        try:
            rocm_smoke.check_drafter_dispatch()
            result["smoke"] = "ok"
        except rocm_smoke.SmokeError as e:
            result["smoke"] = str(e)
        print("RESULT " + json.dumps(result))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_recipe_command_is_read_from_the_recipe():
    line = install_line()
    assert line.startswith('PYTHONPATH="${STACK_DIR}" python3 -m scripts install-overlay')
    assert arg_default("STACK_DIR") == "/opt/k3-dspark-stack"


def test_recipe_installs_the_stack_and_the_amd_drafter_resolves(site, image_python):
    result = run_install(image_python)
    assert result.returncode == 0, result.stderr
    assert f"installed {len(VLLM_ENTRIES)} file(s) into {site}" in result.stdout
    for entry in VLLM_ENTRIES:
        want = None if entry["patched_sha256"] == "deleted" else entry["patched_sha256"]
        assert sha256(site / entry["path"]) == want, entry["path"]
    # A site-packages folder gets only the package: no tests/ or CI files.
    assert sorted(p.name for p in site.iterdir()) == ["vllm"]
    dispatch = drafter_dispatch(site)
    assert dispatch["vllm_file"] == str(site / "vllm" / "__init__.py")
    assert set(dispatch["modules"].values()) == {AMD_DRAFTER}
    assert dispatch["smoke"] == "ok"


def test_a_vllm_folder_in_the_working_directory_does_not_shadow_the_image_one(
        site, image_python, tmp_path):
    """Some base images keep a vLLM source checkout in their WORKDIR."""
    workdir = tmp_path / "app"
    (workdir / "vllm").mkdir(parents=True)
    (workdir / "vllm" / "__init__.py").write_text("# a source checkout, not installed\n")
    result = run_install(image_python, workdir)
    assert result.returncode == 0, result.stderr
    assert f"installed {len(VLLM_ENTRIES)} file(s) into {site}" in result.stdout
    assert sorted(p.name for p in (workdir / "vllm").iterdir()) == ["__init__.py"]


def test_the_smoke_step_refuses_a_base_image_without_rocm_torch(site, image_python):
    """The recipe's smoke RUN line, as written, on this CUDA build of torch:
    the check needs the image's ROCm torch and says so in one line."""
    assert run_install(image_python).returncode == 0
    result = run_install(image_python, line=smoke_line())
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "rocm smoke check: FAILED: torch ") and "is not a ROCm build" in result.stderr


def test_smoke_check_fails_on_the_release_without_the_overlay(site):
    dispatch = drafter_dispatch(site)
    assert dispatch["vllm_file"] == str(site / "vllm" / "__init__.py")
    # The release's registry names the NVIDIA module directly, on every platform.
    assert NVIDIA_DRAFTER in dispatch["smoke"] and "not " + AMD_DRAFTER in dispatch["smoke"]


def test_second_install_writes_nothing(site, image_python):
    assert run_install(image_python).returncode == 0
    before = tree_state(site)
    result = run_install(image_python)
    assert result.returncode == 0, result.stderr
    assert f"already installed ({len(VLLM_ENTRIES)} file(s) in place" in result.stdout
    assert tree_state(site) == before


def test_tampered_vllm_is_refused_with_nothing_written(site, image_python):
    victim = next(e["path"] for e in VLLM_ENTRIES if e["pristine_sha256"] != "added")
    replace_file(site / victim, (site / victim).read_bytes() + b"\n# local change\n")
    before = tree_state(site)
    result = run_install(image_python)
    assert result.returncode != 0
    assert "nothing was written" in result.stderr and victim in result.stderr
    assert "Traceback" not in result.stderr
    assert tree_state(site) == before


OTHER_VERSION = "0.99.0"  # any release but the overlay's


def test_other_vllm_version_is_refused_with_nothing_written(site, image_python):
    version_file = site / "vllm" / "_version.py"
    replace_file(version_file, version_file.read_text().replace(
        MANIFEST["vllm_version"], OTHER_VERSION).encode())
    before = tree_state(site)
    result = run_install(image_python)
    assert result.returncode != 0
    assert (f"holds vLLM {OTHER_VERSION}, the overlay is for vLLM {MANIFEST['vllm_version']}; "
            "nothing was written") in result.stderr
    assert tree_state(site) == before
