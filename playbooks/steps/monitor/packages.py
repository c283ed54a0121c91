"""Debian's packages for the monitor, installed without letting them start: the prometheus
package's maintainer scripts start it on install on every interface (``:9090``), the node
exporter's on ``:9100``. Debian's documented switch is policy-rc.d (invoke-rc.d and
deb-systemd-invoke both ask it; 101: "action not allowed"); the host's own policy-rc.d, if it
has one, is put back after, whatever the install's outcome. voltaforge then runs its own,
loopback-bound units (steps/monitor/units.py), and masks Debian's (units_masked.py)."""

from __future__ import annotations

import shlex

from playbooks.host.ops import Decision, Shell
from playbooks.steps.build.toolchain import EnsureSystemPackages

POLICY_RC_D = "/usr/sbin/policy-rc.d"


def without_starting(command: str) -> str:
    """``command`` run under a policy-rc.d that forbids every start, the host's own restored."""
    p = POLICY_RC_D
    script = (
        f'saved=; if [ -e {p} ]; then saved=$(mktemp) && cp -p {p} "$saved" || exit 1; fi; '
        f"printf '#!/bin/sh\\nexit 101\\n' > {p} && chmod 755 {p} || exit 1; "
        f"rc=0; {command} || rc=$?; "
        f'if [ -n "$saved" ]; then mv -f "$saved" {p}; else rm -f {p}; fi; exit $rc'
    )
    return f"sh -c {shlex.quote(script)}"


class EnsurePackagesUnstarted(EnsureSystemPackages):
    """The packages are installed; an install never starts their services."""

    def decide(self, facts) -> Decision:
        decision = super().decide(facts)
        if not decision.commands:
            return decision
        *before, install = decision.commands
        assert isinstance(install, Shell)
        return Decision.act(decision.reason, *before, Shell(without_starting(install.command), sudo=True))
