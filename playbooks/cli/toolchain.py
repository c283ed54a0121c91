"""`invoke toolchain`: the pinned CUDA toolkit and torch venv on a host, idempotently."""

from __future__ import annotations

from pathlib import Path

from playbooks.cli.converge import converge
from playbooks.cli.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import Operation
from playbooks.plan.gpus import get_gpu
from playbooks.steps.toolchain import toolchain_ops


def toolchain_step(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
    needs_cuda = not get_gpu(loaded.recipe.gpu).is_cpu
    return toolchain_ops(prefix, loaded.recipe.toolchain, host.user, needs_cuda, sudo)


def run_toolchain(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
) -> int:
    return converge(settings or Settings(inventory=Path(inventory)), host_name, recipe, toolchain_step, dry_run)
