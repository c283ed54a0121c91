"""`invoke monitor --stop` and `invoke monitor --remove`: the monitor's own lifecycle.

``--stop`` stops Prometheus and its slots exporter on the monitor host and the node and GPU
exporters on every host of the fleet (each unit stopped and disabled, or its managed process);
``--remove`` also takes off their units, Prometheus's configuration, rules and data (its TSDB:
the history goes with it), the exporters' programs and anything staged for a host with no
package index. `invoke monitor`
makes it all again.

Kept on purpose: Debian's packages (shared with whatever else the host runs, as the balancer
keeps haproxy) and the masks on Debian's own ``prometheus.service`` and
``prometheus-node-exporter.service``: unmasked, a boot or another package could start them on
every interface, which is what masking them prevented (steps/monitor/units_masked.py).

Which hosts: the fleet `invoke monitor` would watch (flags over the inventory's ``monitor:``
entry, conduct/watch.py); a host that cannot be reached is one failed line, the others go on."""

from __future__ import annotations

from collections.abc import Callable

from playbooks.conduct.converge import on_host
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.settings import Settings
from playbooks.conduct.watch import Watch
from playbooks.host import Host
from playbooks.host.ops import Change, Operation
from playbooks.steps.monitor.units import (
    CONFIG_DIR,
    GPU_UNIT,
    NODE_UNIT,
    PROGRAMS,
    PROMETHEUS_STATE,
    PROMETHEUS_UNIT,
    SLOTS_UNIT,
    process_state,
)
from playbooks.steps.serve.removal import EnsureAbsent, EnsureStopped
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.units import UNIT_DIR

_WHAT = {
    PROMETHEUS_UNIT: "Prometheus",
    SLOTS_UNIT: "the slots exporter",
    NODE_UNIT: "the node exporter",
    GPU_UNIT: "the GPU exporter",
}
#: what `invoke monitor` ships into <prefix>/monitor (conduct/monitor.py's ExporterOps) and stages there
_SHIPPED = ("gpu_exporter.py", "telemetry_probe.py", "pynvml.py", "slots_exporter.py", "debs")


def _manager(systemd: bool, prefix: str, unit: str) -> Manager:
    program = PROGRAMS[unit]
    return Systemd(unit) if systemd else ProcessRunner(process_state(prefix, unit), program, (program,))


def part_off_ops(units: tuple[str, ...], remove: bool) -> Callable[[Host, str], list[Operation]]:
    """The parts stopped (and disabled); ``remove``: their files too, and on the monitor host
    Prometheus's configuration and data."""

    def make(host: Host, prefix: str) -> list[Operation]:
        systemd = choose_manager(host, "auto") == "systemd"
        ops: list[Operation] = [EnsureStopped(_manager(systemd, prefix, u), _WHAT[u]) for u in units]
        if not remove:
            return ops
        paths = []
        for u in units:
            paths += [f"{UNIT_DIR}/{u}", f"{UNIT_DIR}/{u}.d"] if systemd else [process_state(prefix, u)]
        if PROMETHEUS_UNIT in units and systemd:
            paths += [CONFIG_DIR, f"/var/lib/{PROMETHEUS_STATE}", f"/var/lib/private/{PROMETHEUS_STATE}"]
        paths += [f"{prefix}/monitor/{f}" for f in _SHIPPED]
        what = f"{', '.join(_WHAT[u] for u in units)}: what `invoke monitor` installed for them"
        ops.append(EnsureAbsent(what, paths, prefix, sudo=systemd, dirs=[f"{prefix}/monitor"], reload=systemd))
        return ops

    return make


def monitor_off(settings: Settings, watch: Watch, remove: bool, dry_run: bool) -> list[Change]:
    """Every fleet host's exporters, and Prometheus on the monitor host, stopped (or removed)."""
    for name in watch.hosts:
        settings.host_spec(name)  # an unknown name: one line before connecting
    changes: list[Change] = []
    for name in watch.hosts:
        units = (NODE_UNIT, GPU_UNIT) + ((PROMETHEUS_UNIT, SLOTS_UNIT) if name == watch.host else ())
        changes += on_host(settings, name, part_off_ops(units, remove), dry_run)
    return changes
