"""`make rocm-image` / `make rocm-source-image`: engine detection, exact commands, build context.

No container engine runs here, so `docker` and `podman` are small recording
stand-ins on PATH: they answer `info` as a daemon-less client does (or as a
working engine does) and record each `build` they are asked for. What the
builds contain is tested elsewhere: the overlay recipe's install step on the
pinned wheel (tests/verification/test_overlay_on_wheel.py), hadolint in the
lint suite; here the source recipe's build context is checked with the real
setuptools-scm call of Dockerfile.rocm's vllm-version stage.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from tests.tooling.conftest import FOO_PATCHED, PYTHON, REPO, V1

NO_DAEMON = ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
             "Is the docker daemon running?")
FAKE_ENGINE = f"""#!{PYTHON}
import json, os, sys
name = os.path.basename(sys.argv[0])
if name == "podman":
    sys.exit("Error: podman: no container runtime found")
if sys.argv[1:2] == ["info"]:
    if os.environ["FAKE_ENGINE"] == "no-daemon":
        print("Client:\\n Version: 28.2.2\\n\\nServer:")
        sys.exit({NO_DAEMON!r})
    sys.exit(0)
with open(os.environ["FAKE_ENGINE_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(),
                          "buildkit": os.environ.get("DOCKER_BUILDKIT")}}) + "\\n")
sys.exit(int(os.environ.get("FAKE_BUILD_EXIT", "0")))
"""
# Dockerfile.rocm's vllm-version stage, verbatim.
VLLM_VERSION_STAGE = ["git", "describe", "--dirty", "--tags", "--long", "--abbrev=40",
                      "--match", "v[0-9]*"]


@pytest.fixture
def engine(project, tmp_path):
    """Recording docker/podman stand-ins; returns a function reading the builds."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        (bin_dir / name).write_text(FAKE_ENGINE)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "builds.jsonl"
    env = project.env()
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_ENGINE="ok", FAKE_ENGINE_LOG=str(log))
    project.env = lambda: env
    (project.root / "docker").mkdir()
    shutil.copy(REPO / "docker" / "Dockerfile.rocm-overlay", project.root / "docker")

    def builds():
        return [json.loads(line) for line in log.read_text().splitlines()] \
            if log.exists() else []
    builds.env = env
    return builds


def make(project, *args):
    return project.make(*args, timeout=120)


def test_without_a_daemon_one_line_names_the_command_to_run_elsewhere(project, engine):
    engine.env["FAKE_ENGINE"] = "no-daemon"
    result = make(project, "rocm-image", "BASE_IMAGE=registry.example/rocm vllm:1")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("make: ***"), result.stderr
    assert lines[0].startswith("error: no working container engine here (docker: "
                               + NO_DAEMON + "; podman: Error: podman: no container runtime")
    assert lines[0].endswith(
        "run: docker build -f docker/Dockerfile.rocm-overlay --build-arg "
        "'BASE_IMAGE=registry.example/rocm vllm:1' -t vllm-k3-dspark-rocm:v0.1.0-overlay .")
    assert engine() == []


def test_overlay_build_gets_base_image_as_one_argument(project, engine, tmp_path):
    hostile = f"rocm/vllm:v0; touch {tmp_path}/pwned #"
    result = make(project, "rocm-image", f"BASE_IMAGE={hostile}", "IMAGE_TAG=k3:ci")
    assert result.returncode == 0, result.stderr
    assert engine() == [{
        "argv": ["build", "-f", "docker/Dockerfile.rocm-overlay",
                 "--build-arg", f"BASE_IMAGE={hostile}", "-t", "k3:ci", "."],
        "cwd": str(project.root), "buildkit": None}]
    assert not (tmp_path / "pwned").exists()
    assert "rocm-image: built k3:ci from rocm/vllm:v0;" in result.stdout


def test_default_base_is_the_pinned_release_image(project, engine):
    project.ok("rocm-image")
    (build,) = engine()
    assert f"BASE_IMAGE=vllm/vllm-openai-rocm:v{V1}" in build["argv"]


def test_a_failed_build_ends_with_one_line(project, engine):
    engine.env["FAKE_BUILD_EXIT"] = "3"
    result = project.run("rocm-image")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: `docker build` failed (3) for "
                                     f"vllm-k3-dspark-rocm:v{V1}-overlay; its output is above")


def test_source_recipe_builds_the_patched_tree_at_the_release_version(stacked, engine):
    setuptools_scm = pytest.importorskip("setuptools_scm")
    result = make(stacked, "rocm-source-image", "BASE_IMAGE=rocm/vllm-dev:base")
    assert result.returncode == 0, result.stderr
    context = stacked.root / "build" / "rocm-source-context"
    tag = f"vllm-k3-dspark-rocm:v{V1}-source"
    assert engine() == [
        {"argv": ["build", "-f", "docker/Dockerfile.rocm",
                  "--build-arg", "BASE_IMAGE=rocm/vllm-dev:base",
                  "--build-arg", "REMOTE_VLLM=0", "--target", "final", "-t", tag, "."],
         "cwd": str(context), "buildkit": "1"},
        # The overlay recipe on the result: every file must already be the stack's.
        {"argv": ["build", "-f", "docker/Dockerfile.rocm-overlay",
                  "--build-arg", f"BASE_IMAGE={tag}", "-t", f"{tag}-overlay-check", "."],
         "cwd": str(stacked.root), "buildkit": None},
    ]
    # The context is the committed stack ...
    assert stacked.git("rev-parse", "HEAD", cwd=context) == stacked.head()
    assert (context / "vllm/models/foo.py").read_text() == FOO_PATCHED
    # ... and Dockerfile.rocm's vllm-version stage reads the release's version there.
    with warnings.catch_warnings():  # the stage uses the deprecated keyword
        warnings.simplefilter("ignore", DeprecationWarning)
        version = setuptools_scm.get_version(root=str(context),
                                             git_describe_command=VLLM_VERSION_STAGE)
    assert version == V1


def test_source_recipe_can_build_vllms_test_stage(stacked, engine):
    result = make(stacked, "rocm-source-image", "DOCKER_TARGET=test")
    assert result.returncode == 0, result.stderr
    source, check = engine()
    assert source["argv"][source["argv"].index("--target") + 1] == "test"


def test_source_recipe_refuses_uncommitted_changes(stacked, engine):
    (stacked.tree / "vllm/models/foo.py").write_text("# local edit\n")
    result = stacked.run("rocm-image", "--source")
    assert result.returncode == 1
    assert "build/vllm has uncommitted changes (vllm/models/foo.py)" in result.stderr
    assert engine() == []


def test_source_recipe_without_a_daemon_names_the_make_command(stacked, engine):
    engine.env["FAKE_ENGINE"] = "no-daemon"
    result = stacked.run("rocm-image", "--source")
    assert result.returncode == 1
    assert result.stderr.strip().endswith(
        "run: make apply && make rocm-source-image BASE_IMAGE=rocm/vllm-dev:base "
        f"IMAGE_TAG=vllm-k3-dspark-rocm:v{V1}-source")
