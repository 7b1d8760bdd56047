"""The `make test` runner's own logic: what it runs and how it counts."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from scripts.common import Layout
from scripts.testing import testrun

REGRESSION = """\
# a comment line
tests/models/test_a.py
tests/models/test_b.py::test_one   # trailing comment

--deselect tests/models/test_b.py::test_two  # needs a GPU
tests/models/test_c.py
"""


def test_regression_list_parsing_skips_comments_and_what_the_stack_runs(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / testrun.REGRESSION_LIST).write_text(REGRESSION)
    args = testrun._regression_args(Layout(tmp_path), ["tests/models/test_c.py"])
    assert args == [
        "tests/models/test_a.py",
        "tests/models/test_b.py::test_one",
        "--deselect",
        "tests/models/test_b.py::test_two",
    ]


def test_the_shipped_regression_list_parses():
    args = testrun._regression_args(Layout.default(), [])
    files = [a for a in args if a.startswith("tests/") and "::" not in a]
    assert "tests/models/test_dspark_mla.py" in files
    assert all(not a.startswith("#") for a in args)


def _junit(path: Path, tests: int, failures: int, errors: int, skipped: int) -> Path:
    path.write_text(
        f'<testsuites><testsuite tests="{tests}" failures="{failures}" '
        f'errors="{errors}" skipped="{skipped}"/></testsuites>'
    )
    return path


def test_junit_counts(tmp_path):
    part = testrun._read_junit(_junit(tmp_path / "x.xml", 10, 1, 1, 3))
    assert (part.passed, part.failed, part.skipped) == (5, 2, 3)


@pytest.mark.parametrize("content", ['<testsuites><testsuite tests="3"', "\xff",
                                     '<testsuites><testsuite tests="x"/></testsuites>'],
                         ids=["cut-short", "not-xml", "not-a-number"])
def test_a_junit_file_that_cannot_be_read_is_a_failure(tmp_path, content):
    """Nothing known is no green, and no traceback either."""
    (tmp_path / "x.xml").write_text(content)
    part = testrun._read_junit(tmp_path / "x.xml")
    assert (part.passed, part.failed, part.note) == (0, 1, "x.xml cannot be read: nothing "
                                                           "is known")


def test_missing_junit_counts_nothing(tmp_path):
    part = testrun._read_junit(tmp_path / "absent.xml")
    assert (part.passed, part.failed, part.skipped) == (0, 0, 0)


def test_regression_entries_run_as_one_process_per_folder(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / testrun.REGRESSION_LIST).write_text(REGRESSION + "tests/models/sub/test_d.py\n"
                                                    "--deselect tests/x/test_e.py::t  # x\n")
    groups = testrun._regression_groups(Layout(tmp_path), ["tests/models/test_c.py"])
    assert groups == [
        ("tests/models", ["tests/models/test_a.py", "tests/models/test_b.py::test_one",
                          "--deselect", "tests/models/test_b.py::test_two"]),
        ("tests/models/sub", ["tests/models/sub/test_d.py"]),
    ]  # tests/x has a deselect and nothing to run


@pytest.mark.parametrize(
    ("failed", "code"), [(0, 0), (1, 1)], ids=["all-passed", "one-failed"]
)
def test_summary_ends_with_the_closing_line_ci_reads(capsys, failed, code):
    outcomes = [
        testrun.Outcome("tooling", passed=3, skipped=1),
        testrun.Outcome("stack", passed=2, failed=failed),
    ]
    assert testrun._summarize(outcomes) == code
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"5 passed, {failed} failed, 1 skipped"


@pytest.mark.parametrize("outcomes", [[], [testrun.Outcome("stack")],
                                      [testrun.Outcome("stack (ROCm)", skipped=3)]],
                         ids=["no-row", "empty-row", "all-skipped"])
def test_a_run_that_checked_nothing_is_no_green(capsys, outcomes):
    """An empty result set proves nothing (issue 31, case 7: a moved release tag
    left the stack row without tests, and it said `0 passed, 0 failed`, exit 0)."""
    assert testrun._summarize(outcomes) == 1
    assert "nothing was checked" in capsys.readouterr().out


def _layout_with_this_python(root: Path) -> Layout:
    """A project whose .venv python is the interpreter running these tests, which
    has pytest (a symlink to a venv's python would lose the venv)."""
    layout = Layout(root)
    venv_python = layout.venv / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    venv_python.chmod(0o755)
    return layout


def test_pytest_without_any_test_counts_as_a_failure(tmp_path):
    """pytest exits 5 when it collects nothing: a suite that ran no test failed."""
    (tmp_path / "empty").mkdir()
    layout = _layout_with_this_python(tmp_path)
    part = testrun._pytest(layout, ["empty"], tmp_path, [tmp_path], tmp_path / "empty.log",
                           None, None)
    assert part.failed == 1 and part.note == "pytest exited 5"
    assert "no tests ran" in (tmp_path / "empty.log").read_text()


def test_a_file_that_skips_as_a_whole_is_no_failure(tmp_path):
    """pytest also exits 5 when a module skips itself (a GPU-only file on CPU):
    that file ran, and skipped, as it should."""
    (tmp_path / "test_gpu.py").write_text(
        "import pytest\n\npytest.skip('needs a GPU', allow_module_level=True)\n")
    layout = _layout_with_this_python(tmp_path)
    part = testrun._pytest(layout, ["test_gpu.py"], tmp_path, [tmp_path], tmp_path / "gpu.log",
                           None, None)
    assert (part.failed, part.skipped, part.note) == (0, 1, "")


def test_pytest_runs_without_humming_background_builds(tmp_path, monkeypatch):
    """Every vLLM import would start two background builds of humming's CUDA
    helpers (9 s of CPU); the tests run with them off, unless the user says."""
    (tmp_path / "test_env.py").write_text(
        "import os\n\n\ndef test_env():\n"
        "    assert os.environ['HUMMING_DISABLE_PARALLEL_BUILD'] == os.environ['WANTED']\n")
    layout = _layout_with_this_python(tmp_path)
    for given, wanted in [(None, "1"), ("0", "0")]:
        if given is None:
            monkeypatch.delenv("HUMMING_DISABLE_PARALLEL_BUILD", raising=False)
        else:
            monkeypatch.setenv("HUMMING_DISABLE_PARALLEL_BUILD", given)
        monkeypatch.setenv("WANTED", wanted)
        part = testrun._pytest(layout, ["test_env.py"], tmp_path, [tmp_path],
                               tmp_path / "env.log", None, None)
        assert (part.passed, part.failed) == (1, 0), (tmp_path / "env.log").read_text()


def test_a_unit_has_a_temporary_folder_of_its_own_but_shares_torch_caches(tmp_path,
                                                                          monkeypatch):
    """TMPDIR is the unit's, removed with it; torch's inductor cache, which
    lives in the temporary folder by default, stays where it was for all."""
    (tmp_path / "test_tmp.py").write_text(
        "import os\nimport tempfile\n\n\ndef test_tmp():\n"
        "    assert os.path.basename(tempfile.gettempdir()).startswith('k3-unit-')\n"
        "    assert os.environ['TORCHINDUCTOR_CACHE_DIR'] == os.environ['WANTED']\n")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("WANTED", testrun._shared_caches()["TORCHINDUCTOR_CACHE_DIR"])
    assert os.path.dirname(os.environ["WANTED"]) == tempfile.gettempdir()
    part = testrun._pytest(_layout_with_this_python(tmp_path), ["test_tmp.py"], tmp_path,
                           [tmp_path], tmp_path / "tmp.log", None, None)
    assert (part.passed, part.failed) == (1, 0), (tmp_path / "tmp.log").read_text()


def _real_hadolint() -> Path | None:
    """hadolint from .venv-lint (requirements/lint.lock), or one on PATH."""
    import shutil

    from scripts.stack.lock import LINT

    installed = LINT.python(Layout.default()).parent / "hadolint"
    found = installed if installed.exists() else shutil.which("hadolint")
    return Path(found) if found else None


def test_recipes_row_runs_hadolint_on_every_recipe(tmp_path, capsys):
    hadolint = _real_hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (make build puts it in .venv-lint)")
    bin_dir = tmp_path / ".venv-lint" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "hadolint").symlink_to(hadolint)
    docker = tmp_path / "docker"
    docker.mkdir()
    shipped = Path(testrun.__file__).parents[2] / "docker" / "Dockerfile.rocm-overlay"
    (docker / "Dockerfile.rocm-overlay").write_text(shipped.read_text())
    # Unpinned apt package, no --no-install-recommends, no list cleanup.
    (docker / "Dockerfile.bad").write_text(
        "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y curl\n")
    part = testrun._hadolint(Layout(tmp_path))
    assert (part.passed, part.failed) == (1, 1)
    out = capsys.readouterr().out
    assert "ok   docker/Dockerfile.rocm-overlay" in out
    assert "FAIL docker/Dockerfile.bad" in out and "DL3008" in out


def test_before_any_run_a_unit_weighs_as_many_test_files_as_it_runs(tmp_path):
    """A fresh run (CI's) starts the units of many files first: the one over all
    of tests/verification must not be left to run alone at the end."""
    for name in ("a/test_one.py", "a/test_two.py", "a/helper.py", "test_three.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")

    class NoRecords:
        def latest_green(self, name):
            return None

    runner = testrun.Runner(Layout(tmp_path), None, NoRecords(), fresh=True)

    def chain(args: list[str]) -> list[testrun.Job]:
        return [testrun.Job("row", "t", "c", ("pytest", *args), None, lambda log: None,
                            files=testrun._test_file_count(tmp_path, args))]

    assert runner._expected_seconds(chain(["a"])) == 120.0
    assert runner._expected_seconds(chain(["-p", "a", "test_three.py::test_x"])) == 60.0
    assert runner._expected_seconds(chain(["--deselect", "a/test_one.py::t", "a"])) == 120.0


def test_the_verification_files_that_take_a_zygote_share_one_unit(tmp_path):
    """Each zygote costs a vLLM import: the files whose tests take one run in one
    process; the others alone, so that what one of them reads stays its own."""
    folder = tmp_path / testrun.VERIFICATION
    folder.mkdir(parents=True)
    (folder / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture(scope='session')\ndef rocm() -> Zygote:\n"
        "    return Zygote('rocm')\n\n\ndef helper() -> int:\n    return 1\n")
    (folder / "test_a.py").write_text("def test_one(rocm):\n    pass\n")
    (folder / "test_b.py").write_text("class TestB:\n    def test_two(self, rocm):\n"
                                      "        pass\n")
    (folder / "test_c.py").write_text("def test_three(helper, tmp_path):\n    pass\n")
    assert testrun.verification_units(Layout(tmp_path)) == [
        ("tests/verification (2 files sharing zygotes)",
         ["tests/verification/test_a.py", "tests/verification/test_b.py"]),
        ("tests/verification/test_c.py", ["tests/verification/test_c.py"])]
