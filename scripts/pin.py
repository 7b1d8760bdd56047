"""The pinned vLLM release (pin.toml): the one place that names the version."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from scripts.common import StackError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Artifact:
    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Pin:
    version: str
    commit: str
    base_tag: str
    sdist: Artifact
    wheel: Artifact

    @property
    def project(self) -> str:
        return "vllm"


def load_pin(path: Path) -> Pin:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise StackError(f"{path}: pin file missing (it names the vLLM release)")
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"{path}: not valid TOML: {e}")
    try:
        vllm = data["vllm"]
        arts = {k: _artifact(path, k, data["artifacts"][k]) for k in ("sdist", "wheel")}
        pin = Pin(vllm["version"], vllm["commit"], vllm["base_tag"], **arts)
    except KeyError as e:
        raise StackError(f"{path}: missing key {e}")
    if pin.version not in pin.sdist.filename or pin.version not in pin.wheel.filename:
        raise StackError(f"{path}: artifact file names do not match version {pin.version}")
    return pin


def _artifact(path: Path, kind: str, table: dict) -> Artifact:
    art = Artifact(str(table["filename"]), int(table["size"]), str(table["sha256"]).lower())
    if not _SHA256.match(art.sha256):
        raise StackError(f"{path}: artifacts.{kind}.sha256 is not a sha256 hex digest")
    if "/" in art.filename or art.filename.startswith("."):
        raise StackError(f"{path}: artifacts.{kind}.filename must be a plain file name")
    return art


def render_pin(pin: Pin) -> str:
    """pin.toml text for `pin` (used when `make rebase` moves to a new release)."""
    def art(kind: str, a: Artifact) -> str:
        return (f"[artifacts.{kind}]\nfilename = \"{a.filename}\"\n"
                f"size = {a.size}\nsha256 = \"{a.sha256}\"\n")

    return (
        "# The vLLM release this patch stack is built on. Every tool reads this file;\n"
        "# nothing else names the version. Update it with `make rebase VLLM_VERSION=...`.\n"
        "\n[vllm]\n"
        f"version = \"{pin.version}\"\n"
        "# Upstream commit the release was cut from (from the release's vllm/_version.py).\n"
        f"commit = \"{pin.commit}\"\n"
        "# Tag of the pristine release commit in build/vllm.\n"
        f"base_tag = \"{pin.base_tag}\"\n\n"
        + art("sdist", pin.sdist) + "\n" + art("wheel", pin.wheel)
    )
