"""`invoke bench`: the deployed server measured against its physical ceiling, the gate (exit 1
when it fails), the reports and the history (steps/measure/bench_run.py), shown as a table. Without a
recipe (no flag, none in the configuration or the inventory) it measures the one the host's
deployment record says it serves (conduct/deployed.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.render import console
from playbooks.conduct.balancer import edge_client
from playbooks.conduct.deploy import served_instances
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.bench_lb import bench_through_balancer
from playbooks.steps.measure.bench_report import compare, render_compare, render_sweep_table
from playbooks.steps.measure.bench_run import bench_dir, gate_run


def run_bench(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    show_compare: bool = False,
    settings: Settings | None = None,
    out_dir: Path | None = None,
    remeasure: bool = False,
) -> int:
    """``remeasure``: measure the host's memory bandwidth again instead of reusing the stored
    figure. A host's layout (or a recipe run once per GPU): every server, one after the other
    (each alone on the host, as its gate measured it); the JSON is then a list."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    served = settings.named_serves(host_name, recipe)
    runs = []
    with settings.connect(spec) as host:
        served = served or settings.deployed_serves(host_name, recipe, host)
        for s in served:
            for _, layout, _ in served_instances(s, spec.prefix)[1]:
                runs.append(gate_run(s.loaded, host, spec.prefix, layout, out_dir, remeasure=remeasure))
    if as_json:
        results = [result for result, _, _ in runs]
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2, sort_keys=True))
    else:
        out = console()
        for result, files, earlier in runs:
            if len(runs) > 1:
                out.print(f"[bold]{result['recipe']}[/] on {result.get('server', {}).get('url', host_name)}")
            render_sweep_table(result, out)
            if show_compare:
                render_compare(compare(result, earlier), out)
            out.print(f"reports: {files['json']}, {files['markdown']}, {files['png']}")
    return 0 if all(result["gate"]["passed"] for result, _, _ in runs) else 1


def run_bench_lb(
    host_name: str, port: int, recipe: str | None = None, as_json: bool = False, settings: Settings | None = None
) -> int:
    """The recipe's workload through the balancer on ``host_name``:``port`` (steps/measure/bench_lb.py):
    a row per level and a row per backend with its share. Exit 1 when a level failed."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    one = settings.one_recipe(host_name, recipe)  # a bad name or a layout of several: before connecting
    with settings.connect(spec) as host:
        loaded = (one or settings.deployed_serves(host_name, recipe, host)[0]).loaded
        # TLS as `invoke lb` set it up (its self-signed certificate the CA)
        result = bench_through_balancer(loaded, host, port, tls=edge_client(host_name))
    path = bench_dir() / host.name / f"{loaded.recipe.name}-lb" / f"{result['at'].replace(':', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        render_lb_table(result, console())
        console().print(f"result: {path}")
    return 1 if any(level.get("error") for level in result["levels"]) else 0


def render_lb_table(result: dict, out: Console) -> None:
    table = Table(title=f"{result['recipe']} through {result['via']}", title_justify="left")
    for col in ("streams", "requests", "aggregate tok/s", "TTFT p50", "backend", "its requests", "share"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for level in result["levels"]:
        backends = level.get("backends") or {}
        first = True
        for name, b in backends.items() or [("", {})]:
            lead = (
                [str(level["concurrency"]), str(level.get("requests", "")), f"{level.get('aggregate_tok_s') or 0:.1f}",
                 f"{(level.get('ttft_p50_s') or 0) * 1000:.0f} ms"]
                if first
                else ["", "", "", ""]
            )  # fmt: skip
            share = b.get("share")
            state = "" if b.get("up", True) else " (down)"
            table.add_row(*lead, name + state, str(b.get("requests", "")), "" if share is None else f"{share:.0%}")
            first = False
        if level.get("error"):
            table.add_row(str(level.get("concurrency", "")), "", "", "", Text(level["error"], style="red"), "", "")
    out.print(table)
