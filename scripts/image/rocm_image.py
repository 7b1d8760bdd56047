"""`make rocm-image` / `make rocm-source-image`: ROCm images of vLLM with the stack.

Two recipes, both on a base image given as a build argument:

- overlay (docker/Dockerfile.rocm-overlay): a vLLM ROCm release image plus
  vllm_overlay/, installed with the manifest check, then a smoke check that
  the K3 DSpark drafter resolves to the AMD module. Seconds to build; for CI.
- source: vLLM's own docker/Dockerfile.rocm, built from the patched tree
  (build/vllm) the way vLLM's ROCm CI builds it from a checkout (the local
  source stages, REMOTE_VLLM=0). The build context is a clone of build/vllm's
  `stack` branch whose HEAD carries the tag `v<version>`, so setuptools-scm
  in Dockerfile.rocm's vllm-version stage reads the release's version, as it
  reads a release tag upstream. The overlay recipe then runs on top of the
  result: install-overlay finds every file already as the stack made it, and
  the smoke check runs.

The container engine is docker or podman, whichever answers `info` (a client
without a daemon does not count). Without one, the command stops with one line
that names the exact command to run on a machine that has one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, rel, say
from scripts.stack.gitrepo import BRANCH, dirty_files, is_stack_repo
from scripts.stack.pin import load_pin

OVERLAY_RECIPE = "docker/Dockerfile.rocm-overlay"
SOURCE_RECIPE = "docker/Dockerfile.rocm"  # in the patched tree
ENGINES = ("docker", "podman")
# The vLLM release's ROCm image (vLLM's docs: vllm/vllm-openai-rocm:<tag>), and
# the base Dockerfile.rocm itself defaults to.
DEFAULT_OVERLAY_BASE = "vllm/vllm-openai-rocm:v{version}"
DEFAULT_SOURCE_BASE = "rocm/vllm-dev:base"
DEFAULT_TAG = "vllm-k3-dspark-rocm:v{version}-{recipe}"


@dataclass(frozen=True)
class Build:
    """One `<engine> build`, as argv without the engine, run in `cwd`."""

    args: list[str]
    cwd: Path
    env: dict[str, str]

    def shell(self, engine: str, layout: Layout) -> str:
        """The command as a user types it from the project root."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cd = "" if self.cwd == layout.root else f"cd {shlex.quote(rel(self.cwd, layout))} && "
        return cd + (prefix + " " if prefix else "") + shlex.join([engine, *self.args])


def settings(layout: Layout, recipe: str) -> tuple[str, str]:
    """BASE_IMAGE and IMAGE_TAG from the environment (make passes its variables so)."""
    version = load_pin(layout.pin_file).version
    default_base = DEFAULT_SOURCE_BASE if recipe == "source" else DEFAULT_OVERLAY_BASE
    base = os.environ.get("BASE_IMAGE") or default_base.format(version=version)
    tag = os.environ.get("IMAGE_TAG") or DEFAULT_TAG.format(version=version, recipe=recipe)
    return base, tag


def overlay_build(layout: Layout, base: str, tag: str) -> Build:
    args = ["build", "-f", OVERLAY_RECIPE, "--build-arg", f"BASE_IMAGE={base}"]
    if arch := os.environ.get("SMOKE_GCN_ARCH"):
        args += ["--build-arg", f"SMOKE_GCN_ARCH={arch}"]
    return Build([*args, "-t", tag, "."], layout.root, {})


def source_builds(layout: Layout, context: Path, base: str, tag: str) -> list[Build]:
    # `final` is the release image; `test` is what vLLM's ROCm CI tests in (it
    # also needs CI_BASE_IMAGE), with pytest and vLLM's test requirements.
    target = os.environ.get("DOCKER_TARGET") or "final"
    # Dockerfile.rocm uses RUN --mount: BuildKit (docker) or buildah (podman).
    source = Build(["build", "-f", SOURCE_RECIPE, "--build-arg", f"BASE_IMAGE={base}",
                    "--build-arg", "REMOTE_VLLM=0", "--target", target, "-t", tag, "."],
                   context, {"DOCKER_BUILDKIT": "1"})
    return [source, overlay_build(layout, tag, f"{tag}-overlay-check")]


def find_engine() -> tuple[str | None, list[str]]:
    """The first engine whose `info` succeeds, and why the others did not."""
    problems = []
    for engine in ENGINES:
        if shutil.which(engine) is None:
            problems.append(f"{engine}: not installed")
            continue
        try:
            proc = subprocess.run([engine, "info"], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            problems.append(f"{engine}: `{engine} info` did not answer in 60 s")
            continue
        if proc.returncode == 0:
            return engine, problems
        reason = (proc.stderr or proc.stdout).strip().splitlines()
        problems.append(f"{engine}: {reason[-1] if reason else f'info exited {proc.returncode}'}")
    return None, problems


def prepare_source_context(layout: Layout, version: str) -> Path:
    """A clone of build/vllm's stack branch, HEAD tagged v<version>: the build context."""
    tree = layout.tree
    if not is_stack_repo(tree):
        raise StackError(f"{rel(tree, layout)} does not exist; run `make apply` first")
    if dirty := dirty_files(tree):
        raise StackError(f"{rel(tree, layout)} has uncommitted changes ({', '.join(dirty[:3])}"
                         f"{', ...' if len(dirty) > 3 else ''}); the image is built from "
                         "commits only: commit or stash them first")
    context = layout.build_dir / "rocm-source-context"
    shutil.rmtree(context, ignore_errors=True)
    _git(layout.build_dir, "clone", "--quiet", "--branch", BRANCH, str(tree), str(context))
    _git(context, "tag", f"v{version}")
    return context


def _git(cwd: Path, *args: str) -> None:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StackError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()}")


def build_image(layout: Layout, source: bool = False, dry_run: bool = False) -> None:
    recipe = "source" if source else "overlay"
    base, tag = settings(layout, recipe)
    if not (layout.root / OVERLAY_RECIPE).is_file():
        raise StackError(f"{OVERLAY_RECIPE} is missing from {layout.root}")
    engine, problems = (ENGINES[0], []) if dry_run else find_engine()
    if engine is None:
        raise StackError(f"no working container engine here ({'; '.join(problems)}); on a "
                         "machine with Docker or Podman, from the project root run: "
                         + _elsewhere(layout, source, base, tag))
    if source:
        context = layout.build_dir / "rocm-source-context"
        version = load_pin(layout.pin_file).version
        if dry_run:
            say(f"# build context: clone of {rel(layout.tree, layout)} ({BRANCH}), "
                f"HEAD tagged v{version}, in {rel(context, layout)}")
        else:
            prepare_source_context(layout, version)
        builds = source_builds(layout, context, base, tag)
    else:
        builds = [overlay_build(layout, base, tag)]
    for b in builds:
        say(f"$ {b.shell(engine, layout)}")
        if dry_run:
            continue
        proc = subprocess.run([engine, *b.args], cwd=b.cwd, env={**os.environ, **b.env})
        if proc.returncode != 0:
            raise StackError(f"`{engine} build` failed ({proc.returncode}) for {tag}; "
                             "its output is above")
    if not dry_run:
        say(f"rocm-image: built {tag} from {base} ({recipe} recipe)")


def _elsewhere(layout: Layout, source: bool, base: str, tag: str) -> str:
    """The command for a machine with a container engine, from a clone of the project."""
    if source:
        # The context is a clone of the patched tree: make prepares it there.
        return (f"make apply && make rocm-source-image BASE_IMAGE={shlex.quote(base)} "
                f"IMAGE_TAG={shlex.quote(tag)}")
    return overlay_build(layout, base, tag).shell("docker", layout)
