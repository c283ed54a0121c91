"""The deploy step of a model set (issues 55, 56): its router on a host, from the files its engine
renders (steps/serve/router.py) and each member's verified GGUF, as a systemd unit where systemd
is PID 1, else as a managed process.

The operations, in order, each reading facts first: the key is private (a keyed set), the port
is free or the router's own, the directories, the key's private copy for a managed process (a
unit gets it as a credential), each member's GGUF verified (its manifest: no manifest, no
deploy), the unit and the preset, then ``EnsureServing`` (steps/serve/lifecycle.py), which restarts
the router only when the files or a member's GGUF changed, waits for /health and keeps the
rollback target. Its record names the members (each recipe as config/recorded.py keeps it, with
its served name), which `invoke status`, stop and the balancer read.

Under systemd the router's unit is a server's (the same template and sandbox, scored by
`systemd-analyze security` like every unit): the children it starts are its own processes, in
the unit's control group, so they share its sandbox and its dynamic user, and the unit's stop
(KillMode=control-group, systemd's default) ends every one of them. Nothing in the sandbox had
to open for a router: it forks and executes its own binary, reads the preset and the GGUFs
(world-readable under the prefix) and talks to its children over loopback, all of which a
server's unit allows.
"""

from __future__ import annotations

import hashlib
import json

from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.quantize import recipe_weights
from playbooks.config.recorded import recipe_record
from playbooks.facts import read_fact
from playbooks.facts.files import cat_command, parse_json_object
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.lifecycle import EnsureServing, Expectations
from playbooks.steps.serve.model_links import CheckArtifact
from playbooks.steps.serve.port_check import CheckPort
from playbooks.steps.serve.router import RouterSet
from playbooks.steps.serve.secrets import CheckSecret, secret_path
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.service_manager import make_manager
from playbooks.steps.serve.units import RenderedFile, ServerLayout
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path

#: nothing of a router's load log is held to a plan: it loads no model itself (each child's
#: memory is held to the plan by the set's real test and `invoke status`)
ROUTER_EXPECTS = Expectations(layers=None, kv_mib=None, compute_mib=None)


def set_files(s: ServedSet, prefix: str, systemd: bool) -> tuple[RouterSet, ServerLayout, list[RenderedFile]]:
    """What the set's engine renders for it (its unit, then its preset), from the inventory
    alone: what `invoke render --host` writes and deploy installs. ``systemd``: the unit goes
    under /etc/systemd/system (a managed process keeps a copy in its state directory instead:
    set_deploy_ops moves it)."""
    first = s.members[0].recipe
    engine = server_engine(first.backend)
    server = s.layout(prefix)
    if not systemd:
        server = engine.process_layout(server, f"{prefix}/deploy")
    members = []
    for loaded in s.members:
        artifact, _, _ = engine.artifact(loaded.recipe, ModelLayout(prefix, recipe_weights(loaded).model_id), server)
        members.append((loaded.recipe, artifact))
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
        api_key_file=secret_path(first),  # every member's: conduct/model_sets.py checked they share it
    )
    return rs, server, engine.render_set_files(rs, server)


def set_deploy_ops(
    s: ServedSet, host: Host, prefix: str, manager_choice: str = "auto", gated: bool = False
) -> list[Operation]:
    """The operations that serve ``s`` on ``host``. ``gated``: a started router becomes the
    rollback target only once the set's gate passes it (steps/measure/set_gate.py)."""
    kind = choose_manager(host, manager_choice)
    systemd = kind == "systemd"
    engine = server_engine(s.members[0].recipe.backend)
    state_root = f"{prefix}/deploy"
    rs, server, rendered = set_files(s, prefix, systemd)
    secret = rs.api_key_file
    checks, shas, sizes = [], [], []
    for r, artifact in rs.members:
        manifest = manifest_path(artifact)
        facts = parse_json_object(read_fact(host, cat_command(manifest))) or {}
        hint = f"run `invoke quantize --host {host.name} --recipe {r.name}` first"
        checks.append(CheckArtifact(artifact, manifest, hint))
        shas.append([r.served_name, artifact, str(facts.get("sha256") or facts.get("id") or "")])
        sizes.append(int(facts.get("bytes") or 0))
    unit = rendered[0]
    unit_name = unit.path.rsplit("/", 1)[1]
    state = DeployLayout(prefix, unit_name.removesuffix(".service"))
    # under systemd every file is root's (the unit's dynamic user reads them); a managed process
    # keeps its unit in its state directory, the preset stays where the router's command line
    # names it
    files = [
        ServiceFile(f.path, f.text, f.mode, sudo=True) if systemd
        else ServiceFile(f"{state.state_dir}/{f.path.rsplit('/', 1)[1]}", f.text, f.mode) if f.kind == "unit"
        else ServiceFile(f.path, f.text, f.mode)
        for f in rendered
    ]  # fmt: skip
    manager = make_manager(kind, state, unit_name, unit.text)
    ops: list[Operation] = [CheckSecret(secret)] if secret else []
    ops.append(CheckPort(s.port, manager, sudo=systemd))
    ops += [EnsureDirectory(d, 0o755) for d in (f"{prefix}/serve", state_root, server.serve_dir)]
    ops.append(EnsureDirectory(state.state_dir, 0o700))
    ops += engine.key_ops(secret, [state], host, systemd)
    ops += checks
    ops += [EnsureServiceFile(f) for f in files]
    # what the router serves, beyond its files: each member's GGUF (its path is in the preset)
    sha = hashlib.sha256(json.dumps(shas).encode()).hexdigest()
    recorded = [{**recipe_record(m), "served_name": m.recipe.served_name} for m in s.members]
    ops.append(
        EnsureServing(manager, state, files, "", "", sha, max(sizes), s.port, ROUTER_EXPECTS, gated, members=recorded)
    )
    return ops
