"""`make help` lists the same commands as the code map (docs/code-map.md).

Both are where a newcomer looks for what the project can do; a target added
to one is easily forgotten in the other. This test reads the real page, so
`make test` runs it as a unit of its own keyed by it
(scripts/testing/testrun.py PROSE_TESTS).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.tooling.conftest import PYTHON, REPO

# "make apply      fetch ...", "make drift [VLLM_VERSION=x.y.z] ...", and
# "make build | lock | fetch" (three commands on one line).
_HELP_LINE = re.compile(r"^make (?P<commands>[a-z][a-z-]*(?: \| [a-z][a-z-]*)*)")
_MAKE_COMMAND = re.compile(r"`make (?P<command>[a-z][a-z-]*)")


def help_commands(text: str) -> set[str]:
    """The commands `make help` lists."""
    found = set()
    for line in text.splitlines():
        if match := _HELP_LINE.match(line):
            found.update(match.group("commands").split(" | "))
    return found


def code_map_commands(readme: str) -> set[str]:
    """The commands of the first column of the table under `## Code map` whose
    first column holds `make <command>` (a row may name two; "none" names none)."""
    section = readme.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]
    for table in re.findall(r"(?:^\|.*\n)+", section, flags=re.MULTILINE):
        first_cells = [row.strip().strip("|").split("|")[0] for row in table.splitlines()[2:]]
        found = {m.group("command") for cell in first_cells
                 for m in _MAKE_COMMAND.finditer(cell)}
        if found:
            return found
    return set()


def mismatches(help_text: str, readme: str) -> list[str]:
    """One line per command that is in one of the two and not in the other."""
    listed, mapped = help_commands(help_text), code_map_commands(readme)
    return ([f"make {c}: in the code map, not in `make help`"
             for c in sorted(mapped - listed)]
            + [f"make {c}: in `make help`, not in the code map"
               for c in sorted(listed - mapped)])


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_help_lists_the_commands_of_the_code_map():
    result = subprocess.run(["make", "-s", "-C", str(REPO), f"PYTHON={PYTHON}", "help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    code_map = (REPO / "docs" / "code-map.md").read_text()
    assert len(code_map_commands(code_map)) > 10  # the table was found
    assert mismatches(result.stdout, code_map) == []


HELP = """\
make apply      fetch pinned vLLM
make drift [VLLM_VERSION=x.y.z]  try the stack
                (a continuation line)
make build | lock | fetch
"""
README = """\
# Project

## Code map

| make target | command | where it is |
| --- | --- | --- |
| `make apply` | `apply` | `stack/apply.py` |
| `make drift` | `drift` | `stack/drift.py` |
| `make build`, `make lock` | `build` | `stack/venv.py` |
| none | `runbook` | `runbook/cli.py` |

| what | where |
| --- | --- |
| `make overlay` is not a row of the map | here |

## Next
"""


def test_a_command_in_one_list_only_is_named():
    assert help_commands(HELP) == {"apply", "drift", "build", "lock", "fetch"}
    assert code_map_commands(README) == {"apply", "drift", "build", "lock"}
    assert mismatches(HELP, README) == [
        "make fetch: in `make help`, not in the code map"]
    assert mismatches(HELP.replace("make drift", "make dirt"), README) == [
        "make drift: in the code map, not in `make help`",
        "make dirt: in `make help`, not in the code map",
        "make fetch: in `make help`, not in the code map"]
