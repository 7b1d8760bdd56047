"""`make test`'s records after damage and kills: a damaged file is one line and
taken as missing; what a killed run left is removed by the next run.

The suite project of test_testcache.py after one green run, its records in
build/test-results/ damaged or left as a SIGKILL leaves them.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from scripts import testcache
from tests.tooling import test_testcache
from tests.tooling.test_testcache import _ran, _test

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
