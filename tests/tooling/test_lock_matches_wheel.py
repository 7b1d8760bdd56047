"""`make build` refuses a venv.lock that does not satisfy the pinned wheel's
requirements: .venv installs the patched tree with --no-deps, so a lock left
over from the previous release would quietly run the tests on its dependency
set (vLLM 0.34.0 pins flashinfer-python 0.7.3; 0.33.0's lock has 0.7.2.post1)."""

from __future__ import annotations

import shutil

from scripts.stack import lock
from scripts.stack.pin import render_pin
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
