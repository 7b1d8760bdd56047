"""Work that exists only in build/vllm survives `make clean` and `make apply`.

Stashes, branches, commits only the reflog holds, exported patches the project
has since dropped and extra worktrees go only with `make clean FORCE=1`, which
names them; `make apply` never deletes build/vllm. A `git am` the tooling
started and that was killed (index.lock left behind) is recovered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.tooling.conftest import (
    PATCH_1,
    PATCH_2,
    PYTHON,
    REPO,
    SERIES_HEADER,
    SUBJECT_1,
    SUBJECT_2,
    V1,
    V2,
    needs_make,
    release_files,
    write_patch,
)

BASE = f"vllm-{V1}"
BAR = {"vllm/models/bar.py": "def bar():\n    return 'BAR'\n"}


def subjects(proj) -> list[str]:
    return proj.git("log", "--reverse", "--format=%s", f"{BASE}..HEAD").splitlines()


def assert_refused_and_kept(proj, result, *named: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "exists only in build/vllm" in result.stderr
    assert "make clean FORCE=1" in result.stderr
    for text in named:
        assert text in result.stderr, result.stderr
    assert proj.tree.is_dir() and proj.git("rev-parse", "--git-dir") == ".git"


@needs_make
def test_clean_keeps_the_stash_its_refusal_suggested_until_forced(stacked):
    (stacked.tree / "vllm/models/wip.py").write_text("# work in progress\n")
    refused = stacked.run("apply")
    assert "stash -u" in refused.stderr
    stacked.git("stash", "-u")
    assert_refused_and_kept(stacked, stacked.run("clean"), "stash@{0}")
    assert stacked.git("stash", "list")
    # FORCE=1 through make deletes it, naming what goes.
    forced = stacked.make("clean", "FORCE=1")
    assert forced.returncode == 0, forced.stderr
    assert "stash@{0}" in forced.stdout
    assert not stacked.tree.exists()


@needs_make
def test_an_exported_force_variable_does_not_force(stacked):
    (stacked.tree / "vllm/models/wip.py").write_text("# work in progress\n")
    stacked.git("stash", "-u")
    env = {**stacked.env(), "FORCE": "1"}
    result = subprocess.run(["make", "-s", "-C", str(REPO), f"PYTHON={PYTHON}", "clean"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert stacked.git("stash", "list")


def test_clean_keeps_the_branch_its_refusal_suggested(stacked):
    stacked.commit("[ROCm] Shout bar", BAR)
    refused = stacked.run("apply")
    assert "branch saved-work" in refused.stderr
    stacked.git("branch", "saved-work")
    stacked.git("reset", "-q", "--hard", BASE)
    assert_refused_and_kept(stacked, stacked.run("clean"), "saved-work", "[ROCm] Shout bar")


def test_clean_keeps_a_commit_only_the_reflog_holds(stacked):
    stacked.commit("[ROCm] Experiment", BAR)
    stacked.git("reset", "-q", "--hard", "HEAD~1")
    assert_refused_and_kept(stacked, stacked.run("clean"), "[ROCm] Experiment")


def test_clean_keeps_an_exported_patch_the_project_dropped(stacked):
    stacked.commit("[ROCm] Shout bar", BAR)
    stacked.ok("patches")
    # The project drops the patch (a pull, or `git checkout patches/` of an
    # uncommitted export) and apply moves build/vllm on: only its reflog has it.
    (stacked.patches / "rocm-shout-bar.patch").unlink()
    (stacked.patches / "series").write_text(SERIES_HEADER + f"{PATCH_1}\n{PATCH_2}\n")
    stacked.ok("apply")
    assert subjects(stacked) == [SUBJECT_1, SUBJECT_2]
    assert_refused_and_kept(stacked, stacked.run("clean"), "[ROCm] Shout bar")


def test_clean_keeps_another_worktree_of_build_vllm(stacked, tmp_path):
    worktree = tmp_path / "h-rs"
    stacked.git("worktree", "add", "-q", "-b", "h-rs", str(worktree))
    (worktree / "vllm/models/rs.py").write_text("# staged work\n")
    stacked.git("add", "vllm/models/rs.py", cwd=worktree)
    assert_refused_and_kept(stacked, stacked.run("clean"), str(worktree), "h-rs")
    assert stacked.git("status", "--porcelain", cwd=worktree) == "A  vllm/models/rs.py"


def test_clean_goes_ahead_when_the_project_history_holds_every_commit(stacked):
    """The README's maintainer workflows leave nothing that clean would refuse."""
    proj = stacked
    (proj.root / ".gitignore").write_text("/build/\n/.k3-stack.running\n")
    proj.git("init", "-q", "-b", "main", cwd=proj.root)
    proj.git("add", "-A", cwd=proj.root)
    proj.git("commit", "-q", "-m", "stack", cwd=proj.root)
    # Edit a patch: a fixup folded in with an autosquash rebase, exported, committed.
    first = proj.git("rev-list", "--reverse", f"{BASE}..HEAD").split()[0]
    (proj.tree / "vllm/models/foo.py").write_text(
        (proj.tree / "vllm/models/foo.py").read_text() + "# tuned\n")
    proj.git("commit", "-q", "-a", f"--fixup={first}")
    proj.git("-c", "sequence.editor=:", "rebase", "-q", "-i", "--autosquash", BASE)
    proj.ok("patches")
    proj.git("add", "-A", cwd=proj.root)
    proj.git("commit", "-q", "-m", "edit patch 1", cwd=proj.root)
    # A patch dropped by a commit of the project, then applied.
    proj.git("rm", "-q", f"patches/{PATCH_2}", cwd=proj.root)
    (proj.patches / "series").write_text(SERIES_HEADER + f"{PATCH_1}\n")
    proj.git("add", "-A", cwd=proj.root)
    proj.git("commit", "-q", "-m", "drop patch 2", cwd=proj.root)
    proj.ok("apply")
    result = proj.run("clean")
    assert result.returncode == 0, result.stderr
    assert not proj.tree.exists()


def test_a_new_pin_keeps_stashes_branches_and_history(stacked):
    stacked.commit("[ROCm] Side work", BAR)
    side = stacked.head()
    stacked.git("branch", "side")
    stacked.git("reset", "-q", "--hard", "HEAD~1")
    (stacked.tree / "vllm/models/wip.py").write_text("# work in progress\n")
    stacked.git("stash", "-u")
    files = release_files(V1)
    files["vllm/models/bar.py"] = b"def bar():\n    return 'bar, respun'\n"
    pin = stacked.use_release(V1, files)
    result = stacked.ok("apply")
    assert "holds another vLLM release" in result.stdout
    assert stacked.git("stash", "list")
    assert stacked.git("rev-parse", "side") == side
    assert stacked.state()["base_sdist_sha256"] == pin.sdist.sha256
    assert (stacked.tree / "vllm/models/bar.py").read_text() == \
        "def bar():\n    return 'bar, respun'\n"
    assert subjects(stacked) == [SUBJECT_1, SUBJECT_2]
    assert stacked.git("status", "--porcelain", "--untracked-files=all") == ""
    # The same commits as a build from scratch: ids depend only on the inputs.
    head = stacked.head()
    stacked.ok("clean", "--force")
    stacked.ok("apply")
    assert stacked.head() == head


# --- a killed `git am` -----------------------------------------------------------


BIG_LINES = 200_000  # a `git am` of this holds index.lock for long enough to be killed


def _big_patch(proj) -> None:
    """One patch adding a large file."""
    body = "".join(f"+line {i}\n" for i in range(BIG_LINES))
    diff = (f"diff --git a/vllm/big.txt b/vllm/big.txt\nnew file mode 100644\n"
            f"--- /dev/null\n+++ b/vllm/big.txt\n@@ -0,0 +1,{BIG_LINES} @@\n{body}")
    write_patch(proj.patches, "rocm-add-big.patch", "vllm/big.txt",
                subject="[ROCm] Add big", diff=diff)
    (proj.patches / "series").write_text(SERIES_HEADER + "rocm-add-big.patch\n")


def _kill_inside_git_am(proj, *command: str) -> None:
    """Run `command` and SIGKILL it (and its git) while its `git am` holds index.lock."""
    git_dir = proj.tree / ".git"
    # The command runs at the lowest priority, so that on a busy machine the
    # poll below still sees its `git am` before it finishes.
    proc = subprocess.Popen([PYTHON, "-m", "scripts", *command], cwd=REPO, env=proj.env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=lambda: os.nice(19))
    deadline = time.monotonic() + 60
    while not ((git_dir / "rebase-apply").exists() and (git_dir / "index.lock").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, "git am never started"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (git_dir / "index.lock").exists()


@pytest.mark.parametrize("command", ["apply", "clean", "patches"])
def test_a_killed_git_am_is_recovered(project, command):
    _big_patch(project)
    _kill_inside_git_am(project, "apply")
    patches = project.patch_bytes()
    result = project.run(command)
    assert "Traceback" not in result.stderr
    assert "index.lock" in result.stdout  # says what it recovered
    assert not (project.tree / ".git" / "index.lock").exists()
    if command == "apply":
        assert result.returncode == 0, result.stderr
        assert "[1/1] applied rocm-add-big.patch" in result.stdout
        assert project.state()["status"] == "applied"
        assert project.git("status", "--porcelain", "--untracked-files=all") == ""
    elif command == "clean":
        assert result.returncode == 0, result.stderr
        assert not project.tree.exists()
    else:  # the series is half applied: exporting it would drop patches
        assert result.returncode == 1
        assert "Run `make apply` first" in result.stderr
        assert project.patch_bytes() == patches


def test_a_killed_rebase_git_am_is_recovered(project, index):
    project.ok("apply")
    project.commit("[ROCm] Add big", {"vllm/big.txt": "".join(f"line {i}\n"
                                                               for i in range(BIG_LINES))})
    project.ok("patches")
    index.add(*project.release(V1))
    index.add(*project.release(V2, release_files(V2, "g7654321"), commit="g7654321"))
    project.index_url = index.url
    _kill_inside_git_am(project, "rebase", V2)
    result = project.run("rebase", V2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "killed while applying rocm-add-big.patch" in result.stdout
    assert f"rebased onto vLLM {V2}" in result.stdout
    assert not (project.tree / ".git" / "index.lock").exists()
    assert project.git("log", "--format=%s", f"vllm-{V2}..HEAD") == "[ROCm] Add big"
    assert project.git("status", "--porcelain", "--untracked-files=all") == ""
