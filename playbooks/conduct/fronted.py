"""Which balancer fronts which of a host's servers: a record `invoke lb` leaves on every backend
host (``<prefix>/deploy/balancers/<balancer host>.json``), which provision reads before it
restarts a server, to take it out of rotation first (conduct/roll.py).

Why a record on the backend and not the inventory's ``lb:`` entry: the record says what the
running balancer was given (its host, the runtime API's socket there, each server's name in
its backend, by port), which is what a drain must name; the entry says what the next
`invoke lb` will give it. A record whose balancer no longer lists the server is harmless: the
roll finds the server gone from HAProxy and changes it in place, saying so.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.conduct.converge import MakeOps
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.fleet import Fleet
from playbooks.conduct.placements import Served
from playbooks.config.inventory import check_host_name
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.serve.runtime_api import RuntimeApi
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile

#: the record's format
VERSION = 1


@dataclass(frozen=True)
class FrontedServer:
    port: int
    model: str  # the served model name: the balancer's backend model_<name>
    server: str  # its name in that backend
    peers: int  # the model's servers behind this balancer, this one included


@dataclass(frozen=True)
class Fronted:
    """One balancer in front of some of a host's servers."""

    balancer: str  # the inventory name of the balancer's host
    api: RuntimeApi
    servers: tuple[FrontedServer, ...]

    def servers_on(self, port: int) -> list[FrontedServer]:
        """Its names for the server on ``port``: one, or one per member for a model set's router
        (each member's name is its own backend, the router a server in each)."""
        return [s for s in self.servers if s.port == port]


def records_dir(prefix: str) -> str:
    return f"{prefix}/deploy/balancers"


def fronted_of(lb_host: str, api: RuntimeApi, fleet: Fleet, backend: str) -> Fronted:
    """What the balancer fronts of one backend host (its servers, by port)."""
    models = fleet.models
    mine = [
        FrontedServer(b.port, b.model, b.name, len(models[b.model]))
        for b, owner in zip(fleet.backends, fleet.owners, strict=True)
        if owner == backend
    ]
    return Fronted(lb_host, api, tuple(sorted(mine, key=lambda s: s.port)))


def record_text(f: Fronted) -> str:
    body = {
        "version": VERSION,
        "balancer": f.balancer,
        "socket": f.api.socket,
        "sudo": f.api.sudo,
        "servers": [vars(s) for s in f.servers],
    }
    return json.dumps(body, indent=1, sort_keys=True) + "\n"


def record_ops_maker(fronted: Fronted) -> MakeOps:
    """The record on one backend host, for converge()."""

    def make(served: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        # beside the deployment records, written as they are: as root where systemd runs the
        # servers, as the SSH user where it runs them itself
        sudo = choose_manager(host, "auto") == "systemd"
        where = records_dir(prefix)
        return [
            EnsureDirectory(where, 0o755, sudo=sudo),
            EnsureServiceFile(ServiceFile(f"{where}/{fronted.balancer}.json", record_text(fronted), 0o644, sudo=sudo)),
        ]

    return make


def read_fronted(host: Host, prefix: str) -> list[Fronted]:
    """Every balancer's record on this host, in one command (one JSON document a line)."""
    root = shlex.quote(records_dir(prefix))
    out = read_fact(
        host, f'for f in {root}/*.json; do [ -f "$f" ] || continue; tr -d \'\\n\\r\' < "$f"; echo; done; true'
    )
    return parse_fronted(out)


def parse_fronted(text: str) -> list[Fronted]:
    """The records (one a line); a line that is not one of ours: one clear error."""
    found = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            balancer = check_host_name(str(data["balancer"]))
            servers = tuple(
                FrontedServer(int(s["port"]), str(s["model"]), str(s["server"]), int(s["peers"]))
                for s in data["servers"]
            )
            found.append(Fronted(balancer, RuntimeApi(str(data["socket"]), bool(data["sudo"])), servers))
        except (ValueError, KeyError, TypeError, VoltaforgeError) as exc:
            raise VoltaforgeError(
                f"a balancer record under deploy/balancers/ is not readable ({exc}): run `invoke lb` again"
            ) from None
    return found


def fronting(records: Sequence[Fronted], port: int) -> list[tuple[Fronted, FrontedServer]]:
    """The balancers that send requests to the server on ``port``, each with its name there (a
    set's router: once per member's backend)."""
    return [(f, s) for f in records for s in f.servers_on(port)]
