"""`invoke deploy`: one recipe's deployment assembled, as the operations that install its
rendered files, start it, check it against the plan, and roll it back when it is not right.

The operations, in order (each reads facts, decides, and is ``ok`` when already right):

1. ``CheckSecret`` (a keyed recipe) and ``CheckPort`` (steps/serve/port_check.py) per
   instance: a missing key or a port someone else holds fails here, before a file is touched.
2. The state directories, the engine's key files, then ``EnsureModelLink``
   (steps/serve/model_links.py): the service's model link points at the artifact `invoke
   quantize` verified (and the draft's beside it); no manifest, no deploy.
3. ``EnsureServiceFile`` per rendered file (steps/serve/service_file.py): uploaded only when it
   differs; a dry run prints the unified diff.
4. ``EnsureServing`` per instance (steps/serve/lifecycle.py): start, wait for /health, the
   load log against the plan, the record (steps/serve/deploy_record.py), promotion or rollback.

Several GPU indexes (llama.cpp): the instance template, one env file per GPU and one instance
each (port + i), each checked and rolled back alone. Pure but for one read: the artifact's
manifest (its sha256 and size are what the record fingerprints).
"""

from __future__ import annotations

from typing import NamedTuple

from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host.base import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.plan.serving import Option
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.lifecycle import EnsureServing
from playbooks.steps.serve.model_links import EnsureModelLink
from playbooks.steps.serve.port_check import CheckPort
from playbooks.steps.serve.secrets import CheckSecret, secret_path
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.service_manager import make_manager, systemd_only
from playbooks.steps.serve.units import ServerLayout
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path


class Instance(NamedTuple):
    """One server a deployment runs: its systemd unit, where its state lives, its port."""

    unit: str
    state: DeployLayout
    port: int


def instances_of(unit_name: str, port: int, gpus: tuple[int, ...], prefix: str) -> list[Instance]:
    """Each server a unit starts: an instance template (``name@.service``) one per GPU index
    (port + index); a plain unit, itself."""
    service = unit_name.removesuffix(".service").removesuffix("@")
    if unit_name.endswith("@.service"):
        return [Instance(f"{service}@{i}.service", DeployLayout(prefix, f"{service}@{i}"), port + i) for i in gpus]
    return [Instance(unit_name, DeployLayout(prefix, service), port)]


class Sources(NamedTuple):
    """What the deployment serves, resolved where the recipe's weights are known
    (conduct/quantize.py): the model's id, the draft's GGUF on the host, the plan's option."""

    model_id: str
    draft: str | None  # resolved only for an engine that takes a draft (conduct/deploy.py)
    option: Option | None
    recipe: dict[str, str]  # the record of the recipe served (config/recorded.py)


def deployment_ops(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    kind: str,
    sources: Sources,
    gpus: tuple[int, ...],
    server: ServerLayout,
    gated: bool = False,
) -> list[Operation]:
    """The operations of one deployment under ``kind`` (``systemd`` or ``process``).
    ``gated``: a started service becomes the rollback target only once the gate passes it.
    ``server``: the unit name and serve directory (tune's scratch server: its own)."""
    r = loaded.recipe
    state_root = f"{prefix}/deploy"
    engine = server_engine(r.backend)
    if kind != "systemd":
        server = engine.process_layout(server, state_root)
    rendered = planned_service_files(loaded, server, gpus)
    why = systemd_only(r, gpus)
    if why and kind != "systemd":
        raise VoltaforgeError(f"{host.name}: {why}, and this host runs no systemd")
    unit = rendered[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    service = unit_name.removesuffix(".service").removesuffix("@")
    model = ModelLayout(prefix, sources.model_id)
    hint = f"run `invoke quantize --host {host.name} --recipe {r.name}` first"
    artifact, manifest, link = engine.artifact(r, model, server)
    facts = parse_json_object(read_fact(host, cat_command(manifest))) or {}
    files = [
        ServiceFile(f.path, f.text, f.mode, sudo=True)
        if kind == "systemd"
        else ServiceFile(f"{state_root}/{service}/{f.path.rsplit('/', 1)[1]}", f.text, f.mode)
        for f in rendered
    ]
    instances = instances_of(unit_name, r.service.port, gpus, prefix)
    expect = engine.expectations(loaded, sources.option)
    managers = [make_manager(kind, i.state, i.unit, unit.text) for i in instances]
    secret = secret_path(r)
    # a missing or open key stops the deployment before anything changes
    ops: list[Operation] = [CheckSecret(secret)] if secret else []
    ops += [CheckPort(i.port, m, sudo=kind == "systemd") for m, i in zip(managers, instances, strict=True)]
    ops += [EnsureDirectory(f"{prefix}/serve", 0o755), EnsureDirectory(state_root, 0o755)]
    ops += [EnsureDirectory(i.state.state_dir, 0o700) for i in instances]
    ops += engine.key_ops(secret, [i.state for i in instances], host, kind == "systemd")
    ops.append(EnsureModelLink(link, artifact, manifest, hint))
    if sources.draft:  # the unit's --model-draft reads its own link
        ops.append(EnsureModelLink(server.draft_file(r), sources.draft, manifest_path(sources.draft), hint))
    etc = sorted({f.path.rsplit("/", 1)[0] for f in files if f.path.startswith("/etc/voltaforge/")})
    if kind == "systemd" and etc:
        ops += [EnsureDirectory(d, 0o755, sudo=True) for d in dict.fromkeys(["/etc/voltaforge", *etc])]
    ops += engine.serve_dir_ops(server, secret, host)
    ops += [EnsureServiceFile(f) for f in files]
    sha = str(facts.get("sha256") or facts.get("id") or "")
    size = int(facts.get("bytes") or 0)
    ops += [
        EnsureServing(
            m, i.state, files, link, artifact, sha, size, i.port, expect, gated, sources.recipe, r.served_name
        )
        for m, i in zip(managers, instances, strict=True)
    ]
    return ops
