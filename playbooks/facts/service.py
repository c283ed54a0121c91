"""Facts about a served model's process: a systemd unit's state, a managed process's pid,
who listens on a port, what /health answers. Each a read-only command (exit 0 whatever the
host holds) and a pure parser; garbage parses to "not running", never an exception."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from playbooks.facts import lines

# ------------------------------------------------------------------------------------------
# a systemd unit
# ------------------------------------------------------------------------------------------

_UNIT_PROPS = ("ActiveState", "SubState", "MainPID", "InvocationID", "NRestarts", "UnitFileState", "LoadState")


def unit_state_command(unit: str) -> str:
    props = ",".join(_UNIT_PROPS)
    return f"systemctl show -p {props} -- {shlex.quote(unit)} 2>/dev/null || true"


@dataclass(frozen=True)
class UnitState:
    active: str = "unknown"  # active, activating, failed, inactive, ...
    sub: str = ""
    main_pid: int = 0
    invocation: str = ""
    restarts: int = 0
    enabled: str = ""
    loaded: str = ""

    @property
    def running(self) -> bool:
        return self.active == "active" and self.main_pid > 0


def parse_unit_state(output: str) -> UnitState:
    props: dict[str, str] = {}
    for line in lines(output):
        key, sep, value = line.partition("=")
        if sep and key in _UNIT_PROPS:
            props[key] = value.strip()

    def number(key: str) -> int:
        value = props.get(key, "")
        return int(value) if value.isdigit() else 0

    return UnitState(
        active=props.get("ActiveState") or "unknown",
        sub=props.get("SubState", ""),
        main_pid=number("MainPID"),
        invocation=props.get("InvocationID", ""),
        restarts=number("NRestarts"),
        enabled=props.get("UnitFileState", ""),
        loaded=props.get("LoadState", ""),
    )


# ------------------------------------------------------------------------------------------
# a managed process (hosts without systemd)
# ------------------------------------------------------------------------------------------


def process_state_command(pid_file: str, binary: str, exe_file: str | None = None) -> str:
    """The pid in the pid file, whether it lives, its start time (clock ticks since boot: a
    reused pid has another), its executable, and the executable it was started as: the real
    path recorded in ``exe_file`` at its start, else the binary's now (``current`` is a link,
    and `invoke build` moves it to a new build under a running server)."""
    q = shlex.quote(pid_file)
    want = f"readlink -f -- {shlex.quote(binary)}"
    if exe_file:
        want = f"cat -- {shlex.quote(exe_file)} 2>/dev/null || {want}"
    return (
        f'echo "want=$({want})"; '
        f'pid=$(cat -- {q} 2>/dev/null | head -c 32); case "$pid" in ""|*[!0-9]*) echo pid=; exit 0;; esac; '
        'echo "pid=$pid"; if [ -r "/proc/$pid/stat" ]; then '
        "echo \"start=$(sed 's/.*) //' /proc/$pid/stat | cut -d' ' -f20)\"; "
        'echo "exe=$(readlink "/proc/$pid/exe" 2>/dev/null)"; fi; true'
    )


@dataclass(frozen=True)
class ProcessState:
    pid: int = 0
    start_ticks: int = 0  # 0: no such process
    exe: str = ""
    want: str = ""  # the binary's real path

    @property
    def running(self) -> bool:
        """Alive, and the program we started (a pid file outlives its process; pids are reused).
        A rebuilt binary behind the same path shows as '(deleted)': still ours, and running."""
        return (
            self.pid > 0
            and self.start_ticks > 0
            and bool(self.want)
            and self.exe.removesuffix(" (deleted)") == self.want
        )


def parse_process_state(output: str) -> ProcessState:
    values = dict(line.partition("=")[::2] for line in lines(output) if "=" in line)
    pid, start = values.get("pid", ""), values.get("start", "")
    return ProcessState(
        int(pid) if pid.isdigit() else 0,
        int(start) if start.isdigit() else 0,
        values.get("exe", "").strip(),
        values.get("want", "").strip(),
    )


# ------------------------------------------------------------------------------------------
# the port and the health endpoint
# ------------------------------------------------------------------------------------------


def listeners_command(port: int) -> str:
    return f"ss -ltnpH 'sport = :{int(port)}' 2>/dev/null || true"


@dataclass(frozen=True)
class Listener:
    address: str
    pids: tuple[int, ...]
    process: str  # the program name ss shows ('' without the right to see it)


_SS_USERS = re.compile(r'\("([^"]*)",pid=(\d+)')


def parse_listeners(output: str) -> list[Listener]:
    """`ss -ltnpH`'s rows: local address, and the processes when ss may show them."""
    found = []
    for line in lines(output):
        cols = line.split()
        if len(cols) < 4:
            continue
        users = _SS_USERS.findall(line)
        found.append(Listener(cols[3], tuple(int(p) for _, p in users), users[0][0] if users else ""))
    return found


def health_command(port: int, path: str = "/health", tls: bool = False) -> str:
    """The HTTP status of GET /health on loopback ('000': nothing answered). ``tls``: over HTTPS
    without checking the certificate (a liveness probe on the host's own loopback, no key sent;
    clients verify it)."""
    url = f"{'https' if tls else 'http'}://127.0.0.1:{int(port)}{shlex.quote(path)}"
    return f"curl -s {'-k ' if tls else ''}-o /dev/null -m 5 -w '%{{http_code}}' {url} 2>/dev/null; true"


def parse_health(output: str) -> int:
    text = output.strip()[-3:]
    return int(text) if text.isdigit() else 0
