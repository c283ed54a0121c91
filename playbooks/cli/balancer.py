"""`invoke lb`: one endpoint for a fleet's servers (conduct/balancer.py, conduct/fleet.py);
`--stop` and `--remove` (conduct/balancer_off.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from playbooks.cli.converge import converge
from playbooks.cli.render import console, render_report
from playbooks.conduct.balancer import (
    BalancerOps,
    edge_settings,
    edge_tls,
    forget_edge,
    fronted_hosts,
    remember_edge,
)
from playbooks.conduct.balancer_off import balancer_off, record_off_ops
from playbooks.conduct.converge import on_host
from playbooks.conduct.fleet import deployed_fleet
from playbooks.conduct.fronted import fronted_of, record_ops_maker
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings
from playbooks.errors import UsageError


def run_lb(
    host_name: str | None = None,
    backends: Sequence[str] | None = None,
    recipe: str | None = None,
    bind: str | None = None,
    port: int | None = None,
    dry_run: bool = False,
    settings: Settings | None = None,
    tls: bool | None = None,
    cert: str | None = None,
    key: str | None = None,
    default_host: str | None = None,
    stop: bool = False,
    remove: bool = False,
) -> int:
    """Every flag left out comes from the inventory's ``lb:`` entry. ``tls``: HTTPS at the edge
    (None: beyond loopback only); ``cert``/``key``: the pair to present, else a self-signed one
    kept on this controller (its fingerprint printed). ``recipe``: that recipe's servers only.
    ``stop``/``remove``: the balancer stopped or taken off, its records with it."""
    settings = settings or Settings()
    if stop or remove:
        return run_lb_off(settings, host_name or settings.lb().host or default_host, backends, remove, dry_run)
    edge = edge_settings(settings.lb(), host_name, backends, bind, port, tls, cert, key, default_host)
    lb_spec = settings.host_spec(edge.host)
    specs = [settings.host_spec(n) for n in edge.hosts]  # an unknown name: one line before connecting
    if recipe:
        settings.load_recipe(recipe)  # a bad name: one line before connecting
    pair = edge_tls(lb_spec, edge.bind, edge.tls, edge.cert, edge.key)  # a bad pair: the same
    if pair:
        # as Text: the console would read ":AB:" of a fingerprint as an emoji code
        console().print(Text(f"TLS at the edge: {pair.origin}; certificate {pair.fingerprint}"))
    fleet = deployed_fleet(settings, lb_spec, specs, recipe, edge.key_ref)
    for note in fleet.notes:
        console().print(Text(note))
    for model, servers in fleet.models.items():
        console().print(Text(f"model {model}: " + ", ".join(f"{b.name} {b.address}:{b.port}" for b in servers)))
    served = [Served(fleet.loaded)]
    ops = BalancerOps(edge, fleet, pair)
    code = converge(settings, edge.host, None, ops, dry_run, served=served)
    before = fronted_hosts(edge.host)
    if code == 0 and not dry_run:
        remember_edge(edge.host, pair, edge.hosts)  # bench --lb reaches it the same way
    if code or ops.api is None:
        return code
    # each backend host learns which balancer fronts which of its servers: provision drains a
    # server there before restarting it (conduct/roll.py); a host it fronts nothing of any more
    # (every server there stopped, or no longer among its hosts) has its record removed
    gone: list[str] = []
    for spec in specs:
        fronted = fronted_of(edge.host, ops.api, fleet, spec.name)
        if not fronted.servers:
            gone.append(spec.name)
            continue
        code = max(code, converge(settings, spec.name, None, record_ops_maker(fronted), dry_run, served=served))
    gone += [h for h in before if h not in edge.hosts]
    changes = [c for h in gone for c in on_host(settings, h, record_off_ops(edge.host), dry_run)]
    if changes:
        render_report(changes)
    return max(code, 1 if any(c.status == "failed" for c in changes) else 0)


def run_lb_off(
    settings: Settings, lb_host: str | None, backends: Sequence[str] | None, remove: bool, dry_run: bool
) -> int:
    """`invoke lb --stop` / `--remove` (conduct/balancer_off.py): the backends given, the
    inventory's, and those this controller saw it front."""
    if not lb_host:
        raise UsageError("which host runs the balancer: pass --host, or give the inventory an lb: entry with host:")
    hosts = list(dict.fromkeys([*(backends or settings.lb().hosts), *fronted_hosts(lb_host)]))
    changes = balancer_off(settings, lb_host, hosts, remove, dry_run)
    render_report(changes)
    failed = any(c.status == "failed" for c in changes)
    if remove and not dry_run and not failed:
        forget_edge(lb_host)
    return 1 if failed else 0
