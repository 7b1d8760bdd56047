"""Work that exists only in build/vllm survives `make clean` and `make apply`.

Stashes, branches, commits only the reflog holds, exported patches the project
has since dropped and extra worktrees go only with `make clean FORCE=1`, which
names them; `make apply` never deletes build/vllm. A `git am` the tooling
started and that was killed (index.lock left behind) is recovered.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from tests.tooling.conftest import (
    PATCH_1,
    PATCH_2,
    PYTHON,
    RATIONALE,
    REPO,
    SERIES_HEADER,
    SIGNOFF,
    SUBJECT_1,
    SUBJECT_2,
    V1,
    V2,
    WHEEL_COPY,
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


def _one_patch(proj) -> None:
    """One patch adding vllm/big.txt (the file the kill below waits for)."""
    write_patch(proj.patches, "rocm-add-big.patch", "vllm/big.txt", subject="[ROCm] Add big")
    (proj.patches / "series").write_text(SERIES_HEADER + "rocm-add-big.patch\n")


def _kill_inside_git_am(proj, *command: str) -> None:
    """Run `command` and SIGKILL it, with its git, while its `git am` writes
    vllm/big.txt (and so holds index.lock)."""
    proj.kill_git_writing("vllm/big.txt")
    proj.killed(*command)
    assert (proj.tree / ".git" / "index.lock").exists()
    assert (proj.tree / ".git" / "rebase-apply").exists()


@pytest.mark.parametrize("command", ["apply", "clean", "patches"])
def test_a_killed_git_am_is_recovered(project, command):
    _one_patch(project)
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


def test_a_killed_rebase_git_is_recovered(project, index):
    project.ok("apply")
    project.commit("[ROCm] Add big", {"vllm/big.txt": "x\n"})
    project.ok("patches")
    index.add(*project.release(V1))
    index.add(*project.release(V2, release_files(V2, "g7654321"), commit="g7654321"))
    project.index_url = index.url
    project.kill_git_writing("vllm/big.txt")
    project.killed("rebase", V2)  # inside `git rebase`, while it holds index.lock
    assert (project.tree / ".git" / "index.lock").exists()
    assert (project.tree / ".git" / "rebase-merge").exists()
    result = project.run("rebase", V2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the last `make rebase` was killed inside git" in result.stdout
    assert f"rebased onto vLLM {V2}" in result.stdout
    assert not (project.tree / ".git" / "index.lock").exists()
    assert project.git("log", "--format=%s", f"vllm-{V2}..HEAD") == "[ROCm] Add big"
    assert project.git("status", "--porcelain", "--untracked-files=all") == ""


# --- ignored work, worktrees anywhere, FORCE only when typed -------------------------

# Ignored by the release's .gitignore, made by nobody but the user.
IGNORED_WORK = ["vllm/models/rope_hip.py", "benchmarks/results/run.json", "sweep.csv", ".env",
                "vllm/third_party/dep/mine.py"]


def test_clean_keeps_ignored_work_and_deletes_what_the_tooling_made(stacked):
    for path in IGNORED_WORK:
        (stacked.tree / path).parent.mkdir(parents=True, exist_ok=True)
        (stacked.tree / path).write_text("# mine\n")
    # What the python-only build and Python leave: remade on the next `make build`
    # (the wheel's files, copied) and the next import (bytecode of a source there).
    made = {"vllm/_C.abi3.so": hashlib.sha256(V1.encode()).digest() * 64,
            "vllm/models/__pycache__/foo.cpython-311.pyc": b"pyc",
            WHEEL_COPY[0]: WHEEL_COPY[1]}
    for path, data in made.items():
        (stacked.tree / path).parent.mkdir(parents=True, exist_ok=True)
        (stacked.tree / path).write_bytes(data)
    result = stacked.run("clean")
    assert_refused_and_kept(stacked, result, "ignored files", *IGNORED_WORK)
    assert not any(path in result.stderr for path in made), result.stderr
    assert all((stacked.tree / path).exists() for path in IGNORED_WORK)
    forced = stacked.ok("clean", "--force")
    assert all(path in forced.stdout for path in IGNORED_WORK)
    assert not stacked.tree.exists()


# Named as the tooling's excludes name build outputs (*.so, *.pyc, /build/,
# /.deps/), made by the user: kept and named all the same.
LOOK_ALIKE = ["vllm/models/mine.abi3.so", "vllm/models/mine.pyc", "build/lib/mine.py",
              ".deps/cutlass/mine.h", "vllm/models/__pycache__/gone.cpython-311.pyc"]


def test_clean_keeps_files_that_look_like_build_outputs_but_the_tooling_did_not_make(
        stacked):
    """Only what the tooling itself made goes without asking: what `make build`
    wrote (recorded in the state file, as long as nobody changed it), the
    wheel's files and Python's bytecode of a source that is there."""
    from scripts.stack.gitrepo import ignored_stats, record_build_outputs

    before = ignored_stats(stacked.tree)
    built = stacked.tree / "build" / "temp" / "setup.o"  # as a build writes it
    built.parent.mkdir(parents=True)
    built.write_bytes(b"obj")
    record_build_outputs(stacked.tree, before)
    for path in LOOK_ALIKE:
        (stacked.tree / path).parent.mkdir(parents=True, exist_ok=True)
        (stacked.tree / path).write_bytes(b"mine\n")
    result = stacked.run("clean")
    assert_refused_and_kept(stacked, result, "ignored files", *LOOK_ALIKE)
    assert "build/temp/setup.o" not in result.stderr
    assert all((stacked.tree / path).exists() for path in LOOK_ALIKE)
    # Changed since the build wrote it: someone's work now.
    built.write_bytes(b"obj, edited")
    os.utime(built, ns=(1, 1))
    assert "build/temp/setup.o" in stacked.run("clean").stderr


def test_clean_keeps_worktrees_whatever_their_path(stacked, tmp_path):
    odd = tmp_path / "wt\nwith a newline"
    moved = tmp_path / "wt-moved"
    stacked.git("worktree", "add", "-q", "-b", "odd", str(odd))
    stacked.git("worktree", "add", "-q", "-b", "moved", str(moved))
    moved.rename(tmp_path / "wt-moved-here")
    result = stacked.run("clean")
    assert_refused_and_kept(stacked, result, repr(str(odd)), "(on odd)", str(moved),
                            "(on moved), whose folder is missing", "worktree repair")


@needs_make
@pytest.mark.parametrize("how", ["MAKEFLAGS", "parent-make"])
def test_force_from_makeflags_or_a_parent_make_does_not_force(stacked, tmp_path, how):
    (stacked.tree / "vllm/models/wip.py").write_text("# work in progress\n")
    stacked.git("stash", "-u")
    make = ["make", "-s", "-C", str(REPO), f"PYTHON={PYTHON}", "clean"]
    env = stacked.env()
    if how == "MAKEFLAGS":
        env["MAKEFLAGS"] = "FORCE=1"
    else:  # FORCE=1 given to a make whose recipe runs `make clean`
        parent = tmp_path / "parent.mk"
        parent.write_text("all:\n\t" + " ".join(["$(MAKE)", *make[1:]]) + "\n")
        make = ["make", "-s", "-f", str(parent), "FORCE=1"]
    result = subprocess.run(make, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "FORCE=1 is ignored: it reached make through MAKEFLAGS" in result.stderr
    assert stacked.git("stash", "list")


# --- killed half-way: the next run finishes or restores ----------------------------------


def test_apply_killed_inside_its_checkout_is_recovered(stacked):
    # A pulled change to patch 2 makes apply check out the base and apply again.
    patch = stacked.patches / PATCH_2
    patch.write_text(patch.read_text().replace("[ROCm] Add the new model",
                                               "[ROCm] Add the new model for MI300", 1))
    stacked.kill_git_writing("vllm/models/foo.py")  # the base's foo.py: in the checkout
    stacked.killed("apply")
    assert not (stacked.tree / "vllm/models/new.py").exists()  # deleted by the checkout
    result = stacked.run("apply")
    assert result.returncode == 0, result.stderr
    assert "uncommitted" not in result.stderr
    assert "killed half-way" in result.stdout
    assert subjects(stacked) == [SUBJECT_1, "[ROCm] Add the new model for MI300"]
    assert stacked.git("status", "--porcelain", "--untracked-files=all") == ""


RENAMED = "rocm-add-the-newer-model.patch"


@pytest.mark.parametrize("kill", [
    "SIGKILL open 1 after os.remove 1 in /patches/",  # the old patch deleted
    "SIGKILL os.rename 1 in /patches/.series.",  # the new series not yet in place
], ids=["after-removing-the-old-name", "before-the-new-series"])
def test_patches_killed_while_renaming_a_patch_is_finished_next_time(stacked, kill):
    stacked.git("commit", "-q", "--amend", "-m", f"[ROCm] Add the newer model\n\n{RATIONALE}"
                f"\n\n{SIGNOFF}")
    result = stacked.run("patches", fault=kill)
    assert result.returncode == -9, result.stderr
    result = stacked.run("apply")
    assert result.returncode == 0, result.stderr
    assert stacked.series() == [PATCH_1, RENAMED]
    assert not (stacked.patches / PATCH_2).exists()
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout
