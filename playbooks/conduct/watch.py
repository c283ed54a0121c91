"""`invoke monitor`'s settings (the inventory's ``monitor:`` entry under the flags) and where
each part of the monitor listens and is reached: pure, shared by the targets it finds
(conduct/monitor_targets.py), the operations that run it (conduct/monitor.py) and those that
stop or remove it (conduct/monitor_off.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.conduct.fleet import same_host
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec, load_inventory
from playbooks.config.monitor_spec import MonitorSpec
from playbooks.errors import UsageError, VoltaforgeError
from playbooks.steps.monitor.units import Listen


@dataclass(frozen=True)
class Watch:
    """`invoke monitor`'s settings: the inventory's ``monitor:`` entry, each flag given winning."""

    host: str
    hosts: tuple[str, ...]
    bind: str = "127.0.0.1"
    port: int = 9090
    exporters: str = "loopback"
    node_port: int = 9100
    gpu_port: int = 9835
    interval_s: int = 15
    slots_port: int = 9836


def watch_settings(
    entry: MonitorSpec,
    inventory: Sequence[str],
    host: str | None = None,
    hosts: Sequence[str] | None = None,
    bind: str | None = None,
    port: int | None = None,
    default_host: str | None = None,
) -> Watch:
    """The flags over the entry. The fleet: the flag's hosts, else the entry's, else every
    inventory host; the monitor's own host is always among them (its exporters too). A bind is
    checked where it is read (the flag by cli/flags.py, the entry by its schema) and again by
    :class:`Listen` before anything is rendered."""
    mon = host or entry.host or default_host
    if not mon:
        raise UsageError("which host runs Prometheus: pass --host, or give the inventory a monitor: entry with host:")
    fleet = tuple(dict.fromkeys([*(hosts or entry.hosts or inventory), mon]))
    return Watch(
        mon,
        fleet,
        bind or entry.bind,
        port or entry.port,
        entry.exporters,
        entry.node_exporter_port,
        entry.gpu_exporter_port,
        entry.scrape_interval_s,
        entry.slots_exporter_port,
    )


def inventory_hosts(settings: Settings) -> list[str]:
    return list(load_inventory(settings.inventory))


def reach(spec: HostSpec, mon: HostSpec, bind: str) -> str:
    """The address the monitor host reaches a part of ``spec`` at that listens on ``bind``."""
    ip = ipaddress.ip_address(bind)
    if same_host(spec, mon):
        return "127.0.0.1" if ip.is_loopback or ip.is_unspecified else bind
    return spec.host if ip.is_loopback or ip.is_unspecified else bind


def exporter_listen(spec: HostSpec, watch: Watch, port: int) -> Listen:
    """Where a host's exporter listens: loopback, or its inventory address (``exporters: address``)."""
    if watch.exporters == "loopback" or spec.local:
        return Listen("127.0.0.1", port)
    try:
        ipaddress.ip_address(spec.host)
    except ValueError:
        raise VoltaforgeError(
            f"{spec.name}: monitor exporters: address needs its inventory address to be an IP, not {spec.host!r}"
        ) from None
    return Listen(spec.host, port)
