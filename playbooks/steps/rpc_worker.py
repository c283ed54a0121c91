"""An RPC worker: llama.cpp's ggml-rpc-server holding layers for a server on another host
(llama-server --rpc), as a hardened systemd unit.

The worker runs the host's own llama.cpp build (`<prefix>/llama.cpp/current`, built with
GGML_RPC=ON like every build voltaforge makes), so a fleet built from one source runs one RPC
protocol. It listens on the one address its recipe entry names and its unit lets in only
loopback and the entry's `allow_from` (the protocol has no authentication; README, "Beyond
one card"). One unit per endpoint: `voltaforge-rpc-<port>.service`.

EnsureRpcWorker reads the unit's state and what it was started from (the unit text and the
build `current` points at, hashed into a fingerprint kept under the deploy state); it is ok
when the unit runs that; else it (re)starts the unit and waits until the port accepts.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass

from playbooks.config.recipe import Recipe, RpcWorker
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.server_log import journal_command
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Shell
from playbooks.plan.gpus import get_gpu
from playbooks.steps.service_manager import Systemd
from playbooks.steps.units import UNIT_DIR, exec_line, template_env

#: how long a started worker may take to accept connections (it loads no model)
LISTEN_TIMEOUT_S = 60


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

    @property
    def fingerprint_file(self) -> str:
        return f"{self.prefix}/deploy/{self.unit_name.removesuffix('.service')}/started.sha256"


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
    return (
        template_env()
        .get_template("rpc-server.service.j2")
        .render(
            unit_name=layout.unit_name,
            recipe=recipe.name,
            endpoint=worker.endpoint,
            exec_start=exec_line(rpc_argv(recipe, worker, layout)),
            environment=environment,
            allow_from=worker.allow_from,
            gpu=gpu,
            gpu_index=worker.gpu,
        )
    )


def unit_path(layout: RpcLayout) -> str:
    return f"{UNIT_DIR}/{layout.unit_name}"


@dataclass(frozen=True)
class RpcFacts:
    up: bool
    detail: str
    current: str  # the build `current` resolves to
    started: str  # the fingerprint of what the running unit was started from


class EnsureRpcWorker(Operation):
    """The worker's unit runs the rendered unit on the current build and accepts connections."""

    def __init__(self, worker: RpcWorker, layout: RpcLayout, unit_text: str, sudo: bool = False):
        self.worker, self.layout, self.unit_text, self.sudo = worker, layout, unit_text, sudo
        self.manager = Systemd(layout.unit_name)
        self.name = f"Ensure the RPC worker {worker.endpoint} runs ({layout.unit_name})"

    def read(self, host: Host) -> RpcFacts:
        running = self.manager.running(read_fact(host, self.manager.state_command()))
        current = read_fact(host, f"readlink -f -- {shlex.quote(self.layout.current)} || true").strip()
        started = read_fact(host, f"cat -- {shlex.quote(self.layout.fingerprint_file)} 2>/dev/null || true").strip()
        return RpcFacts(running.up, running.detail, current, started)

    def fingerprint(self, current: str) -> str:
        return hashlib.sha256(f"{self.unit_text}\0{current}".encode()).hexdigest()

    def decide(self, facts: RpcFacts) -> Decision:
        want = self.fingerprint(facts.current)
        if facts.up and facts.started == want:
            return Decision.ok(f"{facts.detail}, listening on {self.worker.endpoint}")
        why = (
            "not running"
            if not facts.up
            else "the unit or the build changed since it started"
            if facts.started
            else "running, but not started by voltaforge"
        )
        addr, port = self.worker.address, self.worker.port
        unit = shlex.quote(self.layout.unit_name)
        wait = (
            f"for i in $(seq 1 {LISTEN_TIMEOUT_S * 2}); do "
            f"if (exec 3<>/dev/tcp/{addr}/{port}) 2>/dev/null; then exit 0; fi; sleep 0.5; done; "
            f"echo 'the RPC worker does not accept connections on {self.worker.endpoint} after "
            f"{LISTEN_TIMEOUT_S} s; its log:' >&2; {journal_command(self.layout.unit_name)} | tail -n 12 >&2; exit 1"
        )
        state = shlex.quote(self.layout.fingerprint_file.rsplit("/", 1)[0])
        record = f"mkdir -p -- {state} && printf '%s\\n' {want} > {shlex.quote(self.layout.fingerprint_file)}"
        return Decision.act(
            why,
            self.manager.restart(),
            Shell(f"bash -c {shlex.quote(wait)}"),
            Shell(record, sudo=self.sudo),
            Shell(f"systemctl is-active --quiet -- {unit}"),
        )
