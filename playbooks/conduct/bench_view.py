"""`invoke bench`'s runs seen from the monitor's Prometheus (steps/monitor/bench_view.py says
what is read and what it means): added to each run's result and reports where the inventory has
a ``monitor:`` entry naming its host, nothing otherwise.

The view waits for Prometheus's first scrape after the run's last answer (at most two scrape
intervals and ten seconds): the window ends at a sample, not at a guess. It never fails the
bench: no Prometheus there, a monitor host out of reach or a server it does not scrape is one
line in the view (``error``), and the bench's own figures and gate stand as they were."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from playbooks.conduct.settings import Settings
from playbooks.conduct.top import prometheus
from playbooks.conduct.watch import Watch, inventory_hosts, watch_settings
from playbooks.errors import VoltaforgeError
from playbooks.steps.measure.bench_render import write_reports
from playbooks.steps.monitor.bench_view import (
    COUNTERS,
    Values,
    parse_matrix,
    raw_query,
    rise,
    run_view,
    scraped_after,
    server_selector,
    span_for,
    window_queries,
)
from playbooks.steps.monitor.top import parse_answer

#: one server's run (conduct/bench.py): its result, the report files written, the earlier
#: results to compare with
Run = tuple[dict[str, Any], dict[str, Path], list[dict[str, Any]]]


def add_prometheus_views(settings: Settings, runs: list[Run]) -> None:
    """Each run that sent requests gets ``result["prometheus"]``, and its reports are written
    again with it. Without a monitor host in the inventory: nothing."""
    entry = settings.monitor()
    measured = [run for run in runs if run[0].get("sent")]
    if entry.host is None or not measured:
        return
    watch = watch_settings(entry, inventory_hosts(settings))
    source = f"Prometheus on {watch.host}"
    try:
        with prometheus(settings, watch) as (url, where), httpx.Client(timeout=10) as client:
            source = f"Prometheus on {watch.host} at {where}"
            for result, _, _ in measured:
                result["prometheus"] = read_run_view(lambda q, t=None: _ask(client, url, q, t), watch, result, source)
    except httpx.TransportError:
        for result, _, _ in measured:
            result.setdefault(
                "prometheus",
                {"source": source, "error": f"no Prometheus answers there: run `invoke monitor --host {watch.host}`"},
            )
    except VoltaforgeError as exc:  # the monitor host out of reach: said, the bench stands
        for result, _, _ in measured:
            result.setdefault("prometheus", {"source": source, "error": str(exc)})
    for result, files, _ in measured:
        write_reports(result, files["json"].parent)


def _ask(client: httpx.Client, url: str, query: str, at: float | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"query": query}
    if at is not None:
        params["time"] = f"{at:.3f}"
    answer: dict[str, Any] = client.get(f"{url}/api/v1/query", params=params).json()
    return answer


def read_run_view(
    ask: Callable[..., dict[str, Any]], watch: Watch, result: dict[str, Any], source: str
) -> dict[str, Any]:
    """Wait for a scrape after the run, read the counters' raw samples over the window and the
    window's extremes, and judge them (steps/monitor/bench_view.run_view)."""
    sent = result["sent"]
    selector = server_selector(result)
    deadline = time.monotonic() + 2 * watch.interval_s + 10
    try:
        while True:
            span = span_for(sent["from"], time.time(), watch.interval_s)
            series: dict[str, Values] = {}
            for key in COUNTERS:
                found = parse_matrix(ask(raw_query(key, selector, span)))
                series[key] = found[0] if found else []
            if not series["tokens"]:
                return {
                    "source": source,
                    "error": f"no llama-server series {selector} among its targets (its engine exports none, "
                    f"or the monitor does not scrape it: `invoke monitor` after a deploy)",
                }
            if scraped_after(series["tokens"], sent["to"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        _, window, _ = rise(series["tokens"], sent["from"], sent["to"])
        answers = {}
        if window is not None:
            over = max(1, math.ceil(window[1] - window[0]))
            answers = {k: parse_answer(ask(q, window[1])) for k, q in window_queries(result, selector, over).items()}
        return run_view(result, series, answers, source)
    except ValueError as exc:
        return {"source": source, "error": f"Prometheus's answer: {exc}"}
