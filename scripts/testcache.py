"""What `make test` remembers, so that it never repeats a run whose inputs are identical.

Each row of `make test` (scripts/testrun.py) has a key: a sha256 over
everything that decides its outcome. Part of it is the same for every row and
cannot be left out:
- the project's files, except those made from build/vllm (patches/,
  vllm_overlay/) and prose no test reads (README.md, docs/): so scripts/,
  tests/, requirements/*.lock, pin.toml (hence the wheel's kernels), pytest.ini;
- the pristine release's git tree id, the two venvs (pyvenv.cfg and the build
  stamp recording the installed lock and tree), the interpreter, platform and
  git version, and the environment variables that steer vLLM, torch or pytest.
The row adds the git tree id of the vLLM tree it tests (required; None only
for a row that never reads one), the command it runs, and any other project
path it reads.

A row that passed is recorded under build/test-results/green/<key>.json; a
later run with the same key reuses it and says so in the summary. A failed
row is never recorded, so it always runs again. Any doubt is a new key: a
cache miss costs minutes, a stale green would hide a failure.

build/test-results/summary.json describes the latest run (rows, counts,
commands, what was reused, wall time): `make bench` prints it and `make
export` quotes it in the PR descriptions. runs.jsonl keeps one line per run.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from scripts.common import Layout, run
from scripts.gitrepo import git
from scripts.lock import ENVIRONMENTS

FORMAT = 1
RESULTS = "test-results"
# Made from build/vllm (keyed by its tree id instead) or prose no test reads.
# A row that does read one of them lists it in Row.inputs.
NOT_PROJECT_INPUTS = frozenset({"patches", "vllm_overlay", "docs", "README.md"})
# Never inputs: outputs, caches and the environments (keyed by their stamps).
_NEVER = frozenset({"build", ".cache", ".venv", ".venv-lint", ".git", "__pycache__",
                    ".pytest_cache", ".mypy_cache", ".ruff_cache"})
# Environment variables that can change what a test does. (Not all of PYTEST_*:
# pytest sets PYTEST_CURRENT_TEST itself.)
_STEERING_PREFIXES = ("VLLM_", "TORCH", "PYTORCH_", "CUDA_", "HIP_", "HSA_", "ROCR_",
                      "ROCM_", "TRITON_", "HF_", "TRANSFORMERS_", "OMP_", "MKL_")
_STEERING_NAMES = frozenset({"PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONHASHSEED",
                             "PYTHONWARNINGS", "PYTHONOPTIMIZE"})


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def shown_date(iso: str) -> str:
    return iso[:16].replace("T", " ") + " UTC"


# --- what a key is made of ----------------------------------------------------


def digest_paths(root: Path, paths: list[str] | None = None) -> str:
    """sha256 over the names, exec bits and contents of files under `root`.

    `paths` (files or folders relative to root) default to the whole project
    but NOT_PROJECT_INPUTS. A deleted tracked file counts as "missing".
    """
    digest = hashlib.sha256()
    for relpath in _input_files(root, paths):
        path = root / relpath
        if path.is_symlink():
            kind, data = "link", os.readlink(path).encode()
        elif path.is_file():
            kind, data = ("exec" if os.access(path, os.X_OK) else "file"), path.read_bytes()
        else:
            kind, data = "missing", b""
        digest.update(f"{relpath}\0{kind}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _input_files(root: Path, paths: list[str] | None) -> list[str]:
    if paths is None:
        return [f for f in _project_files(root)
                if f.split("/", 1)[0] not in NOT_PROJECT_INPUTS]
    files = []
    for top in sorted(paths):
        start = root / top
        if not start.is_dir() or start.is_symlink():
            files.append(top)
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if d not in _NEVER)
            base = Path(dirpath).relative_to(root)
            files += [(base / f).as_posix() for f in filenames if not f.endswith(".pyc")]
    return sorted(files)


def _project_files(root: Path) -> list[str]:
    """The project's files as git sees them (tracked, or new and not ignored), so
    that outputs and editor or cache folders never change a key; every file but
    _NEVER when the project is not a git checkout."""
    top = run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], check=False)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return _input_files(root, [p.name for p in root.iterdir() if p.name not in _NEVER])
    listed = run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                  "--exclude-standard"]).stdout
    return sorted({f for f in listed.split("\0") if f})


def tree_id(tree: Path, rev: str) -> str:
    return git(tree, "rev-parse", f"{rev}^{{tree}}").stdout.strip()


def working_tree_id(tree: Path) -> str:
    """The git tree id of what is checked out in `tree`, uncommitted edits included.

    Written through a scratch copy of the index: the repository's index, HEAD
    and branch are untouched (the blobs of edited files are added to its
    object store, as `git stash` would).
    """
    with tempfile.TemporaryDirectory(prefix="k3-test-index-") as tmp:
        index = Path(tmp) / "index"
        shutil.copyfile(tree / ".git" / "index", index)
        env = {"GIT_INDEX_FILE": str(index)}
        git(tree, "add", "--all", env=env)
        return git(tree, "write-tree", env=env).stdout.strip()


@dataclass(frozen=True)
class KeyContext:
    """The inputs every row shares: computed once per run."""

    material: dict

    @classmethod
    def of(cls, layout: Layout, base: str) -> KeyContext:
        venvs = {}
        for env in ENVIRONMENTS:
            folder = env.path(layout)
            venvs[env.name] = {name: _read_or_none(folder / name)
                               for name in ("pyvenv.cfg", "k3-stack-build.json")}
        steering = {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(_STEERING_PREFIXES) or k in _STEERING_NAMES}
        return cls({
            "format": FORMAT,
            "project": digest_paths(layout.root),
            "base_tree": tree_id(layout.tree, base),
            "venvs": venvs,
            "platform": [platform.platform(), platform.machine(), sys.version,
                         git(layout.tree, "--version").stdout.strip()],
            "environment": steering,
        })

    def key(self, root: Path, *, check: str, vllm_tree: str | None,
            command: tuple[str, ...], inputs: tuple[str, ...]) -> tuple[str, dict]:
        material = {**self.material, "check": check, "vllm_tree": vllm_tree,
                    "command": list(command),
                    "inputs": digest_paths(root, list(inputs)) if inputs else None}
        blob = json.dumps(material, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest(), material


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


# --- where results are kept -----------------------------------------------------


class ResultStore:
    """build/test-results/: junit files, green records, summary.json, runs.jsonl."""

    def __init__(self, layout: Layout):
        self.dir = layout.build_dir / RESULTS
        self.dir.mkdir(parents=True, exist_ok=True)

    def green(self, key: str) -> dict | None:
        """The record of a green run under `key`, if there is one."""
        try:
            record = json.loads((self.dir / "green" / f"{key}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return record if record.get("key") == key and "outcome" in record else None

    def record_green(self, key: str, material: dict, outcome: dict) -> None:
        if outcome["failed"]:
            return  # a failure is never reused: the next run tries again
        record = {"key": key, "date": now(), "inputs": material, "outcome": outcome}
        _write_json(self.dir / "green" / f"{key}.json", record)

    def write_summary(self, summary: dict) -> None:
        _write_json(self.dir / "summary.json", summary)
        line = {k: summary[k] for k in ("started", "wall_seconds", "fresh", "vllm",
                                        "totals", "rows_run", "rows_reused")}
        with open(self.dir / "runs.jsonl", "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def read_summary(layout: Layout) -> dict | None:
    """The latest `make test` run, or None if there is none (or it is unreadable)."""
    try:
        summary = json.loads((layout.build_dir / RESULTS / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return summary if summary.get("format") == FORMAT else None


def read_runs(layout: Layout) -> list[dict]:
    try:
        lines = (layout.build_dir / RESULTS / "runs.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    runs = []
    for line in lines:
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted write
    return runs


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
