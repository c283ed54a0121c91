"""The build step's operations for one host: llama.cpp from the pinned source for the host's
arch (from the fleet cache when it holds a proven build of the same inputs), llama-cpp-python
from the same source into the toolchain venv, on the server build's libraries; for EXL2
recipes ExLlamaV2 with its extension built for the host's GPU, and TabbyAPI at its pinned
commit."""

from __future__ import annotations

from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import Operation
from playbooks.plan.gpus import get_gpu
from playbooks.steps.build.build import LLAMACPP_TARGETS, BuildLayout, build_ops
from playbooks.steps.build.fleet_cache import FleetCache
from playbooks.steps.build.llamacpp_python import bindings_ops
from playbooks.steps.build.llamacpp_source import fetch_sdist
from playbooks.steps.build.toolchain import venv_path
from playbooks.steps.serve.engines import server_engine


def build_step(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    sudo: bool,
    targets: tuple[str, ...] = LLAMACPP_TARGETS,
    extra_flags: tuple[str, ...] = (),
    no_cache: bool = False,
    bindings: bool = True,
) -> list[Operation]:
    """The build's operations for one host: llama.cpp (from the fleet cache when it holds a
    proven build of the same inputs), the bindings, and for EXL2 ExLlamaV2 and TabbyAPI."""
    r = loaded.recipe
    tc = r.toolchain
    major, minor = (int(x) for x in tc.cuda.split("."))  # the recipe schema checks MAJOR.MINOR
    layout = BuildLayout(prefix)
    source = fetch_sdist(tc.llamacpp_sdist, tc.llamacpp_ref)  # on the controller, once
    cuda_release = None if get_gpu(r.gpu).is_cpu else (major, minor)
    cache = None if no_cache else FleetCache.default()
    ops = build_ops(
        layout,
        source,
        cuda_release=cuda_release,
        recipe_arch=tc.cuda_arch,
        targets=targets,
        extra_flags=extra_flags,
        owner=host.user,
        sudo=sudo,
        cache=cache,
    )
    if bindings:
        ops += bindings_ops(layout, source, venv_path(prefix), cuda=cuda_release is not None)
    # what the recipe's engine builds beyond llama.cpp (ExLlamaV2 and TabbyAPI for EXL2)
    return ops + server_engine(r.backend).build_ops(prefix, venv_path(prefix), tc)
