"""Debian's packages for the monitor, installed without letting them start: the prometheus
package's maintainer scripts start it on install on every interface (``:9090``), the node
exporter's on ``:9100``. Debian's documented switch is policy-rc.d (invoke-rc.d and
deb-systemd-invoke both ask it; 101: "action not allowed"); the host's own policy-rc.d, if it
has one, is put back after, whatever the install's outcome. voltaforge then runs its own,
loopback-bound units (steps/monitor/units.py), and masks Debian's (units_masked.py).

A host whose apt knows the packages installs them from its mirror; one with no package index
(an air-gapped lab) gets them staged from the controller (staged_debs.py), pushed and installed
with dpkg under the same policy."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from playbooks.facts import read_fact
from playbooks.facts.system import OsRelease
from playbooks.host.base import Host
from playbooks.host.ops import Decision, PushFile, Shell
from playbooks.steps.build.llamacpp_source import file_sha256
from playbooks.steps.build.toolchain import APT_ENV, EnsureSystemPackages

POLICY_RC_D = "/usr/sbin/policy-rc.d"
#: (the packages missing, the host's dpkg status, its codename) -> the .debs to push
Stager = Callable[[Sequence[str], str, "str | None"], list[Path]]


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


def indexed_command(packages: Sequence[str]) -> str:
    return f"LC_ALL=C apt-cache policy -- {' '.join(packages)} 2>&1 || true"


def parse_indexed(output: str) -> set[str]:
    """The packages the host's apt has a candidate for (its lists know them)."""
    found = set()
    for name, candidate in re.findall(r"^(\S+):\n(?:.*\n)*?\s+Candidate: (\S+)", output, re.M):
        if candidate != "(none)":
            found.add(name.split(":")[0])
    return found


@dataclass(frozen=True)
class PackageFacts:
    installed: set[str]
    os: OsRelease
    #: the .debs staged for a host with no package index (None: its apt installs)
    staged: tuple[Path, ...] | None = None


class EnsurePackagesUnstarted(EnsureSystemPackages):
    """The packages are installed; an install never starts their services. ``stager``: where a
    host's apt does not know them, what stages them on the controller; ``stage_dir``: where
    they are pushed (the SSH user's), removed after the install."""

    def __init__(self, packages: tuple[str, ...], why: str, stager: Stager | None = None, stage_dir: str = ""):
        super().__init__(packages, why)
        self.stager, self.stage_dir = stager, stage_dir

    def read(self, host: Host) -> PackageFacts:  # type: ignore[override]
        installed, os = super().read(host)
        missing = [p for p in self.packages if p not in installed]
        if not missing or self.stager is None:
            return PackageFacts(installed, os)
        if set(missing) <= parse_indexed(read_fact(host, indexed_command(missing))):
            return PackageFacts(installed, os)
        status = read_fact(host, "cat /var/lib/dpkg/status")
        return PackageFacts(installed, os, tuple(self.stager(missing, status, os.codename)))

    def decide(self, facts: PackageFacts) -> Decision:  # type: ignore[override]
        if facts.staged is None:
            decision = super().decide((facts.installed, facts.os))
            if not decision.commands:
                return decision
            *before, install = decision.commands
            assert isinstance(install, Shell)
            return Decision.act(decision.reason, *before, Shell(without_starting(install.command), sudo=True))
        missing = [p for p in self.packages if p not in facts.installed]
        stage = shlex.quote(self.stage_dir)
        pushed = [f"{self.stage_dir}/{deb.name}" for deb in facts.staged]
        return Decision.act(
            f"{', '.join(missing)} missing and the host has no package index: {len(facts.staged)} packages staged "
            "from the controller",
            Shell(f"mkdir -p -m 0700 -- {stage}"),
            *(PushFile(path, deb, file_sha256(deb)) for path, deb in zip(pushed, facts.staged, strict=True)),
            Shell(without_starting(f"{APT_ENV} dpkg -i -- {' '.join(shlex.quote(p) for p in pushed)}"), sudo=True),
            Shell(f"rm -rf -- {stage}"),
        )
