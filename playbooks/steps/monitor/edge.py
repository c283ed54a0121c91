"""Where the edge publishes its metrics, read from the configuration `invoke lb` rendered on its
host (templates/haproxy.cfg.j2): the stats frontend's loopback port, and whether it serves
HAProxy's Prometheus exporter at /metrics (an edge rendered before the exporter does not)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_STATS = re.compile(r"^frontend stats\n((?:[ \t]+.*\n?)+)", re.M)
_BIND = re.compile(r"^\s+bind\s+([0-9.]+):([0-9]{1,5})\s*$", re.M)


@dataclass(frozen=True)
class EdgeMetrics:
    address: str
    port: int
    exporter: bool


def parse_edge_metrics(config: str) -> EdgeMetrics | None:
    """The stats frontend's bind and exporter; None when the text holds no stats frontend."""
    block = _STATS.search(config)
    if block is None:
        return None
    bind = _BIND.search(block.group(1))
    if bind is None:
        return None
    return EdgeMetrics(bind.group(1), int(bind.group(2)), "use-service prometheus-exporter" in block.group(1))
