"""Which tests a change reaches: the blocks of a Python file (scripts/testing/testblocks.py)
and the per-test record pytest writes under the tracker (scripts/testing/reads/k3_pertest.py).

The record is made by a real pytest process over a small package, under the
read tracker, as `make test` starts its units; the blocks are compared on
sources as patches edit them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.testing.testblocks import MODULE, Blocks, affected_tests, changed_blocks
from scripts.testing.testdeps import TRACKER_DIR, tracker_env

SOURCE = textwrap.dedent('''\
    import functools

    SCALE = 2


    def double(x):
        return x * SCALE


    class Model:
        size = 4

        def forward(self, x):
            return [double(v) for v in x]

        def backward(self, x):
            return x


    @functools.lru_cache
    def table():
        return [1, 2]
    ''')


def _changed(new: str) -> set[str]:
    return changed_blocks(Blocks(SOURCE), Blocks(new))


@pytest.mark.parametrize(("edit", "blocks"), [
    (("return x * SCALE", "return SCALE * x"), {"double"}),
    (("return x\n", "return -x\n"), {"Model.backward"}),
    (("return x\n", "return x  # the same\n"), set()),
    (("SCALE = 2", "SCALE = 3"), {MODULE}),
    (("size = 4", "size = 5"), {MODULE}),
    (("def backward(self, x):", "def backward(self, x, y=1):"), {MODULE, "Model.backward"}),
    (("@functools.lru_cache\n", ""), {MODULE, "table"}),
    (("    def backward", "    def reset(self):\n        pass\n\n    def backward"),
     {MODULE, "Model.reset"}),
], ids=["function-body", "method-body", "comment", "constant", "class-attribute",
        "signature", "decorator", "new-method"])
def test_a_file_changes_in_its_function_bodies_or_in_its_skeleton(edit, blocks):
    assert _changed(SOURCE.replace(*edit)) == blocks


@pytest.mark.parametrize(("source", "block"), [
    ("match 1:\n    case _:\n        def f():\n            return 1\n", "f"),
    ("for _ in [0]:\n    def f():\n        return 1\n", "f"),
    ("while True:\n    def f():\n        return 1\n    break\n", "f"),
    ("for _ in []:\n    pass\nelse:\n    def f():\n        return 1\n", "f"),
    ("try:\n    pass\nexcept* ValueError:\n    def f():\n        return 1\n", "f"),
    ("with open('x') as g:\n    class C:\n        def f(self):\n            return 1\n",
     "C.f"),
    ("for _ in [0]:\n    class C:\n        def f(self):\n            return 1\n", "C.f"),
    ("if X:\n    def f():\n        return 1\nelse:\n    def f():\n        return 2\n",
     "f"),
], ids=["match-case", "for", "while", "for-else", "except-star", "class-under-with",
        "class-under-for", "same-name-twice"])
def test_a_def_under_any_compound_statement_is_a_block(source, block):
    """_Skeleton strips the body of every def: one that no block holds would
    change nothing at all when its body changes."""
    assert _changed_in(source, source.replace("return 1", "return 3")) == {block}


def _changed_in(old: str, new: str) -> set[str]:
    return changed_blocks(Blocks(old), Blocks(new))


def test_code_objects_belong_to_their_outermost_function():
    blocks = Blocks(SOURCE)
    assert blocks.block_of("Model.forward.<locals>.<listcomp>") == "Model.forward"
    assert blocks.block_of("Model") == MODULE  # the class body
    assert blocks.block_of("<lambda>") == MODULE
    assert blocks.stateful == {"table"}


def _coverage(shared=None, **tests) -> dict:
    return {"shared": shared or {}, "tests": {
        name: {"code": {}, "data": [], "whole": [], **bucket} for name, bucket in tests.items()}}


def test_the_tests_that_ran_a_changed_function_are_chosen():
    new = SOURCE.replace("return x\n", "return -x\n")
    coverage = _coverage(
        test_forward={"code": {"m.py": ["Model.forward", "Model.forward.<locals>.<listcomp>",
                                        "double"]}},
        test_backward={"code": {"m.py": ["Model.backward"]}},
        test_other={"code": {"other.py": ["Model.backward"]}},
        test_thread={"whole": ["starts a thread"]},
        test_source={"data": ["m.py"]})
    chosen, _ = affected_tests(coverage, {"m.py": (SOURCE, new)})
    assert chosen == ["test_backward", "test_thread", "test_source"]
    assert affected_tests(coverage, {}) == ([], "")


@pytest.mark.parametrize(("coverage", "new", "why"), [
    (_coverage(test_a={"code": {"m.py": ["double"]}}), SOURCE.replace("SCALE = 2", "SCALE = 3"),
     "m.py: more than function bodies changed"),
    (_coverage({"code": {"m.py": ["Model.backward"]}}), SOURCE.replace("return x\n", "return 0\n"),
     "m.py: Model.backward runs outside the tests"),
    (_coverage(test_a={"code": {"m.py": ["table"]}}), SOURCE.replace("[1, 2]", "[2, 1]"),
     "m.py: table is decorated"),
    (_coverage(test_a={}), "def broken(:\n", "m.py does not parse"),
], ids=["skeleton", "shared", "cached", "syntax"])
def test_every_test_runs_when_the_record_cannot_narrow_it_down(coverage, new, why):
    assert affected_tests(coverage, {"m.py": (SOURCE, new)}) == (None, why)


# --- the record a pytest process writes -----------------------------------------------

PACKAGE = {
    "pkg/__init__.py": "",
    "pkg/ops.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    "pkg/late.py": "from pkg.ops import mul\n\nTABLE = mul(3, 4)\n",
    "pkg/setup.py": "def make():\n    return {'ready': True}\n",
    "tests/test_pkg.py": textwrap.dedent('''\
        import queue
        import subprocess
        import sys
        import threading
        from pathlib import Path

        import pytest

        from pkg import ops, setup


        @pytest.fixture(scope="module")
        def state():
            return setup.make()


        def test_add():
            assert ops.add(1, 2) == 3


        def test_late(state):
            from pkg import late

            assert late.TABLE == 12 and state["ready"]


        def test_thread():
            worker = threading.Thread(target=ops.mul, args=(1, 2))
            worker.start()
            worker.join()


        def test_source():
            assert "def mul" in Path("pkg/ops.py").read_text()


        @pytest.mark.skip(reason="not today")
        def test_skipped():
            pass


        def python(code, **kwargs):
            return subprocess.run([sys.executable, "-c", code], check=True, **kwargs)


        def test_in_a_subprocess():
            python("from pkg import ops\\nops.mul(2, 3)")


        def test_in_a_subprocess_of_a_subprocess():
            python("import subprocess, sys\\n"
                   "subprocess.run([sys.executable, '-c', 'from pkg import ops; ops.add(1, 1)'],"
                   " check=True)")


        def test_in_a_subprocess_that_leaves_no_record():
            python("import os\\nfrom pkg import ops\\nops.add(1, 2)\\nos._exit(0)")


        def test_in_a_subprocess_without_the_tracker():
            python("from pkg import ops", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."})


        def test_in_a_subprocess_that_imports_a_noisy_library():
            python("import noisy\\nfrom pkg import ops\\nops.add(2, 2)")


        def test_in_a_subprocess_that_starts_a_thread():
            python("import threading\\nfrom pkg import ops\\n"
                   "t = threading.Thread(target=ops.add, args=(1, 2))\\nt.start()\\nt.join()")


        @pytest.fixture(scope="session")
        def server():
            """A process that runs pkg's code for the tests that ask it."""
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys\\nfrom pkg import ops\\n"
                 "for line in sys.stdin:\\n    print(ops.mul(2, int(line)), flush=True)"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            yield proc
            proc.stdin.close()
            proc.wait()


        def test_served(server):
            server.stdin.write("3\\n")
            server.stdin.flush()
            assert server.stdout.readline() == "6\\n"


        @pytest.fixture(scope="module")
        def worker():
            """A thread that runs pkg's code for the tests that hand it work."""
            jobs, results = queue.Queue(), queue.Queue()
            thread = threading.Thread(target=lambda: [results.put(ops.add(*job)) for job in
                                                      iter(jobs.get, None)])
            thread.start()
            yield jobs, results
            jobs.put(None)
            thread.join()


        def test_handed_to_a_thread(worker):
            jobs, results = worker
            jobs.put((1, 2))
            assert results.get() == 3
        '''),
}


def test_pytest_records_what_each_test_runs(tmp_path):
    tree = tmp_path / "tree"
    for path, text in PACKAGE.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(text)
    # A library off the tree whose import starts a thread, and a Python that
    # leaves no record, as opentelemetry's and humming's imports do.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "noisy.py").write_text(
        "import subprocess, sys, threading\n"
        "threading.Thread(target=lambda: None).start()\n"
        "subprocess.Popen([sys.executable, '-c', 'import os; os._exit(0)']).wait()\n")
    log = tmp_path / "reads.log"
    env = {**os.environ, **tracker_env(log, tree, [], "", per_test=True),
           "PYTHONPATH": os.pathsep.join([str(TRACKER_DIR), str(tree), str(tmp_path / "lib")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_pkg.py"], cwd=tree, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(Path(f"{log}.tests.json").read_text())
    tests = {nodeid.split("::")[1]: bucket for nodeid, bucket in record["tests"].items()}
    assert list(tests) == ["test_add", "test_late", "test_thread", "test_source", "test_skipped",
                           "test_in_a_subprocess", "test_in_a_subprocess_of_a_subprocess",
                           "test_in_a_subprocess_that_leaves_no_record",
                           "test_in_a_subprocess_without_the_tracker",
                           "test_in_a_subprocess_that_imports_a_noisy_library",
                           "test_in_a_subprocess_that_starts_a_thread", "test_served",
                           "test_handed_to_a_thread"]
    assert tests["test_add"]["code"] == {"pkg/ops.py": ["add"],
                                         "tests/test_pkg.py": ["test_add"]}
    # What an import or a module-scoped fixture runs outlives its test: the unit's.
    assert "mul" in record["shared"]["code"]["pkg/ops.py"]
    assert "make" in record["shared"]["code"]["pkg/setup.py"]
    assert "pkg/late.py" not in tests["test_late"]["code"]
    assert tests["test_thread"]["whole"] == ["starts a thread"]
    assert tests["test_source"]["data"] == ["pkg/ops.py"]
    assert tests["test_skipped"]["outcome"] == "skipped"
    assert tests["test_add"]["outcome"] == "passed"
    # Code another process or thread runs for a test: the profiler cannot see it.
    assert tests["test_served"]["whole"] == ["a process started before it still runs"]
    assert "a thread started before it still runs" in tests["test_handed_to_a_thread"]["whole"]
    assert tests["test_add"]["whole"] == tests["test_source"]["whole"] == []
    # A Python subprocess (and its own) records for the test that started it,
    # imports included; one that leaves no record, or is not tracked, makes it whole.
    for name, ran in [("test_in_a_subprocess", "mul"),
                      ("test_in_a_subprocess_of_a_subprocess", "add")]:
        assert tests[name]["whole"] == [], name
        assert tests[name]["code"]["pkg/ops.py"] == ["<module>", ran], name
        assert tests[name]["code"]["pkg/__init__.py"] == ["<module>"], name
    assert tests["test_in_a_subprocess_that_leaves_no_record"]["whole"] == [
        "a subprocess left no record"]
    assert tests["test_in_a_subprocess_without_the_tracker"]["whole"] == ["runs a subprocess"]
    # What a library's import starts is the library's; what the tree's code starts is not.
    noisy = tests["test_in_a_subprocess_that_imports_a_noisy_library"]
    assert noisy["whole"] == [] and "add" in noisy["code"]["pkg/ops.py"]
    assert tests["test_in_a_subprocess_that_starts_a_thread"]["whole"] == ["starts a thread"]
    assert not list(tmp_path.glob("reads.log.child-*"))  # taken in, and removed
