"""`invoke remove`: what `invoke deploy` and `invoke rpc-worker` put on a host, taken off it.

Which deployments: those of ``--recipe`` (every instance of its layout; a model set's name: its
router), else every deployment
record on the host, with the RPC workers the recipe places there (without a recipe: every
``voltaforge-rpc-*`` unit). Read from the host's records, not from the recipe as it reads now:
the record lists the files that deploy really installed, and its manager (systemd or a managed
process) is the one that started it.

For each: stopped (under systemd also disabled), then its unit and drop-ins, environment and
configuration files (the record's list), its state directory (the record, ``good/``, the key's
private copy, the pid and log of a managed process) and its serve directory (the model's link)
removed, with ``/etc/voltaforge/tabbyapi`` once nothing else is in it; systemd re-reads its units.
The operator's secrets in ``/etc/voltaforge/secrets``, the weights and the builds stay: they are
shared and verified by hash. A balancer's record on this host (``deploy/balancers/``) is the
balancer's: `invoke lb --remove` takes it off, or the balancer's next run.

Every server is stopped before any file goes: an instance template serves every instance of a
layout, and systemd disables an instance only while its template is there."""

from __future__ import annotations

from playbooks.conduct.converge import prefix_needs_sudo, run_locked
from playbooks.conduct.deployed import deployment_manager, read_deployments
from playbooks.conduct.settings import Settings
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment
from playbooks.facts.fleet_units import UNITS_COMMAND, parse_units
from playbooks.host import Host
from playbooks.host.ops import Change, Operation
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.removal import EnsureAbsent, EnsureStopped
from playbooks.steps.serve.router import set_unit_name
from playbooks.steps.serve.rpc_worker import RpcLayout
from playbooks.steps.serve.service_manager import Systemd
from playbooks.steps.serve.units import UNIT_DIR

#: TabbyAPI's configuration directory under systemd (steps/serve/units.py), removed once empty
TABBYAPI_ETC = "/etc/voltaforge/tabbyapi"
#: the step's name in the report when there is nothing to remove
NOTHING = "Remove what voltaforge deployed"


def removal_ops(host: Host, prefix: str, found: list[Deployment], rpc_units: list[str]) -> list[Operation]:
    """Stop everything first, then remove each deployment's files, then each worker's unit."""
    stops: list[Operation] = []
    removals: list[Operation] = []
    for d in found:
        mgr = deployment_manager(host, prefix, d)
        systemd = d.manager == "systemd" or isinstance(mgr, Systemd)
        if mgr is not None:
            stops.append(EnsureStopped(mgr, d.service))
        files = [str(p) for p in (d.record or {}).get("files") or {}]
        unit = f"{UNIT_DIR}/{d.service}.service"
        if systemd and "@" not in d.service:
            files += [unit, f"{unit}.d"]  # a unit and its drop-ins, whatever the record lists
        state = DeployLayout(prefix, d.service).state_dir
        serve = f"{prefix}/serve/{d.service.split('@', 1)[0]}"
        ours = [p for p in files if not p.startswith(f"{state}/")]  # the state directory goes whole
        removals.append(
            EnsureAbsent(
                f"{d.service}: its files and state",
                [*ours, state, serve],
                prefix,
                sudo=systemd,
                dirs=["/etc/voltaforge/tabbyapi"]
                if any(p.startswith("/etc/voltaforge/tabbyapi/") for p in ours)
                else [],
                reload=systemd,
            )
        )
    for unit in rpc_units:
        stops.append(EnsureStopped(Systemd(unit), f"the RPC worker {unit}"))
        path = f"{UNIT_DIR}/{unit}"
        removals.append(EnsureAbsent(f"the RPC worker {unit}", [path, f"{path}.d"], prefix, sudo=True, reload=True))
    return stops + removals


def chosen(
    settings: Settings, host_name: str, host: Host, prefix: str, recipe: str | None
) -> tuple[list[Deployment], list[str]]:
    """The deployments and RPC worker units to remove (see the module's docstring)."""
    found = read_deployments(host, prefix)
    if recipe is None:
        workers = [u.unit for u in parse_units(read_fact(host, UNITS_COMMAND)) if u.kind == "rpc-worker"]
        return found, workers
    if _names_a_set(settings, host_name, recipe):
        service = set_unit_name(recipe).removesuffix(".service")
        return [d for d in found if d.service == service], []
    r = settings.load_recipe(recipe).recipe
    mine = [d for d in found if d.recipe is not None and d.recipe.name == r.name]
    workers = [RpcLayout(prefix, w.port).unit_name for w in r.rpc if w.worker == host_name]
    present = {u.unit for u in parse_units(read_fact(host, UNITS_COMMAND))} if workers else set()
    return mine, [u for u in workers if u in present or _unit_file_there(host, u)]


def _names_a_set(settings: Settings, host_name: str, name: str) -> bool:
    """Whether ``--recipe`` names one of the host's model sets (its router is removed)."""
    return any(e.set == name for e in settings.host_spec(host_name).model_sets)


def _unit_file_there(host: Host, unit: str) -> bool:
    return read_fact(host, f"[ -e {UNIT_DIR}/{unit} ] && echo yes; true").strip() == "yes"


def remove_deployed(settings: Settings, host_name: str, recipe: str | None, dry_run: bool) -> list[Change]:
    """Remove the chosen deployments and workers from the host; a dry run lists every command."""
    spec = settings.host_spec(host_name)
    if recipe and not _names_a_set(settings, host_name, recipe):
        settings.load_recipe(recipe)  # a bad name: one line before connecting
    with settings.connect(spec) as host:
        found, workers = chosen(settings, host_name, host, spec.prefix, recipe)
        if not found and not workers:
            what = f"of {recipe} " if recipe else ""
            return [Change(host.name, NOTHING, "ok", f"nothing {what}is deployed under {spec.prefix}")]
        sudo = prefix_needs_sudo(host, spec.prefix)
        return run_locked(host, spec.prefix, removal_ops(host, spec.prefix, found, workers), dry_run, sudo)
