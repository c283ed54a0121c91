"""Facts about a model set's router (llama-server started without a model, issue 55): what its
``GET /models`` says of each member, and what each child process holds. Each a read-only
command (exit 0 whatever the host holds) and a pure parser; garbage parses to nothing.

At the pinned llama.cpp (0c1e570, tools/server/server-models.cpp) ``GET /models`` lists every
model of the preset with ``status.value`` one of unloaded, loading, loaded, sleeping (and
downloading, downloaded for a hub model: never ours), ``status.args`` the child's command line
while one runs, ``status.failed`` and ``exit_code`` after a child that died. It does not say when
a model was last used (the router keeps that for its own eviction only): its log does. Each
request it routes is one line, ``proxy_reques: proxying request to model NAME on port N``,
stamped (``M.SS.mmm.uuu``: minutes, seconds, ms, us) from the logger's start as the process
starts (common/log.cpp); so a member was last used the router's age less its last line's stamp.

What a child holds, on a CPU host: its anonymous resident memory (KV cache, compute buffers,
its own heap: ``RssAnon``) and the pages of its model file it has mapped (``RssFile``: the
weights, from the page cache, so the same pages held by the cache after the child exits are
not counted anywhere; each member has its own file, so no page is counted twice). On a GPU host
the card's memory per process is nvidia-smi's (``--query-compute-apps``), read apart.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

#: the states a member can be in, as the router names them
STATES = ("unloaded", "loading", "loaded", "sleeping", "downloading", "downloaded")


@dataclass(frozen=True)
class Member:
    """One model of the router's list."""

    name: str
    state: str  # one of STATES, or "unknown"
    port: int | None = None  # its child's, while one runs
    failed: bool = False
    exit_code: int | None = None


def parse_models(text: str) -> list[Member]:
    """The router's ``GET /models`` body (``{"data": [...]}``, or a bare list) as members, in
    its order; anything else is no members."""
    try:
        body = json.loads(text)
    except ValueError:
        return []
    items = body.get("data") if isinstance(body, dict) else body
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        got = item.get("status")
        status: dict = got if isinstance(got, dict) else {}
        value = status.get("value")
        state = value if isinstance(value, str) and value in STATES else "unknown"
        code = status.get("exit_code")
        out.append(
            Member(
                name=item["id"],
                state=state,
                port=_port(status.get("args")),
                failed=bool(status.get("failed")),
                exit_code=code if isinstance(code, int) else None,
            )
        )
    return out


def _port(args: object) -> int | None:
    """``--port N`` in a child's argument list."""
    if not isinstance(args, list):
        return None
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--port" and isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def models_command(port: int, key_file: str) -> str:
    """The router's ``GET /models`` on the host's loopback; with the key file's first line as
    the bearer token when the file is there (a keyed router lists nothing without it). The key
    reaches curl on its stdin as a header line (``-H @-``), never in an argv."""
    url = shlex.quote(f"http://127.0.0.1:{int(port)}/models")
    q = shlex.quote(key_file)
    return (
        f"if [ -s {q} ]; then {{ printf 'Authorization: Bearer '; head -n1 -- {q}; }} | "
        f"curl -s -m 5 -H @- {url}; else curl -s -m 5 {url}; fi; true"
    )


def children_command(pid_file: str) -> str:
    """Each child of the router whose pid the file holds: its pid, its resident memory by kind
    (kB, /proc/PID/status) and its command line (NUL-separated words made spaces)."""
    q = shlex.quote(pid_file)
    return (
        f'pid=$(cat -- {q} 2>/dev/null | head -c 32); case "$pid" in ""|*[!0-9]*) exit 0;; esac; '
        'for c in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do '
        'echo "child=$c"; grep -E "^(VmRSS|VmHWM|RssAnon|RssFile):" /proc/"$c"/status 2>/dev/null; '
        "printf 'argv='; tr '\\0' ' ' < /proc/\"$c\"/cmdline 2>/dev/null; echo; done; true"
    )


@dataclass(frozen=True)
class Child:
    """One child process of the router, as /proc shows it."""

    pid: int
    port: int | None
    rss_kb: int | None = None
    peak_kb: int | None = None
    anon_kb: int | None = None
    file_kb: int | None = None

    @property
    def held_bytes(self) -> int | None:
        """Its own memory plus its mapped weights (the module's docstring says why)."""
        if self.anon_kb is None or self.file_kb is None:
            return None
        return (self.anon_kb + self.file_kb) * 1024


def parse_children(text: str) -> list[Child]:
    """:func:`children_command`'s output as children (a record cut short keeps what it has)."""
    out: list[Child] = []
    fields: dict[str, int] = {}
    pid: int | None = None
    port: int | None = None

    def close() -> None:
        if pid is not None:
            out.append(
                Child(pid, port, fields.get("VmRSS"), fields.get("VmHWM"), fields.get("RssAnon"), fields.get("RssFile"))
            )

    for line in text.splitlines():
        if line.startswith("child="):
            close()
            value = line.removeprefix("child=").strip()
            pid, port, fields = (int(value) if value.isdigit() else None), None, {}
        elif line.startswith("argv="):
            port = _port(line.removeprefix("argv=").split())
        else:
            key, sep, rest = line.partition(":")
            words = rest.split()
            if sep and words and words[0].isdigit():
                fields[key.strip()] = int(words[0])
    close()
    return out


#: the router's own lines (a child's come prefixed with its pid in brackets): its start, and a
#: request it routes, each with its stamp
_STAMP = r"^([0-9]+)\.([0-9]{2})\.([0-9]{3})\.([0-9]{3}) [IWED] srv +"
_ROUTED = re.compile(_STAMP + r"proxy_reques: proxying request to model (\S+) on port [0-9]+$")
_STARTED = re.compile(_STAMP + r"llama_server: initializing")


def routed_command(log_file: str) -> str:
    """The router's start lines and the last line it routed each model, from its log file (a
    managed process's; none under systemd, whose journal keeps it): one line per model, bounded
    whatever the log's size. Only the router's own lines count: a child's (``[pid] ...``)
    start says ``llama_server: initializing`` too."""
    q = shlex.quote(log_file)
    return (
        f"[ -r {q} ] && grep -a -E 'llama_server: initializing|proxying request to model ' -- {q} | "
        'awk \'!/^[0-9]/ { next } /llama_server: initializing/ { split("", last); print; next } '
        "{ last[$(NF-3)] = $0 } END { for (m in last) print last[m] }'; true"
    )


def _seconds(m: re.Match[str]) -> float:
    minutes, seconds, ms, us = (int(g) for g in m.groups()[:4])
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def parse_routed(text: str) -> dict[str, float]:
    """:func:`routed_command`'s output: each model's last routed request, in seconds from the
    router's start (its latest start: a line routed before it counts for nothing). A log without
    stamps (``--log-timestamps`` off) says nothing."""
    last: dict[str, float] = {}
    for line in text.splitlines():
        if _STARTED.match(line):
            last = {}
        elif m := _ROUTED.match(line.rstrip()):
            last[m[5]] = _seconds(m)
    return last
