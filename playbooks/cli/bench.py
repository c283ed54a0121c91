"""`invoke bench`: the deployed server measured against its physical ceiling, the gate (exit 1
when it fails), the reports and the history (steps/measure/bench_run.py), shown as a table. Without a
recipe (no flag, none in the configuration or the inventory) it measures the one the host's
deployment record says it serves (conduct/deployed.py)."""

from __future__ import annotations

import json
from pathlib import Path

from playbooks.cli.render import console
from playbooks.conduct.deploy import single_service
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.bench_report import compare, render_compare, render_sweep_table
from playbooks.steps.measure.bench_run import gate_run


def run_bench(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    show_compare: bool = False,
    settings: Settings | None = None,
    out_dir: Path | None = None,
    remeasure: bool = False,
) -> int:
    """``remeasure``: measure the host's memory bandwidth again instead of reusing the stored figure."""
    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    named = recipe or spec.recipe
    loaded = settings.load_recipe(named) if named else None  # a bad name: one line before connecting
    with settings.connect(spec) as host:
        if loaded is None:
            loaded = settings.load_recipe(settings.recipe_for(host_name, recipe, host))
        _, _, layout = single_service(loaded, spec.prefix)
        result, files, earlier = gate_run(loaded, host, spec.prefix, layout, out_dir, remeasure=remeasure)
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        out = console()
        render_sweep_table(result, out)
        if show_compare:
            render_compare(compare(result, earlier), out)
        out.print(f"reports: {files['json']}, {files['markdown']}, {files['png']}")
    return 0 if result["gate"]["passed"] else 1
