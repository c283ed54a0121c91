"""The deploy step's operations: the recipe's server on a host, from the rendered files and the
verified artifact (steps/serve/deploy.py), under systemd or as a managed process; the server's
manager and its one unit (what `invoke stop` and tune's scratch server use)."""

from __future__ import annotations

from typing import Literal

from playbooks.conduct.placements import Served
from playbooks.conduct.quantize import draft_artifact, recipe_weights
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.config.recorded import recipe_record
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.facts.system import SYSTEMD_COMMAND, parse_systemd
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.serve.deploy import (
    CheckPort,
    DeployLayout,
    EnsureModelLink,
    EnsureServiceFile,
    EnsureServing,
    ServiceFile,
    require_systemd,
    systemd_only,
)
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.secrets import CheckSecret, secret_path
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.service_manager import (
    Manager,
    ProcessRunner,
    Systemd,
    process_argv,
    process_environment,
    unit_environment,
    unit_working_directory,
)
from playbooks.steps.serve.units import RenderedFile, ServerLayout, default_gpu_indexes, parse_exec_start
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path

ManagerChoice = Literal["auto", "systemd", "process"]


def choose_manager(host: Host, wanted: str) -> str:
    """systemd where it is PID 1, else a process; `--manager systemd` without it: one line."""
    if wanted not in ("auto", "systemd", "process"):
        raise VoltaforgeError(f"--manager {wanted!r}: want auto, systemd or process")
    booted = parse_systemd(read_fact(host, SYSTEMD_COMMAND)).booted
    require_systemd(booted, wanted, host.name)
    return "systemd" if wanted == "systemd" or (wanted == "auto" and booted) else "process"


def single_service(
    loaded: LoadedRecipe, prefix: str, server: ServerLayout | None = None
) -> tuple[RenderedFile, str, DeployLayout]:
    """The recipe's one server (GPU 0 or the CPU): its rendered unit, unit name and state.
    ``server``: another unit name than the recipe's own (tune's scratch server)."""
    layout = server or ServerLayout(prefix=prefix)
    unit = planned_service_files(loaded, layout)[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    return unit, unit_name, DeployLayout(prefix, unit_name.removesuffix(".service"))


def instances_of(unit_path: str, port: int, gpus: tuple[int, ...], prefix: str) -> list[tuple[str, DeployLayout, int]]:
    """Each server a rendered unit starts: (its systemd unit, where its state lives, its port).
    An instance template starts one per GPU index (port + index); a plain unit, itself."""
    unit_name = unit_path.rsplit("/", 1)[1]
    service = unit_name.removesuffix(".service").removesuffix("@")
    if unit_name.endswith("@.service"):
        return [(f"{service}@{i}.service", DeployLayout(prefix, f"{service}@{i}"), port + i) for i in gpus]
    return [(unit_name, DeployLayout(prefix, service), port)]


def served_instances(served: Served, prefix: str) -> tuple[RenderedFile, list[tuple[str, DeployLayout, int]]]:
    """A recipe as the host serves it: its unit (or instance template) and every instance."""
    r = served.loaded.recipe
    gpus = default_gpu_indexes(r) if served.gpus is None else served.gpus
    unit = planned_service_files(served.loaded, served.layout(prefix), gpus)[0]
    return unit, instances_of(unit.path, r.service.port, gpus, prefix)


def make_manager(kind: str, state: DeployLayout, unit_name: str, unit_text: str) -> Manager:
    if kind == "systemd":
        return Systemd(unit_name)
    argv = parse_exec_start(unit_text)
    unit_env = unit_environment(unit_text)
    env = process_environment(unit_env, f"{state.state_dir}/cache")
    return ProcessRunner(
        state.state_dir,
        argv[0],
        process_argv(argv, f"{state.state_dir}/credentials"),
        env,
        cwd=unit_working_directory(unit_text),
        # what CacheDirectory= would have made: the directories %C named
        make_dirs=tuple(dict.fromkeys(v for (_, unit_v), (_, v) in zip(unit_env, env, strict=True) if "%C" in unit_v)),
    )


def deploy_ops(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    manager_choice: str,
    gpus: tuple[int, ...] | None = None,
    gated: bool = False,
    server: ServerLayout | None = None,
) -> list[Operation]:
    """The operations of one deployment. Several GPU indexes (llama.cpp): the instance template,
    one env file per GPU, and one instance each (port + i), each checked and rolled back alone.
    ``gated``: a started service becomes the rollback target only once the gate passes it.
    ``server``: another unit name and serve directory than the recipe's own (tune's scratch
    server beside the live one)."""
    r = loaded.recipe
    kind = choose_manager(host, manager_choice)
    server = server or ServerLayout(prefix=prefix)
    state_root = f"{prefix}/deploy"
    engine = server_engine(r.backend)
    if kind != "systemd":
        server = engine.process_layout(server, state_root)
    gpus = default_gpu_indexes(r) if gpus is None else gpus
    rendered = planned_service_files(loaded, server, gpus)
    why = systemd_only(r, gpus)
    if why and kind != "systemd":
        raise VoltaforgeError(f"{host.name}: {why}, and this host runs no systemd")
    unit = rendered[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    service = unit_name.removesuffix(".service").removesuffix("@")
    model = ModelLayout(prefix, recipe_weights(loaded).model_id)
    hint = f"run `invoke quantize --host {host.name} --recipe {r.name}` first"
    artifact, manifest, link = engine.artifact(r, model, server)
    facts = parse_json_object(read_fact(host, cat_command(manifest))) or {}
    files = [
        ServiceFile(f.path, f.text, f.mode, sudo=True)
        if kind == "systemd"
        else ServiceFile(f"{state_root}/{service}/{f.path.rsplit('/', 1)[1]}", f.text, f.mode)
        for f in rendered
    ]
    instances = instances_of(unit.path, r.service.port, gpus, prefix)
    plan = plan_recipe(loaded)
    option = next((o for o in plan.options if o.quant == r.quant_name), None)
    expect = engine.expectations(loaded, option)
    managers = [make_manager(kind, state, name, unit.text) for name, state, _ in instances]
    ports = [port for _, _, port in instances]
    secret = secret_path(r)
    # a missing or open key stops the deployment before anything changes
    ops: list[Operation] = [CheckSecret(secret)] if secret else []
    ops += [CheckPort(p, m, sudo=kind == "systemd") for m, p in zip(managers, ports, strict=True)]
    ops += [EnsureDirectory(f"{prefix}/serve", 0o755), EnsureDirectory(state_root, 0o755)]
    ops += [EnsureDirectory(state.state_dir, 0o700) for _, state, _ in instances]
    ops += engine.key_ops(secret, [state for _, state, _ in instances], host, kind == "systemd")
    ops.append(EnsureModelLink(link, artifact, manifest, hint))
    draft = draft_artifact(loaded, prefix) if engine.engine.takes_draft else None
    if draft:  # the unit's --model-draft reads it through its own link beside the model's
        ops.append(EnsureModelLink(server.draft_file(r), draft, manifest_path(draft), hint))
    etc = sorted({f.path.rsplit("/", 1)[0] for f in files if f.path.startswith("/etc/voltaforge/")})
    if kind == "systemd" and etc:
        ops += [EnsureDirectory(d, 0o755, sudo=True) for d in dict.fromkeys(["/etc/voltaforge", *etc])]
    ops += engine.serve_dir_ops(server, secret, host)
    ops += [EnsureServiceFile(f) for f in files]
    sha = str(facts.get("sha256") or facts.get("id") or "")
    size = int(facts.get("bytes") or 0)
    recorded = recipe_record(loaded)
    ops += [
        EnsureServing(m, state, files, link, artifact, sha, size, port, expect, gated, recorded, r.served_name)
        for m, (_, state, port) in zip(managers, instances, strict=True)
    ]
    return ops
