"""The deploy step for a recipe: the manager a host gets, what the deployment serves (the
model's id, the draft, the plan's option, the recipe's record), and its operations, assembled by
steps/serve/deploy.py; the instances a recipe runs on a host (its records' ports, no plan); and
the one server of tune's scratch deployments."""

from __future__ import annotations

from typing import Literal

from playbooks.conduct.placements import Served
from playbooks.conduct.quantize import draft_artifact, recipe_weights
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.config.recorded import recipe_record
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment
from playbooks.facts.system import SYSTEMD_COMMAND, parse_systemd
from playbooks.host import Host
from playbooks.host.ops import Operation
from playbooks.steps.serve.deploy import Instance, Sources, deployment_ops, instances_of
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.service_manager import require_systemd
from playbooks.steps.serve.units import RenderedFile, ServerLayout, default_gpu_indexes

ManagerChoice = Literal["auto", "systemd", "process"]


def choose_manager(host: Host, wanted: str) -> str:
    """systemd where it is PID 1, else a process; `--manager systemd` without it: one line."""
    if wanted not in ("auto", "systemd", "process"):
        raise VoltaforgeError(f"--manager {wanted!r}: want auto, systemd or process")
    booted = parse_systemd(read_fact(host, SYSTEMD_COMMAND)).booted
    require_systemd(booted, wanted, host.name)
    return "systemd" if wanted == "systemd" or (wanted == "auto" and booted) else "process"


def served_instances(
    served: Served, prefix: str, records: list[Deployment] | None = None
) -> tuple[str, list[Instance]]:
    """A recipe as a host serves it: the name of its unit (or instance template), as its engine
    names it, and each server it runs: its unit, state and port. Nothing is rendered and nothing
    planned. ``records``: the host's deployment records; an instance recorded there has the port
    its record says it listens on (what runs, not what the file says now)."""
    r = served.loaded.recipe
    gpus = default_gpu_indexes(r) if served.gpus is None else served.gpus
    unit = server_engine(r.backend).unit_name(r, served.layout(prefix), gpus)
    ports = {d.service: d.port for d in records or () if d.port is not None}
    planned = instances_of(unit, r.service.port, gpus, prefix)
    return unit, [i._replace(port=ports.get(i.state.service, i.port)) for i in planned]


def single_service(
    loaded: LoadedRecipe, prefix: str, server: ServerLayout | None = None
) -> tuple[RenderedFile, str, DeployLayout]:
    """The recipe's one server (GPU 0 or the CPU): its rendered unit, unit name and state.
    ``server``: another unit name than the recipe's own (tune's scratch server)."""
    layout = server or ServerLayout(prefix=prefix)
    unit = planned_service_files(loaded, layout)[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    return unit, unit_name, DeployLayout(prefix, unit_name.removesuffix(".service"))


def deploy_ops(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    manager_choice: str,
    gpus: tuple[int, ...] | None = None,
    gated: bool = False,
    server: ServerLayout | None = None,
) -> list[Operation]:
    """The operations of one deployment (steps/serve/deploy.py). ``gated``: a started service
    becomes the rollback target only once the gate passes it. ``server``: another unit name and
    serve directory than the recipe's own (tune's scratch server beside the live one)."""
    r = loaded.recipe
    kind = choose_manager(host, manager_choice)
    option = next((o for o in plan_recipe(loaded).options if o.quant == r.quant_name), None)
    takes_draft = server_engine(r.backend).engine.takes_draft
    sources = Sources(
        recipe_weights(loaded).model_id,
        draft_artifact(loaded, prefix) if takes_draft else None,
        option,
        recipe_record(loaded),
    )
    return deployment_ops(
        loaded,
        host,
        prefix,
        kind,
        sources,
        default_gpu_indexes(r) if gpus is None else gpus,
        server or ServerLayout(prefix=prefix),
        gated,
    )
