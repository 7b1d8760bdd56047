"""`make build` refuses a venv.lock that does not satisfy the pinned wheel's
requirements: .venv installs the patched tree with --no-deps, so a lock left
over from the previous release would quietly run the tests on its dependency
set (vLLM 0.34.0 pins flashinfer-python 0.7.3; 0.33.0's lock has 0.7.2.post1)."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.common import Layout, StackError
from scripts.stack import lock
from scripts.stack.pin import Pin, Substitute, load_pin, render_pin
from tests.tooling.conftest import V1, make_sdist, make_wheel, pin_for, release_files

REQUIRES = [
    "torch==2.14.0",
    "flashinfer-python==0.7.3",
    "fastapi[standard]<0.137.0,>=0.133.0",
    "protobuf==7.36.1; platform_machine == \"s390x\"",  # not the lock's platform
    "six>=1.16.0; python_version > \"3.11\"",  # nor this: the lock is for 3.11
    "pytest; extra == \"test\"",  # an extra nobody asked for
]
LOCK = """\
FastAPI==0.136.0 \\
    --hash=sha256:00
flashinfer_python==0.7.3 \\
    --hash=sha256:00
torch==2.14.0 \\
    --hash=sha256:00
"""


def test_a_lock_that_satisfies_every_requirement_of_the_platform_passes():
    assert lock.lock_mismatches(REQUIRES, LOCK) == []


def test_each_unsatisfied_or_missing_requirement_is_named():
    old = LOCK.replace("flashinfer_python==0.7.3", "flashinfer-python==0.7.2.post1")
    old = old.replace("torch==2.14.0 \\\n    --hash=sha256:00\n", "")
    assert lock.lock_mismatches(REQUIRES, old) == [
        "torch==2.14.0 (the lock has none)",
        "flashinfer-python==0.7.3 (the lock has 0.7.2.post1)",
    ]


def test_build_refuses_the_lock_of_another_release_before_creating_a_venv(project):
    sdist = make_sdist(project.releases / V1, V1, release_files(V1))
    wheel = make_wheel(project.releases / V1, V1, REQUIRES)
    (project.root / "pin.toml").write_text(render_pin(pin_for(V1, sdist, wheel)))
    project.downloads.mkdir(parents=True, exist_ok=True)
    for path in (sdist, wheel):
        shutil.copyfile(path, project.downloads / path.name)
    (project.root / "requirements").mkdir()
    (project.root / "requirements" / "venv.lock").write_text(
        LOCK.replace("flashinfer_python==0.7.3", "flashinfer-python==0.7.2.post1"))
    project.ok("apply")
    result = project.run("build")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert (f"requirements/venv.lock does not satisfy {wheel.name}'s requirements (1):\n"
            "  flashinfer-python==0.7.3 (the lock has 0.7.2.post1)\n"
            "next step: `make lock`") in result.stderr
    assert not (project.root / ".venv").exists()


# vLLM 0.34.0's case: its wheel pins flashinfer-python==0.7.3, which the package
# index does not serve. pin.toml names what the lock takes instead.
SUBSTITUTE = Substitute("flashinfer-python==0.7.3", "flashinfer-python==0.7.4",
                        "the index has no 0.7.3")


def _pin_with_substitute(tmp_path: Path, requires: list[str]) -> tuple[Pin, Path]:
    wheel = make_wheel(tmp_path, V1, requires)
    pin = replace(pin_for(V1, wheel, wheel), substitutes=(SUBSTITUTE,))
    return pin, wheel


def test_the_lock_is_held_to_the_substitute_not_to_the_requirement_it_replaces(tmp_path):
    pin, wheel = _pin_with_substitute(tmp_path, REQUIRES)
    requirements = lock.pinned_requirements(pin, wheel)
    substituted = LOCK.replace("flashinfer_python==0.7.3", "flashinfer-python==0.7.4")
    assert lock.lock_mismatches(requirements, substituted) == []
    assert lock.lock_mismatches(requirements, LOCK) == [
        "flashinfer-python==0.7.4 (the lock has 0.7.3)"]


def test_a_substitute_for_a_requirement_the_wheel_no_longer_has_is_refused(tmp_path):
    pin, wheel = _pin_with_substitute(
        tmp_path, [r.replace("0.7.3", "0.7.5") for r in REQUIRES])
    with pytest.raises(StackError) as err:
        lock.pinned_requirements(pin, wheel)
    assert str(err.value).startswith(
        f"pin.toml: lock.substitute names 'flashinfer-python==0.7.3', which {wheel.name} "
        "does not require: remove the entry")


def test_make_lock_resolves_the_substitute_and_says_so_in_the_lock(tmp_path, monkeypatch):
    pin, wheel = _pin_with_substitute(tmp_path, REQUIRES)
    layout = Layout(tmp_path / "project")
    (layout.root / "requirements").mkdir(parents=True)
    layout.pin_file.write_text(render_pin(pin))
    lock.VENV.source(layout).write_text("pytest\n")
    resolved: list[str] = []

    def pip(argv, **_kwargs):  # what pip was asked to resolve, and a report of it
        files = [Path(argv[i + 1]) for i, arg in enumerate(argv) if arg == "-r"]
        resolved.extend(line for f in files for line in f.read_text().splitlines())
        report = {"install": [
            {"metadata": {"name": "flashinfer-python", "version": "0.7.4"},
             "download_info": {"archive_info": {"hashes": {"sha256": "ab" * 32}}}}]}
        Path(argv[argv.index("--report") + 1]).write_text(json.dumps(report))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(lock, "run", pip)
    monkeypatch.setattr(lock, "ensure_artifact", lambda *_args: wheel)
    lock._generate(layout, lock.VENV)
    assert resolved == ["pytest", "torch==2.14.0", "flashinfer-python==0.7.4",
                        "fastapi[standard]<0.137.0,>=0.133.0"]
    written = lock.VENV.lock(layout).read_text()
    assert ("# flashinfer-python==0.7.4 in place of the wheel's flashinfer-python==0.7.3 "
            "(pin.toml)") in written
    assert "flashinfer-python==0.7.4 \\\n    --hash=sha256:" + "ab" * 32 in written


def test_pin_toml_keeps_its_substitutes_and_refuses_one_for_another_package(tmp_path):
    pin, _wheel = _pin_with_substitute(tmp_path, REQUIRES)
    path = tmp_path / "pin.toml"
    path.write_text(render_pin(pin))
    assert load_pin(path) == pin
    path.write_text(render_pin(replace(pin, substitutes=(
        replace(SUBSTITUTE, use="flashinfer-cubin==0.7.4"),))))
    with pytest.raises(StackError) as err:
        load_pin(path)
    assert "lock.substitute[0] replaces 'flashinfer-python==0.7.3' with " \
        "'flashinfer-cubin==0.7.4', another package" in str(err.value)


def test_a_requirement_the_index_cannot_serve_is_one_line_naming_the_substitute(project, index):
    """vLLM 0.34.0's wheel pins a flashinfer-python the index lacks. Before: pip's
    hundred lines of output, and no word of pin.toml's [[lock.substitute]]."""
    wheel = make_wheel(project.releases / "needs", V1, ["flashinfer-python==0.7.3"])
    pin = pin_for(V1, make_sdist(project.releases / "needs", V1, release_files(V1)), wheel)
    (project.root / "pin.toml").write_text(render_pin(pin))
    shutil.copyfile(wheel, project.downloads / wheel.name)
    (project.root / "requirements").mkdir()
    for name in ("venv", "lint"):
        (project.root / "requirements" / f"{name}.in").write_text("")
    project.index_url = index.url  # serves vllm only: pip finds no flashinfer-python
    result = project.run("lock", timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        "error: the package index cannot serve flashinfer-python==0.7.3 (it serves: none)")
    assert (f"which {wheel.name} requires: add a [[lock.substitute]] entry to pin.toml with "
            'requirement = "flashinfer-python==0.7.3", use = ') in result.stderr
    log = project.root / "build" / "lock-venv-pip.log"
    assert f"pip's output is in {log.relative_to(project.root)}" in result.stderr
    assert "No matching distribution found for flashinfer-python==0.7.3" in log.read_text()
    assert not (project.root / "requirements" / "venv.lock").exists()
