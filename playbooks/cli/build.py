"""`invoke build`: llama.cpp from the pinned source for the host's arch, proven and stamped, then
llama-cpp-python from the same source into the toolchain venv; for EXL2 recipes ExLlamaV2 with
its extension built for the host's GPU, and TabbyAPI at its pinned commit."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from playbooks.cli.converge import converge
from playbooks.conduct.build import build_step
from playbooks.conduct.converge import per_recipe
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.steps.build.build import LLAMACPP_TARGETS

if TYPE_CHECKING:  # cli/ never runs a host itself (tests/test_layers.py): the types only
    from playbooks.host import Host
    from playbooks.host.ops import Operation


def run_build(
    host_name: str,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | Path = "inventory.yaml",
    targets: tuple[str, ...] = LLAMACPP_TARGETS,
    extra_flags: tuple[str, ...] = (),
    no_cache: bool = False,
    bindings: bool = True,
    settings: Settings | None = None,
) -> int:
    def ops(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        return build_step(loaded, host, prefix, sudo, targets, extra_flags, no_cache, bindings)

    return converge(settings or Settings(inventory=Path(inventory)), host_name, recipe, per_recipe(ops), dry_run)
