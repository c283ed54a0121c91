"""What issue 54's engine move must leave byte-identical (a guard, removed once it has landed):
for every shipped recipe, the files `invoke render` writes (units, TabbyAPI config, their
modes) and `invoke plan --json`'s output, or the refusal either gives.

    .venv/bin/python tests/tools/engine_guard.py --write   # capture (before the change)
    tests/test_engine_guard.py                              # the same outputs, now

Pure: no host, no network; run from the checkout.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data" / "engine_guard.json"


def shipped() -> list[str]:
    return sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "defaults")


def outputs(name: str) -> dict[str, Any]:
    """One recipe's rendered files and plan JSON, each as text (or the refusal's message)."""
    from playbooks.cli.plan import run_plan
    from playbooks.config.planning import refuse_unfit
    from playbooks.config.recipe import load_recipe
    from playbooks.errors import VoltaforgeError
    from playbooks.steps.serve.service_files import planned_service_files
    from playbooks.steps.serve.units import ServerLayout

    out: dict[str, Any] = {}
    try:
        loaded = load_recipe(name)
        refuse_unfit(loaded)
        files = planned_service_files(loaded, ServerLayout(), None)
        out["files"] = [[f.path, f.text, f.mode, f.kind] for f in files]
    except VoltaforgeError as e:
        out["files_refused"] = str(e)
    # the recipe's own plan, and with the other engine's quant (plan --quant: the cache types
    # translated, that engine's memory model and refusals)
    for key, quant in (("plan", None), ("plan_other_engine", None if "exl2" in name else "EXL2-4.0")):
        if key != "plan" and quant is None:
            quant = "Q4_K_M"
        buf = io.StringIO()
        try:
            rc = run_plan(recipe=name, quant=quant, as_json=True, out=buf)
            out[key] = {"rc": rc, "json": buf.getvalue()}
        except VoltaforgeError as e:
            out[key] = {"refused": str(e)}
    return out


def capture() -> dict[str, Any]:
    return {name: outputs(name) for name in shipped()}


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        sys.exit(__doc__)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(capture(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}")
