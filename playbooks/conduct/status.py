"""What `invoke status` reads on each host: its deployment records (one command lists them,
facts/deployments.py), each service checked where it runs (its manager's state, /health, the
process's age), its RPC workers and balancer (with each backend's share from the stats page).
Several hosts are read at once, one thread each; a host that cannot be reached is an entry with
its error. Nothing on a host is changed. cli/status.py draws the tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from playbooks.conduct.deployed import deployment_manager, read_deployments
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment, parse_process_age, process_age_command
from playbooks.facts.fleet_units import UNITS_COMMAND, parse_units
from playbooks.facts.gpu_processes import COMPUTE_APPS_COMMAND, parse_compute_apps
from playbooks.facts.router import (
    children_command,
    models_command,
    parse_children,
    parse_models,
    parse_routed,
    routed_command,
)
from playbooks.facts.service import health_command, parse_health
from playbooks.host import Host
from playbooks.steps.serve.balancer import parse_stats, stats_command
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.service_manager import Running

HEALTH = {200: "200 ready", 503: "503 loading", 0: "nothing listens"}


def _since(at: str | None) -> int | None:
    """Seconds since a record's time stamp (None when it has none that parses)."""
    try:
        then = datetime.strptime(at or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return max(0, int((datetime.now(timezone.utc) - then).total_seconds()))


def service_status(host: Host, prefix: str, d: Deployment) -> dict[str, Any]:
    """One deployment, checked where it runs."""
    recipe = d.recipe
    if d.record is None:
        note = "its deployment record cannot be read"
    elif recipe is None and not d.members:
        note = "deployed before voltaforge recorded its recipe"
    else:
        note = None
    mgr = deployment_manager(host, prefix, d)
    running: Running | None = None
    if mgr is not None:
        running = mgr.running(read_fact(host, mgr.state_command()))
    health = parse_health(read_fact(host, health_command(d.port))) if d.port else 0
    uptime, basis = None, None
    if running is not None and running.up and running.pid > 0:
        uptime, basis = parse_process_age(read_fact(host, process_age_command(running.pid))), "process"
    if uptime is None and (running.up if running is not None else health in (200, 503)):
        uptime, basis = _since(d.at), "deployed_at"  # the record's time, when the process's is not to be had
    if uptime is None:
        basis = None
    gate = d.gate
    members = set_members(host, prefix, d, running, uptime if basis == "process" else None) if d.members else None
    return {
        "service": d.service,
        # a model set's router: its members, each shown below with its state
        "recipe": recipe.name if recipe else ("set: " + ", ".join(r.name for r in d.members) if d.members else None),
        "recipe_path": recipe.path if recipe else None,
        "recipe_sha256": recipe.sha256 if recipe else None,
        "note": note,
        "model": d.model,
        "model_name": d.served_name,
        "port": d.port,
        "health": health,
        "health_text": HEALTH.get(health, str(health)),
        "manager": d.manager,
        "manager_detail": mgr.describe() if mgr else None,
        "running": running.up if running is not None else None,
        "pid": running.pid if running is not None and running.up else None,
        "uptime_s": uptime,
        "uptime_basis": basis,
        "deployed_at": d.at,
        "members": members,
        "gate": {
            "status": gate.get("status") or "not run",
            "at": gate.get("at"),
            "figures": gate.get("figures"),
            "reasons": gate.get("reasons") or [],
            "report": gate.get("report"),
        },
    }


def set_members(
    host: Host, prefix: str, d: Deployment, running: Running | None, age_s: int | None
) -> list[dict[str, Any]]:
    """A model set's members as its router lists them (unloaded, loading, loaded, sleeping) and,
    for each with a child, the memory the child holds: its own (RssAnon) and the pages of its
    weights it maps (RssFile, from the page cache: facts/router.py says why that counts each
    file once); a child that holds a CUDA context, what nvidia-smi says it holds on the cards
    (facts/gpu_processes.py). When each was last used: the router's age (``age_s``) less its log's stamp of
    the last request it routed to it (facts/router.py); a router whose log is not a file (under
    systemd: the journal) or not stamped says nothing (None), one that routed none to a member
    since it started says so (``used`` False)."""
    state = DeployLayout(prefix, d.service)
    listed = parse_models(read_fact(host, models_command(d.port or 0, f"{state.state_dir}/credentials/api-key")))
    by_name = {m.name: m for m in listed}
    up = running is not None and running.up
    children = {c.port: c for c in parse_children(read_fact(host, children_command(f"{state.state_dir}/server.pid")))}
    on_cards = parse_compute_apps(read_fact(host, COMPUTE_APPS_COMMAND)) if up and children else {}
    routed = parse_routed(read_fact(host, routed_command(f"{state.state_dir}/server.log"))) if up else {}
    stamped = up and age_s is not None and bool(routed)
    out = []
    for r, served in zip(d.members, d.member_names, strict=True):
        m = by_name.get(served)
        child = children.get(m.port) if m and m.port and up else None
        at = routed.get(served)
        out.append(
            {
                "name": served,
                "recipe": r.name,
                "state": m.state if m else ("not listed" if up else "router down"),
                "child_pid": child.pid if child else None,
                # a child on a card: what nvidia-smi says it holds there; on CPU, its memory
                "held_bytes": (on_cards[child.pid] if child.pid in on_cards else child.held_bytes) if child else None,
                "held_on": ("GPU" if child.pid in on_cards else "host") if child else None,
                "failed": bool(m and m.failed),
                "used": (at is not None) if stamped else None,
                # whole seconds: the router's age is ps's; its log's stamp starts a moment after
                "idle_s": max(0, round(age_s - at)) if stamped and at is not None and age_s is not None else None,
            }
        )
    return out


def fleet_units(host: Host) -> list[dict[str, Any]]:
    """The host's RPC workers and load balancer; the balancer with each backend's state and
    request count from its stats page."""
    out = []
    for u in parse_units(read_fact(host, UNITS_COMMAND)):
        entry: dict[str, Any] = {"unit": u.unit, "kind": u.kind, "port": u.port, "running": u.running,
                                 "state": f"{u.active} ({u.sub})"}  # fmt: skip
        if u.kind == "balancer":
            stats = parse_stats(read_fact(host, stats_command())) if u.running else []
            entry["backends"] = [{"name": b.name, "model": b.model, "up": b.up, "status": b.status,
                                  "requests": b.requests, "check": b.check} for b in stats]  # fmt: skip
        out.append(entry)
    return out


def host_status(settings: Settings, spec: HostSpec) -> dict[str, Any]:
    """A host's deployments, RPC workers and balancer, or why it could not be read."""
    out: dict[str, Any] = {"host": spec.name, "prefix": spec.prefix, "error": None, "services": [], "units": []}
    try:
        with settings.connect(spec) as host:
            out["services"] = [service_status(host, spec.prefix, d) for d in read_deployments(host, spec.prefix)]
            out["units"] = fleet_units(host)
    except VoltaforgeError as exc:  # unreachable, a host key that changed, a connection lost
        out["error"] = " ".join(str(exc).removeprefix(f"{spec.name}: ").split())
    return out


def read_status(settings: Settings, names: Sequence[str]) -> list[dict[str, Any]]:
    """Every named host's status (one, or several read at once), in the order named."""
    if len(set(names)) != len(names):
        raise VoltaforgeError(f"--host {','.join(names)}: a host is named twice")
    specs = [settings.host_spec(n) for n in names]  # an unknown name: one line before connecting
    if len(specs) == 1:
        return [host_status(settings, specs[0])]
    with ThreadPoolExecutor(max_workers=min(len(specs), 16), thread_name_prefix="status") as pool:
        return list(pool.map(lambda spec: host_status(settings, spec), specs))
