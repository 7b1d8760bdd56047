"""`make drift`: how the stack fares on the newest vLLM release, changing nothing.

Looks the newest release up on the package index (or takes VLLM_VERSION),
downloads its sdist (checked against the index's sha256) and tries every patch
on it strictly, in a scratch git index: which still apply, which are already
upstream (they apply in reverse), and which stop applying, with their files.
build/vllm, pin.toml and patches/ are never touched. Meant to run on a
schedule, so a broken patch is known before the bump; `make rebase` acts on it.
"""

from __future__ import annotations

import os
import re
import tempfile

from scripts.common import Layout, say
from scripts.stack.fetch import (
    IndexUnreachable,
    configured_indexes,
    ensure_artifact,
    index_needed,
    newest_version,
    project_page,
    release_versions,
)
from scripts.stack.gitrepo import create_base, git, is_stack_repo, read_state
from scripts.stack.pin import Pin, check_version, load_pin
from scripts.stack.rebase import pin_for
from scripts.stack.series import Patch, read_series, touched_paths


def drift(layout: Layout, version: str | None = None) -> int:
    if version is not None:
        check_version(version, "VLLM_VERSION", "give a release, as in "
                      "`make drift VLLM_VERSION=0.34.0`, or none for the newest")
    pin = load_pin(layout.pin_file)
    try:
        version = version or newest_release(pin)
    except IndexUnreachable as e:
        raise index_needed("look up the newest vLLM release for `make drift`", e)
    if version == pin.version:
        say(f"vLLM {pin.version} is the newest release on the index: no drift to check")
        return 0
    new = pin_for(pin, version)
    sdist = ensure_artifact(layout, new.project, new.sdist)
    repo = layout.build_dir / "drift-base"
    if not (is_stack_repo(repo)
            and read_state(repo).get("base_sdist_sha256") == new.sdist.sha256):
        create_base(layout, new, sdist, dest=repo)
    patches = read_series(layout)
    broken = _try_series(repo, new, patches)
    applied = len(patches) - broken
    say(f"{applied} of {len(patches)} patch(es) apply strictly to vLLM {version}"
        + (f"; move the stack with `make rebase VLLM_VERSION={version}`" if broken else ""))
    return 1 if broken else 0


def newest_release(pin: Pin) -> str:
    """The highest final-release version with an sdist on the first index."""
    files = project_page(configured_indexes()[0], pin.project)
    return newest_version(release_versions(files) + [pin.version])


def _why(git_errors: str, earlier: list[Patch]) -> str:
    """What stops a patch, from `git apply --check`'s errors: the files it does
    not apply to, and the ones it needs that the release lacks. Those were there
    in the pinned release (the series applies to it): an earlier patch creates
    them, or upstream deleted them, and then resolving a conflict would bring a
    deleted module back."""
    missing = re.findall(r"error: ([^:\s]+): does not exist in index", git_errors)
    failed = sorted(set(re.findall(r"error: (?:patch failed: )?([^:\s]+)", git_errors))
                    - set(missing))
    reasons = [", ".join(failed)] if failed else []
    for path in missing:
        creator = next((e.name for e in earlier if path in touched_paths(e.name, e.read())),
                       None)
        reasons.append(f"needs {path}, which {creator} creates" if creator else
                       f"upstream deleted {path}: drop or re-home the patch")
    return "; ".join(reasons)


def _try_series(repo, new: Pin, patches: list[Patch]) -> int:
    """Apply each patch on top of those before it that applied; count the failures."""
    fd, index = tempfile.mkstemp(prefix="k3-drift-index-")
    os.close(fd)
    env = {"GIT_INDEX_FILE": index}
    broken = 0
    try:
        git(repo, "read-tree", new.base_tag, env=env)
        for i, p in enumerate(patches):
            path = str(p.path.resolve())
            if git(repo, "apply", "--cached", path, env=env, check=False).returncode == 0:
                say(f"  applies          {p.name}")
            elif git(repo, "apply", "--cached", "--check", "--reverse", path, env=env,
                     check=False).returncode == 0:
                say(f"  already upstream {p.name} (drop it from the series)")
                broken += 1
            else:
                result = git(repo, "apply", "--cached", "--check", path, env=env,
                             check=False)
                say(f"  does not apply   {p.name}: {_why(result.stderr, patches[:i])}")
                broken += 1
    finally:
        os.unlink(index)
    return broken
