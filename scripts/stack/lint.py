"""vLLM's own pre-commit checks, run on the files the stack changes.

Each patch is a future upstream PR, so it must pass what vLLM's pre-commit
runs there: ruff (check and format), typos, mypy through vLLM's hook script,
the SPDX header check, the forbidden-import and torch.cuda checks, and the
test-tethering check that every test file is collected by a Buildkite job.
The linters run from .venv-lint, installed from requirements/lint.lock, whose
versions must be the ones the patched tree's .pre-commit-config.yaml pins.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, say
from scripts.stack.gitrepo import git
from scripts.stack.lock import LINT, locked_versions

_PRE_COMMIT = "tools/pre_commit"
# vLLM's mypy hook checks against the oldest Python vLLM supports.
_MYPY_PYTHON = "3.11"


@dataclass
class LintResult:
    name: str
    ok: bool
    output: str


def changed_files(tree: Path, base: str) -> list[str]:
    out = git(tree, "diff", "--no-renames", "--name-only", "--diff-filter=AM",
              base, "HEAD").stdout
    return out.split()


def lint_commands(tree: Path, base: str, python: Path) -> list[tuple[str, list[str]]]:
    files = changed_files(tree, base)
    py = [f for f in files if f.endswith(".py")]
    vllm_py = [f for f in py if f.startswith("vllm/")]
    tethered = [f for f in files if (f.startswith("tests/") and f.endswith(".py"))
                or (f.startswith(".buildkite/") and f.endswith(".yaml"))]
    bin_dir = python.parent
    tool = [str(python)]
    commands = []
    if files:
        commands.append(("typos", [str(bin_dir / "typos"), "--force-exclude", *files]))
    if py:
        commands += [
            ("ruff check", [str(bin_dir / "ruff"), "check", "--no-fix", *py]),
            ("ruff format", [str(bin_dir / "ruff"), "format", "--check", *py]),
            ("mypy", [*tool, f"{_PRE_COMMIT}/mypy.py", _MYPY_PYTHON, *py]),
            ("SPDX headers", [*tool, f"{_PRE_COMMIT}/check_spdx_header.py", *py]),
            ("forbidden imports", [*tool, f"{_PRE_COMMIT}/check_forbidden_imports.py", *py]),
            ("torch.cuda calls", [*tool, f"{_PRE_COMMIT}/check_torch_cuda.py", *py]),
            ("boolean context managers",
             [*tool, f"{_PRE_COMMIT}/check_boolean_context_manager.py", *py]),
        ]
    if vllm_py:
        commands.append(("trust_remote_code",
                         [*tool, f"{_PRE_COMMIT}/check_trust_remote_code.py", *vllm_py]))
    if tethered:
        commands.append(("test tethering",
                         [*tool, f"{_PRE_COMMIT}/check_test_tethering.py", *tethered]))
    if any(f.startswith(".buildkite/") for f in files):
        commands.append(("buildkite step keys",
                         [*tool, f"{_PRE_COMMIT}/check_buildkite_step_keys.py"]))
    return commands


def run_lints(layout: Layout, base: str, tree: Path) -> list[LintResult]:
    """Lint the files `tree` (build/vllm or a worktree of it) changes since `base`."""
    python = LINT.python(layout)
    results = [check_linter_versions(layout, tree)]
    env = {
        **os.environ,
        # vLLM's mypy hook calls `mypy` from PATH.
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MYPY_CACHE_DIR": str(mypy_cache(layout, tree)),
        "K3_PROJECT_ROOT": str(layout.root),  # as every test process has it (no key holds it)
    }
    for name, cmd in lint_commands(tree, base, python):
        passed = _passed_before(layout, tree, cmd) if name == "test tethering" else None
        if passed is not None and passed.exists():
            results.append(LintResult(name, True, ""))
            continue
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        results.append(LintResult(name, proc.returncode == 0,
                                  (proc.stdout + proc.stderr).strip()))
        if passed is not None and proc.returncode == 0:
            passed.parent.mkdir(parents=True, exist_ok=True)
            passed.touch()
    return results


# What vLLM's test-tethering check reads of a tree: the CI pipelines, the test
# files (`git ls-files tests/`) and its own folder (the script, its allowlist).
_TETHERING_READS = (".buildkite", "tests", _PRE_COMMIT)


def _passed_before(layout: Layout, tree: Path, cmd: list[str]) -> Path | None:
    """Where a pass of the tethering check on these inputs is kept (5 s a tree, the
    same in every tree a change to vllm/ leaves its tests alone in); None when
    the tree has edits there, or is no git tree."""
    dirty = git(tree, "status", "--porcelain", "--", *_TETHERING_READS, check=False)
    index = git(tree, "ls-files", "-s", "--", *_TETHERING_READS, check=False)
    if dirty.returncode or index.returncode or dirty.stdout.strip():
        return None
    digest = hashlib.sha256("\0".join([
        index.stdout, *cmd[1:], LINT.lock(layout).read_text()]).encode()).hexdigest()
    return layout.cache_dir / "tethering" / digest


def mypy_cache(layout: Layout, tree: Path) -> Path:
    """mypy's cache for one tree's place (build/vllm, prefix-trees/3): a cache
    that other trees' paths keep overwriting is never warm (12 s a tree, not 2)."""
    try:
        place = tree.resolve().relative_to(layout.build_dir.resolve()).as_posix()
    except ValueError:
        place = "other"
    return layout.cache_dir / "mypy" / place.replace("/", "-")


def run_hadolint(layout: Layout) -> list[LintResult]:
    """The project's container recipes (docker/Dockerfile*), linted by hadolint
    from .venv-lint; one result per recipe."""
    hadolint = LINT.python(layout).parent / "hadolint"
    results = []
    for recipe in sorted((layout.root / "docker").glob("Dockerfile*")):
        proc = subprocess.run([str(hadolint), str(recipe)], capture_output=True, text=True)
        results.append(LintResult(str(recipe.relative_to(layout.root)), proc.returncode == 0,
                                  (proc.stdout + proc.stderr).strip()))
    return results


def print_results(results: list[LintResult]) -> None:
    """One `ok`/`FAIL` line per check, a failing one followed by its output."""
    for result in results:
        say(f"  {'ok  ' if result.ok else 'FAIL'} {result.name}")
        if not result.ok and result.output:
            say("    " + result.output.replace("\n", "\n    "))


# Pins in .pre-commit-config.yaml: a hook repository's `rev`, or an
# additional dependency pinned with `==`.
_HOOK_REPOS = {"ruff": "astral-sh/ruff-pre-commit", "typos": "crate-ci/typos"}
_HOOK_DEPENDENCIES = ("mypy", "pydantic")


def pre_commit_pins(config: str) -> dict[str, str]:
    """The linter versions vLLM's pre-commit config pins, by package name."""
    pins = {}
    for package, repo in _HOOK_REPOS.items():
        if version := _hook_rev(config, repo):
            pins[package] = version
    for package in _HOOK_DEPENDENCIES:
        if match := re.search(rf"[\"']{package}==([^\"']+)[\"']", config):
            pins[package] = match.group(1)
    return pins


def _hook_rev(config: str, repo: str) -> str | None:
    """The version a hook repository's `rev` names.

    A rev is a tag (`rev: v0.14.0`) or, as `pre-commit autoupdate --freeze`
    writes it, a commit SHA followed by the tag it was frozen from
    (`rev: <sha>  # frozen: v0.17.2`): the SHA is not a version.
    """
    match = re.search(rf"repo: https://github\.com/{re.escape(repo)}\s*\n"
                      r"\s*rev: ['\"]?([^\s'\"#]+)['\"]?[ \t]*(?:#\s*frozen:\s*(\S+))?", config)
    if not match:
        return None
    rev, frozen_from = match.groups()
    if frozen_from:
        rev = frozen_from
    elif re.fullmatch(r"[0-9a-f]{40}", rev):
        return None  # a bare SHA: nothing says which version it is
    return rev.removeprefix("v")


def check_linter_versions(layout: Layout, tree: Path) -> LintResult:
    config_path = tree / ".pre-commit-config.yaml"
    lock_path = LINT.lock(layout)
    wanted = pre_commit_pins(config_path.read_text())
    locked = locked_versions(lock_path.read_text())
    problems = [f"{config_path.name} pins {name}=={version}, "
                f"{lock_path.name} has {locked.get(name, 'nothing')}"
                for name, version in sorted(wanted.items()) if locked.get(name) != version]
    missing = sorted((set(_HOOK_REPOS) | set(_HOOK_DEPENDENCIES)) - set(wanted))
    problems += [f"{config_path.name} no longer pins {name} where this check looks"
                 for name in missing]
    if problems:
        problems.append("next step: update requirements/lint.in, run `make lock`, then "
                        "`make test` (and scripts/stack/lint.py if the config's layout changed)")
    return LintResult("linter versions match vLLM's pre-commit", not problems,
                      "\n".join(problems))
