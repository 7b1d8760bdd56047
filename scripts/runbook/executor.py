"""How the runbook's commands run: subprocesses here, a recording fake in tests."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass
class Result:
    returncode: int  # 124: timed out
    output: str  # all of stdout and stderr (also in the log file)


class Executor(Protocol):
    def run(self, argv: list[str], *, timeout: float, log: Path, kind: str = "",
            meta: dict | None = None) -> Result:
        """Run argv to completion, its output going to `log`."""
        ...

    def http_status(self, url: str) -> int | None:
        """The HTTP status of a GET, or None when nothing answers."""
        ...

    def sleep(self, seconds: float) -> None: ...

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    def timestamp(self) -> str:
        """Wall-clock time for the record of commands."""
        ...


class SubprocessExecutor:
    def run(self, argv: list[str], *, timeout: float, log: Path, kind: str = "",
            meta: dict | None = None) -> Result:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            try:
                proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = 124
            except FileNotFoundError:
                out.write(f"{argv[0]}: command not found\n".encode())
                code = 127
        return Result(code, log.read_text(errors="replace"))

    def http_status(self, url: str) -> int | None:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def now(self) -> float:
        return time.monotonic()

    def timestamp(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S%z")
