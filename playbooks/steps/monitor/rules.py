"""Prometheus rules written at monitor time from what voltaforge knows of each server: its gate
(the recipe's single-stream decode floor, its slots) and its plan (the decode roofline, the
memory it was planned to hold), not guesses. Pure: the same fleet gives the same file, checked
by ``promtool check rules`` and each alert unit-tested with ``promtool test rules``
(tests/test_monitor_rules.py).

Recorded, per server (labels host, model, service):
- ``voltaforge:decode_tok_s:stream``: decode tokens/s of one stream while it generates, from
  llama-server's own counters (tokens over the seconds its slots spent generating them);
- ``voltaforge:decode_tok_s:server``: the tokens/s it serves in all;
- ``voltaforge:roofline_share``: the stream's rate over the plan's roofline (MBU);
- ``voltaforge:waiting:server``: requests it deferred (no free slot);
- ``voltaforge:slots``: the slots its recipe gives it (``parallel``), a constant beside its
  ``llamacpp:requests_processing`` (the slots busy) for `invoke top`;
- ``voltaforge:kv_use``: the tokens its slots hold (the slots exporter's reading of its /slots)
  over the context its plan gives it (the recipe's context x slots);
and, fleet-wide, ``voltaforge:decode_tok_s:model`` (by model) and ``voltaforge:waiting:edge``
(requests queued in the edge, by model backend).

Alerts: a server down for four scrapes (a minute at the default interval; ``up == 0``; not for
a set's models, whose targets are down while they sleep); requests queued at the edge beyond
the servers' slots for a minute; decode below the gate's floor for five minutes while it
generates; a card held by a power or thermal reason for five minutes; a host's GPU memory
above what its servers' plans put there.

A set's models have no KV use: the router answers their /slots (not read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import yaml

#: the clocks-event reasons that mean the card is held down, not idle (gpu_exporter's labels)
HELD = ("sw_power_cap", "hw_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown")
#: the rate window: four scrapes at the longest default interval
WINDOW = "1m"


@dataclass(frozen=True)
class ServerFacts:
    """One server as its rules need it."""

    host: str
    service: str
    model: str
    #: the gate's single-stream decode floor (recipe gate.min_tok_s; 0: no alert)
    floor_tok_s: float = 0.0
    #: the plan's decode roofline for one stream (None: none known, e.g. a CPU whose cache holds a token)
    roofline_tok_s: float | None = None
    #: what the plan puts on its GPUs in all (bytes); 0 for a CPU server
    planned_gpu_bytes: int = 0
    #: a model of a router-mode set (its target is down while the model sleeps)
    in_set: bool = False
    #: the slots its recipe gives it (parallel)
    slots: int = 1
    #: the KV cache its plan gives it, in tokens (context per slot x slots; 0: not known)
    kv_tokens: int = 0


def _sel(s: ServerFacts) -> str:
    return f'job="llama-server",host="{s.host}",service="{s.service}",model="{s.model}"'


def server_group(s: ServerFacts, down_for_s: int = 60) -> dict:
    sel = _sel(s)
    rules: list[dict] = [
        {
            "record": "voltaforge:decode_tok_s:stream",
            "expr": f"rate(llamacpp:tokens_predicted_total{{{sel}}}[{WINDOW}]) "
            f"/ rate(llamacpp:tokens_predicted_seconds_total{{{sel}}}[{WINDOW}])",
        },
        {
            "record": "voltaforge:decode_tok_s:server",
            "expr": f"rate(llamacpp:tokens_predicted_total{{{sel}}}[{WINDOW}])",
        },
        {"record": "voltaforge:waiting:server", "expr": f"llamacpp:requests_deferred{{{sel}}}"},
        {
            "record": "voltaforge:slots",
            "expr": f"vector({s.slots})",
            "labels": {"host": s.host, "service": s.service, "model": s.model},
        },
    ]
    if s.kv_tokens and not s.in_set:
        rules.append({
            "record": "voltaforge:kv_use",
            "expr": f'voltaforge_kv_tokens{{host="{s.host}",service="{s.service}",model="{s.model}"}} / {s.kv_tokens}',
        })  # fmt: skip
    if s.roofline_tok_s:
        rules.append({
            "record": "voltaforge:roofline_share",
            "expr": f'voltaforge:decode_tok_s:stream{{host="{s.host}",service="{s.service}",model="{s.model}"}} '
            f"/ {s.roofline_tok_s:g}",
        })  # fmt: skip
    if not s.in_set:
        rules.append({
            "alert": "VoltaforgeServerDown",
            "expr": f"up{{{sel}}} == 0",
            "for": f"{down_for_s}s",
            "labels": {"severity": "critical"},
            "annotations": {"summary": f"{s.host}: {s.service} ({s.model}) does not answer its scrape"},
        })  # fmt: skip
    if s.floor_tok_s:
        rules.append({
            "alert": "VoltaforgeDecodeBelowGate",
            "expr": f'voltaforge:decode_tok_s:stream{{host="{s.host}",service="{s.service}",model="{s.model}"}} '
            f"< {s.floor_tok_s:g}",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{s.host}: {s.model} decodes {{{{ $value | printf \"%.1f\" }}}} tok/s a stream, "
                f"below its gate's {s.floor_tok_s:g}"
            },
        })  # fmt: skip
    return {"name": f"voltaforge-{s.host}-{s.service}", "rules": rules}


def fleet_group() -> dict:
    """Fleet-wide records and the edge's and the cards' alerts (the edge queues a request only
    once every server of its model has all its slots busy: HAProxy's maxconn is the slots)."""
    rules: list[dict] = [
        {
            "record": "voltaforge:decode_tok_s:model",
            "expr": f'sum by (model) (rate(llamacpp:tokens_predicted_total{{job="llama-server"}}[{WINDOW}]))',
        },
        {"record": "voltaforge:waiting:edge", "expr": 'haproxy_backend_current_queue{proxy=~"model_.+"}'},
        {
            "alert": "VoltaforgeEdgeQueue",
            "expr": 'haproxy_backend_current_queue{proxy=~"model_.+"} > 0',
            "for": "1m",
            "labels": {"severity": "warning"},
            "annotations": {"summary": "{{ $labels.proxy }}: requests wait at the edge beyond every server's slots"},
        },
        {
            "alert": "VoltaforgeGpuThrottled",
            "expr": f'voltaforge_gpu_clocks_event_reason{{reason=~"{"|".join(HELD)}"}} == 1',
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {"summary": "{{ $labels.host }}: GPU {{ $labels.gpu }} held down by {{ $labels.reason }}"},
        },
    ]
    return {"name": "voltaforge-fleet", "rules": rules}


def memory_group(servers: Sequence[ServerFacts]) -> dict | None:
    """A card's memory above the plan, per host: what its GPUs hold against what the plans of
    the servers there put on them (a host's servers sit on disjoint GPUs, and a GPU's memory is
    not told apart by process here). A host with a set is left out: a set's residency changes
    with what is loaded."""
    planned: dict[str, int] = {}
    unplanned: set[str] = set()
    for s in servers:
        if s.in_set or not s.planned_gpu_bytes:
            unplanned.add(s.host)
        planned[s.host] = planned.get(s.host, 0) + s.planned_gpu_bytes
    rules = [
        {
            "alert": "VoltaforgeGpuMemoryAbovePlan",
            "expr": f'sum by (host) (voltaforge_gpu_memory_used_bytes{{host="{host}"}}) > {total}',
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{host}: its GPUs hold more than the {total / 2**30:.2f} GiB its servers' plans put there"
            },
        }  # fmt: skip
        for host, total in sorted(planned.items())
        if host not in unplanned
    ]
    return {"name": "voltaforge-memory", "rules": rules} if rules else None


def render_rules(servers: Sequence[ServerFacts], interval_s: int = 15) -> str:
    """``interval_s``: the scrape interval; a server is down after four scrapes missed (a minute
    at the default 15 s)."""
    ordered = sorted(servers, key=lambda s: (s.host, s.service, s.model))
    groups = [fleet_group()] + [server_group(s, 4 * interval_s) for s in ordered]
    memory = memory_group(servers)
    if memory:
        groups.append(memory)
    head = "# rendered by voltaforge (`invoke monitor`) - do not edit; run `invoke monitor` again instead.\n"
    return head + yaml.safe_dump({"groups": groups}, sort_keys=False, default_flow_style=False, width=200)
