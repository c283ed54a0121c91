"""`invoke preflight`'s run: connect once, gather the host's facts, judge them against each
recipe the host serves (steps/preflight.py). The CLI shows the verdicts (cli/preflight.py)."""

from __future__ import annotations

from playbooks.conduct.placements import Served, host_serves
from playbooks.conduct.settings import Settings
from playbooks.steps.preflight import Verdict, gather, judge, rpc_endpoints


def preflight_host(host_name: str, recipe: str | None, settings: Settings) -> list[tuple[Served | None, Verdict]]:
    """One verdict per recipe of the host's layout (the named recipe's, else the inventory's);
    the host's facts alone, judged against no recipe, when none is named."""
    spec = settings.host_spec(host_name)
    served: list[Served | None] = list(host_serves(spec, recipe, settings.load_recipe)) or [None]
    model_dir = f"{spec.prefix}/models"
    endpoints = [e for s in served if s for e in rpc_endpoints(s.loaded)]
    with settings.connect(spec) as host:
        facts = gather(host, spec.prefix, model_dir, list(dict.fromkeys(endpoints)))
    layout = bool(spec.serve)
    return [
        (s, judge(facts, s.loaded if s else None, model_dir, spec.prefix, spec.gpu, s.gpus if s and layout else None))
        for s in served
    ]
