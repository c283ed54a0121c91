"""The units beside the model servers that `invoke status` shows: the RPC workers
(voltaforge-rpc-<port>.service) and the load balancer (voltaforge-lb.service), with the
balancer's view of its backends from its loopback stats page. One read-only command each;
garbage parses to nothing, never an exception."""

from __future__ import annotations

import re
from dataclasses import dataclass

from playbooks.facts import lines

UNITS_COMMAND = (
    "systemctl list-units --all --plain --no-legend --no-pager "
    "'voltaforge-rpc-*.service' 'voltaforge-lb.service' 2>/dev/null || true"
)
_UNIT = re.compile(r"^(voltaforge-(?:rpc-(\d+)|lb)\.service)\s+(\S+)\s+(\S+)\s+(\S+)")


@dataclass(frozen=True)
class FleetUnit:
    unit: str
    kind: str  # rpc-worker | balancer
    port: int | None  # an RPC worker's port (from its name)
    active: str  # active, failed, inactive, ...
    sub: str  # running, dead, ...

    @property
    def running(self) -> bool:
        return self.active == "active" and self.sub == "running"


def parse_units(output: str) -> list[FleetUnit]:
    found = []
    for line in lines(output):
        m = _UNIT.match(line.strip().lstrip("●* "))
        if m:
            unit, port, _load, active, sub = m.groups()
            kind = "rpc-worker" if port else "balancer"
            found.append(FleetUnit(unit, kind, int(port) if port else None, active, sub))
    return found
