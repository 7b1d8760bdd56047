"""The read tracker and the digests `make test` keys its units by (scripts/testing/testdeps.py).

Each test runs a small Python program under the tracker, in a git repository
standing for the vLLM tree, and checks what it recorded and which changes to
the tree change the digest: those that could change what the program does,
and only those.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.testing.testdeps import TRACKER_DIR, Reads, TreeIndex, tracker_env

BASE = "vllm-0.1.0"


class Tree:
    """A git repository with a package `pkg`, committed; `tree_id()` after edits."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        self.git("init", "-q")
        self.write("pkg/__init__.py", "")
        self.write("pkg/used.py", "VALUE = 1\n")
        self.write("pkg/unused.py", "VALUE = 2\n")
        self.write("data/table.txt", "a b c\n")
        self.git("add", "-A")
        self.git("commit", "-q", "-m", "release")
        self.git("tag", BASE)

    def git(self, *args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@t.dev",
               "GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@t.dev"}
        return subprocess.run(["git", "-C", str(self.root), *args], env=env, check=True,
                              capture_output=True, text=True).stdout.strip()

    def write(self, path: str, text: str) -> None:
        (self.root / path).parent.mkdir(parents=True, exist_ok=True)
        (self.root / path).write_text(text)

    def tree_id(self) -> str:
        self.git("add", "-A")
        return self.git("write-tree")

    def run(self, program: str, tmp_path: Path, *, env: dict | None = None,
            path: list[Path] = ()) -> Reads:
        """Run `program` in the tree under the tracker (`path` after the tree on
        PYTHONPATH); what it read."""
        log = tmp_path / "reads.log"
        log.unlink(missing_ok=True)
        full = {**os.environ, **tracker_env(log, self.root, [], BASE), **(env or {}),
                "PYTHONPATH": os.pathsep.join(map(str, [TRACKER_DIR, self.root, *path]))}
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(program)],
                                cwd=self.root, env=full, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return Reads.parse(log.read_text() if log.exists() else "", self.root, tmp_path)

    def digest(self, reads: Reads) -> str:
        return reads.digest(TreeIndex(self.root, self.tree_id()), self.root)


@pytest.fixture
def tree(tmp_path) -> Tree:
    return Tree(tmp_path / "tree")


def test_what_a_program_imports_and_opens_is_recorded(tree, tmp_path):
    reads = tree.run("import pkg.used\nopen('data/table.txt').read()\n", tmp_path)
    assert {"r pkg/used.py", "r pkg/__init__.py", "r data/table.txt",
            "i pkg", "i pkg/used"} <= reads.entries
    assert not any("unused" in e for e in reads.entries) and not reads.opaque
    # Again from cached bytecode: the source still counts as read.
    assert "r pkg/used.py" in tree.run("import pkg.used\n", tmp_path).entries


def test_only_a_change_to_what_was_read_changes_the_digest(tree, tmp_path):
    reads = tree.run("import pkg.used\nopen('data/table.txt').read()\n", tmp_path)
    before = tree.digest(reads)
    tree.write("pkg/unused.py", "VALUE = 3\n")  # never imported
    tree.write("pkg/other.py", "X = 1\n")  # new, in a folder it imports from
    tree.write("docs/new.md", "words\n")
    assert tree.digest(reads) == before
    tree.write("pkg/used.py", "VALUE = 10\n")
    assert tree.digest(reads) != before
    tree.write("pkg/used.py", "VALUE = 1\n")
    assert tree.digest(reads) == before
    tree.write("data/table.txt", "a b c d\n")
    assert tree.digest(reads) != before


def test_a_module_looked_for_and_missing_is_an_input(tree, tmp_path):
    """A later patch that adds the module changes what the program does."""
    reads = tree.run("try:\n    import pkg.extra\nexcept ImportError:\n    pass\n", tmp_path)
    before = tree.digest(reads)
    tree.write("pkg/unrelated.py", "")
    assert tree.digest(reads) == before
    tree.write("pkg/extra.py", "")
    assert tree.digest(reads) != before
    # Found by importlib as well as by an import statement.
    reads = tree.run("import importlib\ntry:\n    importlib.import_module('pkg.plugin')\n"
                     "except ImportError:\n    pass\n", tmp_path)
    before = tree.digest(reads)
    tree.write("pkg/plugin/__init__.py", "")
    assert tree.digest(reads) != before


def test_listings_and_probes_are_inputs(tree, tmp_path):
    reads = tree.run("import os\nos.listdir('data')\nos.path.exists('data/missing.txt')\n",
                     tmp_path)
    assert {"l data", "k data/missing.txt"} <= reads.entries
    before = tree.digest(reads)
    tree.write("data/more.txt", "")
    assert tree.digest(reads) != before
    listed = tree.digest(reads)
    tree.write("data/missing.txt", "")
    assert tree.digest(reads) != listed


def test_python_subprocesses_are_followed(tree, tmp_path):
    reads = tree.run("import subprocess, sys\n"
                     "subprocess.run([sys.executable, '-c', 'import pkg.used'], check=True)\n",
                     tmp_path)
    assert "r pkg/used.py" in reads.entries and not reads.opaque


@pytest.mark.parametrize("program, why", [
    ("import subprocess\nsubprocess.run(['cat', 'pkg/used.py'], capture_output=True)\n",
     "runs cat pkg/used.py"),
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-c', 'pass'])\n",
     "runs "),
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], env={})\n",
     "runs "),
    ("open('data/out.txt', 'w').write('x')\n", "writes "),
    ("open('.git/HEAD').read()\n", "reads .git"),
    ("import subprocess\nsubprocess.run(['gcc', '-E', '-I.', '-x', 'c', '/dev/null'], "
     "capture_output=True)\n", "runs gcc"),
    ("import subprocess\nsubprocess.run(['gcc', '-E', '-o', 'out.i', '-x', 'c', '/dev/null'], "
     "capture_output=True)\n", "runs gcc"),
], ids=["cat", "isolated-python", "clean-environment", "write", "git-internals",
        "probe-given-the-tree", "probe-writing-the-tree"])
def test_what_cannot_be_followed_makes_the_whole_tree_the_input(tree, tmp_path, program, why):
    reads = tree.run(program, tmp_path)
    assert any(reason.startswith(why) for reason in reads.opaque), reads.opaque
    before = tree.digest(reads)
    tree.write("docs/new.md", "words\n")
    assert tree.digest(reads) != before


def test_the_pristine_release_and_system_probes_read_nothing_of_the_tree(tree, tmp_path):
    reads = tree.run(f"import subprocess\n"
                     f"subprocess.run(['git', '-C', '.', 'show', '{BASE}:pkg/used.py'], "
                     f"check=True, capture_output=True)\n"
                     f"subprocess.run(['uname', '-p'], capture_output=True)\n"
                     f"subprocess.run(['g++', '-v'], capture_output=True)\n"
                     f"subprocess.run(['g++', '-DX=1', '-O2', '-lm', '-E', '-x', 'c++', "
                     f"'/dev/null'], capture_output=True)\n"
                     # Triton asks for the CUDA assembler's version as it loads.
                     f"try:\n    subprocess.run(['ptxas', '--version'], capture_output=True)\n"
                     f"except FileNotFoundError:\n    pass\n", tmp_path)
    assert not reads.opaque
    reads = tree.run("import subprocess\nsubprocess.run(['git', '-C', '.', 'show', "
                     "'HEAD:pkg/used.py'], capture_output=True)\n", tmp_path)
    assert reads.opaque


def test_project_files_that_no_key_holds_are_tracked_on_disk(tree, tmp_path):
    """vllm_overlay/ (the tree exported) and docs/ are in no key: a unit that reads
    them is keyed by what it read there."""
    overlay = tmp_path / "project" / "vllm_overlay"
    overlay.mkdir(parents=True)
    (overlay / "MANIFEST.json").write_text("{}")
    log = tmp_path / "reads.log"
    env = {**os.environ, **tracker_env(log, tree.root, [overlay], BASE),
           "PYTHONPATH": str(TRACKER_DIR)}
    subprocess.run([sys.executable, "-c", f"open({str(overlay / 'MANIFEST.json')!r}).read()"],
                   env=env, check=True)
    reads = Reads.parse(log.read_text(), tree.root, tmp_path / "project")
    assert reads.entries == {"r project:vllm_overlay/MANIFEST.json"}
    index = TreeIndex(tree.root, tree.tree_id())
    before = reads.digest(index, tmp_path / "project")
    (overlay / "MANIFEST.json").write_text('{"files": []}')
    assert reads.digest(index, tmp_path / "project") != before


def test_changed_names_the_paths(tree, tmp_path):
    reads = tree.run("import pkg.used\n", tmp_path)
    before = TreeIndex(tree.root, tree.tree_id())
    tree.write("pkg/used.py", "VALUE = 10\n")
    tree.write("pkg/unused.py", "VALUE = 20\n")
    after = TreeIndex(tree.root, tree.tree_id())
    assert reads.changed(before, after, tmp_path) == ["pkg/used.py"]


@pytest.mark.parametrize("target, sibling_counts", [("checks/test_one.py", False),
                                                    ("checks", True)],
                         ids=["named-file", "folder"])
def test_pytest_reads_the_files_beside_a_test_only_when_given_their_folder(
        tree, tmp_path, target, sibling_counts):
    tree.write("checks/test_one.py", "import pkg.used\n\n\ndef test_one():\n    pass\n")
    reads = tree.run(f"import sys, pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider',"
                     f" {target!r}]))\n", tmp_path)
    assert "r pkg/used.py" in reads.entries and not reads.opaque
    before = tree.digest(reads)
    tree.write("checks/test_two.py", "def test_two():\n    pass\n")
    assert (tree.digest(reads) != before) is sibling_counts
    # Even a file pytest would not collect: a folder's listing is an input.
    tree.git("rm", "-q", "--cached", "checks/test_two.py")
    (tree.root / "checks/test_two.py").unlink()
    tree.write("checks/notes.txt", "not a test\n")
    assert (tree.digest(reads) != before) is sibling_counts


# Readers that open a file themselves, as C or Rust code does: through libc, so
# that Python's `open` audit event never fires.
NATIVE_READ = """\
import ctypes
import os

_libc = ctypes.CDLL(None)


def _read(path):
    fd = _libc.open(os.fsencode(path), 0)
    buffer = ctypes.create_string_buffer(64)
    size = _libc.read(fd, buffer, 64)
    _libc.close(fd)
    return buffer.raw[:size]
"""
FAKE_READERS = {
    "safetensors": NATIVE_READ + "\n\ndef safe_open(filename, framework, device='cpu'):\n"
                                 "    return _read(filename)\n",
    "torch": NATIVE_READ + "\n\ndef from_file(filename, shared=None, size=0):\n"
                           "    return _read(filename)\n",
    "tokenizers": NATIVE_READ + "\n\nclass Tokenizer:\n    @classmethod\n"
                                "    def from_file(cls, path):\n        return _read(path)\n",
}
CALLS = {"safetensors": "safetensors.safe_open('data/w.bin', framework='np')",
         "torch": "torch.from_file(filename='data/w.bin', size=4)",
         "tokenizers": "tokenizers.Tokenizer.from_file('data/w.bin')"}


@pytest.mark.parametrize("reader", list(FAKE_READERS))
def test_a_file_a_native_reader_opens_is_recorded(tree, tmp_path, reader):
    """Case 3: safetensors (Rust), torch.from_file (C++), tokenizers (Rust) read
    a file of the tree by its path: its content is an input all the same."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{reader}.py").write_text(FAKE_READERS[reader])
    tree.write("data/w.bin", "weights\n")
    program = f"import {reader}\nassert {CALLS[reader]} == b'weights\\n'\n"
    reads = tree.run(program, tmp_path, path=[lib])
    assert "r data/w.bin" in reads.entries
    before = tree.digest(reads)
    tree.write("data/w.bin", "changed\n")
    assert tree.digest(reads) != before


def test_a_real_safetensors_read_is_recorded(tree, tmp_path):
    pytest.importorskip("safetensors")
    numpy = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    (tree.root / "data").mkdir(exist_ok=True)
    save_file({"w": numpy.arange(4, dtype=numpy.float32)}, str(tree.root / "data/w.st"))
    reads = tree.run("from safetensors.numpy import load_file\n"
                     "assert load_file('data/w.st')['w'].sum() == 6\n", tmp_path)
    assert "r data/w.st" in reads.entries
