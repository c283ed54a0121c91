"""`invoke deploy` and `invoke stop`: the recipe's server on a host, from the rendered files and
the verified artifact (steps/serve/deploy.py), under systemd or as a managed process."""

from __future__ import annotations

from playbooks.cli.converge import converge
from playbooks.cli.render import render_report
from playbooks.conduct.deploy import choose_manager, deploy_ops, make_manager, single_service
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import Change, Operation, run_command


def run_deploy(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    manager: str = "auto",
    settings: Settings | None = None,
    gpus: tuple[int, ...] | None = None,
) -> int:
    def ops(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        return deploy_ops(loaded, host, prefix, manager, gpus)

    return converge(settings or Settings(), host_name, recipe, ops, dry_run)


def run_stop(host_name: str, recipe: str | None = None, settings: Settings | None = None) -> int:
    """Stop the recipe's server (the unit, or the managed process); its files stay. Without a
    recipe named anywhere: the one the host's deployment record says it serves."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    named = recipe or spec.recipe
    loaded = settings.load_recipe(named) if named else None  # a bad name: one line before connecting
    with settings.connect(spec) as host:
        if loaded is None:
            loaded = settings.load_recipe(settings.recipe_for(host_name, recipe, host))
        kind = choose_manager(host, "auto")
        unit, unit_name, state = single_service(loaded, spec.prefix)
        mgr = make_manager(kind, state, unit_name, unit.text)
        cmd = mgr.stop()
        run_command(host, cmd)
        change = Change(host.name, f"Stop {mgr.describe()}", "changed", "stopped", (cmd.show(),))
    render_report([change])
    return 0
