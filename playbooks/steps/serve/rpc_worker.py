"""An RPC worker: llama.cpp's ggml-rpc-server holding layers for a server on another host
(llama-server --rpc), as a hardened systemd unit.

The worker runs the host's own llama.cpp build (`<prefix>/llama.cpp/current`, built with
GGML_RPC=ON like every build voltaforge makes), so a fleet built from one source runs one RPC
protocol. It listens on the one address its recipe entry names and its unit lets in only
loopback and the entry's `allow_from` (the protocol has no authentication; docs/split.md).
One unit per endpoint: `voltaforge-rpc-<port>.service`.

rpc_worker_op: the unit runs what was rendered on the build `current` points at
(steps/serve/unit_running.py), else it is (re)started and must accept connections.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from playbooks.config.recipe import Recipe, RpcWorker
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, exec_line, render_template


@dataclass(frozen=True)
class RpcLayout:
    prefix: str
    port: int

    @property
    def unit_name(self) -> str:
        return f"voltaforge-rpc-{self.port}.service"

    @property
    def binary(self) -> str:
        return f"{self.prefix}/llama.cpp/current/bin/ggml-rpc-server"

    @property
    def current(self) -> str:
        return f"{self.prefix}/llama.cpp/current"


def workers_on(recipe: Recipe, host_name: str) -> list[RpcWorker]:
    """The recipe's RPC workers this inventory host runs; refused when there are none."""
    mine = [w for w in recipe.rpc if w.worker == host_name]
    if not mine:
        named = ", ".join(f"{w.endpoint} ({w.worker or 'started by hand'})" for w in recipe.rpc) or "none"
        raise VoltaforgeError(
            f"recipe {recipe.name} names no RPC worker on {host_name} (rpc: entries with worker: {host_name}); "
            f"its workers: {named}"
        )
    return mine


def rpc_argv(recipe: Recipe, worker: RpcWorker, layout: RpcLayout) -> list[str]:
    argv = [layout.binary, "--host", worker.address, "--port", str(worker.port)]
    if recipe.threads:
        argv += ["--threads", str(recipe.threads)]
    return argv


def render_rpc_unit(recipe: Recipe, worker: RpcWorker, layout: RpcLayout) -> str:
    gpu = not get_gpu(recipe.gpu).is_cpu
    # PCI_BUS_ID: CUDA's index is nvidia-smi's and /dev/nvidia<i>'s (as for llama-server)
    environment = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", str(worker.gpu))] if gpu else []
    return render_template(
        "rpc-server.service.j2",
        unit_name=layout.unit_name,
        recipe=recipe.name,
        endpoint=worker.endpoint,
        exec_start=exec_line(rpc_argv(recipe, worker, layout)),
        environment=environment,
        allow_from=worker.allow_from,
        gpu=gpu,
        gpu_index=worker.gpu,
    )


def unit_path(layout: RpcLayout) -> str:
    return f"{UNIT_DIR}/{layout.unit_name}"


def rpc_worker_op(worker: RpcWorker, layout: RpcLayout, unit_text: str, sudo: bool = False) -> EnsureUnitRunning:
    """The worker's unit runs the rendered unit on the build `current` points at (a rebuild
    restarts it: the worker must speak the server's build's protocol) and accepts connections."""
    return EnsureUnitRunning(
        layout.unit_name,
        [unit_text],
        layout.prefix,
        (worker.address, worker.port),
        sudo=sudo,
        extra_command=f"readlink -f -- {shlex.quote(layout.current)} || true",
        what=f"the RPC worker {worker.endpoint}",
    )
