"""`invoke bench --lb`: the gate's workload sent through a host's load balancer (`invoke lb`), one
concurrency level after another, with each backend's share of the requests.

The shares come from HAProxy's own counters (its loopback stats page, read before and after each
level), not from the client: they count every request the balancer sent where, retries and the
level's first /health request included (tests/test_balancer_real.py holds them to each server's
own log). The
levels are the recipe's gate levels (``levels`` to choose others); a level's figures are the
bench's own (steps/measure/bench.py level_summary), measured through the balancer.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.plan.engines import engine
from playbooks.steps.measure.bench_run import bench_health, measure_level
from playbooks.steps.serve.balancer import STATS_PORT, ServerStat, parse_stats, stats_command
from playbooks.steps.serve.secrets import api_key_for


def shares(before: Sequence[ServerStat], after: Sequence[ServerStat]) -> dict[str, dict[str, Any]]:
    """Each backend's requests between two reads of the counters, and its share of them. A
    backend that appeared in between counts from zero; one whose counter went back (HAProxy
    restarted) counts what it shows now."""
    old = {s.name: s.requests for s in before}
    got = {s.name: s.requests - old.get(s.name, 0) for s in after}
    got = {name: n if n >= 0 else next(s.requests for s in after if s.name == name) for name, n in got.items()}
    total = sum(got.values())
    return {
        s.name: {"requests": got[s.name], "share": round(got[s.name] / total, 3) if total else None, "up": s.up}
        for s in after
    }


def read_stats(host: Host, stats_port: int, model: str | None = None) -> list[ServerStat]:
    return parse_stats(read_fact(host, stats_command(stats_port)), model)


def bench_through_balancer(
    loaded: LoadedRecipe,
    host: Host,
    port: int,
    stats_port: int = STATS_PORT,
    levels: Sequence[int] | None = None,
    tls: str | bool | None = None,
) -> dict[str, Any]:
    """Every level through the balancer on ``host``'s ``port``: the result, or one line why not."""
    r = loaded.recipe
    # the key the edge checks: the balancer host's copy of the recipe's secret (its unit loads
    # the same file), read over the connection and held in memory
    api_key = api_key_for(host, r)
    if bench_health(host, port, tls is not None) == 0:
        raise VoltaforgeError(f"nothing answers on {host.name}:{port}: is the balancer there (`invoke lb`)?")
    if not read_stats(host, stats_port, r.served_name):
        raise VoltaforgeError(
            f"{host.name}: the balancer's stats page (127.0.0.1:{stats_port}) lists no server of "
            f"{r.served_name}: is it voltaforge's, in front of this recipe?"
        )
    kind = engine(r.backend).server
    result: dict[str, Any] = {
        "version": 1,
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host.name,
        "recipe": r.name,
        "via": f"the balancer on {host.name}:{port}" + (" (TLS)" if tls is not None else ""),
        "levels": [],
    }
    for c in levels or r.gate.levels:
        before = read_stats(host, stats_port, r.served_name)
        level = measure_level(host, port, kind, c, r.gate, api_key, tls)
        level["backends"] = shares(before, read_stats(host, stats_port, r.served_name))
        result["levels"].append(level)
        if level.get("error"):
            break
    return result
