"""`invoke status`: what each host serves, from its deployment records (one command lists them,
facts/deployments.py), each service checked where it runs: its recipe, model file, port,
/health (200 ready, 503 loading, nothing listening), its manager (a systemd unit or a managed
process) and how long it has run, and the last gate's figures from the record.

Several hosts are read at once, one thread each, as provision runs them; a host that cannot be
reached is a row saying why, and the exit code is 1. Nothing on a host is changed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.render import console
from playbooks.conduct.deployed import deployment_manager, read_deployments
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment, parse_process_age, process_age_command
from playbooks.facts.fleet_units import UNITS_COMMAND, parse_units
from playbooks.facts.service import health_command, parse_health
from playbooks.host import Host
from playbooks.steps.measure.gate import figures_line
from playbooks.steps.serve.balancer import parse_stats, stats_command
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
    elif recipe is None:
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
    return {
        "service": d.service,
        "recipe": recipe.name if recipe else None,
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
        "gate": {
            "status": gate.get("status") or "not run",
            "at": gate.get("at"),
            "figures": gate.get("figures"),
            "reasons": gate.get("reasons") or [],
            "report": gate.get("report"),
        },
    }


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


def _uptime(seconds: int | None) -> str:
    if seconds is None:
        return ""
    d, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    if d:
        return f"{d} d {h} h"
    if h:
        return f"{h} h {m:02d} min"
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _gate_text(gate: dict[str, Any]) -> str:
    status = gate.get("status") or "not run"
    if status not in ("passed", "failed"):
        return status
    when = f" {gate['at']}" if gate.get("at") else ""
    text = f"{status}{when}: {figures_line(gate.get('figures') or {})}"
    if status == "failed" and gate.get("reasons"):
        text += f"; {gate['reasons'][0]}"
    return text


def _unit_ok(u: dict[str, Any]) -> bool:
    return u["running"] and all(b["up"] for b in u.get("backends", []))


def _unit_health(u: dict[str, Any]) -> str:
    """An RPC worker's state; a balancer's backends: which are up, which down, and the requests
    each answered (its share of the traffic)."""
    if not u["running"] or u["kind"] != "balancer":
        return u["state"]
    backends = u.get("backends", [])
    up = sum(b["up"] for b in backends)
    # each server under the model it serves (a fleet balancer routes by model name)
    parts = [
        f"{b.get('model') or '?'}/{b['name']} {'up' if b['up'] else 'DOWN'} ({b['requests']} requests)"
        for b in backends
    ]
    return f"{up} of {len(backends)} backends up: " + ", ".join(parts)


def _manager_text(s: dict[str, Any]) -> str:
    kind = {"systemd": f"systemd unit {s['service']}.service", "process": "managed process"}.get(
        s["manager"], "unknown manager"
    )
    if s["running"] is None:
        return f"{kind} (state unknown)"
    return f"{kind}, pid {s['pid']}" if s["running"] else f"{kind}, not running"


def render_status(hosts: Sequence[dict[str, Any]], out: Console) -> None:
    """One row per service (or per host that serves nothing or cannot be read), then each
    service's details: its model, manager, recipe file, deployment and last gate."""
    table = Table(title="status", title_justify="left")
    for col in ("host", "service", "recipe", "port", "health", "up"):
        table.add_column(col, overflow="fold")
    for h in hosts:
        if h["error"]:
            table.add_row(Text(h["host"]), Text(f"unreachable: {h['error']}", style="bold red"))
        elif not h["services"] and not h.get("units"):
            table.add_row(Text(h["host"]), Text(f"nothing deployed under {h['prefix']}", style="dim"))
        for u in h.get("units", []):
            table.add_row(
                Text(h["host"]),
                Text(u["unit"].removesuffix(".service")),
                Text(u["kind"]),
                Text(str(u["port"] or "")),
                Text(_unit_health(u), style="green" if _unit_ok(u) else "bold red"),
                Text("" if u["running"] else "down"),
            )
        for s in h["services"]:
            style = "green" if s["health"] == 200 else "yellow" if s["health"] == 503 else "bold red"
            up = _uptime(s["uptime_s"]) + (" (since deployed)" if s["uptime_basis"] == "deployed_at" else "")
            table.add_row(
                Text(h["host"]),
                Text(s["service"]),
                Text(s["recipe"] or f"? ({s['note']})"),
                Text(str(s["port"] or "")),
                Text(s["health_text"], style=style),
                Text(up or ("down" if s["running"] is False else "")),
            )
    out.print(table)
    for h in hosts:
        for s in h["services"]:
            details = Table(title=f"{h['host']}: {s['service']}", title_justify="left", show_header=False)
            details.add_column("what", style="bold")
            details.add_column("value", overflow="fold")
            rows = [
                ("model", (f"{s['model_name']}: " if s.get("model_name") else "") + (s["model"] or "")),
                ("manager", _manager_text(s)),
                ("recipe", s["recipe_path"] or s["note"] or ""),
                ("deployed", s["deployed_at"] or ""),
                ("last gate", _gate_text(s["gate"])),
            ]
            for what, value in rows:
                details.add_row(Text(what), Text(value))
            out.print(details)
    down = [f"{h['host']}: {u['unit']}" for h in hosts for u in h.get("units", []) if not _unit_ok(u)]
    if down:
        out.print(Text(f"not well: {'; '.join(down)}", style="bold red"))
    bad = [h["host"] for h in hosts if h["error"]]
    if len(hosts) > 1 or bad:
        read = f"{len(hosts) - len(bad)} of {len(hosts)} hosts read"
        out.print(Text(read + (f"; unreachable: {', '.join(bad)}" if bad else "")))


def run_status(hosts: str | Sequence[str], as_json: bool = False, settings: Settings | None = None) -> int:
    """Every host's deployments (one host, or several read at once); exit 1 when a host could not be read."""
    settings = settings or Settings()
    names = [hosts] if isinstance(hosts, str) else list(hosts)
    if len(set(names)) != len(names):
        raise VoltaforgeError(f"--host {','.join(names)}: a host is named twice")
    specs = [settings.host_spec(n) for n in names]  # an unknown name: one line before connecting
    if len(specs) == 1:
        found = [host_status(settings, specs[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(len(specs), 16), thread_name_prefix="status") as pool:
            found = list(pool.map(lambda spec: host_status(settings, spec), specs))
    if as_json:
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        render_status(found, console())
    return 1 if any(h["error"] for h in found) else 0
