"""`invoke lb --stop` and `invoke lb --remove`: a balancer's own lifecycle.

``--stop`` stops HAProxy on the balancer's host (its unit stopped and disabled, or its managed
process); ``--remove`` also takes off its unit, configuration, TLS pair and state. Both remove
the balancer's records from its backend hosts (``<prefix>/deploy/balancers/<balancer>.json``,
conduct/fronted.py): a balancer that does not run fronts nothing, so a provision there changes
its servers in place instead of asking a dead runtime API to drain them. `invoke lb` starts it
again and writes the records again.

Which backend hosts: the ones given (``--hosts`` or the inventory's ``lb:`` entry) and the ones
this controller last saw it front (conduct/balancer.py: ``edge.json``). The controller keeps its
self-signed pair: a balancer made again on that host presents the same certificate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from playbooks.conduct.converge import on_host
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.fronted import records_dir
from playbooks.conduct.settings import Settings
from playbooks.host import Host
from playbooks.host.ops import Change, Operation
from playbooks.steps.serve.balancer import CONFIG_PATH, TLS_PATH, UNIT_NAME
from playbooks.steps.serve.removal import EnsureAbsent, EnsureStopped
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.units import UNIT_DIR

#: the binary the balancer's unit runs (templates/haproxy-lb.service.j2): a managed process is
#: stopped only when its pid is still this program's
HAPROXY = "/usr/sbin/haproxy"


def state_dir(prefix: str) -> str:
    return f"{prefix}/deploy/{UNIT_NAME.removesuffix('.service')}"


def balancer_off_ops(host: Host, prefix: str, remove: bool) -> list[Operation]:
    """The balancer stopped (and disabled); ``remove``: its files too."""
    systemd = choose_manager(host, "auto") == "systemd"
    state = state_dir(prefix)
    manager: Manager = Systemd(UNIT_NAME) if systemd else ProcessRunner(state, HAPROXY, (HAPROXY,))
    ops: list[Operation] = [EnsureStopped(manager, "the load balancer")]
    if remove:
        unit = f"{UNIT_DIR}/{UNIT_NAME}"
        paths = [unit, f"{unit}.d", CONFIG_PATH, TLS_PATH, state] if systemd else [state]
        etc = [CONFIG_PATH.rsplit("/", 1)[0]] if systemd else []
        what = "the load balancer: its unit, configuration, TLS pair and state"
        ops.append(EnsureAbsent(what, paths, prefix, sudo=systemd, dirs=etc, reload=systemd))
    return ops


def record_off_ops(lb_host: str) -> Callable[[Host, str], list[Operation]]:
    """The balancer's record on one backend host, removed (as root where systemd runs there:
    the record was written as the servers' records are)."""

    def make(host: Host, prefix: str) -> list[Operation]:
        sudo = choose_manager(host, "auto") == "systemd"
        where = records_dir(prefix)
        # the records' directory too once this was the last one in it
        what = f"the record of the balancer on {lb_host}"
        return [EnsureAbsent(what, [f"{where}/{lb_host}.json"], prefix, sudo=sudo, dirs=[where])]

    return make


def balancer_off(
    settings: Settings, lb_host: str, backends: Sequence[str], remove: bool, dry_run: bool
) -> list[Change]:
    """Stop (or remove) the balancer on ``lb_host``, then its records on ``backends``."""
    settings.host_spec(lb_host)  # an unknown name: one line before connecting
    changes = on_host(settings, lb_host, lambda h, p: balancer_off_ops(h, p, remove), dry_run)
    for name in backends:
        changes += on_host(settings, name, record_off_ops(lb_host), dry_run)
    return changes
