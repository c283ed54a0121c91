"""`invoke toolchain`: the pinned CUDA toolkit and torch venv on a host, idempotently."""

from __future__ import annotations

from pathlib import Path

from playbooks.cli.render import render_report
from playbooks.cli.settings import Settings
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host.lock import host_lock
from playbooks.host.ops import run_ops
from playbooks.plan.gpus import get_gpu
from playbooks.steps.toolchain import toolchain_ops


def run_toolchain(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
) -> int:
    settings = settings or Settings(inventory=Path(inventory))
    spec = settings.host_spec(host_name)
    name = recipe or spec.recipe
    if not name:
        raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
    loaded = settings.load_recipe(name)
    tc = loaded.recipe.toolchain
    needs_cuda = not get_gpu(loaded.recipe.gpu).is_cpu
    with settings.connect(spec) as host:
        # a prefix under a directory the user cannot write (e.g. /opt) is created with sudo
        prefix_sudo = not parse_writable(read_fact(host, writable_command(spec.prefix)))
        ops = toolchain_ops(spec.prefix, tc, host.user, needs_cuda, prefix_sudo)
        if dry_run:
            changes = run_ops(host, ops, dry_run=True)
        else:
            with host_lock(host, spec.prefix, sudo=prefix_sudo):
                changes = run_ops(host, ops)
    render_report(changes)
    return 1 if any(c.status == "failed" for c in changes) else 0
