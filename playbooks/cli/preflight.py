"""`invoke preflight`: connect, gather the facts, judge them, show the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from playbooks.cli.render import console, render_verdict, verdict_json
from playbooks.conduct.settings import Settings
from playbooks.steps.preflight import gather, judge, rpc_endpoints


def run_preflight(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    settings = settings or Settings(inventory=Path(inventory))
    spec = settings.host_spec(host_name)
    recipe_name = recipe or spec.recipe
    loaded = settings.load_recipe(recipe_name) if recipe_name else None
    model_dir = f"{spec.prefix}/models"
    with settings.connect(spec) as host:
        facts = gather(host, spec.prefix, model_dir, rpc_endpoints(loaded))
    v = judge(facts, loaded, model_dir, spec.prefix, inventory_gpu=spec.gpu)
    if as_json:
        out.write(json.dumps(verdict_json(v), indent=2) + "\n")
    else:
        render_verdict(v, console(out, width=140))
    return 0 if v.ok else 1
