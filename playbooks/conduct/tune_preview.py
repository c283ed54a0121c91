"""`invoke tune --dry-run`: what a search would measure and about how long it would take,
without a host: the space, the pruning counts, the measuring order and a predicted time.

The order is the run's own (conduct/tune.search_space). The time follows successive halving's
schedule (every survivor at rung 0; the better half, at least two, at each next rung; before each
rung after the first, the last leader again; up to four interleaved blocks of the final two),
each measurement costed from what was measured before where the controller keeps it (the
median time of that rung's measurements on that host, `measurements.jsonl`), else from its
floor (tune_cost.floor_s: the weights read and the rung's requests and warm-up decoded at the
candidate's roofline rate): a lower bound, as a server is never faster than its ceiling and its
start is not in it; the report says which was used.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from playbooks.conduct.tune import TuneOptions, search_space
from playbooks.conduct.tune_store import stored_rows
from playbooks.config.recipe import LoadedRecipe
from playbooks.steps.measure.tune_cost import floor_s
from playbooks.steps.measure.tune_search import promoted
from playbooks.steps.measure.tune_space import Planned, Space


@dataclass(frozen=True)
class Preview:
    space: Space
    schedule: list[int]  # measurements per rung (successive halving, before the budget)
    rung_s: list[float]  # the predicted cost of one measurement at each rung
    basis: list[str]  # per rung: "measured before", or the roofline's lower bound
    predicted_s: float  # the whole search, the interleaving included
    budget_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "space": {"total": self.space.total, "measured": len(self.space.survivors), "pruned": self.space.pruned},
            "order": [
                {"candidate": p.candidate.label(), "predicted_tok_s": round(p.predicted_tok_s, 2)}
                for p in self.space.survivors
            ],
            "schedule": self.schedule,
            "rung_s": [round(x, 1) for x in self.rung_s],
            "basis": self.basis,
            "predicted_s": round(self.predicted_s, 1),
            "budget_s": self.budget_s,
            "fits_budget": self.predicted_s <= self.budget_s,
        }


def halving_schedule(n: int, rungs: int) -> list[int]:
    """How many candidates each rung measures: all at rung 0, then the better half (at least
    two) while more than two are left (tune_search.successive_halving's rule)."""
    out = [n] if n else []
    while out and len(out) < rungs and out[-1] > 2:
        out.append(promoted(out[-1]))
    return out


def stored_rung_costs(store: Path) -> dict[int, float]:
    """The median time of each rung's fresh measurements kept on the controller (rows without
    a time, from before it was kept, are skipped)."""
    took: dict[int, list[float]] = {}
    for row in stored_rows(store):
        if isinstance(row.get("took_s"), (int, float)) and isinstance(row.get("rung"), int):
            took.setdefault(row["rung"], []).append(float(row["took_s"]))
    return {r: statistics.median(v) for r, v in took.items()}


def floor_cost(loaded: LoadedRecipe, planned: list[Planned], objective: str, rung: int) -> float:
    """The mean over the candidates of one measurement's floor at ``rung`` (tune_cost.floor_s:
    the weights read and the rung's requests decoded at the roofline)."""
    g = loaded.recipe.gate
    costs = [floor_s(p, g, objective, rung) for p in planned]  # type: ignore[arg-type]
    return statistics.fmean(costs) if costs else 0.0


def preview(loaded: LoadedRecipe, opts: TuneOptions, store: Path | None = None) -> Preview:
    space = search_space(loaded, opts)
    schedule = halving_schedule(len(space.survivors), opts.rungs)
    kept = stored_rung_costs(store) if store else {}
    rung_s, basis = [], []
    for r in range(len(schedule)):
        if r in kept:
            rung_s.append(kept[r])
            basis.append("measured before")
        else:
            rung_s.append(floor_cost(loaded, space.survivors, opts.objective, r))
            basis.append("the floor: the weights read and the requests decoded at the roofline, a lower bound")
    total = sum(n * c for n, c in zip(schedule, rung_s, strict=True))
    total += sum(rung_s[r - 1] for r in range(1, len(schedule)))  # each rung's reference
    if len(space.survivors) > 1 and rung_s:
        total += 4 * rung_s[-1]  # at most: the two finalists again, A B B A
    return Preview(space, schedule, rung_s, basis, total, opts.budget_s)
