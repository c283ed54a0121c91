"""`invoke preflight`: connect, gather the facts, judge them, show the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from playbooks.cli.render import console, render_verdict, verdict_json
from playbooks.conduct.placements import Served, host_serves
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
    # the host's facts alone when no recipe is named; a layout: one verdict per recipe of it
    served: list[Served | None] = list(host_serves(spec, recipe, settings.load_recipe)) or [None]
    model_dir = f"{spec.prefix}/models"
    endpoints = [e for s in served if s for e in rpc_endpoints(s.loaded)]
    with settings.connect(spec) as host:
        facts = gather(host, spec.prefix, model_dir, list(dict.fromkeys(endpoints)))
    verdicts = [
        judge(facts, s.loaded if s else None, model_dir, spec.prefix, spec.gpu, s.gpus if s and spec.serve else None)
        for s in served
    ]
    if as_json:
        docs = [verdict_json(v) for v in verdicts]
        out.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    else:
        for s, v in zip(served, verdicts, strict=True):
            if len(verdicts) > 1 and s:
                out.write(f"\n{spec.name}: {s.name} (GPU {', '.join(map(str, s.gpus or ()))})\n")
            render_verdict(v, console(out, width=140))
    return 0 if all(v.ok for v in verdicts) else 1
