"""Host facts: a named command plus a pure parser of its output (pyinfra style).

Every command that reads host state lives in this package, beside the parser of what it
prints; operations and steps read facts through :func:`read_fact` and never run ad-hoc
reads of their own. Parsers are tested on captured real output, without a host.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Runs(Protocol):
    """What a fact needs of a host: to run a command (Host, and any stand-in in a test)."""

    def run(self, cmd: str, *, check: bool = ..., stream: bool = ..., stdin: bytes | None = ...) -> _Output: ...


class _Output(Protocol):
    @property
    def stdout(self) -> str: ...  # read-only: a frozen Result satisfies it


def read_fact(host: Runs, command: str, stdin: bytes | None = None) -> str:
    """Run a fact's read-only command quietly; its parser judges the output, even on failure.
    ``stdin``: a probe script fed to the command (small; never a secret)."""
    return host.run(command, check=False, stream=False, stdin=stdin).stdout


def lines(text: str | None) -> list[str]:
    """Output split into lines whatever the line endings (CRLF from some tools, CR from others)."""
    return (text or "").replace("\r\n", "\n").replace("\r", "\n").split("\n")


def last_json_line(text: str | None, probe: str) -> dict[str, Any] | None:
    """The object a probe script printed: the last line starting with '{', when it parses and
    names this probe; None otherwise (noise before it is ignored, garbage never raises)."""
    for line in reversed(lines(text)):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            return data if isinstance(data, dict) and data.get("probe") == probe else None
    return None
