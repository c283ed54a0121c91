"""`invoke preflight`: the verdicts conduct/preflight.py reaches, shown (a table, or JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from playbooks.cli.render import console, render_verdict, verdict_json
from playbooks.conduct.preflight import preflight_host
from playbooks.conduct.settings import Settings


def run_preflight(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    inventory: str | Path = "inventory.yaml",
    settings: Settings | None = None,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    judged = preflight_host(host_name, recipe, settings or Settings(inventory=Path(inventory)))
    if as_json:
        docs = [verdict_json(v) for _, v in judged]
        out.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    else:
        for s, v in judged:
            if len(judged) > 1 and s:
                out.write(f"\n{host_name}: {s.name} (GPU {', '.join(map(str, s.gpus or ()))})\n")
            render_verdict(v, console(out, width=140))
    return 0 if all(v.ok for _, v in judged) else 1
