"""Whether this host reaches a recipe's llama.cpp RPC workers: one read-only command that tries
a TCP connection to each endpoint (bash's /dev/tcp, 3 s each) and prints one line per endpoint.
Garbage parses to "not reached", never an exception."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from playbooks.facts import lines

CONNECT_TIMEOUT_S = 3
_ENDPOINT = re.compile(r"^\[?([0-9A-Fa-f.:]+)\]?:(\d{1,5})$")


def reach_command(endpoints: Sequence[str]) -> str:
    """`ENDPOINT open` or `ENDPOINT closed` per endpoint; exit 0 whatever it finds."""
    parts = []
    for e in endpoints:
        m = _ENDPOINT.match(e)
        if not m:  # the recipe schema admits IP:PORT only; anything else is not tried
            continue
        addr, port = m.groups()
        probe = f"exec 3<>/dev/tcp/{addr}/{port}"
        parts.append(
            f"if timeout {CONNECT_TIMEOUT_S} bash -c {shlex.quote(probe)} 2>/dev/null; "
            f"then echo {shlex.quote(e)} open; else echo {shlex.quote(e)} closed; fi"
        )
    return "; ".join(parts) or "true"


def parse_reach(output: str) -> dict[str, bool]:
    found: dict[str, bool] = {}
    for line in lines(output):
        endpoint, _, state = line.strip().rpartition(" ")
        if endpoint and state in ("open", "closed"):
            found[endpoint] = state == "open"
    return found
