"""vLLM's test files run in forks of a server that imported their conftest's
imports (scripts/testing/forkserver.py): the same outcome as a pytest process of their
own, and what the server read before the fork counts as read by each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.testing.forkserver import UNPROVEN, ForkServers
from scripts.testing.testdeps import TRACKER_DIR, Reads, tracker_env
from tests.tooling.test_testdeps import BASE, Tree

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = "import pkg.used  # what every test of the tree imports first\n"
TESTS = {"tests/test_pass.py": "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n",
         "tests/test_fail.py": "import pkg.used\n\n\ndef test_value():\n"
                               "    assert pkg.used.VALUE == 2\n"}


@pytest.fixture
def tree(tmp_path) -> Tree:
    tree = Tree(tmp_path / "tree")
    tree.write("tests/__init__.py", "")
    tree.write("tests/conftest.py", CONFTEST)
    for path, text in TESTS.items():
        tree.write(path, text)
    return tree


def _env(tree: Tree, reads: Path) -> dict[str, str]:
    return {**os.environ, **tracker_env(reads, tree.root, [], BASE),
            "PYTHONPATH": os.pathsep.join([str(TRACKER_DIR), str(tree.root)])}


@pytest.mark.parametrize(("test", "code"), [("tests/test_pass.py", 0),
                                            ("tests/test_fail.py", 1)])
def test_a_served_file_runs_as_in_a_process_of_its_own(tree, tmp_path, test, code):
    reads = tmp_path / "reads.log"
    log = tmp_path / "out.log"
    with ForkServers(Path(sys.executable), tmp_path / "servers") as servers:
        served = servers.run(tree.root, _env(tree, reads), ["-q", "-p", "no:cacheprovider",
                                                            test], log, reads)
        assert served is not None
        assert served[0] == code
        # A second file is served by the same server, forked again.
        again = servers.run(tree.root, _env(tree, reads), ["-q", test], log, reads)
        assert again == served and len(servers._all) == 1
    last = log.read_text().strip().splitlines()[-1]
    assert ("2 passed" if code == 0 else "1 failed") in last


def test_vllms_cleanup_leaves_the_server_frozen(tmp_path):
    """vLLM's per-test cleanup calls gc.unfreeze() before its gc.collect(): in a
    child, the server's objects must stay out of the collector (else every
    teardown walks, and copies, all of them)."""
    script = ("import gc\n"
              "from scripts.testing.forkserver import FrozenHeap\n"
              "keep = [[i] for i in range(5000)]\n"
              "gc.collect(); gc.freeze(); frozen = gc.get_freeze_count()\n"
              "heap = FrozenHeap()\n"
              "gc.unfreeze(); gc.collect()\n"
              "assert heap._real['get_freeze_count']() == frozen > 5000\n"
              "assert heap.unobservable()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


# What a test does to an object the server made (pkg/used.py's CACHE, a cycle):
# freed in a fresh process at its next gc.collect(), kept in a child.
CACHED = {
    "inert": "",
    "finalizer": "    def __del__(self):\n        pass\n",
    "weakref": "",
}


@pytest.mark.parametrize(("kind", "served"), [("inert", True), ("finalizer", False),
                                              ("weakref", False), ("looks", False)])
def test_a_child_that_could_tell_it_was_frozen_is_run_again(tree, tmp_path, kind, served):
    """Whether a child's run could differ from a fresh process's: a server object
    that became garbage with a finalizer or a weak reference (freeing it would run
    code or clear a reference), or a test that looks at the gc's own view of the
    heap. Such a file is handed back (UNPROVEN: make test runs it in a plain
    pytest process, with a reads log of its own); inert garbage is not."""
    tree.write("pkg/used.py",
               "import weakref\n\n\nclass Node:\n    pass\n"
               + CACHED.get(kind, "") + "\n\nCACHE = [Node()]\n"
               "CACHE[0].me = CACHE[0]\n"
               + ("REF = weakref.ref(CACHE[0])\n" if kind == "weakref" else ""))
    body = ("    gc.get_objects()\n" if kind == "looks"
            else "    pkg.used.CACHE.clear()\n    gc.unfreeze()\n    gc.collect()\n")
    tree.write("tests/test_cache.py", "import gc\n\nimport pkg.used\n\n\n"
               "def test_cache():\n" + body)
    reads = tmp_path / "reads.log"
    with ForkServers(Path(sys.executable), tmp_path / "servers") as servers:
        result = servers.run(tree.root, _env(tree, reads), ["-q", "tests/test_cache.py"],
                             tmp_path / "out.log", reads)
    assert result is not None, (tmp_path / "out.log").read_text()
    assert result[0] == (0 if served else UNPROVEN), (tmp_path / "out.log").read_text()
    if not served:
        assert reads.read_text() == ""


def test_what_the_server_read_before_the_fork_is_the_files_input(tree, tmp_path):
    """conftest's `import pkg.used` ran in the server: a file that never imports it
    itself still has it among its reads, as it would in a process of its own."""
    reads = tmp_path / "reads.log"
    with ForkServers(Path(sys.executable), tmp_path / "servers") as servers:
        code, server_reads = servers.run(tree.root, _env(tree, reads),
                                         ["-q", "tests/test_pass.py"], tmp_path / "o.log",
                                         reads)
        before_fork = Reads.parse(server_reads.read_text(), tree.root, tmp_path).entries
    assert code == 0
    assert "r pkg/used.py" in before_fork
    assert not server_reads.exists()  # a closed server leaves nothing behind
    mine = Reads.parse(reads.read_text(), tree.root, tmp_path).entries
    assert "r tests/test_pass.py" in mine and "r pkg/used.py" not in mine


def test_a_server_that_cannot_start_runs_nothing(tree, tmp_path):
    """make test then runs the file in a pytest process of its own."""
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    with ForkServers(broken, tmp_path / "servers") as servers:
        assert servers.run(tree.root, _env(tree, tmp_path / "r.log"), ["-q"],
                           tmp_path / "o.log", tmp_path / "r.log") is None
