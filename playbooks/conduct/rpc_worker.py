"""`invoke rpc-worker`: the operations that make a host an RPC worker of a recipe: the same
toolchain and llama.cpp build as any host (the worker's protocol is its build's), then one
hardened ggml-rpc-server unit per endpoint the recipe gives this host (steps/serve/rpc_worker.py).
Workers run under systemd only: their network filter (IPAddressAllow) is systemd's."""

from __future__ import annotations

from playbooks.conduct.build import build_step
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.toolchain import toolchain_step
from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import Operation
from playbooks.steps.serve.rpc_worker import RpcLayout, render_rpc_unit, rpc_worker_op, unit_path, workers_on
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile


def rpc_worker_ops(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
    r = loaded.recipe
    workers = workers_on(r, host.name)  # a host the recipe does not name: one line, nothing read
    choose_manager(host, "systemd")  # no systemd there: one line
    ops = toolchain_step(loaded, host, prefix, sudo) + build_step(loaded, host, prefix, sudo, bindings=False)
    for w in workers:
        layout = RpcLayout(prefix, w.port)
        text = render_rpc_unit(r, w, layout)
        ops += [
            EnsureServiceFile(ServiceFile(unit_path(layout), text, 0o644, sudo=True)),
            rpc_worker_op(w, layout, text, sudo),
        ]
    return ops
