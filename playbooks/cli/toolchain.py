"""`invoke toolchain`: the pinned CUDA toolkit and torch venv on a host, idempotently."""

from __future__ import annotations

from pathlib import Path

from playbooks.cli.converge import converge
from playbooks.conduct.converge import per_recipe
from playbooks.conduct.settings import Settings
from playbooks.conduct.toolchain import toolchain_step


def run_toolchain(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
) -> int:
    return converge(
        settings or Settings(inventory=Path(inventory)), host_name, recipe, per_recipe(toolchain_step), dry_run
    )
