"""vLLM's own pre-commit checks, run on the files the stack changes.

Each patch is a future upstream PR, so it must pass what vLLM's pre-commit
runs there: ruff 0.14.0 (check and format), the SPDX header check, the
forbidden-import and torch.cuda checks, and the test-tethering check that
every test file is collected by a Buildkite job.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from scripts.gitrepo import git

_PRE_COMMIT = "tools/pre_commit"


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
    ruff = [str(python), "-m", "ruff"]
    tool = [str(python)]
    commands = []
    if py:
        commands += [
            ("ruff check", [*ruff, "check", "--no-fix", *py]),
            ("ruff format", [*ruff, "format", "--check", *py]),
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


def run_lints(tree: Path, base: str, python: Path) -> list[LintResult]:
    results = []
    for name, cmd in lint_commands(tree, base, python):
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        results.append(LintResult(name, proc.returncode == 0,
                                  (proc.stdout + proc.stderr).strip()))
    return results
