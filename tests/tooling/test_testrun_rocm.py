"""make test's "(ROCm)" rows: the pytest arguments that emulate ROCm, and the
list of what those rows leave out (tests/vllm_regression_rocm.txt)."""

from __future__ import annotations

import pytest

from scripts.common import Layout, StackError
from scripts.testing import testrun

ROCM_LIST = """\
# a comment line
--deselect tests/a.py::test_gpu[  # runs on device "cuda"

--replace tests/b.py::test_x[True] tests/b.py::test_x[False]  # platform-dependent id
--deselect tests/other/c.py::test_y  # another file's test
--deselect tests/gpu_only.py  # every test of it needs a GPU
"""


def _layout(tmp_path, text: str) -> Layout:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / testrun.ROCM_LIST).write_text(text)
    return Layout(tmp_path)


def test_rocm_rows_load_the_plugin_and_apply_the_list(tmp_path):
    deselects, renamed = testrun.rocm_list(_layout(tmp_path, ROCM_LIST))
    args = testrun.rocm_args(["tests/a.py", "tests/b.py::test_x[True]"], deselects, renamed)
    # Only the deselects of the files it runs: the command stays short, and an
    # entry about another file changes no key of this one.
    assert args == ["-p", "rocm_emulation.plugin", "tests/a.py", "tests/b.py::test_x[False]",
                    "--deselect", "tests/a.py::test_gpu["]
    folder = testrun.rocm_args(["tests/other"], deselects, renamed)
    assert folder[-2:] == ["--deselect", "tests/other/c.py::test_y"]


def test_a_file_deselected_whole_is_not_run(tmp_path):
    deselects, _ = testrun.rocm_list(_layout(tmp_path, ROCM_LIST))
    files = ["tests/a.py", "tests/gpu_only.py", "tests/gpu_only.py.bak"]
    assert testrun.rocm_files(files, deselects) == ["tests/a.py", "tests/gpu_only.py.bak"]


@pytest.mark.parametrize(
    "line",
    [
        "--deselect tests/a.py::test_gpu",  # no reason
        "--deselect tests/a.py::test_gpu   #  ",  # empty reason
        "tests/a.py::test_gpu  # an entry, not a directive",
        "--replace tests/b.py::test_x[True]  # no ROCm id",
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, line):
    layout = _layout(tmp_path, f"# header\n{line}\n")
    with pytest.raises(StackError, match=rf"^{testrun.ROCM_LIST}:2: expected"):
        testrun.rocm_list(layout)


def test_the_shipped_rocm_list_parses_and_gives_every_reason():
    layout = Layout.default()
    deselects, _ = testrun.rocm_list(layout)
    assert deselects, "the shipped list deselects nothing"
    lines = (layout.root / testrun.ROCM_LIST).read_text().splitlines()
    assert sum(line.startswith("--deselect ") for line in lines) == len(deselects)
