"""`invoke plan --models a,b,c` (or `--host H`: the model sets its inventory entry serves): a model
set's residency plan (config/model_set.py), as a table or JSON. Exit 1 where a member does not
fit alone (the set is refused), else 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.flags import UsageError
from playbooks.cli.render import console
from playbooks.conduct.model_sets import host_set_plan
from playbooks.conduct.settings import Settings
from playbooks.config.model_set import SetPlan, plan_set
from playbooks.config.recipe import RECIPES_DIR
from playbooks.plan.gpus import mem_text


def set_json(sp: SetPlan) -> dict[str, Any]:
    r = sp.residency
    return {
        "gpu": sp.gpu.key,
        "capacity_bytes": r.capacity,
        "capacity_source": sp.budget_source,
        "router_bytes": r.parent,
        "shared_bytes": r.room,
        "members": [
            {"name": m.name, "recipe": m.recipe, "quant": m.quant, "held_bytes": m.held, "parts": dict(m.parts)}
            for m in r.members
        ],
        "models_max": r.models_max,
        "most_together": r.most_together,
        "peak_bytes": r.peak,
        "refusal": sp.refusal,
        "grouping": r.grouping(),
    }


def render_set(sp: SetPlan, out: Console) -> None:
    r = sp.residency
    table = Table(title=f"model set on {sp.gpu.name}: each member alone")
    for col in ("model", "recipe", "quant", "holds alone"):
        table.add_column(col, justify="right" if col == "holds alone" else "left", overflow="fold")
    part_names = [name for name, _ in r.members[0].parts]
    for name in part_names:
        table.add_column(name, justify="right")
    for m in r.largest_first:
        flag = " (does not fit)" if m in r.too_large else ""
        table.add_row(
            Text(m.name), Text(m.recipe), m.quant, Text(mem_text(m.held) + flag), *(mem_text(b) for _, b in m.parts)
        )  # fmt: skip
    out.print(table)
    out.print(
        Text(
            f"memory: {mem_text(r.capacity)} ({sp.budget_source}); the router holds {mem_text(r.parent)}; "
            f"its children share {mem_text(r.room)}"
        )
    )
    if sp.refusal:
        out.print(Text(f"refused: {sp.refusal}"))
        return
    k = r.models_max
    out.print(
        Text(
            f"resident together: any {k} of {len(r.members)} (the {k} largest hold {mem_text(r.peak)} with "
            f"the router): serve with --models-max {k}"
        )
    )
    if grouping := r.grouping():
        out.print(Text(grouping))


def run_plan_set(
    models: list[str],
    gpu: str | None = None,
    memory_gib: float | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    recipes_dir: Path | None = None,
) -> int:
    sp = plan_set(models, gpu, memory_gib, recipes_dir or RECIPES_DIR)
    if as_json:
        (out or sys.stdout).write(json.dumps(set_json(sp), indent=2) + "\n")
    else:
        render_set(sp, console(out))
    return 1 if sp.refusal else 0


def run_plan_host_sets(host_name: str, settings: Settings, as_json: bool = False, out: TextIO | None = None) -> int:
    """Each model set of the host's ``serve:`` layout planned on the host's GPU (or, on a CPU
    host, within its ``memory_budget_gib``): the table per set, or JSON (a list, one per set)."""
    spec = settings.host_spec(host_name)
    if not spec.model_sets:
        raise UsageError(f"--host {host_name}: its inventory entry serves no model set (serve: - set: ...)")
    plans = [(s.set, host_set_plan(spec, s, settings.recipes_dir or RECIPES_DIR)) for s in spec.model_sets]
    if as_json:
        (out or sys.stdout).write(json.dumps([{"set": name} | set_json(sp) for name, sp in plans], indent=2) + "\n")
    else:
        shown = console(out)
        for name, sp in plans:
            shown.print(Text(f"{host_name}: set {name}"))
            render_set(sp, shown)
    return 1 if any(sp.refusal for _, sp in plans) else 0
