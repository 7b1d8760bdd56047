"""Fault injection for the tooling tests: a signal, or a failing system call, at
an exact file operation of the tooling's own process.

`Project.run(..., fault=SPEC)` puts this folder first on PYTHONPATH, so
Python imports this module at start-up, and passes SPEC in K3_TEST_FAULT:

    <action> <event> <n> [after <event> <m>] [in <text>]

- action: a signal name (SIGKILL, SIGTERM, SIGHUP), sent to the process
  itself, or an errno name (EIO, ENOSPC), raised as the call's OSError;
- event: a Python audit event: `open` (open(), os.open()), `os.rename`
  (os.rename(), os.replace()) or `os.remove` (os.remove(), os.unlink());
- n: act at the n-th such event, counting only events whose first argument
  (the path) contains `text`, and only once `after` has happened m times.

A hook runs before the call it audits: SIGKILL and an errno stop the call
itself, while a signal with a Python handler is handled just after it.
The variable is removed at once, so no child process (git, pip) sees it.
"""

from __future__ import annotations

import errno
import os
import signal
import sys


def _install(spec: str) -> None:
    words = spec.split()
    action, event, nth = words[0], words[1], int(words[2])
    after, after_count, where = None, 0, ""
    rest = words[3:]
    while rest:
        if rest[0] == "after":
            after, after_count, rest = rest[1], int(rest[2]), rest[3:]
        elif rest[0] == "in":
            where, rest = rest[1], rest[2:]
        else:
            raise SystemExit(f"K3_TEST_FAULT: cannot read {spec!r}")
    seen = {"event": 0, "after": 0}

    def hook(name: str, args: tuple) -> None:
        path = str(args[0]) if args else ""
        if where not in path:
            return
        if name == after:
            seen["after"] += 1
        if name != event or seen["after"] < after_count:
            return
        seen["event"] += 1
        if seen["event"] != nth:
            return
        if action.startswith("SIG"):
            os.kill(os.getpid(), getattr(signal, action))
        else:
            code = getattr(errno, action)
            raise OSError(code, f"{os.strerror(code)} (injected by the test)", path)

    sys.addaudithook(hook)


if spec := os.environ.pop("K3_TEST_FAULT", None):
    _install(spec)
