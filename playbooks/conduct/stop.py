"""`invoke stop`: each server of the recipe (or of the host's layout, its model sets included, or
what its deployment record says it serves) stopped by the manager its deployment record names
(a unit, or the command line of the unit file kept in its state directory); its files stay, so
a deploy starts it again. A server with no record was never deployed here: nothing to stop. A
model set's router is stopped as its record says it runs (its children end with it)."""

from __future__ import annotations

from playbooks.conduct.deploy import served_instances
from playbooks.conduct.deployed import deployment_manager, read_deployments
from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings
from playbooks.host.ops import Change, run_command


def stop_served(settings: Settings, host_name: str, recipe: str | None = None) -> list[Change]:
    """Stop the recipe's servers (the unit or each instance, or the managed process); their
    files stay. A host's layout: every recipe and set of it. Without a recipe named anywhere:
    the one the host's deployment record says it serves."""
    spec = settings.host_spec(host_name)
    named = settings.named_targets(host_name, recipe)
    changes = []
    with settings.connect(spec) as host:
        served = [t for t in named if isinstance(t, Served)]
        sets = [t for t in named if isinstance(t, ServedSet)]
        if not named:
            served = settings.deployed_serves(host_name, recipe, host)
        records = {d.service: d for d in read_deployments(host, spec.prefix)}
        for s in served:
            for instance in served_instances(s, spec.prefix)[1]:
                d = records.get(instance.state.service)
                mgr = deployment_manager(host, spec.prefix, d) if d else None
                if mgr is None:
                    changes.append(Change(host.name, f"Stop {instance.unit}", "ok", "never deployed here"))
                    continue
                cmd = mgr.stop()
                run_command(host, cmd)
                changes.append(Change(host.name, f"Stop {mgr.describe()}", "changed", "stopped", (cmd.show(),)))
        for ms in sets:
            d = records.get(ms.unit_name.removesuffix(".service"))
            router = deployment_manager(host, spec.prefix, d) if d else None
            if router is None:
                changes.append(Change(host.name, f"Stop set {ms.name}", "ok", "never deployed here"))
                continue
            cmd = router.stop()
            run_command(host, cmd)
            changes.append(
                Change(host.name, f"Stop set {ms.name}: {router.describe()}", "changed", "stopped", (cmd.show(),))
            )
    return changes
