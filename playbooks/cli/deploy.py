"""`invoke deploy` and `invoke stop`: the recipe's server on a host, from the rendered files and
the verified artifact (steps/serve/deploy.py), under systemd or as a managed process."""

from __future__ import annotations

from playbooks.cli.converge import converge
from playbooks.cli.render import render_report
from playbooks.conduct.deploy import choose_manager, deploy_ops, make_manager, served_instances
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings
from playbooks.errors import UsageError
from playbooks.host import Host
from playbooks.host.ops import Change, Operation, run_command
from playbooks.plan.gpus import get_gpu


def run_deploy(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    manager: str = "auto",
    settings: Settings | None = None,
    gpus: tuple[int, ...] | None = None,
) -> int:
    settings = settings or Settings()
    if gpus is not None and settings.host_spec(host_name).serve:
        raise UsageError(f"--gpus: {host_name}'s serve: layout places the GPUs; change it there")

    def ops(s: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        if gpus is not None and get_gpu(s.loaded.recipe.gpu).is_cpu:
            raise UsageError(f"--gpus: {s.name} is a CPU recipe; its replicas are a serve: layout's instances")
        chosen = gpus if gpus is not None else s.gpus
        return deploy_ops(s.loaded, host, prefix, manager, chosen, server=s.layout(prefix))

    return converge(settings, host_name, recipe, ops, dry_run)


def run_stop(host_name: str, recipe: str | None = None, settings: Settings | None = None) -> int:
    """Stop the recipe's servers (the unit or each instance, or the managed process); their
    files stay. A host's layout: every recipe of it. Without a recipe named anywhere: the one
    the host's deployment record says it serves."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    served = settings.named_serves(host_name, recipe)
    changes = []
    with settings.connect(spec) as host:
        served = served or settings.deployed_serves(host_name, recipe, host)
        kind = choose_manager(host, "auto")
        for s in served:
            unit, instances = served_instances(s, spec.prefix)
            for unit_name, state, _ in instances:
                mgr = make_manager(kind, state, unit_name, unit.text)
                cmd = mgr.stop()
                run_command(host, cmd)
                changes.append(Change(host.name, f"Stop {mgr.describe()}", "changed", "stopped", (cmd.show(),)))
    render_report(changes)
    return 0
