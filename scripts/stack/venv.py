"""`make build`: .venv with the patched tree installed, and .venv-lint.

Both are installed from their hash-pinned locks (scripts/stack/lock.py). The patched
tree is installed into .venv as a python-only editable build against the
pinned wheel's compiled kernels, so the stack never needs a CUDA/ROCm
toolchain. A stamp file in each venv records what is installed; only what
changed is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from scripts.common import Layout, StackError, rel, run, say
from scripts.stack.fetch import ensure_artifact
from scripts.stack.gitrepo import (
    dirty_files,
    ignored_stats,
    is_stack_repo,
    read_state,
    record_build_outputs,
)
from scripts.stack.lock import ENVIRONMENTS, VENV, LockedEnv, check_lock_matches_wheel
from scripts.stack.pin import Pin, load_pin


def venv_python(layout: Layout) -> Path:
    return VENV.python(layout)


def _stamp_path(layout: Layout, env: LockedEnv) -> Path:
    return env.path(layout) / "k3-stack-build.json"


def _read_stamp(layout: Layout, env: LockedEnv = VENV) -> dict:
    try:
        return json.loads(_stamp_path(layout, env).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_stamp(layout: Layout, env: LockedEnv = VENV, **updates) -> None:
    stamp = {**_read_stamp(layout, env), **updates}
    _stamp_path(layout, env).write_text(json.dumps(stamp, indent=1))


def pip_env(layout: Layout) -> dict[str, str]:
    # Downloads are cached under the project so a rebuilt .venv costs no network.
    return {"PIP_CACHE_DIR": str(layout.cache_dir / "pip"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def build(layout: Layout) -> None:
    pin = load_pin(layout.pin_file)
    if not is_stack_repo(layout.tree):
        raise StackError(f"{rel(layout.tree, layout)} does not exist; run `make apply` first")
    wheel = ensure_artifact(layout, pin.project, pin.wheel)
    check_lock_matches_wheel(layout, pin, wheel)
    for env in ENVIRONMENTS:
        _install_locked_dependencies(layout, env)
    _install_patched_tree(layout, pin, wheel)
    _verify_import(layout)


def _install_locked_dependencies(layout: Layout, env: LockedEnv) -> None:
    if not env.python(layout).exists():
        say(f"creating {rel(env.path(layout), layout)}")
        run([sys.executable, "-m", "venv", str(env.path(layout))])
    lock = env.lock(layout)
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    if _read_stamp(layout, env).get("lock_sha256") == digest:
        return
    size = " (~9 GB, a few minutes on a cold cache)" if env.with_vllm_dependencies else ""
    say(f"installing {rel(lock, layout)} into {rel(env.path(layout), layout)}{size}")
    _pip(env.python(layout), layout, "install", "--require-hashes", "--no-deps",
         "-r", str(lock))
    _write_stamp(layout, env, lock_sha256=digest, editable=None)


def _install_patched_tree(layout: Layout, pin: Pin, wheel: Path) -> None:
    wanted = {"tree": str(layout.tree.resolve()), "wheel": wheel.name, "version": pin.version,
              "base_commit": read_state(layout.tree).get("base_commit")}
    # A re-created build/vllm has lost the kernels the install copied into it.
    kernels_present = any((layout.tree / "vllm").glob("*.so"))
    if _read_stamp(layout).get("editable") == wanted and kernels_present:
        return
    say(f"installing {rel(layout.tree, layout)} into .venv (python-only build on "
        f"{wheel.name}'s kernels)")
    before = set(dirty_files(layout.tree))
    ignored_before = ignored_stats(layout.tree)
    env = {
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
        # build/vllm is a git repo of our own, not upstream's: give setuptools-scm
        # the release's version and commit so it rewrites vllm/_version.py unchanged.
        "SETUPTOOLS_SCM_PRETEND_VERSION": pin.version,
        "SETUPTOOLS_SCM_PRETEND_METADATA": f'{{node="{pin.commit}"}}',
    }
    _pip(venv_python(layout), layout, "install", "--no-build-isolation", "--no-deps",
         "-e", str(layout.tree), env=env)
    if new := set(dirty_files(layout.tree)) - before:
        raise StackError(f"the build changed tracked files in {rel(layout.tree, layout)}: "
                         f"{', '.join(sorted(new))}; add them to the excludes in "
                         "scripts/stack/gitrepo.py or fix the build")
    record_build_outputs(layout.tree, ignored_before)  # what `make clean` may delete
    _write_stamp(layout, editable=wanted)


def _verify_import(layout: Layout) -> None:
    # Locate the package without importing it (importing vLLM takes many seconds).
    probe = ("import importlib.util as u, importlib.metadata as m, os; "
             "print(os.path.realpath(u.find_spec('vllm').origin)); print(m.version('vllm'))")
    out = run([str(venv_python(layout)), "-c", probe], cwd=layout.root).stdout.split()
    where, version = out[0], out[1]
    if not where.startswith(str(layout.tree.resolve()) + os.sep):
        raise StackError(f".venv imports vllm from {where}, not from {layout.tree}; "
                         "remove .venv and run `make build` again")
    say(f".venv: vllm {version} from {rel(Path(where).parent, layout)}")


def _pip(python: Path, layout: Layout, *args: str,
         env: dict[str, str] | None = None) -> None:
    cmd = [str(python), "-m", "pip", *args]
    full_env = {**os.environ, **pip_env(layout), **(env or {})}
    # pip's log is long; keep it out of the way and show its end if pip fails.
    result = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-30:])
        raise StackError(f"pip failed ({result.returncode}): {' '.join(cmd)}\n{tail}")
