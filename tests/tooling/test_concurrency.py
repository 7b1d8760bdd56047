"""Two runs at once never race: one lock per project, one per file of the download cache.

Git commands meant for build/vllm never run against the project's own
repository, even when build/vllm/.git is missing or damaged.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tests.tooling.conftest import PYTHON, REPO, SUBJECT_1, SUBJECT_2, V1, Project, sha256_file

BASE = f"vllm-{V1}"


def start(proj, command: str, log: Path) -> subprocess.Popen:
    """`python3 -m scripts <command>` in the background, its output going to `log`."""
    out = open(log, "w")
    return subprocess.Popen([PYTHON, "-m", "scripts", command], cwd=REPO, env=proj.env(),
                            stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, what: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def pause_git_am(proj, tmp_path) -> tuple[Path, Path]:
    """Every `git am` stops in its pre-applypatch hook until `release` exists."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    started, release = tmp_path / "am-started", tmp_path / "am-release"
    hook = hooks / "pre-applypatch"
    hook.write_text(f"#!/bin/sh\ntouch '{started}'\ni=0\n"
                    f"while [ ! -e '{release}' ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n")
    hook.chmod(0o755)
    with open(proj.gitconfig, "a") as f:
        f.write(f"[core]\n\thooksPath = {hooks}\n")
    return started, release


def test_a_second_apply_waits_for_the_first(stacked, tmp_path):
    shutil.rmtree(stacked.root / "build")
    started, release = pause_git_am(stacked, tmp_path)
    first = start(stacked, "apply", tmp_path / "first.log")
    second = None
    try:
        assert wait_for(started.exists, "the first apply's git am")
        second = start(stacked, "apply", tmp_path / "second.log")
        waited = wait_for(lambda: "waiting for" in (tmp_path / "second.log").read_text(),
                          "the second apply to wait", timeout=15)
    finally:
        release.touch()
        first.wait(60)
        if second:
            second.wait(60)
    log_1, log_2 = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert waited, log_2
    assert "`make apply`" in log_2 and f"pid {first.pid}" in log_2
    assert first.returncode == 0, log_1
    assert second.returncode == 0, log_2
    assert "Traceback" not in log_1 + log_2
    assert "2 patch(es) already applied" in log_2
    assert stacked.git("log", "--reverse", "--format=%s", f"{BASE}..HEAD").splitlines() == \
        [SUBJECT_1, SUBJECT_2]
    assert stacked.state()["status"] == "applied"
    assert stacked.git("status", "--porcelain", "--untracked-files=all") == ""


def test_two_clones_sharing_a_cache_download_each_file_once(project, index, tmp_path):
    shutil.rmtree(project.cache)
    sdist, wheel = project.release(V1)
    index.add(sdist, wheel)
    index.stall = 3  # per file: the second clone starts well within it
    project.index_url = index.url
    clone = Project(tmp_path / "clone", project.cache, project.releases, project.gitconfig)
    shutil.copytree(project.root, clone.root)
    clone.index_url = index.url
    first = start(project, "fetch", tmp_path / "first.log")
    try:
        assert wait_for(lambda: index.downloads(sdist.name) == 1, "the first download")
        second = start(clone, "fetch", tmp_path / "second.log")
        second.wait(60)
    finally:
        first.wait(60)
    log_1, log_2 = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert first.returncode == 0, log_1
    assert second.returncode == 0, log_2
    assert "Traceback" not in log_1 + log_2
    assert "waiting for" in log_2 and "in the download cache" in log_2
    assert index.downloads(sdist.name) == 1 and index.downloads(wheel.name) == 1
    assert sha256_file(project.downloads / sdist.name) == sha256_file(sdist)
    assert not [p for p in project.downloads.iterdir() if p.name.endswith(".part")]


def test_git_never_reaches_the_project_repository_through_a_damaged_tree(stacked):
    """With build/vllm/.git half deleted, git must not find the project's own .git."""
    proj = stacked
    (proj.root / ".gitignore").write_text("/build/\n/.k3-stack.running\n")
    proj.git("init", "-q", "-b", "stack", cwd=proj.root)  # same branch name as the tool's
    proj.git("add", "-A", cwd=proj.root)
    proj.git("commit", "-q", "-m", "project", cwd=proj.root)
    project_head = proj.git("rev-parse", "HEAD", cwd=proj.root)
    git_dir = proj.tree / ".git"
    for name in ("HEAD", "objects", "refs"):
        path = git_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for command in ("apply", "patches", "clean"):
        result = proj.run(command)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert "build/vllm/.git is damaged" in result.stderr, (command, result.stderr)
        assert "FORCE=1" in result.stderr
    assert proj.git("rev-parse", "HEAD", cwd=proj.root) == project_head
    assert proj.git("status", "--porcelain", cwd=proj.root) == ""
    assert proj.git("branch", "--format=%(refname:short)", cwd=proj.root) == "stack"
    forced = proj.run("clean", "--force")
    assert forced.returncode == 0, forced.stderr
    assert not proj.tree.exists()
