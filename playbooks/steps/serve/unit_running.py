"""A systemd unit runs what voltaforge rendered, and accepts connections on its address.

For the units that are no model server (the RPC workers, the load balancer): nothing to load
and nothing to judge in a log, but the same promise as deploy's: a second run changes nothing,
a change of the unit, its configuration or the build it runs restarts it, and a start that
does not end listening fails with the unit's last log lines.

What the unit was started from is a fingerprint (sha256 of the rendered texts and, when given,
a fact such as the build `current` resolves to), kept once the start worked in
`<prefix>/deploy/<unit>/started.sha256`, beside deploy's own state.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.facts import read_fact
from playbooks.facts.server_log import journal_command
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Shell
from playbooks.steps.serve.service_manager import Manager, Systemd

#: how long a started unit may take to accept connections (it loads no model)
LISTEN_TIMEOUT_S = 60


@dataclass(frozen=True)
class UnitFacts:
    up: bool
    detail: str
    extra: str  # the extra fact's output ("" without one)
    started: str  # the fingerprint of what the running unit was started from


class EnsureUnitRunning(Operation):
    """`unit` runs from `texts` (+ the output of `extra_command`) and listens on address:port."""

    def __init__(
        self,
        unit: str,
        texts: Sequence[str],
        prefix: str,
        listen: tuple[str, int],
        *,
        sudo: bool = False,
        extra_command: str | None = None,
        what: str = "",
        manager: Manager | None = None,
    ):
        self.unit, self.texts, self.listen = unit, tuple(texts), listen
        self.state_file = f"{prefix}/deploy/{unit.removesuffix('.service')}/started.sha256"
        self.sudo, self.extra_command = sudo, extra_command
        #: systemd, else the unit's own command line as a managed process (deploy's runner)
        self.manager: Manager = manager or Systemd(unit)
        self.name = f"Ensure {what or unit} runs ({unit})"

    def read(self, host: Host) -> UnitFacts:
        running = self.manager.running(read_fact(host, self.manager.state_command()))
        extra = read_fact(host, self.extra_command).strip() if self.extra_command else ""
        started = read_fact(host, f"cat -- {shlex.quote(self.state_file)} 2>/dev/null || true").strip()
        return UnitFacts(running.up, running.detail, extra, started)

    def _log_command(self) -> str:
        return journal_command(self.unit) if isinstance(self.manager, Systemd) else self.manager.log_command("")

    def fingerprint(self, extra: str) -> str:
        return hashlib.sha256("\0".join((*self.texts, extra)).encode()).hexdigest()

    def decide(self, facts: UnitFacts) -> Decision:
        want = self.fingerprint(facts.extra)
        addr, port = self.listen
        endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        if facts.up and facts.started == want:
            return Decision.ok(f"{facts.detail}, listening on {endpoint}")
        if not facts.up:
            why = "not running"
        elif facts.started:
            why = "its unit, configuration or build changed since it started"
        else:
            why = "running, but not started by voltaforge"
        wait = (
            f"for i in $(seq 1 {LISTEN_TIMEOUT_S * 2}); do "
            f"if (exec 3<>/dev/tcp/{addr}/{port}) 2>/dev/null; then exit 0; fi; sleep 0.5; done; "
            f"echo '{self.unit} does not accept connections on {endpoint} after {LISTEN_TIMEOUT_S} s; "
            f"its log:' >&2; {{ {self._log_command()}; }} | tail -n 12 >&2; exit 1"
        )
        state = shlex.quote(self.state_file.rsplit("/", 1)[0])
        record = f"mkdir -p -- {state} && printf '%s\\n' {want} > {shlex.quote(self.state_file)}"
        return Decision.act(
            why,
            self.manager.restart(),
            Shell(f"bash -c {shlex.quote(wait)}"),
            Shell(record, sudo=self.sudo),
        )
