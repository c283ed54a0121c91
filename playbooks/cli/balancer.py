"""`invoke lb`: one load-balanced endpoint for a recipe's servers (conduct/balancer.py)."""

from __future__ import annotations

from collections.abc import Sequence

from playbooks.cli.converge import converge
from playbooks.conduct.balancer import balancer_ops_maker
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
) -> int:
    settings = settings or Settings()
    if len(set(backends)) != len(backends):
        raise UsageError(f"--hosts {','.join(backends)}: a host is named twice")
    lb_spec = settings.host_spec(host_name)
    settings.one_recipe(host_name, recipe)  # a layout of several: one line, before connecting
    specs = [settings.host_spec(n) for n in backends]  # an unknown name: one line before connecting
    return converge(
        settings,
        host_name,
        recipe,
        balancer_ops_maker(lb_spec, specs, bind, port, settings.load_recipe, recipe),
        dry_run,
    )
