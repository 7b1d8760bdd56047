"""A result `make test` reuses equals what a fresh run of the same tests gives.

Each case is one that once came out green where a fresh run failed (issue
31), or a neighbour of one: the suite project of test_testcache.py after a
green run, an edit that makes a fresh run of a unit fail, and `make test`
(its Python entry) run again, which must fail too. A few guards check that
what no test can observe (make's variables, bytecode in the venv) still
changes no key.
"""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest

from scripts.common import StackError
from tests.tooling import test_testcache
from tests.tooling.conftest import FOO_PATCHED, TEST_FOO_PATCHED, TEST_FOO_V1, V1
from tests.tooling.test_testcache import FOO, LINT, VERIFY, _parts, _ran, _summary, _test

suites = test_testcache.suites  # the fixture: its green project, built once per session

# A cache of built objects, as vLLM's get_rope keeps them in _ROPE_DICT: only
# the first test that asks for a key runs Rope.__init__.
ROPE = FOO_PATCHED + """

_ROPE_DICT = {}


class Rope:
    def __init__(self, key):
        self.first = 1
        self.second = 2


def get_rope(key):
    if key not in _ROPE_DICT:
        _ROPE_DICT[key] = Rope(key)
    return _ROPE_DICT[key]
"""
TEST_ROPE = TEST_FOO_PATCHED + """

def test_rope_first():
    from vllm.models.foo import get_rope

    assert get_rope("a").first == 1


def test_rope_second():
    from vllm.models.foo import get_rope

    assert get_rope("a").second == 2
"""
TEST_SCALE = TEST_FOO_PATCHED + """

def test_scale():
    from vllm.models.foo import scale

    assert scale() == 2
"""


def _edit(project, path: str, text: str) -> None:
    """An uncommitted edit in build/vllm (the stack row tests the working tree).
    Each edit changes the file's size: Python's bytecode cache would take an
    edit of the same size within the second its .pyc was written for none."""
    (project.tree / path).write_text(text)


def _fresh_agrees(project, expected: int) -> None:
    """`make test ONLY=stack` gives `expected`, and so does a fresh run of it."""
    assert _test(project, only="stack") == expected
    assert _test(project, fresh=True, only="stack") == expected


def test_state_shared_across_tests_is_seen_by_every_test(suites):
    """Case 1: test_rope_second never runs Rope.__init__ (the first test built
    the object it gets), yet sees what it did: a change there reruns the unit."""
    _edit(suites, "vllm/models/foo.py", ROPE)
    _edit(suites, "tests/test_foo.py", TEST_ROPE)
    _fresh_agrees(suites, 0)
    _ran(suites)
    _edit(suites, "vllm/models/foo.py", ROPE.replace("self.second = 2", "self.second = -2"))
    assert _test(suites, only="stack") == 1
    assert _ran(suites) == {("stack", FOO)}


@pytest.mark.parametrize("wrapped", [
    "match 1:\n    case _:\n        def scale():\n            return 2\n",
    "for _ in [0]:\n    def scale():\n        return 2\n",
    "while True:\n    def scale():\n        return 2\n    break\n",
    "try:\n    pass\nexcept* ValueError:\n    pass\nelse:\n    def scale():\n        return 2\n",
], ids=["match", "for", "while", "try-except-star-else"])
def test_a_def_under_a_compound_statement_reruns_its_unit(suites, wrapped):
    """Case 2: a def that a module-level `match`, `for`, `while` or `try` holds."""
    _edit(suites, "vllm/models/foo.py", FOO_PATCHED + "\n\n" + wrapped)
    _edit(suites, "tests/test_foo.py", TEST_SCALE)
    _fresh_agrees(suites, 0)
    _ran(suites)
    edited = wrapped.replace("return 2", "return -2")
    _edit(suites, "vllm/models/foo.py", FOO_PATCHED + "\n\n" + edited)
    assert _test(suites, only="stack") == 1
    assert _ran(suites) == {("stack", FOO)}


TEST_ARCH = TEST_FOO_PATCHED + """

def test_arch():
    import os

    assert os.environ.get("K3_ROCM_ARCH", "gfx942") == "gfx942"
    assert os.environ.get("MY_SWITCH", "off") == "off"
"""


@pytest.mark.parametrize("variable", ["K3_ROCM_ARCH=gfx9999", "MY_SWITCH=on",
                                      "K3_PRISTINE_GIT_DIR=/elsewhere"],
                         ids=["k3-rocm-arch", "any-variable", "pristine-git-dir"])
def test_every_environment_variable_a_test_may_read_is_in_the_key(suites, monkeypatch,
                                                                   variable):
    """Case 5: a variable no list of vLLM's or torch's prefixes names."""
    _edit(suites, "tests/test_foo.py", TEST_ARCH)
    _fresh_agrees(suites, 0)
    _ran(suites)
    name, value = variable.split("=")
    monkeypatch.setenv(name, value)
    assert _test(suites, only="stack") == (0 if name == "K3_PRISTINE_GIT_DIR" else 1)
    assert ("stack", FOO) in _ran(suites)


def test_make_and_the_terminal_change_no_key(suites, monkeypatch):
    """What make passes on (its flags, the variables typed after `make test`) and
    the terminal's variables are read by no test: everything is reused."""
    for name, value in {"MAKEFLAGS": " -- ONLY=stack", "MAKELEVEL": "1", "ONLY": "stack",
                        "FRESH": "", "TERM": "dumb", "COLUMNS": "80", "OLDPWD": "/",
                        "K3_PROJECT_ROOT": "/as/mutate/sets/it"}.items():
        monkeypatch.setenv(name, value)
    assert _test(suites) == 0
    assert _ran(suites) == set()


def test_a_moved_release_tag_is_refused(suites):
    """Case 7: with the release tag on the stack's head, the stack would change
    no test file and the stack row would check nothing."""
    suites.git("tag", "-f", f"vllm-{V1}", "stack")
    with pytest.raises(StackError, match=rf"^build/vllm: tag vllm-{V1} points at [0-9a-f]{{12}}, "
                       r"not at the release commit [0-9a-f]{12} that make apply imported; put "
                       rf"it back with `git -C build/vllm tag -f vllm-{V1} [0-9a-f]{{40}}`$"):
        _test(suites, only="stack")
    assert _ran(suites) == set()


def test_a_row_with_nothing_to_check_is_no_green(suites, capsys):
    """The stack changes no test file any more: `make test ONLY=stack` checks nothing."""
    suites.commit("[ROCm] Drop the tests", {"tests/test_foo.py": TEST_FOO_V1,
                                            "tests/test_new.py": None})
    assert _test(suites, only="stack") == 1
    out = capsys.readouterr().out
    assert "nothing was checked" in out and out.strip().endswith("0 passed, 0 failed, 0 skipped")


def test_a_failed_fresh_run_removes_the_greens_it_contradicts(suites, tmp_path, monkeypatch):
    """FRESH=1 fails where a green was recorded (a condition outside every key
    changed): the next plain run must not reuse that green."""
    needed = tmp_path / "flaky-machine-is-ok"
    needed.touch()
    monkeypatch.setenv("FAKE_VERIFY_NEEDS", str(needed))
    assert _test(suites) == 0
    needed.unlink()
    assert _test(suites, fresh=True, only="verification") == 1
    _ran(suites)
    assert _test(suites, only="verification") == 1
    assert _ran(suites) == {("verification", VERIFY)}


TEST_PLUGINS = TEST_FOO_PATCHED + """

def test_plugin():
    try:
        from vllm.models import plugin
    except ImportError:
        return
    assert plugin.OK


def test_third_party():
    from vllm.third_party import dep

    assert dep.OK
"""
THIRD_PARTY = "vllm/third_party/dep/__init__.py"  # ignored by the tree's .gitignore


def _compiled(tmp_path, source: str) -> bytes:
    """A .pyc of `source` for this interpreter (the fake venv's python runs it)."""
    (tmp_path / "plugin.py").write_text(source)
    return Path(py_compile.compile(str(tmp_path / "plugin.py"),
                                   cfile=str(tmp_path / "plugin.pyc"))).read_bytes()


@pytest.mark.parametrize("how", ["so-shadows-a-module", "pyc-beside-no-source",
                                 "ignored-source-edited"])
def test_ignored_files_that_python_imports_are_in_the_key(suites, tmp_path, how):
    """Case 4: git trees leave ignored files out; the import system does not.
    A junk extension module shadows foo.py; a .pyc with no source beside it is
    a module; a source under an ignored folder is imported like any other."""
    _edit(suites, ".gitignore", (suites.tree / ".gitignore").read_text() + "*.pyc\n")
    _edit(suites, "tests/test_foo.py", TEST_PLUGINS)
    (suites.tree / THIRD_PARTY).parent.mkdir(parents=True)
    _edit(suites, THIRD_PARTY, "OK = True\n")
    _fresh_agrees(suites, 0)
    _ran(suites)
    if how == "so-shadows-a-module":
        (suites.tree / "vllm/models/foo.abi3.so").write_bytes(b"junk\n")
    elif how == "pyc-beside-no-source":
        (suites.tree / "vllm/models/plugin.pyc").write_bytes(_compiled(tmp_path, "OK = False\n"))
    else:
        _edit(suites, THIRD_PARTY, "OK = False  # edited\n")
    assert suites.git("status", "--porcelain", "--", "vllm") == ""  # all of it ignored
    _fresh_agrees(suites, 1)


TEST_HELPER = TEST_FOO_PATCHED + """

def test_helper():
    import helper

    assert helper.OK
"""


def test_an_edit_inside_the_venv_is_in_the_key(suites):
    """Case 6: a package of .venv edited by hand (here a module its python finds)."""
    venv = suites.root / ".venv"
    python = venv / "bin" / "python"
    site = venv / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "helper.py").write_text("OK = True\n")
    python.write_text(python.read_text().replace(
        "exec ", f'PYTHONPATH="$PYTHONPATH:{site}"; export PYTHONPATH\nexec '))
    _edit(suites, "tests/test_foo.py", TEST_HELPER)
    _fresh_agrees(suites, 0)
    _ran(suites)
    # Bytecode Python writes into the venv as tests import from it is no edit.
    (site / "__pycache__").mkdir(exist_ok=True)
    (site / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"cache")
    assert _test(suites, only="stack") == 0
    assert _ran(suites) == set()
    (site / "helper.py").write_text("OK = False  # edited\n")
    _fresh_agrees(suites, 1)


TEST_WEIGHTS = TEST_FOO_PATCHED + """

def test_weights():
    from safetensors.numpy import load_file

    assert load_file("tests/data/w.safetensors")["w"].sum() == 6
"""


def test_data_a_native_reader_reads_is_in_the_key(suites):
    """Case 3: safetensors reads the file in Rust, which raises no `open` audit event."""
    numpy = pytest.importorskip("numpy")
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    weights = suites.tree / "tests/data/w.safetensors"
    weights.parent.mkdir()
    save_file({"w": numpy.arange(4, dtype=numpy.float32)}, str(weights))
    _edit(suites, "tests/test_foo.py", TEST_WEIGHTS)
    _fresh_agrees(suites, 0)
    _ran(suites)
    save_file({"w": numpy.arange(4, dtype=numpy.float32) * 2}, str(weights))
    _fresh_agrees(suites, 1)


def test_an_ignored_file_linked_into_the_prefix_trees_is_in_their_keys(suites):
    """Case 4 in the prefix rows: their worktrees link build/vllm's ignored files
    under vllm/ (the kernels the build copied in), junk ones too."""
    (suites.tree / "vllm/models/foo.abi3.so").write_bytes(b"junk\n")
    assert _test(suites) == 1
    assert _summary(suites)["rows"][3]["name"] == "prefix 1/3"
    assert _summary(suites)["rows"][3]["failed"] >= 1  # test_foo.py imports the junk


def test_an_ignored_python_file_is_in_the_lint_key(suites):
    """mypy follows imports into the files git ignores (vllm/third_party/, the
    wheel's copies): an edit there runs the lint of build/vllm again."""
    (suites.tree / THIRD_PARTY).parent.mkdir(parents=True)
    _edit(suites, THIRD_PARTY, "OK = True\n")
    assert _test(suites, only="lint") == 0
    assert _ran(suites) == {("lint", LINT)}
    assert _test(suites, only="lint") == 0
    assert _ran(suites) == set()
    _edit(suites, THIRD_PARTY, "OK = 'yes'  # edited\n")
    assert _test(suites, only="lint") == 0
    assert _ran(suites) == {("lint", LINT)}


TEST_VPLUG = """\
import sys
from pathlib import Path


def test_vplug():
    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    try:
        import vplug
    except ImportError:
        return
    assert vplug.OK
"""


@pytest.mark.parametrize("checkout", [False, True], ids=["plain-folder", "git-checkout"])
def test_a_module_python_finds_in_the_project_is_in_every_key(suites, tmp_path, checkout):
    """Case 4 in the project: a .pyc beside no source, which git ignores (the
    project's .gitignore has *.pyc), imported from a folder of the project."""
    (suites.root / "tests/verification/test_vplug.py").write_text(TEST_VPLUG)
    if checkout:
        (suites.root / ".gitignore").write_text("/build/\n/.venv*/\n__pycache__/\n*.pyc\n")
        suites.git("init", "-q", cwd=suites.root)
        suites.git("add", "-A", cwd=suites.root)
        suites.git("commit", "-q", "-m", "the project", cwd=suites.root)
    assert _test(suites, only="verification") == 0
    plugins = suites.root / "tests/verification/plugins"
    plugins.mkdir()
    (plugins / "vplug.pyc").write_bytes(_compiled(tmp_path, "OK = False\n"))
    assert _test(suites, only="verification") == 1
    # Every key holds the project's files: the other unit runs again too.
    assert _parts(suites)[("verification", VERIFY)]["reused"] is None
