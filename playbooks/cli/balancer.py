"""`invoke lb`: one load-balanced endpoint for a recipe's servers (conduct/balancer.py)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from playbooks.cli.converge import converge
from playbooks.cli.render import console
from playbooks.conduct.balancer import balancer_ops_maker, edge_tls, remember_edge
from playbooks.conduct.settings import Settings
from playbooks.errors import UsageError


def run_lb(
    host_name: str,
    backends: Sequence[str],
    recipe: str | None = None,
    bind: str = "127.0.0.1",
    port: int = 8000,
    dry_run: bool = False,
    settings: Settings | None = None,
    tls: bool | None = None,
    cert: str | None = None,
    key: str | None = None,
) -> int:
    """``tls``: HTTPS at the edge (None: beyond loopback only); ``cert``/``key``: the pair to
    present, else a self-signed one kept on this controller (its fingerprint printed)."""
    settings = settings or Settings()
    if len(set(backends)) != len(backends):
        raise UsageError(f"--hosts {','.join(backends)}: a host is named twice")
    lb_spec = settings.host_spec(host_name)
    settings.one_recipe(host_name, recipe)  # a layout of several: one line, before connecting
    specs = [settings.host_spec(n) for n in backends]  # an unknown name: one line before connecting
    pair = edge_tls(lb_spec, bind, tls, cert, key)  # a bad pair: one line, before connecting
    if pair:
        # as Text: the console would read ":AB:" of a fingerprint as an emoji code
        console().print(Text(f"TLS at the edge: {pair.origin}; certificate {pair.fingerprint}"))
    code = converge(
        settings,
        host_name,
        recipe,
        balancer_ops_maker(lb_spec, specs, bind, port, settings.load_recipe, recipe, pair),
        dry_run,
    )
    if code == 0 and not dry_run:
        remember_edge(host_name, pair)  # bench --lb reaches it the same way
    return code
