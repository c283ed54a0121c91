"""`invoke stop`: each server of the recipe (or of the host's layout, or what its deployment
record says it serves) stopped by its manager; its files stay, so a deploy starts it again."""

from __future__ import annotations

from playbooks.conduct.deploy import choose_manager, make_manager, served_instances
from playbooks.conduct.settings import Settings
from playbooks.host.ops import Change, run_command


def stop_served(settings: Settings, host_name: str, recipe: str | None = None) -> list[Change]:
    """Stop the recipe's servers (the unit or each instance, or the managed process); their
    files stay. A host's layout: every recipe of it. Without a recipe named anywhere: the one
    the host's deployment record says it serves."""
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
    return changes
