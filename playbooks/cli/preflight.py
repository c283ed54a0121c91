"""`invoke preflight`: connect, gather the facts, judge them, show the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from playbooks.cli.render import console, render_verdict, verdict_json
from playbooks.config.inventory import resolve_host
from playbooks.config.recipe import load_recipe
from playbooks.host import connect
from playbooks.steps.preflight import gather, judge


def run_preflight(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    inventory: str | Path = "inventory.yaml",
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    spec = resolve_host(host_name, Path(inventory))
    recipe_name = recipe or spec.recipe
    loaded = load_recipe(recipe_name) if recipe_name else None
    model_dir = f"{spec.prefix}/models"
    with connect(spec) as host:
        facts = gather(host, spec.prefix, model_dir)
    v = judge(facts, loaded, model_dir, spec.prefix, inventory_gpu=spec.gpu)
    if as_json:
        out.write(json.dumps(verdict_json(v), indent=2) + "\n")
    else:
        render_verdict(v, console(out, width=140))
    return 0 if v.ok else 1
