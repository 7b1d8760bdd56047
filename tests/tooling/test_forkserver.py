"""vLLM's test files run in forks of a server that imported their conftest's
imports (scripts/testing/forkserver.py): the same outcome as a pytest process of their
own, and what the server read before the fork counts as read by each."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from scripts.testing.forkserver import ForkServers
from scripts.testing.testdeps import TRACKER_DIR, Reads, tracker_env
from tests.tooling.test_testdeps import BASE, Tree

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


def test_a_child_collects_none_of_what_the_server_imported(tree, tmp_path):
    """vLLM's tests call gc.collect() after each test: in a child, it must not walk
    (and so copy) the server's objects."""
    tree.write("tests/test_gc.py", "import gc\n\n\ndef test_frozen():\n"
               "    assert gc.get_freeze_count() > 1000\n")
    reads = tmp_path / "reads.log"
    with ForkServers(Path(sys.executable), tmp_path / "servers") as servers:
        code, _ = servers.run(tree.root, _env(tree, reads), ["-q", "tests/test_gc.py"],
                              tmp_path / "out.log", reads)
    assert code == 0, (tmp_path / "out.log").read_text()


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
