"""`invoke top`'s reads: Prometheus on the monitor host, asked the view's instant queries
(steps/monitor/top.py) over one SSH connection kept for the whole session.

Prometheus listens where `invoke monitor` put it: on the monitor host's loopback (the default)
it is reached through a port forwarded over SSH (host.forward; `local` needs none), on another
address directly. Nothing answering there is one line that says where it looked and what makes
a monitor; a host that cannot be reached is the usual one line of the SSH layer."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator

import httpx

from playbooks.conduct.settings import Settings
from playbooks.conduct.watch import Watch
from playbooks.errors import VoltaforgeError
from playbooks.steps.monitor.top import QUERIES, Sample, View, fleet_view, parse_answer
from playbooks.steps.monitor.units import Listen


class NoMonitor(VoltaforgeError):
    """No Prometheus answers where the monitor's settings say it listens."""


@contextlib.contextmanager
def prometheus(settings: Settings, watch: Watch) -> Iterator[tuple[str, str]]:
    """(the URL this controller reaches Prometheus at, where that is on the monitor host)."""
    where = str(Listen(watch.bind, watch.port))
    ip = ipaddress.ip_address(watch.bind)
    if not (ip.is_loopback or ip.is_unspecified):
        yield f"http://{where}", where
        return
    with settings.connect(settings.host_spec(watch.host)) as host, host.forward(watch.port) as local:
        yield f"http://127.0.0.1:{local}", where


@contextlib.contextmanager
def watching(settings: Settings, watch: Watch) -> Iterator[tuple[Callable[[], View], str]]:
    """(a call that reads the view now, what it reads from), one connection for the session."""
    with prometheus(settings, watch) as (url, where), httpx.Client(timeout=10) as client:
        yield (lambda: read_view(client, url, watch.host, where)), f"Prometheus on {watch.host} at {where}"


def read_view(client: httpx.Client, url: str, host: str, where: str) -> View:
    """Every query of the view, answered by Prometheus at ``url``."""
    answers: dict[str, list[Sample]] = {}
    for name, query in QUERIES.items():
        try:
            r = client.get(f"{url}/api/v1/query", params={"query": query})
        except httpx.TransportError:
            raise NoMonitor(
                f"{host}: no Prometheus answers at {where}: run `invoke monitor --host {host}` to make one"
            ) from None
        try:
            answers[name] = parse_answer(r.json())
        except ValueError as exc:
            raise VoltaforgeError(f"{host}: Prometheus at {where} answered {query!r} with {exc}") from None
    return fleet_view(answers)
