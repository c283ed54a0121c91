"""HAProxy's runtime API on the balancer's host: take one server out of rotation and put it back
(a rolling change, conduct/roll.py).

The API is a Unix socket, owner-only (templates/haproxy.cfg.j2 ``stats socket``): under systemd
the unit's dynamic user owns it (root reaches it through ``sudo``), as a managed process the SSH
user does. Hosts carry no socat, so a few lines of the host's python3 (every host voltaforge
serves from has one) carry one command line there and the answer back; the command travels on
stdin, the socket's path is the only argument.

- ``set server <backend>/<server> state drain``: HAProxy sends that server no new request (it
  goes to the model's other servers; a request already queued at the edge too), and those it
  runs go on to their end (``scur``: its current requests, in ``show stat``).
- ``state ready``: back in rotation once its health check passes (``UP``; a restarted server
  that is still loading stays out on its own).

Both are operations (check, then act), so a dry run shows the exact command and a server already
drained or back is ``ok``; the waits are bounded and say what they saw when the bound passes.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from playbooks.errors import HostError, VoltaforgeError
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Shell
from playbooks.steps.serve.balancer import BACKEND_PREFIX, SOCKET_PATH_MAX, ServerStat, parse_stats
from playbooks.words import clip

# one command line to the socket, the whole answer back (HAProxy closes after answering)
_CLIENT = (
    "import socket,sys\n"
    "s=socket.socket(socket.AF_UNIX)\n"
    "s.settimeout(10)\n"
    "s.connect(sys.argv[1])\n"
    "s.sendall(sys.stdin.buffer.read())\n"
    "s.shutdown(socket.SHUT_WR)\n"
    "while True:\n"
    "    b=s.recv(65536)\n"
    "    if not b:\n"
    "        break\n"
    "    sys.stdout.buffer.write(b)\n"
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: how often a wait asks HAProxy again
POLL_S = 0.5
#: how long a server put back may take to pass its health check (2 checks 2 s apart, a margin)
READY_BOUND_S = 60.0


@dataclass(frozen=True)
class RuntimeApi:
    """The socket of one balancer's runtime API on its host."""

    socket: str
    sudo: bool

    def __post_init__(self) -> None:
        if not self.socket.startswith("/") or "\n" in self.socket:
            raise VoltaforgeError(f"runtime API socket {self.socket!r}: not an absolute path")
        if len(self.socket.encode()) > SOCKET_PATH_MAX:
            raise VoltaforgeError(
                f"the balancer's runtime API socket {self.socket} is {len(self.socket.encode())} bytes long, past "
                f"the {SOCKET_PATH_MAX} a Unix socket's path holds: give the balancer's host a shorter prefix"
            )

    def command(self) -> str:
        """The shell line that sends a command line given on its stdin."""
        return f"python3 -c {shlex.quote(_CLIENT)} {shlex.quote(self.socket)}"

    def send(self, host: Host, line: str) -> str:
        run = host.sudo if self.sudo else host.run
        result = run(self.command(), stdin=(line + "\n").encode(), stream=False, check=False, timeout=30)
        if not result.ok:
            said = (result.stderr.strip().splitlines() or ["exit " + str(result.exited)])[-1]
            raise HostError(f"{host.name}: HAProxy's runtime API at {self.socket} did not answer ({clip(said, 200)})")
        return result.stdout

    def unanswered(self, host: Host) -> str | None:
        """Why the API does not answer (HAProxy not running, its socket gone), None when it does."""
        try:
            self.send(host, "show info")
        except HostError as exc:
            return str(exc).removeprefix(f"{host.name}: ")
        return None

    def servers(self, host: Host, model: str) -> list[ServerStat]:
        return parse_stats(self.send(host, "show stat"), model)

    def shown(self, line: str) -> Shell:
        """A command as a dry run lists it: what goes to which socket."""
        return Shell(f"echo {shlex.quote(line)} | {self.command()}", sudo=self.sudo)


def server_line(model: str, server: str, state: str) -> str:
    for name in (model, server):
        if not _NAME.match(name):
            raise VoltaforgeError(f"{name!r} is not a balancer's model or server name")
    return f"set server {BACKEND_PREFIX}{model}/{server} state {state}"


def find(stats: list[ServerStat], server: str) -> ServerStat | None:
    return next((s for s in stats if s.name == server), None)


def wait_for(
    what: Callable[[], ServerStat | None], done: Callable[[ServerStat], bool], bound_s: float
) -> tuple[ServerStat | None, float]:
    """Ask until ``done`` or ``bound_s`` passed: the last answer and the seconds it took."""
    t0 = time.monotonic()
    while True:
        now = what()
        if now is None or done(now) or time.monotonic() - t0 >= bound_s:
            return now, time.monotonic() - t0
        time.sleep(POLL_S)


class DrainServer(Operation):
    """One server of a model out of rotation on the balancer, its requests finished: HAProxy
    sends it nothing new, and those it runs end (up to ``bound_s``, then it is changed anyway:
    ``cut`` says how many were still running)."""

    def __init__(self, api: RuntimeApi, model: str, server: str, bound_s: float):
        self.api, self.model, self.server, self.bound_s = api, model, server, bound_s
        self.line = server_line(model, server, "drain")
        self.name = f"Drain {server} of model {model} on the balancer"
        #: what the drain saw: requests still running at the bound, the counter when it ended,
        #: and (None when the model keeps another server in rotation) why it serves alone
        self.alone: str | None = None
        self.cut = 0
        self.requests: int | None = None
        self.seconds = 0.0

    def read(self, host: Host) -> list[ServerStat]:
        return self.api.servers(host, self.model)

    def decide(self, facts: list[ServerStat]) -> Decision:
        me = find(facts, self.server)
        if me is None:
            return Decision.ok(f"the balancer no longer lists {self.server} in model {self.model}: changed in place")
        others = [s.name for s in facts if s.name != self.server and s.status == "UP"]
        if not others:
            self.alone = (
                f"{self.server} is the only server of model {self.model} in rotation: it is changed in place once "
                "its requests end; new requests get the balancer's 503 meanwhile"
            )
        return self._decide(me)

    def _decide(self, facts: ServerStat) -> Decision:
        if facts.status in ("DRAIN", "MAINT") or "DRAIN" in facts.status:
            if facts.in_flight == 0:
                self.requests = facts.requests
                return Decision.ok(f"out of rotation already ({facts.status}), nothing in flight")
            return Decision.act(f"out of rotation already, {facts.in_flight} in flight", self.api.shown(self.line))
        return Decision.act(
            f"{facts.status}, {facts.in_flight} in flight: new requests go to the model's other servers",
            self.api.shown(self.line),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        answer = self.api.send(host, self.line).strip()
        if answer:  # HAProxy answers a change with nothing; "No such server." and the like
            raise HostError(f"HAProxy refused `{self.line}`: {answer}")
        last, self.seconds = wait_for(
            lambda: find(self.api.servers(host, self.model), self.server), lambda s: s.in_flight == 0, self.bound_s
        )
        self.cut = last.in_flight if last else 0
        self.requests = last.requests if last else None
        if self.cut:
            host.printer.line(
                host.name,
                f"{self.server}: {self.cut} request{'s' if self.cut > 1 else ''} still running after "
                f"{self.bound_s:g} s (the drain's bound): changed anyway",
            )


class ReadyServer(Operation):
    """The server back in rotation: ``state ready``, then HAProxy's health check says UP."""

    def __init__(self, api: RuntimeApi, model: str, server: str, bound_s: float = READY_BOUND_S):
        self.api, self.model, self.server, self.bound_s = api, model, server, bound_s
        self.line = server_line(model, server, "ready")
        self.name = f"Put {server} of model {model} back in rotation"
        #: its request counter just before it came back (against the drain's: none while out)
        self.requests: int | None = None

    def read(self, host: Host) -> ServerStat | None:
        return find(self.api.servers(host, self.model), self.server)

    def decide(self, facts: ServerStat | None) -> Decision:
        if facts is None:
            return Decision.ok(f"the balancer no longer lists {self.server} in model {self.model}")
        self.requests = facts.requests
        if facts.status == "UP" or facts.status.startswith("UP "):
            return Decision.ok("in rotation, its health check passes")
        return Decision.act(f"{facts.status}: back once its health check passes", self.api.shown(self.line))

    def apply(self, host: Host, decision: Decision) -> None:
        answer = self.api.send(host, self.line).strip()
        if answer:
            raise HostError(f"HAProxy refused `{self.line}`: {answer}")
        last, waited = wait_for(
            lambda: find(self.api.servers(host, self.model), self.server),
            lambda s: s.status.startswith("UP"),
            self.bound_s,
        )
        if last is None or not last.status.startswith("UP"):
            seen = f"{last.status}, last check {last.check or '?'}" if last else "gone from the balancer"
            raise HostError(
                f"{self.server} was put back, but after {waited:.0f} s HAProxy still counts it out ({seen})"
            )
