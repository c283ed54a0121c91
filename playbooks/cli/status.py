"""`invoke status`: what each host serves, as conduct/status.py reads it: its recipe, model file,
port, /health (200 ready, 503 loading, nothing listening), its manager (a systemd unit or a
managed process) and how long it has run, and the last gate's figures from the record. A host
that cannot be reached is a row saying why, and the exit code is 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.render import console
from playbooks.conduct.settings import Settings
from playbooks.conduct.status import read_status
from playbooks.plan.gpus import mem_text
from playbooks.steps.measure.gate import figures_line


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


def _member_text(m: dict[str, Any]) -> str:
    """A model set's member: its state in the router, and what its child holds."""
    text = f"{m['recipe']}: {m['state']}" + (" (its last child failed)" if m.get("failed") else "")
    if m.get("child_pid"):
        where = " on its cards" if m.get("held_on") == "GPU" else ""
        held = f", holds {mem_text(m['held_bytes'])}{where}" if m.get("held_bytes") is not None else ""
        text += f", child pid {m['child_pid']}{held}"
    if m.get("idle_s") is not None:
        text += f", last used {_uptime(m['idle_s'])} ago"
    elif m.get("used") is False:
        text += ", not used since the router started"
    return text


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
            rows += [(f"member {m['name']}", _member_text(m)) for m in s.get("members") or []]
            for what, value in rows:
                if value:  # a set's router has no model or recipe of its own: its members say them
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
    found = read_status(settings or Settings(), [hosts] if isinstance(hosts, str) else list(hosts))
    if as_json:
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        render_status(found, console())
    return 1 if any(h["error"] for h in found) else 0
