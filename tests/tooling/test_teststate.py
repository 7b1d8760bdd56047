"""`make test`'s records after damage and kills: a damaged file is one line and
taken as missing; what a killed run left is removed by the next run.

The suite project of test_testcache.py after one green run, its records in
build/test-results/ damaged or left as a SIGKILL leaves them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from scripts.testing import testcache
from tests.tooling import test_testcache
from tests.tooling.conftest import PYTHON, REPO, TEST_FOO_PATCHED
from tests.tooling.test_testcache import _parts, _ran, _test

suites = test_testcache.suites  # the fixture: its green project, built once per session


def _results(project) -> Path:
    return project.root / "build" / "test-results"


def _outcome_of_many(path: Path) -> bytes:
    record = json.loads(path.read_text())
    record["outcome"]["passed"] = "many"
    return json.dumps(record).encode()


# (what is damaged, which files, their new bytes)
DAMAGE = {
    "green-not-utf8": ("green/*.json", lambda path: b'{"key": "\xff\xfe"}'),
    "green-a-list": ("green/*.json", lambda path: b"[1]"),
    "green-outcome-of-wrong-type": ("green/*.json", _outcome_of_many),
    "latest-key-of-wrong-type": ("latest/*.json", lambda path: b'{"key": 5}'),
    "reads-index-of-wrong-shape": ("reads/*[0-9a-f].json", lambda path: b'{"reads": 5}'),
    "reads-cut-short": ("reads/*.json.gz", lambda path: path.read_bytes()[:12]),
    "reads-of-wrong-shape": ("reads/*.json.gz", lambda path: __import__("gzip").compress(
        b'{"entries": ["no-kind"], "opaque": []}')),
    "project-files-a-list": ("projects/*.json", lambda path: b"[1]"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_is_one_line_and_taken_as_missing(suites, capsys, damage):
    pattern, damaged = DAMAGE[damage]
    files = sorted(_results(suites).glob(pattern))
    assert files
    for path in files:
        path.write_bytes(damaged(path))
    if damage.startswith("project-files"):  # read to say which project files changed
        tool = suites.root / "tests/tooling/test_tool.py"
        tool.write_text(tool.read_text() + "# edited\n")
    assert _test(suites) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "taken as missing" in line]
    assert warnings and "Traceback" not in err
    assert all(line.startswith("warning: ") and "test-results/" in line for line in warnings)
    # Removed: the next run reuses what this one recorded, and says nothing.
    _ran(suites)
    assert _test(suites) == 0
    assert _ran(suites) == set()
    assert "taken as missing" not in capsys.readouterr().err


def test_the_next_run_removes_what_a_killed_run_left(suites, capsys):
    """A SIGKILL leaves the read logs of the units that ran, the fork servers'
    logs and half-written records: the next run removes them, and says so."""
    results = _results(suites)
    left = [results / "logs" / "reads-x1y2.log", results / "logs" / "reads-x1y2.log.child-0.7.json",
            results / "servers" / "server-a1b2.reads",
            results / "green" / ".0123.json.ab12.k3-tmp"]
    for path in left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("left\n")
    assert _test(suites) == 0
    assert not any(path.exists() for path in left)
    assert "removed 4 files that a killed run left in " in capsys.readouterr().out


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch):
    """write() on a full disk raises ENOSPC without a file name: the error names
    the record, and the scratch copy is gone."""
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.file = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(testcache.os, "fdopen", Full)
    target = tmp_path / "green" / "k.json"
    with pytest.raises(OSError, match="No space left on device") as raised:
        testcache._write_json(target, {"key": "k"})
    assert raised.value.filename == str(target)
    assert list(target.parent.iterdir()) == []


SLOW = """\
import os
import time
from pathlib import Path


def test_slow():
    (Path(os.environ["FAKE_STARTED"]) / Path(__file__).name).write_text(str(os.getpid()))
    time.sleep(120)
"""


def _session(sid: int) -> list[int]:
    """The processes of session `sid` (make test started in a session of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("whom", ["python", "make-group"])
@pytest.mark.parametrize("row", ["verification", "stack"])
def test_sigterm_stops_make_test_within_seconds(suites, tmp_path, whom, row):
    """SIGTERM to `python3 -m scripts test` alone, or to the process group `make`
    shares with it: it exits in seconds, no process it started is left (a
    pytest process, a fork server and the child it forked), the queued unit
    never starts, the lock is free and the stopped unit is not recorded green."""
    if row == "verification":  # plain pytest processes, one at a time: one runs, one waits
        for name in ("test_slow_a.py", "test_slow_b.py"):
            (suites.root / "tests/verification" / name).write_text(SLOW)
    else:  # a fork of the tree's fork server
        (suites.tree / "tests/test_foo.py").write_text(TEST_FOO_PATCHED + "\n\n" + SLOW)
    greens = set((_results(suites) / "green").iterdir())
    started = tmp_path / "started"
    started.mkdir()
    env = {**suites.env(), "FAKE_RUN_LOG": os.environ["FAKE_RUN_LOG"],
           "FAKE_STARTED": str(started), "K3_TEST_JOBS": "1"}
    proc = subprocess.Popen([PYTHON, "-m", "scripts", "test", "--only", row], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(started.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(started.iterdir()), "no slow test started"
        stopped = time.monotonic()
        if whom == "python":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - stopped < 10, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "terminated (SIGTERM)" in out
    deadline = time.monotonic() + 5
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session(proc.pid) == []
    assert len(list(started.iterdir())) == 1  # the queued unit never started
    assert not (suites.root / ".k3-stack.running").exists()
    fd = os.open(suites.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free
    finally:
        os.close(fd)
    # A unit that ended before the stop may be green (test_new, say); not the stopped one.
    new = [json.loads(p.read_text())["name"] for p in set(
        (_results(suites) / "green").iterdir()) - greens]
    assert not [name for name in new if "test_foo" in name or "test_slow" in name], new


LEAK = """\
import os
import tempfile


def test_leak():
    tempfile.mkdtemp(prefix=os.environ["FAKE_LEAK"])
"""


def test_a_test_that_leaves_temporary_files_leaves_none_in_tmp(suites, monkeypatch):
    """A test that never removes its mkdtemp (verification's drafter harness did,
    for each checkpoint it wrote): each unit's temporary folder is its own, and
    goes with it, in a pytest process of its own as in a fork of a server."""
    prefix = f"k3-leak-{os.getpid()}-"
    monkeypatch.setenv("FAKE_LEAK", prefix)
    (suites.root / "tests/verification/test_leak.py").write_text(LEAK)
    (suites.tree / "tests/test_foo.py").write_text(TEST_FOO_PATCHED + "\n\n" + LEAK)
    try:
        assert _test(suites, only="stack,verification") == 0
        parts = _parts(suites)
        assert parts[("stack", "tests/test_foo.py")]["passed"] == 2
        assert parts[("verification", "tests/verification/test_leak.py")]["passed"] == 1
        assert list(Path(tempfile.gettempdir()).glob(prefix + "*")) == []
    finally:
        for leaked in Path(tempfile.gettempdir()).glob(prefix + "*"):
            shutil.rmtree(leaked)
