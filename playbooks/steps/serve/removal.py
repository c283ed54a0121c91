"""Taking what voltaforge started off a host: a server, an RPC worker or a balancer is stopped
by its manager (under systemd also disabled, so a boot does not start it again), then its files
go (`invoke remove`, `invoke lb --remove`). Two operations, each reading before it acts:

- ``EnsureStopped``: stopped (and disabled) when it runs (or is enabled); ``ok`` when not.
- ``EnsureAbsent``: the listed paths removed, with the directories they leave empty; ``ok``
  when none is there. A path outside what voltaforge writes is refused before anything runs:
  the list comes from a record on the host, which is data, not an instruction.

Weights and builds are never on such a list: they are shared by every deployment and verified by
hash, so a later deploy of the same model reuses them."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.facts import lines, read_fact
from playbooks.facts.service import UnitState, parse_unit_state
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Shell
from playbooks.steps.serve.service_manager import Manager, Running, Systemd
from playbooks.steps.serve.units import UNIT_DIR

#: what systemd says of a unit that is (being) started
_UP = ("active", "activating", "reloading", "deactivating")


class EnsureStopped(Operation):
    """The service stopped by its manager; under systemd also disabled."""

    def __init__(self, manager: Manager, what: str):
        self.manager = manager
        self.name = f"Stop {what} ({'its systemd unit' if isinstance(manager, Systemd) else 'a managed process'})"

    def read(self, host: Host) -> UnitState | Running:
        out = read_fact(host, self.manager.state_command())
        return parse_unit_state(out) if isinstance(self.manager, Systemd) else self.manager.running(out)

    def decide(self, facts: UnitState | Running) -> Decision:
        if isinstance(facts, UnitState):
            assert isinstance(self.manager, Systemd)
            unit = shlex.quote(self.manager.unit)
            up, enabled = facts.active in _UP, facts.enabled.startswith("enabled")
            failed = facts.active == "failed"
            if not up and not enabled and not failed:
                return Decision.ok("not running, not enabled" if facts.loaded != "not-found" else "no such unit")
            said = (f"{facts.active} ({facts.sub})" if up or failed else "", "enabled" if enabled else "")
            why = ", ".join(w for w in said if w)
            # a failed unit stays listed (and counted) by systemd until its failure is reset,
            # its file gone or not; reset-failed has nothing worth failing on when none is kept
            reset = f"{{ systemctl reset-failed -- {unit} 2>/dev/null || true; }}"
            if not up and not enabled:
                return Decision.act(why, Shell(reset, True))
            return Decision.act(why, Shell(f"systemctl disable --now --quiet -- {unit} && {reset}", True))
        if not facts.up:
            return Decision.ok("not running")
        return Decision.act(f"running (pid {facts.pid})", self.manager.stop())


@dataclass(frozen=True)
class Present:
    """Which of the paths are there, and what each candidate directory holds."""

    paths: frozenset[str]
    entries: dict[str, frozenset[str]]  # an existing directory -> the names in it


def removable(path: str, prefix: str) -> str:
    """``path`` when it is one voltaforge writes for a server, a balancer or the monitor: its unit
    (and drop-ins) in /etc/systemd/system, its files in /etc/voltaforge (never the operator's
    secrets), its systemd state directory, its state, serve and monitor directories under the
    prefix. Anything else: one error, nothing run."""
    p = posixpath.normpath(path)
    ok = (
        p == path
        and p.startswith("/")
        and (
            (p.startswith(f"{UNIT_DIR}/voltaforge-") and p.count("/") in (4, 5))
            or (p.startswith("/etc/voltaforge/") and not p.startswith("/etc/voltaforge/secrets"))
            # systemd's StateDirectory= of a voltaforge unit (Prometheus's data; under
            # DynamicUser= the name in /var/lib is a link to /var/lib/private/<name>)
            or (p.startswith(("/var/lib/voltaforge-", "/var/lib/private/voltaforge-")) and p.count("/") in (3, 4))
            or any(
                p.startswith(f"{prefix}/{d}/") and p.count("/") >= prefix.count("/") + 2
                for d in ("deploy", "serve", "monitor")
            )
        )
    )
    if not ok:
        raise OperationError(f"{path}: not a file voltaforge installs for a service (under {prefix}): not removed")
    return p


class EnsureAbsent(Operation):
    """The paths removed (files, links, whole directories), and the directories in ``dirs`` once
    nothing but those paths was in them; ``reload``: systemd re-reads its units after."""

    def __init__(self, what: str, paths: Sequence[str], prefix: str, sudo: bool, dirs: Sequence[str] = (),
                 reload: bool = False):  # fmt: skip
        self.paths = tuple(dict.fromkeys(removable(p, prefix) for p in paths))
        self.dirs = tuple(dict.fromkeys(dirs))
        self.sudo, self.reload = sudo, reload
        self.name = f"Remove {what}"

    def read(self, host: Host) -> Present:
        run = host.sudo if self.sudo else host.run
        return parse_present(run(present_command(self.paths, self.dirs), stream=False, check=False).stdout)

    def decide(self, facts: Present) -> Decision:
        there = [p for p in self.paths if p in facts.paths]
        going = {p.rsplit("/", 1)[1] for p in there}
        empty = [d for d in self.dirs if d in facts.entries and facts.entries[d] <= going]
        if not there and not empty:
            return Decision.ok("nothing of it is left")
        cmds = []
        if there:
            cmds.append(Shell(f"rm -rf -- {' '.join(shlex.quote(p) for p in there)}", self.sudo))
        if empty:
            cmds.append(Shell(f"rmdir -- {' '.join(shlex.quote(d) for d in empty)}", self.sudo))
        if self.reload and any(p.startswith(f"{UNIT_DIR}/") for p in there):
            cmds.append(Shell("systemctl daemon-reload", True))
        shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        return Decision.act(f"{len(there)} present: {shown}" if there else "an empty directory left", *cmds)


def present_command(paths: Sequence[str], dirs: Sequence[str]) -> str:
    """``P<tab>path`` for each path there (a dangling link counts), ``D<tab>dir`` and
    ``E<tab>dir<tab>name`` for each candidate directory and what is in it."""
    parts = [f"{{ [ -e {q} ] || [ -L {q} ]; }} && printf 'P\\t%s\\n' {q}" for q in map(shlex.quote, paths)]
    parts += [
        f"[ -d {q} ] && {{ printf 'D\\t%s\\n' {q}; ls -A -- {q} | while IFS= read -r e; do "
        f"printf 'E\\t%s\\t%s\\n' {q} \"$e\"; done; }}"
        for q in map(shlex.quote, dirs)
    ]
    return "; ".join(f"{{ {p}; }}" for p in parts) + "; true"


def parse_present(output: str) -> Present:
    paths: set[str] = set()
    entries: dict[str, set[str]] = {}
    for line in lines(output):
        kind, _, rest = line.partition("\t")
        if kind == "P" and rest:
            paths.add(rest)
        elif kind == "D" and rest:
            entries.setdefault(rest, set())
        elif kind == "E":
            d, _, name = rest.partition("\t")
            if d in entries and name:
                entries[d].add(name)
    return Present(frozenset(paths), {d: frozenset(n) for d, n in entries.items()})
