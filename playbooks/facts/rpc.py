"""Whether this host reaches a recipe's llama.cpp RPC workers: one read-only command that tries
a TCP connection to each endpoint (bash's /dev/tcp, 3 s each) and prints one line per endpoint:
open, refused (nothing listens there) or timeout (no answer: a filter drops it, or the worker
is busy: ggml-rpc-server serves one client at a time, and a running llama-server holds its
connection, measured in tests/test_rpc_split_real.py). Garbage parses to nothing, never an
exception."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from playbooks.facts import lines

CONNECT_TIMEOUT_S = 3
_ENDPOINT = re.compile(r"^\[?([0-9A-Fa-f.:]+)\]?:(\d{1,5})$")


def reach_command(endpoints: Sequence[str]) -> str:
    """`ENDPOINT open|refused|timeout MICROSECONDS` per endpoint; exit 0 whatever it finds."""
    parts = []
    for e in endpoints:
        m = _ENDPOINT.match(e)
        if not m:  # the recipe schema admits IP:PORT only; anything else is not tried
            continue
        addr, port = m.groups()
        probe = f"exec 3<>/dev/tcp/{addr}/{port}"
        # each endpoint in its own subshell, all at once: busy workers (one client at a time)
        # cost one timeout together, not one each; a line is one short write, never interleaved
        parts.append(
            f"( t=$(date +%s%N); timeout {CONNECT_TIMEOUT_S} bash -c {shlex.quote(probe)} 2>/dev/null; "
            f"case $? in 0) s=open;; 124) s=timeout;; *) s=refused;; esac; "
            f"echo {shlex.quote(e)} $s $(( ($(date +%s%N) - t) / 1000 )) ) &"
        )
    return " ".join(parts) + " wait" if parts else "true"


def parse_reach_timed(output: str) -> dict[str, tuple[str, float | None]]:
    """endpoint -> (state, connect time in ms: the TCP handshake, one round trip, plus the
    cost of starting `timeout` and bash on the probing host, so an upper bound)."""
    found: dict[str, tuple[str, float | None]] = {}
    for line in lines(output):
        words = line.split()
        if len(words) >= 2 and words[1] in ("open", "refused", "timeout"):
            micros = words[2] if len(words) > 2 and words[2].isdigit() else None
            found[words[0]] = (words[1], int(micros) / 1000 if micros is not None else None)
    return found
