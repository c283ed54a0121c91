"""The deploy step of a model set (issue 55): its router on a host, from the files its engine
renders (steps/serve/router.py) and each member's verified GGUF, as a managed process.

The operations, in order, each reading facts first: the key is private (a keyed set), the port
is free or the router's own, the directories, the key's private copy for the process, each
member's GGUF verified (its manifest: no manifest, no deploy), the unit copy and the preset,
then ``EnsureServing`` (steps/serve/deploy.py), which restarts the router only when the files or
a member's GGUF changed, waits for /health and keeps the rollback target. Its record names the
members (each recipe as config/recorded.py keeps it, with its served name), which `invoke
status`, stop and the balancer read.

Decision recorded here: in this version a set runs as a managed process only; on a host whose
systemd is PID 1 it is refused in one line (the set's unit, and what its sandbox must allow a
router that starts children, are the second part of the issue).
"""

from __future__ import annotations

import hashlib
import json

from playbooks.conduct.deploy import choose_manager, make_manager
from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.quantize import recipe_weights
from playbooks.config.recorded import recipe_record
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.serve.deploy import (
    CheckArtifact,
    CheckPort,
    DeployLayout,
    EnsureServiceFile,
    EnsureServing,
    Expectations,
    ServiceFile,
)
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.router import RouterSet
from playbooks.steps.serve.secrets import CheckSecret, secret_path
from playbooks.steps.weights.model_layout import ModelLayout

#: nothing of a router's load log is held to a plan: it loads no model itself (each child's
#: memory is held to the plan by the set's real test and `invoke status`)
ROUTER_EXPECTS = Expectations(layers=None, kv_mib=None, compute_mib=None)


def set_deploy_ops(
    s: ServedSet, host: Host, prefix: str, manager_choice: str = "auto", gated: bool = False
) -> list[Operation]:
    """The operations that serve ``s`` on ``host``. ``gated``: a started router becomes the
    rollback target only once the set's gate passes it (steps/measure/set_gate.py)."""
    kind = choose_manager(host, manager_choice)
    if kind == "systemd":
        raise VoltaforgeError(
            f"{host.name}: set {s.name}: a model set runs as a managed process in this version, and this host runs "
            "systemd: deploy it with --manager process (its systemd unit comes with the set's second part)"
        )
    first = s.members[0].recipe
    engine = server_engine(first.backend)
    state_root = f"{prefix}/deploy"
    server = engine.process_layout(s.layout(prefix), state_root)
    secret = secret_path(first)  # every member's: conduct/model_sets.py checked they share it
    members, checks, shas, sizes = [], [], [], []
    for loaded in s.members:
        r = loaded.recipe
        artifact, manifest, _ = engine.artifact(r, ModelLayout(prefix, recipe_weights(loaded).model_id), server)
        facts = parse_json_object(read_fact(host, cat_command(manifest))) or {}
        hint = f"run `invoke quantize --host {host.name} --recipe {r.name}` first"
        checks.append(CheckArtifact(artifact, manifest, hint))
        members.append((r, artifact))
        shas.append([r.served_name, artifact, str(facts.get("sha256") or facts.get("id") or "")])
        sizes.append(int(facts.get("bytes") or 0))
    rs = RouterSet(
        name=s.name,
        members=tuple(members),
        port=s.port,
        bind=first.service.bind,
        models_max=s.models_max,
        gpu=not s.plan.gpu.is_cpu,
        gpu_indexes=s.gpus,
        sleep_idle_s=s.spec.sleep_idle_s,
        load_at_start=frozenset(m.recipe.served_name for m in s.members if m.recipe.name in s.spec.load_at_start),
        api_key_file=secret,
    )
    rendered = engine.render_set_files(rs, server)
    unit = rendered[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    state = DeployLayout(prefix, unit_name.removesuffix(".service"))
    # a managed process keeps its unit in its state directory; the preset stays where the
    # router's command line names it
    files = [
        ServiceFile(f"{state.state_dir}/{f.path.rsplit('/', 1)[1]}", f.text, f.mode) if f.kind == "unit"
        else ServiceFile(f.path, f.text, f.mode)
        for f in rendered
    ]  # fmt: skip
    manager = make_manager(kind, state, unit_name, unit.text)
    ops: list[Operation] = [CheckSecret(secret)] if secret else []
    ops.append(CheckPort(s.port, manager, sudo=False))
    ops += [EnsureDirectory(d, 0o755) for d in (f"{prefix}/serve", state_root, server.serve_dir)]
    ops.append(EnsureDirectory(state.state_dir, 0o700))
    ops += engine.key_ops(secret, [state], host, False)
    ops += checks
    ops += [EnsureServiceFile(f) for f in files]
    # what the router serves, beyond its files: each member's GGUF (its path is in the preset)
    sha = hashlib.sha256(json.dumps(shas).encode()).hexdigest()
    recorded = [{**recipe_record(m), "served_name": m.recipe.served_name} for m in s.members]
    ops.append(
        EnsureServing(manager, state, files, "", "", sha, max(sizes), s.port, ROUTER_EXPECTS, gated, members=recorded)
    )
    return ops
