"""The pinned vLLM release (pin.toml): the one place that names the version."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from scripts.common import StackError, read_regular
from scripts.stack.requirements import InvalidRequirement, Requirement, canonicalize_name

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A public PEP 440 version as vLLM publishes them: 0.33.0, 0.34.0rc1, 0.10.1.post1.
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")
_FIX = "fix pin.toml (`git diff pin.toml` shows what changed)"
# A tag git takes as a tag and as nothing else: not an option ("-f"), not a
# name git gives a meaning of its own ("HEAD"), no `..`, no `.lock` ending.
_TAG = re.compile(r"(?!HEAD$)(?!.*\.\.)(?!.*\.lock$)[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class Artifact:
    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Substitute:
    """A requirement of the pinned wheel that the package index cannot serve,
    and the one `make lock` resolves instead. Release-specific: a rebase drops
    it, and the lock tools refuse one the wheel no longer requires."""

    requirement: str  # exactly as the wheel's Requires-Dist has it
    use: str  # a requirement of the same package
    why: str


@dataclass(frozen=True)
class Pin:
    version: str
    commit: str
    base_tag: str
    sdist: Artifact
    wheel: Artifact
    substitutes: tuple[Substitute, ...] = ()

    @property
    def project(self) -> str:
        return "vllm"


def check_version(version: str, where: str, next_step: str) -> str:
    """`version` if it is a release version; it becomes part of file names and URLs."""
    if not _VERSION.fullmatch(version):
        raise StackError(f"{where}: {version!r} is not a vLLM version (like 0.33.0 or "
                         f"0.34.0rc1); {next_step}")
    return version


def load_pin(path: Path) -> Pin:
    try:
        data = tomllib.loads(read_regular(path, _FIX, follow_links=True).decode("utf-8"))
    except FileNotFoundError:
        raise StackError(f"{path}: pin file missing (it names the vLLM release)")
    except UnicodeDecodeError as e:
        raise StackError(f"{path}: not UTF-8 text (byte {e.start}); {_FIX}")
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"{path}: not valid TOML: {e}; {_FIX}")
    fields = _Fields(path, data)
    version = check_version(fields.text("vllm", "version"), f"{path}: vllm.version", _FIX)
    base_tag = fields.text("vllm", "base_tag")
    if not _TAG.fullmatch(base_tag):
        raise StackError(f"{path}: vllm.base_tag {base_tag!r} is not a plain tag name (like "
                         f"vllm-{version}: letters, digits, '.', '_', '-', not starting with "
                         f"'-'); {_FIX}")
    pin = Pin(version, fields.text("vllm", "commit"), base_tag,
              sdist=_artifact(fields, "sdist"), wheel=_artifact(fields, "wheel"),
              substitutes=_substitutes(fields))
    if pin.version not in pin.sdist.filename or pin.version not in pin.wheel.filename:
        raise StackError(f"{path}: artifact file names do not match version {pin.version}; "
                         f"{_FIX}")
    return pin


class _Fields:
    """Typed access to pin.toml: a missing or mistyped value is one clear error."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path, self.data = path, data

    def _value(self, table: str, key: str, kind: type, kind_name: str):
        node = self.data
        for part in (*table.split("."), key):
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                raise StackError(f"{self.path}: missing {table}.{key}; {_FIX}")
        if not isinstance(node, kind) or isinstance(node, bool):
            raise StackError(f"{self.path}: {table}.{key} must be {kind_name}, not "
                             f"{node!r}; {_FIX}")
        return node

    def text(self, table: str, key: str) -> str:
        value = self._value(table, key, str, "a string")
        if not value.isprintable():  # a NUL, a newline: nothing pin.toml names has one
            raise StackError(f"{self.path}: {table}.{key} {value!r} holds a control "
                             f"character; {_FIX}")
        return value

    def number(self, table: str, key: str) -> int:
        value = self._value(table, key, int, "an integer")
        if value <= 0:
            raise StackError(f"{self.path}: {table}.{key} must be a positive integer, not "
                             f"{value}; {_FIX}")
        return value


def _artifact(fields: _Fields, kind: str) -> Artifact:
    table = f"artifacts.{kind}"
    art = Artifact(fields.text(table, "filename"), fields.number(table, "size"),
                   fields.text(table, "sha256").lower())
    if not _SHA256.match(art.sha256):
        raise StackError(f"{fields.path}: {table}.sha256 is not a sha256 hex digest; {_FIX}")
    if "/" in art.filename or art.filename.startswith("."):
        raise StackError(f"{fields.path}: {table}.filename must be a plain file name; {_FIX}")
    return art


def _substitutes(fields: _Fields) -> tuple[Substitute, ...]:
    entries = fields.data.get("lock", {}).get("substitute", [])
    if not isinstance(entries, list):
        raise StackError(f"{fields.path}: lock.substitute must be an array of tables "
                         f"([[lock.substitute]]); {_FIX}")
    found = []
    for i, entry in enumerate(entries):
        table = f"substitute[{i}]"
        one = _Fields(fields.path, {"lock": {table: entry}})
        sub = Substitute(*(one.text(f"lock.{table}", key)
                           for key in ("requirement", "use", "why")))
        if _requirement_name(sub.requirement) != _requirement_name(sub.use):
            raise StackError(f"{fields.path}: lock.substitute[{i}] replaces "
                             f"{sub.requirement!r} with {sub.use!r}, another package; {_FIX}")
        found.append(sub)
    return tuple(found)


def _requirement_name(requirement: str) -> str:
    try:
        return canonicalize_name(Requirement(requirement).name)
    except InvalidRequirement as e:
        raise StackError(f"{requirement!r} is not a requirement ({e}); {_FIX}")


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
        + "".join(_render_substitute(sub) for sub in pin.substitutes)
    )


def _render_substitute(sub: Substitute) -> str:
    return ("\n[[lock.substitute]]\n" + "".join(
        f"{key} = {json.dumps(getattr(sub, key))}\n" for key in ("requirement", "use", "why")))
