"""The toolchain step's operations: the pinned CUDA toolkit (a GPU recipe) and the torch venv."""

from __future__ import annotations

from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import Operation
from playbooks.plan.gpus import get_gpu
from playbooks.steps.build.toolchain import toolchain_ops


def toolchain_step(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
    needs_cuda = not get_gpu(loaded.recipe.gpu).is_cpu
    return toolchain_ops(prefix, loaded.recipe.toolchain, host.user, needs_cuda, sudo)
