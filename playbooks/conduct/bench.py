"""`invoke bench`'s runs: the deployed servers of a host measured against their ceilings and
gated (steps/measure/bench_run.py), or one recipe's workload through the host's balancer
(steps/measure/bench_lb.py). The CLI shows what these return (cli/bench.py).

Without a recipe (no flag, none in the configuration or the inventory) it measures the one the
host's deployment record says it serves (conduct/deployed.py); a host's layout (or a recipe run
once per GPU): every server, one after the other, each alone on the host as its gate measured it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from playbooks.conduct.balancer import edge_client
from playbooks.conduct.bench_view import Run, add_prometheus_views
from playbooks.conduct.deploy import served_instances
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.bench_history import read_history
from playbooks.steps.measure.bench_lb import bench_through_balancer
from playbooks.steps.measure.bench_noise import HostNoise, host_noise
from playbooks.steps.measure.bench_run import bench_dir, gate_run


def bench_host(
    host_name: str,
    recipe: str | None,
    settings: Settings,
    out_dir: Path | None = None,
    remeasure: bool = False,
) -> list[Run]:
    """Each server of the host benched and gated, with Prometheus's view of each run where the
    inventory has a monitor (conduct/bench_view.py). ``remeasure``: the host's memory bandwidth
    measured again instead of the stored figure."""
    runs = _gate_runs(host_name, recipe, settings, out_dir, remeasure)
    add_prometheus_views(settings, runs)
    return runs


def _gate_runs(
    host_name: str, recipe: str | None, settings: Settings, out_dir: Path | None = None, remeasure: bool = False
) -> list[Run]:
    spec = settings.host_spec(host_name)
    served = settings.named_serves(host_name, recipe)
    runs = []
    with settings.connect(spec) as host:
        served = served or settings.deployed_serves(host_name, recipe, host)
        for s in served:
            for _, layout, _ in served_instances(s, spec.prefix)[1]:
                runs.append(gate_run(s.loaded, host, spec.prefix, layout, out_dir, remeasure=remeasure))
    return runs


def bench_noise(
    host_name: str, recipe: str | None, settings: Settings, runs: int
) -> tuple[list[Run], HostNoise | None]:
    """The unchanged server(s) benched ``runs`` times back to back, each run kept in the
    history, and the host's run-to-run noise pooled from its history after them
    (steps/measure/bench_noise.py). No Prometheus view: these runs are for their spread."""
    done: list[Run] = []
    for _ in range(runs):
        done += _gate_runs(host_name, recipe, settings)
    host = done[-1][0]["host"] if done else host_name  # the name the history keeps
    return done, host_noise(read_history(bench_dir() / "history.jsonl", host))


def bench_balancer(host_name: str, port: int, recipe: str | None, settings: Settings) -> tuple[dict[str, Any], Path]:
    """The recipe's workload through the balancer on ``host_name``:``port``, over TLS as `invoke
    lb` set it up (its self-signed certificate the CA); the result kept in the bench history."""
    spec = settings.host_spec(host_name)
    one = settings.one_recipe(host_name, recipe)  # a bad name or a layout of several: before connecting
    with settings.connect(spec) as host:
        loaded = (one or settings.deployed_serves(host_name, recipe, host)[0]).loaded
        result = bench_through_balancer(loaded, host, port, tls=edge_client(host_name))
    path = bench_dir() / host.name / f"{loaded.recipe.name}-lb" / f"{result['at'].replace(':', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result, path
