"""`invoke lb`: one endpoint for a fleet's servers (conduct/balancer.py, conduct/fleet.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from playbooks.cli.converge import converge
from playbooks.cli.render import console
from playbooks.conduct.balancer import BalancerOps, edge_settings, edge_tls, remember_edge
from playbooks.conduct.fleet import deployed_fleet
from playbooks.conduct.fronted import fronted_of, record_ops_maker
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings


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
) -> int:
    """Every flag left out comes from the inventory's ``lb:`` entry. ``tls``: HTTPS at the edge
    (None: beyond loopback only); ``cert``/``key``: the pair to present, else a self-signed one
    kept on this controller (its fingerprint printed). ``recipe``: that recipe's servers only."""
    settings = settings or Settings()
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
    if code == 0 and not dry_run:
        remember_edge(edge.host, pair)  # bench --lb reaches it the same way
    if code or ops.api is None:
        return code
    # each backend host learns which balancer fronts which of its servers: provision drains a
    # server there before restarting it (conduct/roll.py)
    for spec in specs:
        record = record_ops_maker(fronted_of(edge.host, ops.api, fleet, spec.name))
        code = max(code, converge(settings, spec.name, None, record, dry_run, served=served))
    return code
