"""`python3 -m scripts mutate`: each defect put back in the patch that has the
code, and the `make test` of a scratch copy asked what catches it.

The `make test` that runs here is a stand-in project's (`--project`): it fails
a row when the tree it tests has the defect, so the test checks the driver
(the scratch project, the mutated stack, the report), not the real suite.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from scripts.common import Layout, StackError
from scripts.testing import mutate
from scripts.testing.testcache import keyed_environment
from tests.tooling.conftest import FOO_PATCHED, SUBJECT_1, V1

DEFECT = mutate.Mutation("small-block", "foo's block is back to 32", "vllm/models/foo.py",
                         "BLOCK = 64", "BLOCK = 32")
CONTROL = mutate.Mutation("rename", "none", "vllm/models/foo.py", "def backward(x):",
                          "def backward(x):  # a comment", control=True)
# A make test that fails its row "stack" when build/vllm has BLOCK = 32.
FAKE_TEST = textwrap.dedent('''\
    import json, sys
    from pathlib import Path

    root = Path.cwd()
    results = root / "build" / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    foo = (root / "build" / "vllm" / "vllm" / "models" / "foo.py").read_text()
    failed = int("BLOCK = 32" in foo)
    part = {"command": "pytest tests/test_foo.py", "failed": failed}
    summary = {"rows": [{"name": "stack", "failed": failed, "parts": [part]},
                        {"name": "tooling", "failed": 0, "parts": []}]}
    (results / "summary.json").write_text(json.dumps(summary))
    sys.exit(failed)
''')


# The project Makefile's shape: test needs build, which needs apply (here a
# failure: re-applying the patches would undo the mutation), and make exports
# variables of its own, empty unless given.
FAKE_MAKEFILE = textwrap.dedent('''\
    export TARGET
    PYTHON ?= python3
    build: apply
    \t$(PYTHON) -m scripts build
    apply:
    \t@echo "apply ran over the mutated stack"; exit 3
    test: build
    \t$(PYTHON) -m scripts test
''')


@pytest.fixture
def stand_in(stacked, tmp_path):
    """The stacked project with venvs, and a project whose make test is FAKE_TEST."""
    layout = Layout(stacked.root)
    for venv in (layout.venv, layout.lint_venv):
        (venv / "bin").mkdir(parents=True)
    other = tmp_path / "other"
    (other / "scripts").mkdir(parents=True)
    (other / "Makefile").write_text(FAKE_MAKEFILE)
    (other / "scripts" / "__init__.py").write_text("")
    (other / "scripts" / "__main__.py").write_text(FAKE_TEST)
    stacked.layout, stacked.other = layout, other
    return stacked


def test_a_mutation_goes_into_every_patch_that_has_the_code(stand_in, tmp_path):
    clone = tmp_path / "clone"
    stand_in.git("clone", "-q", "--shared", "--no-checkout", str(stand_in.tree), str(clone))
    assert mutate._mutated_stack(stand_in.layout, clone, DEFECT) == [1]
    log = stand_in.git("log", "--format=%s|%an", f"vllm-{V1}..stack", cwd=clone)
    assert log.splitlines()[-1].startswith(SUBJECT_1 + "|")  # message and author kept
    for rev in ("stack", "stack~1"):  # patch 2 builds on the mutated patch 1
        assert "BLOCK = 32" in stand_in.git("show", f"{rev}:vllm/models/foo.py", cwd=clone)
    assert stand_in.git("rev-parse", f"vllm-{V1}^{{tree}}", cwd=clone) == stand_in.git(
        "rev-parse", f"vllm-{V1}^{{tree}}")
    assert (clone / "vllm/models/foo.py").read_text() == FOO_PATCHED.replace("64", "32")
    # build/vllm itself is untouched.
    assert "BLOCK = 64" in (stand_in.tree / "vllm/models/foo.py").read_text()


def test_a_mutation_the_stack_no_longer_has_is_named(stand_in, tmp_path):
    clone = tmp_path / "clone"
    stand_in.git("clone", "-q", "--shared", "--no-checkout", str(stand_in.tree), str(clone))
    gone = mutate.Mutation("gone", "x", "vllm/models/foo.py", "BLOCK = 128", "BLOCK = 1")
    with pytest.raises(StackError, match=r"mutation gone: no patch has 'BLOCK = 128' in "
                                         r"vllm/models/foo.py; .*update scripts/testing/mutate.py"):
        mutate._mutated_stack(stand_in.layout, clone, gone)


def test_a_mutation_the_stack_no_longer_has_stops_the_check_before_any_run(
        stand_in, monkeypatch):
    gone = mutate.Mutation("gone", "x", "vllm/models/foo.py", "BLOCK = 128", "BLOCK = 1")
    monkeypatch.setattr(mutate, "MUTATIONS", (DEFECT, gone))
    with pytest.raises(StackError, match=r"mutation gone: no patch has 'BLOCK = 128'"):
        mutate.mutate(stand_in.layout, [], project=stand_in.other)
    # Refused before the baseline ran: nothing was built or tested.
    assert not (stand_in.root / "build/mutate/baseline").exists()


def test_every_mutation_applies_to_the_stack():
    """The real MUTATIONS against patches/: each one's code is in some patch."""
    root = Path(__file__).resolve().parents[2]
    added = "".join(line[1:] for patch in sorted((root / "patches").glob("*.patch"))
                    for line in patch.read_text().splitlines(keepends=True)
                    if line.startswith("+"))
    for m in mutate.MUTATIONS:
        first_line = m.old.splitlines()[0]
        assert first_line in added, f"{m.name}: {first_line!r} is in no patch"


def test_the_report_names_what_catches_each_defect_and_checks_the_control(
        stand_in, monkeypatch, capsys):
    monkeypatch.setattr(mutate, "MUTATIONS", (DEFECT, CONTROL))
    assert mutate.mutate(stand_in.layout, [], project=stand_in.other) == 0
    report = json.loads((stand_in.root / "build/mutate/report.json").read_text())
    assert report["baseline"]["exit"] == 0
    defect, control = report["mutations"]
    assert defect["caught"] == {"stack": ["pytest tests/test_foo.py"]}
    assert defect["patches"] == [1] and defect["exit"] != 0  # make's 2
    assert control["caught"] == {} and control["exit"] == 0
    out = capsys.readouterr().out
    assert "small-block              caught" in out and "rename                   ok:" in out
    # What each scratch project ran is kept; the rest of it is not.
    assert (stand_in.root / "build/mutate/small-block/build/make-test.log").exists()
    assert not (stand_in.root / "build/mutate/small-block/build/vllm").exists()


def test_an_uncaught_defect_fails_the_check(stand_in, monkeypatch, capsys):
    quiet = mutate.Mutation("quiet", "a defect nothing tests", "vllm/models/foo.py",
                            "def backward(x):", "def backward(x):  # nothing checks this")
    monkeypatch.setattr(mutate, "MUTATIONS", (quiet,))
    assert mutate.mutate(stand_in.layout, [], project=stand_in.other) == 1
    assert "quiet                    NOT CAUGHT" in capsys.readouterr().out


def test_a_stack_that_fails_as_it_is_stops_the_check(stand_in, monkeypatch):
    (stand_in.other / "scripts" / "__main__.py").write_text("import sys\nsys.exit(1)\n")
    monkeypatch.setattr(mutate, "MUTATIONS", (DEFECT,))
    with pytest.raises(StackError, match="the stack as it is fails make test"):
        mutate.mutate(stand_in.layout, [], project=stand_in.other)


def test_an_unknown_name_is_refused(stand_in):
    with pytest.raises(StackError, match=r"unknown mutation\(s\) nope; known: stale-pointers"):
        mutate.mutate(stand_in.layout, ["nope"])


# A make test that writes an object into its clone of build/vllm on its first run
# (as a real run writes the trees it compares), and fails when a later run, in
# another scratch project, cannot read it back.
OBJECT_TEST = textwrap.dedent('''\
    import json, subprocess, sys
    from pathlib import Path

    results = Path.cwd() / "build" / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    saved = results / "object"
    git = ["git", "-C", "build/vllm"]
    if saved.exists():
        failed = subprocess.run(git + ["cat-file", "-e", saved.read_text()]).returncode != 0
    else:
        saved.write_text(subprocess.run(git + ["hash-object", "-w", "--stdin"], input="mine",
                                        capture_output=True, text=True).stdout.strip())
        failed = False
    part = {"command": "read the baseline's tree", "failed": int(failed)}
    summary = {"rows": [{"name": "stack", "failed": int(failed), "parts": [part]}]}
    (results / "summary.json").write_text(json.dumps(summary))
    sys.exit(int(failed))
''')


def test_each_mutation_reads_the_objects_of_the_baseline_it_starts_from(
        stand_in, monkeypatch, capsys):
    (stand_in.other / "scripts" / "__main__.py").write_text(OBJECT_TEST)
    monkeypatch.setattr(mutate, "MUTATIONS", (CONTROL,))
    assert mutate.mutate(stand_in.layout, [], project=stand_in.other) == 0, capsys.readouterr()
    # Once the mutations are done, the baseline's clone goes too.
    assert not (stand_in.root / "build/mutate/baseline/build/vllm").exists()


# A make test that records the environment its commands see.
ENV_TEST = textwrap.dedent('''\
    import json, os
    from pathlib import Path

    results = Path.cwd() / "build" / "test-results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "env.json").write_text(json.dumps(dict(os.environ)))
    (results / "summary.json").write_text(json.dumps({"rows": []}))
''')


def test_a_scratch_run_sees_the_environment_of_the_projects_make_test(
        stand_in, monkeypatch, capsys):
    """Every variable is in every key: a scratch run that sees other variables
    than the project's own `make test` (K3_CACHE_DIR, or none of make's exports)
    re-runs everything the project had green."""
    (stand_in.other / "scripts" / "__main__.py").write_text(ENV_TEST)
    monkeypatch.delenv("K3_CACHE_DIR", raising=False)
    monkeypatch.setattr(mutate, "MUTATIONS", (CONTROL,))
    assert mutate.mutate(stand_in.layout, [], project=stand_in.other) == 0, capsys.readouterr()
    subprocess.run(["make", "-s", "-o", "build", "test"], cwd=stand_in.other, check=True)

    def seen(project: Path) -> dict[str, str]:
        env = json.loads((project / "build/test-results/env.json").read_text())
        return keyed_environment(env)

    scratch = stand_in.root / "build/mutate/rename"
    assert seen(scratch) == seen(stand_in.other)
    assert "TARGET" in seen(scratch)  # make's export, though empty
