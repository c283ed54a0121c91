"""`invoke monitor`: one Prometheus for the fleet (conduct/monitor.py): the targets found, each
host's report, and a line for each target the monitor host cannot reach; `--stop` and
`--remove` (conduct/monitor_off.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from playbooks.cli.converge import report
from playbooks.cli.render import console
from playbooks.conduct.converge import converge_plain
from playbooks.conduct.monitor import ExporterOps, MonitorOps, unreachable
from playbooks.conduct.monitor_off import monitor_off
from playbooks.conduct.monitor_targets import find_targets
from playbooks.conduct.settings import Settings
from playbooks.conduct.watch import inventory_hosts, watch_settings


def run_monitor(
    host_name: str | None = None,
    hosts: Sequence[str] | None = None,
    bind: str | None = None,
    port: int | None = None,
    dry_run: bool = False,
    settings: Settings | None = None,
    default_host: str | None = None,
    stop: bool = False,
    remove: bool = False,
) -> int:
    settings = settings or Settings()
    watch = watch_settings(settings.monitor(), inventory_hosts(settings), host_name, hosts, bind, port, default_host)
    if stop or remove:
        return report(monitor_off(settings, watch, remove, dry_run))
    mon = settings.host_spec(watch.host)
    specs = [settings.host_spec(n) for n in watch.hosts]  # an unknown name: one line before connecting
    found = find_targets(settings, watch)
    for note in found.notes:
        console().print(Text(note), soft_wrap=True)
    for t in found.targets:
        console().print(Text(f"scrape {t.job:<12} {t.url}  {dict(t.labels).get('model', '')}".rstrip()))
    changes = []
    for spec in specs:
        if spec.name in found.skipped:
            continue
        changes += converge_plain(settings, spec.name, ExporterOps(watch, spec, mon), dry_run)
    changes += converge_plain(settings, watch.host, MonitorOps(watch, found), dry_run)
    code = report(changes)
    if dry_run:
        return code
    with settings.connect(mon) as host:
        lost = unreachable(host, found.targets)
    for t in lost:
        console().print(
            Text(f"{watch.host}: cannot reach {t.what} at {t.url}; Prometheus scrapes the rest"), soft_wrap=True
        )
    return code
