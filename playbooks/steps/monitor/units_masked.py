"""Debian's own units for the packages the monitor installs are masked under systemd: their
postinst enables them, and ``prometheus.service`` listens on every interface (``:9090``), the
node exporter's on ``:9100``; the install ran under a policy-rc.d that kept them stopped
(steps/build/toolchain.without_starting), and masking keeps a reboot or another package from
starting them beside voltaforge's own, loopback-bound units."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from playbooks.facts import read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Shell

_UNIT = re.compile(r"^[A-Za-z0-9@._-]+\.service$")


class EnsureUnitsMasked(Operation):
    def __init__(self, units: Sequence[str]):
        bad = [u for u in units if not _UNIT.match(u)]
        if bad:
            raise ValueError(f"not a unit name: {bad[0]!r}")
        self.units = tuple(units)
        self.name = f"Ensure {', '.join(self.units)} cannot start (masked)"

    def read(self, host: Host) -> dict[str, str]:
        # is-enabled prints one state per unit: enabled, disabled, masked, not-found...
        out = read_fact(host, f"systemctl is-enabled -- {' '.join(self.units)} 2>&1 || true").split()
        return dict(zip(self.units, out, strict=False))

    def decide(self, facts: dict[str, str]) -> Decision:
        todo = [u for u in self.units if facts.get(u) != "masked"]
        if not todo:
            return Decision.ok("masked")
        names = " ".join(shlex.quote(u) for u in todo)
        return Decision.act(
            ", ".join(f"{u} is {facts.get(u, 'unknown')}" for u in todo),
            Shell(f"systemctl disable --now -- {names} 2>/dev/null; systemctl mask -- {names}", True),
        )
