"""`invoke deploy`, `invoke stop` and `invoke remove`: the recipe's server on a host, from the
rendered files and the verified artifact (steps/serve/deploy.py), under systemd or as a managed
process; stopped; taken off the host (conduct/remove.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from playbooks.cli.converge import converge
from playbooks.cli.render import render_report
from playbooks.conduct.deploy import deploy_ops
from playbooks.conduct.placements import Served
from playbooks.conduct.remove import remove_deployed
from playbooks.conduct.settings import Settings
from playbooks.conduct.stop import stop_served
from playbooks.errors import UsageError
from playbooks.plan.gpus import get_gpu

if TYPE_CHECKING:  # cli/ never runs a host itself (tests/test_layers.py): the types only
    from playbooks.host import Host
    from playbooks.host.ops import Operation


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
    """Stop the recipe's servers (conduct/stop.py); their files stay."""
    render_report(stop_served(settings or Settings(), host_name, recipe))
    return 0


def run_remove(
    host_name: str, recipe: str | None = None, dry_run: bool = False, settings: Settings | None = None
) -> int:
    """Stop and remove the recipe's servers (every deployment without one) and their files
    (conduct/remove.py); exit 1 when a step failed."""
    changes = remove_deployed(settings or Settings(), host_name, recipe, dry_run)
    render_report(changes)
    return 1 if any(c.status == "failed" for c in changes) else 0
