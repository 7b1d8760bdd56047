"""make test's "(ROCm)" rows: the pytest arguments that emulate ROCm, and the
list of what those rows leave out (tests/vllm_regression_rocm.txt)."""

from __future__ import annotations

import os

import pytest

from scripts import testrun
from scripts.common import Layout, StackError

ROCM_LIST = """\
# a comment line
--deselect tests/a.py::test_gpu[  # runs on device "cuda"

--replace tests/b.py::test_x[True] tests/b.py::test_x[False]  # platform-dependent id
"""


def _layout(tmp_path, text: str) -> Layout:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / testrun.ROCM_LIST).write_text(text)
    return Layout(tmp_path)


def test_rocm_rows_load_the_plugin_and_apply_the_list(tmp_path):
    layout = _layout(tmp_path, ROCM_LIST)
    args, python_path = testrun._rocm_emulated(
        layout, ["tests/a.py", "tests/b.py::test_x[True]", "--deselect", "tests/c.py"]
    )
    assert args == [
        "-p",
        "rocm_emulation.plugin",
        "tests/a.py",
        "tests/b.py::test_x[False]",
        "--deselect",
        "tests/c.py",
        "--deselect",
        "tests/a.py::test_gpu[",
    ]
    # vLLM comes from the tree under test; the plugin's packages are imported
    # from <root>/tests: in the vLLM tree, `tests` is vLLM's own package.
    assert python_path.split(os.pathsep) == [
        str(layout.tree), str(tmp_path / "tests"), str(tmp_path)]


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
        testrun._rocm_emulated(layout, [])


def test_the_shipped_rocm_list_parses_and_gives_every_reason():
    layout = Layout.default()
    args, _ = testrun._rocm_emulated(layout, [])
    deselected = [args[i + 1] for i, a in enumerate(args) if a == "--deselect"]
    assert deselected, "the shipped list deselects nothing"
    lines = (layout.root / testrun.ROCM_LIST).read_text().splitlines()
    assert sum(line.startswith("--deselect ") for line in lines) == len(deselected)
