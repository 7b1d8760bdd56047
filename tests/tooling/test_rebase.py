"""`rebase <version>`: move the stack onto another (fake) release served by the index."""

from __future__ import annotations

import shutil

import pytest

from scripts.stack.pin import Pin, render_pin
from tests.tooling.conftest import (
    FOO_V1,
    RATIONALE,
    PATCH_1,
    PATCH_2,
    SUBJECT_1,
    SUBJECT_2,
    V1,
    V2,
    artifact_of,
    release_files,
)

COMMIT_V2 = "g7654321"
# Upstream changed a line inside patch 1's context, two lines away from its change:
# plain `git am` fails, a 3-way merge succeeds.
FOO_V2_MERGEABLE = FOO_V1.replace("def forward(x):", "def forward(x, scale=1):")
# Upstream changed the very line patch 1 changes: a real conflict.
FOO_V2_CONFLICT = FOO_V1.replace("BLOCK = 16", "BLOCK = 32")


@pytest.fixture
def upstream(stacked, index):
    """Serve 0.1.0 and a 0.2.0 whose foo.py is `foo_v2`; returns a setter."""
    index.add(*stacked.release(V1))

    def publish(foo_v2: str):
        files = release_files(V2, COMMIT_V2)
        files["vllm/models/foo.py"] = foo_v2.encode()
        sdist, wheel = stacked.release(V2, files, commit=COMMIT_V2)
        index.add(sdist, wheel)
        stacked.index_url = index.url
        return sdist, wheel
    return publish


def subjects(proj, base: str) -> list[str]:
    return proj.git("log", "--reverse", "--format=%s", f"{base}..HEAD").splitlines()


def test_rebase_with_a_3way_merge_succeeds(stacked, upstream, index):
    sdist, wheel = upstream(FOO_V2_MERGEABLE)
    old_head = stacked.head()
    old_patch_2 = (stacked.patches / PATCH_2).read_bytes()
    result = stacked.ok("rebase", V2)
    assert f"rebased onto vLLM {V2}; pin.toml, patches/" in result.stdout
    # pin.toml: the new release with the index's sizes and hashes, the upstream commit.
    expected = Pin(V2, COMMIT_V2, f"vllm-{V2}", artifact_of(sdist), artifact_of(wheel))
    assert (stacked.root / "pin.toml").read_text() == render_pin(expected)
    assert index.downloads(sdist.name) == 1 and index.downloads(wheel.name) == 0
    # The patches were re-exported onto the new release, the series kept.
    assert stacked.series() == [PATCH_1, PATCH_2]
    patch_1 = (stacked.patches / PATCH_1).read_text()
    assert " def forward(x, scale=1):" in patch_1 and "+BLOCK = 64" in patch_1
    assert (stacked.patches / PATCH_2).read_bytes() == old_patch_2
    # build/vllm: stack on the new tag, the old stack kept as a branch.
    tree = stacked
    assert tree.git("symbolic-ref", "--short", "HEAD") == "stack"
    assert tree.git("rev-parse", f"stack-{V1}") == old_head
    assert tree.git("rev-parse", f"vllm-{V2}^") == tree.git("rev-parse", f"vllm-{V1}")
    assert subjects(tree, f"vllm-{V2}") == [SUBJECT_1, SUBJECT_2]
    assert tree.git("branch", "--list", f"rebase-{V2}") == ""
    assert tree.git("status", "--porcelain", "--untracked-files=all") == ""
    state = tree.state()
    assert state["base_tag"] == f"vllm-{V2}" and state.get("rebase") is None
    assert state["base_sdist_sha256"] == expected.sdist.sha256
    assert (tree.tree / "vllm/_version.py").read_text().startswith(
        f"__version__ = version = '{V2}'")
    assert (tree.tree / "vllm/models/foo.py").read_text() == \
        FOO_V2_MERGEABLE.replace("BLOCK = 16", "BLOCK = 64")
    assert stacked.manifest()["vllm_version"] == V2
    # The stack is consistent afterwards.
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout
    assert "2 patch(es) already applied" in stacked.ok("apply").stdout


def test_rebase_names_the_patches_upstream_changed_under(stacked, upstream):
    upstream(FOO_V2_MERGEABLE)
    result = stacked.ok("rebase", V2)
    assert f"upstream changed files these patches change, review them: {PATCH_1}" \
        in result.stdout


def test_rebase_stops_at_a_conflict_then_finishes_after_resolution(stacked, upstream):
    sdist, wheel = upstream(FOO_V2_CONFLICT)
    pin_before = (stacked.root / "pin.toml").read_bytes()
    patches_before = stacked.patch_bytes()
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{PATCH_1} conflicts with vLLM {V2} in: vllm/models/foo.py" in result.stderr
    assert f"make rebase VLLM_VERSION={V2}" in result.stderr
    assert (stacked.root / "pin.toml").read_bytes() == pin_before
    assert stacked.patch_bytes() == patches_before
    assert stacked.git("rev-parse", f"stack-{V1}")  # the old stack is kept
    assert (stacked.tree / ".git" / "rebase-merge").exists()

    # While the rebase is stopped, apply refuses and another version is refused.
    blocked = stacked.run("apply")
    assert blocked.returncode == 1 and "make rebase-abandon" in blocked.stderr
    other = stacked.run("rebase", "0.3.0")
    assert other.returncode == 1
    assert f"a rebase to vLLM {V2} is in progress" in other.stderr

    # Resolve as a maintainer would, then go on.
    resolved = FOO_V2_CONFLICT.replace("BLOCK = 32", "BLOCK = 64")
    (stacked.tree / "vllm/models/foo.py").write_text(resolved)
    stacked.git("add", "vllm/models/foo.py")
    result = stacked.ok("rebase", V2)
    assert f"rebased onto vLLM {V2}; pin.toml, patches/" in result.stdout
    expected = Pin(V2, COMMIT_V2, f"vllm-{V2}", artifact_of(sdist), artifact_of(wheel))
    assert (stacked.root / "pin.toml").read_text() == render_pin(expected)
    assert stacked.series() == [PATCH_1, PATCH_2]
    patch_1 = (stacked.patches / PATCH_1).read_text()
    assert "-BLOCK = 32\n+BLOCK = 64\n" in patch_1
    assert (stacked.patches / PATCH_2).read_bytes() == patches_before[PATCH_2]
    assert (stacked.tree / "vllm/models/foo.py").read_text() == resolved
    assert subjects(stacked, f"vllm-{V2}") == [SUBJECT_1, SUBJECT_2]
    assert not (stacked.tree / ".git" / "rebase-merge").exists()
    assert stacked.state().get("rebase") is None
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout


def test_rebase_to_a_version_the_index_lacks_changes_nothing(stacked, upstream):
    upstream(FOO_V2_MERGEABLE)
    head, pin = stacked.head(), (stacked.root / "pin.toml").read_bytes()
    result = stacked.run("rebase", "0.9.0")
    assert result.returncode == 1
    assert "cannot download vllm-0.9.0.tar.gz" in result.stderr
    assert (stacked.root / "pin.toml").read_bytes() == pin
    assert stacked.head() == head
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack"
    assert stacked.git("tag") == f"vllm-{V1}"


def test_rebase_refuses_the_current_version_and_bad_input(stacked):
    result = stacked.run("rebase", V1)
    assert result.returncode == 1 and f"already on vLLM {V1}" in result.stderr
    result = stacked.run("rebase", "../1.0")
    assert result.returncode == 1 and "is not a vLLM version" in result.stderr


def test_rebase_refuses_unexported_work(stacked, upstream):
    upstream(FOO_V2_MERGEABLE)
    (stacked.tree / "vllm/models/bar.py").write_text("# wip\n")
    pin = (stacked.root / "pin.toml").read_bytes()
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "vllm/models/bar.py" in result.stderr and "make rebase" in result.stderr
    assert (stacked.tree / "vllm/models/bar.py").read_text() == "# wip\n"
    assert (stacked.root / "pin.toml").read_bytes() == pin


def test_only_an_explicit_skip_drops_a_patch(stacked, upstream):
    """`git rebase --abort` puts branch rebase-<v> back on the old stack; the next
    `make rebase` applies the patch again. Only `git rebase --skip` drops it."""
    upstream(FOO_V2_CONFLICT)
    for _ in range(2):
        result = stacked.run("rebase", V2)
        assert result.returncode == 1 and f"{PATCH_1} conflicts" in result.stderr
        stacked.git("rebase", "--abort")
    result = stacked.run("rebase", V2)
    assert result.returncode == 1 and f"{PATCH_1} conflicts" in result.stderr
    stacked.git("rebase", "--skip")
    result = stacked.ok("rebase", V2)
    assert f"dropped {PATCH_1}: git's rebase left nothing of it" in result.stdout
    assert stacked.series() == [PATCH_2]
    assert subjects(stacked, f"vllm-{V2}") == [SUBJECT_2]


@pytest.fixture
def upstream_without_foo(stacked, index):
    """Serve 0.1.0 and a 0.2.0 that deleted vllm/models/foo.py (which patch 1 changes)."""
    index.add(*stacked.release(V1))
    files = release_files(V2, COMMIT_V2)
    del files["vllm/models/foo.py"]
    index.add(*stacked.release(V2, files, commit=COMMIT_V2))
    stacked.index_url = index.url


def test_a_patch_whose_file_upstream_deleted_is_not_called_a_conflict(stacked,
                                                                     upstream_without_foo):
    """Before: "conflicts ... resolve, `git add`", which brings the deleted file back."""
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"upstream deleted vllm/models/foo.py in vLLM {V2}, and {PATCH_1} changes it: " \
        "drop the patch" in result.stderr
    assert "conflicts with" not in result.stderr
    # Dropping it, as the message says, finishes the rebase.
    stacked.git("rebase", "--skip")
    result = stacked.ok("rebase", V2)
    assert f"dropped {PATCH_1}" in result.stdout
    assert stacked.series() == [PATCH_2]
    assert not (stacked.tree / "vllm/models/foo.py").exists()


def test_starting_again_never_resets_a_branch_holding_resolved_patches(stacked, upstream):
    """The old give-up recipe (am --abort, checkout stack, state entry removed by
    hand) left rebase-<v> holding the resolution; the next rebase reset it."""
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    (stacked.tree / "vllm/models/foo.py").write_text(
        FOO_V2_CONFLICT.replace("BLOCK = 32", "BLOCK = 64"))
    stacked.git("add", "vllm/models/foo.py")
    stacked.git("-c", "core.editor=:", "rebase", "--continue")
    resolved = stacked.git("rev-parse", f"rebase-{V2}")
    stacked.git("checkout", "-q", "stack")
    state = stacked.state()
    del state["rebase"]
    state["status"] = "applied"
    stacked.state_file.write_text(__import__("json").dumps(state))
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert f"branch rebase-{V2} in build/vllm holds 2 commit(s) of an earlier rebase" \
        in result.stderr
    assert stacked.git("rev-parse", f"rebase-{V2}") == resolved
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack"


def test_abandon_goes_back_to_the_old_stack_and_keeps_the_work_as_a_branch(stacked, upstream):
    upstream(FOO_V2_CONFLICT)
    old_head = stacked.head()
    pin, patches = (stacked.root / "pin.toml").read_bytes(), stacked.patch_bytes()
    result = stacked.run("rebase", V2)
    assert "to give up: `make rebase-abandon`" in result.stderr
    half = FOO_V2_CONFLICT.replace("BLOCK = 32", "BLOCK = 48  # half resolved")
    (stacked.tree / "vllm/models/foo.py").write_text(half)
    stacked.no_git_identity()  # as on a fresh machine (CI)
    result = stacked.ok("rebase", "--abandon")
    assert f"abandoned the rebase to vLLM {V2}: build/vllm is back on branch stack" \
        in result.stdout
    assert f"kept as branch abandoned-rebase-{V2}" in result.stdout
    # Back where it was, nothing changed in the project.
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack"
    assert stacked.head() == old_head
    assert not (stacked.tree / ".git" / "rebase-merge").exists()
    assert stacked.state().get("rebase") is None
    assert (stacked.root / "pin.toml").read_bytes() == pin
    assert stacked.patch_bytes() == patches
    assert stacked.git("status", "--porcelain") == ""
    # The half-done resolution is the kept branch's last commit, on the new release.
    kept = f"abandoned-rebase-{V2}"
    assert stacked.git("show", f"{kept}:vllm/models/foo.py") + "\n" == half
    assert stacked.git("rev-parse", f"{kept}^") == stacked.git("rev-parse", f"vllm-{V2}")
    assert "2 patch(es) already applied" in stacked.ok("apply").stdout
    # A second rebase starts afresh, and its own abandon keeps its own branch.
    assert stacked.run("rebase", V2).returncode == 1
    assert "2" in stacked.ok("rebase", "--abandon").stdout.split("kept as branch ")[1]
    assert stacked.git("rev-parse", kept)


def test_abandon_without_a_rebase_says_so(stacked):
    result = stacked.run("rebase", "--abandon")
    assert result.returncode == 1
    assert "no rebase is in progress in build/vllm: nothing to abandon" in result.stderr


def test_a_dropped_patch_takes_its_committed_notes_along(stacked, upstream_without_foo):
    """Before: patches/notes/<dropped>.md stayed, and the next `make check` failed."""
    notes = stacked.patches / "notes"
    notes.mkdir()
    stem_1, stem_2 = PATCH_1.removesuffix(".patch"), PATCH_2.removesuffix(".patch")
    (notes / f"{stem_1}.md").write_text("# notes of patch 1\n")
    (notes / f"{stem_2}.md").write_text("# notes of patch 2\n")
    stacked.git("init", "-q", cwd=stacked.root)
    stacked.git("add", "patches", cwd=stacked.root)
    stacked.git("commit", "-q", "-m", "project", cwd=stacked.root)
    assert stacked.run("rebase", V2).returncode == 1
    stacked.git("rebase", "--skip")
    result = stacked.ok("rebase", V2)
    assert f"removed patches/notes/{stem_1}.md: its patch left the series" in result.stdout
    assert sorted(p.name for p in notes.iterdir()) == [f"{stem_2}.md"]
    assert "check OK: 1 patch(es)" in stacked.ok("check").stdout


def test_the_notes_of_a_dropped_patch_are_kept_when_not_committed_as_they_are(
        stacked, upstream_without_foo):
    notes = stacked.patches / "notes"
    notes.mkdir()
    note = notes / f"{PATCH_1.removesuffix('.patch')}.md"
    note.write_text("# written today, never committed\n")
    assert stacked.run("rebase", V2).returncode == 1
    stacked.git("rebase", "--skip")
    result = stacked.ok("rebase", V2)
    assert f"kept patches/notes/{note.name}: its patch left the series" in result.stderr
    assert note.read_text() == "# written today, never committed\n"


def test_a_renamed_patch_keeps_its_notes(stacked):
    """A changed subject renames the patch file: to the export that is one patch
    dropped and one added, and the notes must not go with the "dropped" one."""
    notes = stacked.patches / "notes"
    notes.mkdir()
    note = notes / f"{PATCH_2.removesuffix('.patch')}.md"
    note.write_text("# notes of patch 2\n")
    stacked.git("init", "-q", cwd=stacked.root)
    stacked.git("add", "patches", cwd=stacked.root)
    stacked.git("commit", "-q", "-m", "project", cwd=stacked.root)
    message = stacked.git("log", "-1", "--format=%B").replace(SUBJECT_2, "[ROCm] Add a new model")
    stacked.git("commit", "-q", "--amend", "-F", "-", input=message)
    result = stacked.ok("patches")
    assert f"kept patches/notes/{note.name}: its patch left the series while " \
        "rocm-add-a-new-model.patch joined it" in result.stderr
    assert note.read_text() == "# notes of patch 2\n"


# --- what a maintainer does during a stop, and kills: the rebase neither lies nor loses ---


RESOLVED = FOO_V2_CONFLICT.replace("BLOCK = 32", "BLOCK = 64")


def resolve_patch_1(stacked) -> None:
    (stacked.tree / "vllm/models/foo.py").write_text(RESOLVED)
    stacked.git("add", "vllm/models/foo.py")


def abort_what_git_holds(stacked) -> None:
    """What the tooling's advice at a stop used to lead to: abort git's operation."""
    for folder, command in (("rebase-merge", "rebase"), ("rebase-apply", "am")):
        if (stacked.tree / ".git" / folder).exists():
            stacked.git(command, "--abort")


def test_a_give_up_and_a_restart_reuse_the_resolution(stacked, upstream):
    """Before: the restart stopped at the same conflict; the resolution was lost."""
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    stacked.ok("rebase", "--abandon")
    result = stacked.ok("rebase", V2)
    assert "reused the recorded resolution" in result.stdout
    assert "-BLOCK = 32\n+BLOCK = 64\n" in (stacked.patches / PATCH_1).read_text()
    assert stacked.series() == [PATCH_1, PATCH_2]


def test_a_resolved_patch_keeps_the_headings_of_its_message(stacked, upstream):
    """Before: git took "## Purpose" for a comment when it committed a resolution."""
    message = stacked.git("log", "-1", "--format=%B", "HEAD~1")
    stacked.git("checkout", "-q", "HEAD~1")
    stacked.git("commit", "-q", "--amend", "-F", "-", input=message.replace(
        RATIONALE, "## Purpose\n\n" + RATIONALE + "\n\n## Test Plan\n\nrun it"))
    stacked.git("cherry-pick", "stack")
    stacked.git("branch", "-f", "stack", "HEAD")
    stacked.git("checkout", "-q", "stack")
    stacked.ok("patches")
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    stacked.ok("rebase", V2)
    text = (stacked.patches / PATCH_1).read_text()
    assert "\n## Purpose\n" in text and "\n## Test Plan\n" in text
    assert "Conflicts:" not in text


def test_a_commit_made_during_a_stop_drops_no_patch(stacked, upstream):
    """Before: the resolution committed by hand was counted as the next patch,
    which was never applied; a `--fixup` made then became a patch of its own."""
    upstream(FOO_V2_CONFLICT)
    old_patch_2 = (stacked.patches / PATCH_2).read_bytes()
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    message = stacked.git("log", "-1", "--format=%B", f"stack-{V1}~1")
    stacked.git("commit", "-q", "-F", "-", input=message)  # the resolution, by hand
    (stacked.tree / "vllm/models/foo.py").write_text(RESOLVED + "# reviewed\n")
    stacked.git("commit", "-q", "-a", "--fixup=HEAD")  # the habit the docs teach
    result = stacked.run("rebase", V2)
    assert result.returncode == 0, result.stderr
    assert stacked.series() == [PATCH_1, PATCH_2]
    assert (stacked.patches / PATCH_2).read_bytes() == old_patch_2
    assert "+# reviewed\n" in (stacked.patches / PATCH_1).read_text()
    assert subjects(stacked, f"vllm-{V2}") == [SUBJECT_1, SUBJECT_2]


def test_a_commit_that_takes_a_stopped_patch_along_is_refused(stacked, upstream):
    """git counts any commit made at a conflict stop as the patch itself: a
    `--fixup` that took the staged resolution would fold the patch away."""
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    stacked.git("commit", "-q", "--fixup=HEAD")
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "took that patch's resolution along" in result.stderr
    assert "git -C build/vllm reset --soft" in result.stderr
    stacked.git("reset", "-q", "--soft", "HEAD~1")
    stacked.ok("rebase", V2)
    assert stacked.series() == [PATCH_1, PATCH_2]


def test_an_untracked_file_in_the_way_is_named_and_never_committed(stacked, upstream):
    """Before: git aborted the patch's `am`, the advice was "resolve, git add", and
    following it committed the user's file as the patch."""
    upstream(FOO_V2_CONFLICT)
    old_patch_2 = (stacked.patches / PATCH_2).read_bytes()
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    mine = stacked.tree / "vllm/models/new.py"
    mine.write_text("# my own scratch file\n")
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "untracked vllm/models/new.py in build/vllm stand where the patch writes" \
        in result.stderr
    assert "do not `git add` them" in result.stderr
    stacked.git("add", "vllm/models/new.py")  # what the old advice said
    result = stacked.run("rebase", V2)
    assert result.returncode == 1, result.stdout
    assert "would be committed as that patch" in result.stderr
    stacked.git("restore", "--staged", "vllm/models/new.py")
    mine.rename(stacked.root / "new.py.mine")
    stacked.ok("rebase", V2)
    assert (stacked.root / "new.py.mine").read_text() == "# my own scratch file\n"
    assert (stacked.patches / PATCH_2).read_bytes() == old_patch_2


def test_a_resume_from_another_branch_is_refused(stacked, upstream):
    """Before: `git am --abort`, `git checkout stack` (make apply's advice), and the
    rerun "finished" on the old stack, writing the new release into pin.toml."""
    upstream(FOO_V2_CONFLICT)
    pin = (stacked.root / "pin.toml").read_bytes()
    assert stacked.run("rebase", V2).returncode == 1
    abort_what_git_holds(stacked)
    stacked.git("checkout", "-q", "stack")
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert f"build/vllm is on stack, not on branch rebase-{V2}" in result.stderr
    assert f"git -C build/vllm checkout rebase-{V2}" in result.stderr
    assert (stacked.root / "pin.toml").read_bytes() == pin
    stacked.git("checkout", "-q", f"rebase-{V2}")
    assert stacked.run("rebase", V2).returncode == 1  # stops at the conflict again
    resolve_patch_1(stacked)
    stacked.ok("rebase", V2)
    assert stacked.series() == [PATCH_1, PATCH_2]


def test_an_edit_to_pin_toml_during_a_rebase_is_refused(stacked, upstream):
    """Before: the finish overwrote it."""
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    resolve_patch_1(stacked)
    pin = stacked.root / "pin.toml"
    edited = pin.read_text() + "# a note of mine\n"
    pin.write_text(edited)
    patches = stacked.patch_bytes()
    result = stacked.run("rebase", V2)
    assert result.returncode == 1
    assert "changed since `make rebase` began: pin.toml" in result.stderr
    assert pin.read_text() == edited and stacked.patch_bytes() == patches
    pin.write_text(edited.removesuffix("# a note of mine\n"))
    stacked.ok("rebase", V2)


@pytest.mark.parametrize("command", ["overlay", "apply", "patches", "check", "clean"])
def test_commands_that_write_wait_for_a_rebase(stacked, upstream, command):
    """Before: `make overlay` wrote an overlay of the wrong release; the others
    advised steps (`git am --abort`, `make patches`) that led to a false finish."""
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    overlay = stacked.manifest()
    result = stacked.run(command)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"finish it with `make rebase VLLM_VERSION={V2}`, or give it up with " \
        "`make rebase-abandon`" in result.stderr
    assert "git am" not in result.stderr
    assert stacked.manifest() == overlay and stacked.tree.is_dir()


def test_a_damaged_rebase_entry_is_one_line(stacked, upstream):
    upstream(FOO_V2_CONFLICT)
    assert stacked.run("rebase", V2).returncode == 1
    state = stacked.state()
    state["rebase"]["pin"] = "0.2.0"
    stacked.state_file.write_text(__import__("json").dumps(state))
    result = stacked.run("rebase", V2)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "its rebase entry is damaged; give the rebase up with `make rebase-abandon`" \
        in result.stderr
    stacked.ok("rebase", "--abandon")
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack"


# --- kills --------------------------------------------------------------------------


def test_a_kill_during_the_switch_to_the_release_is_recovered(stacked, index):
    """Before: a half-switched tree and index.lock; every next command advised
    committing the half-switched files, and rebase-abandon saw no rebase."""
    index.add(*stacked.release(V1))
    files = release_files(V2, COMMIT_V2)
    files["csrc/attention.cu"] = b"// kernel, 0.2.0\n"
    index.add(*stacked.release(V2, files, commit=COMMIT_V2))
    stacked.index_url = index.url
    stacked.kill_git_writing("attention.cu")
    stacked.killed("rebase", V2)
    result = stacked.ok("rebase", V2)
    assert "killed inside git" in result.stdout
    assert stacked.series() == [PATCH_1, PATCH_2]
    assert (stacked.tree / "csrc/attention.cu").read_text() == "// kernel, 0.2.0\n"
    assert stacked.git("status", "--porcelain", "--untracked-files=all") == ""
    assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack"


def test_a_kill_at_any_file_step_of_a_rebase_is_recovered(stacked, upstream, tmp_path):
    """SIGKILL at each rename the rebase makes (the state file, the finish's
    moves, the branch deletion between them), then the same command again: the
    same patches/ and pin.toml as a run that was never killed. Before: a kill
    after the finish deleted its branch left a raw git error on every later run."""
    upstream(FOO_V2_MERGEABLE)
    saved = tmp_path / "saved"
    shutil.copytree(stacked.root, saved, symlinks=True)
    stacked.ok("rebase", V2)
    clean = (stacked.patch_bytes(), (stacked.root / "pin.toml").read_bytes())
    for n in range(1, 60):
        shutil.rmtree(stacked.root)
        shutil.copytree(saved, stacked.root, symlinks=True)
        killed = stacked.run("rebase", V2, fault=f"SIGKILL os.rename {n}")
        if killed.returncode == 0:
            break  # fewer than n renames: every one was killed once
        assert killed.returncode == -9, (n, killed.stderr)
        again = stacked.run("rebase", V2)
        assert again.returncode == 0, (n, again.stderr)
        assert (stacked.patch_bytes(), (stacked.root / "pin.toml").read_bytes()) == clean, n
        assert stacked.git("symbolic-ref", "--short", "HEAD") == "stack", n
    else:
        raise AssertionError("the rebase never ran to its end")
    assert n > 5


def test_a_write_that_fails_in_the_finish_is_completed_by_the_next_run(stacked, upstream):
    """The finish writes pin.toml, patches/ and vllm_overlay/ after its journal:
    a write that fails there (a full disk) leaves the rebase in progress, other
    commands refused, and the same command completes it."""
    upstream(FOO_V2_MERGEABLE)
    failed = stacked.run("rebase", V2, fault="ENOSPC open 2 in k3-tmp")  # the first patch
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert "finishing" in stacked.state()["rebase"]
    assert stacked.run("apply").returncode == 1
    result = stacked.ok("rebase", V2)
    assert f"rebased onto vLLM {V2}; pin.toml, patches/" in result.stdout
    assert stacked.series() == [PATCH_1, PATCH_2]
    assert " def forward(x, scale=1):" in (stacked.patches / PATCH_1).read_text()
    assert "check OK: 2 patch(es)" in stacked.ok("check").stdout
