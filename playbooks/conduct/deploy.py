"""The deploy step's operations: the recipe's server on a host, from the rendered files and the
verified artifact (steps/serve/deploy.py), under systemd or as a managed process; the server's
manager and its one unit (what `invoke stop` and tune's scratch server use)."""

from __future__ import annotations

from dataclasses import replace
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
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.deploy import (
    CheckPort,
    DeployLayout,
    EnsureModelLink,
    EnsureServiceFile,
    EnsureServing,
    EnsureSymlink,
    EnsureTabbyTokens,
    Expectations,
    ServiceFile,
    require_systemd,
    systemd_only,
)
from playbooks.steps.serve.secrets import CheckSecret, EnsureCredentialCopy, secret_path
from playbooks.steps.serve.service_manager import (
    Manager,
    ProcessRunner,
    Systemd,
    process_argv,
    process_environment,
    unit_environment,
    unit_working_directory,
)
from playbooks.steps.serve.units import (
    RenderedFile,
    ServerLayout,
    default_gpu_indexes,
    parse_exec_start,
    planned_service_files,
)
from playbooks.steps.weights.exl2_convert import STAMP_NAME as EXL2_STAMP
from playbooks.steps.weights.exl2_convert import Exl2Layout
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
    if r.backend == "exllamav2" and kind != "systemd":
        # TabbyAPI as a managed process: its config, tokens and logs where the SSH user owns
        # them, the same directory its rendered files are copied into below
        server = replace(server, process_state=f"{state_root}/{server.tabbyapi_unit_name.removesuffix('.service')}")
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
    if r.backend == "exllamav2":
        assert not isinstance(r.quant, str)  # the recipe schema: an exllamav2 recipe gives bpw
        artifact = Exl2Layout(model.root).output(Exl2Layout.tag(r.quant.bpw, r.quant.head_bits))
        manifest, link = f"{artifact}/{EXL2_STAMP}", server.tabbyapi_model_link(r)
    else:
        artifact = model.gguf(r.quant_name)
        manifest, link = manifest_path(artifact), server.model_file(r)
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
    gpu = not get_gpu(r.gpu).is_cpu
    llama = r.backend == "llamacpp"
    # the load log is judged for llama-server's lines only: TabbyAPI prints no offload or buffer
    # lines (ExLlamaV2 loads every layer on the GPU or fails), so nothing of it is held to the plan
    expect = Expectations(
        # every layer on a device: the GPU's, or the RPC workers' (a CPU recipe split over them)
        layers=loaded.shape.num_hidden_layers + 1 if llama and (gpu or r.rpc) else None,
        # a draft model's KV cache and compute buffer are printed beside the target's (summed)
        kv_mib=option.loaded_kv_bytes / 2**20 if option and llama else None,
        compute_mib=option.loaded_compute_bytes / 2**20 if option and llama else None,
        # a MoE: the experts in host RAM are exactly the planned ones (the layer count cannot tell)
        device_model_mib=(option.gpu_weights_bytes + option.draft_weights_bytes) / 2**20
        if option and llama and gpu and loaded.shape.is_moe and not r.split
        else None,
        devices=tuple((d.weights_bytes / 2**20, d.kv_bytes / 2**20) for d in option.devices)
        if option and llama
        else (),
    )
    managers = [make_manager(kind, state, name, unit.text) for name, state, _ in instances]
    ports = [port for _, _, port in instances]
    secret = secret_path(r)
    # a missing or open key stops the deployment before anything changes
    ops: list[Operation] = [CheckSecret(secret)] if secret else []
    ops += [CheckPort(p, m, sudo=kind == "systemd") for m, p in zip(managers, ports, strict=True)]
    ops += [EnsureDirectory(f"{prefix}/serve", 0o755), EnsureDirectory(state_root, 0o755)]
    ops += [EnsureDirectory(state.state_dir, 0o700) for _, state, _ in instances]
    if secret and kind != "systemd" and r.backend == "llamacpp":
        # systemd's LoadCredential= as a process gets it: a private copy where %d points
        # (service_manager.process_argv), owned by the user the process runs as
        ops += [
            EnsureCredentialCopy(secret, f"{state.state_dir}/credentials/api-key", host.user)
            for _, state, _ in instances
        ]
    ops.append(EnsureModelLink(link, artifact, manifest, hint))
    draft = draft_artifact(loaded, prefix) if r.backend == "llamacpp" else None
    if draft:  # the unit's --model-draft reads it through its own link beside the model's
        ops.append(EnsureModelLink(server.draft_file(r), draft, manifest_path(draft), hint))
    etc = sorted({f.path.rsplit("/", 1)[0] for f in files if f.path.startswith("/etc/voltaforge/")})
    if kind == "systemd" and etc:
        ops += [EnsureDirectory(d, 0o755, sudo=True) for d in dict.fromkeys(["/etc/voltaforge", *etc])]
    if r.backend == "exllamav2":
        # TabbyAPI opens these relative to its working directory (ServerLayout.tabbyapi_links)
        if server.process_state:  # systemd's LogsDirectory=, as a process has it
            ops.append(EnsureDirectory(server.tabbyapi_logs, 0o700))
        ops += [EnsureSymlink(f"{server.tabbyapi_serve_dir}/{n}", t) for n, t in server.tabbyapi_links().items()]
        if secret:
            owner = host.user if server.process_state else None  # a process reads its own copy
            ops.append(EnsureTabbyTokens(secret, server.tabbyapi_tokens, owner))
    ops += [EnsureServiceFile(f) for f in files]
    sha = str(facts.get("sha256") or facts.get("id") or "")
    size = int(facts.get("bytes") or 0)
    recorded = recipe_record(loaded)
    ops += [
        EnsureServing(m, state, files, link, artifact, sha, size, port, expect, gated, recorded, r.served_name)
        for m, (_, state, port) in zip(managers, instances, strict=True)
    ]
    return ops
