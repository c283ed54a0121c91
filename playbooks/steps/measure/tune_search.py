"""`invoke tune`'s search (pure): successive halving over the planned candidates, and the
winner with the tie rule. Measuring is a function given to it (the conductor deploys a scratch
server and benches it), so the search itself is tested without a server.

Successive halving: every survivor is measured briefly (rung 0: the bench's fewest requests),
the better half by the objective's figure is measured again longer (rung 1: twice the
requests), and so on, until one or two remain, the rungs run out or the budget does. A
candidate that fails (the server would not start, every request failed) is kept in the table
with its reason and leaves the race.

The winner: the best figure of the last rung each candidate reached, where two candidates
whose 95% intervals do not tell them apart are a tie, and a tie goes to the simpler, safer
configuration (tune_space.simplicity: no speculation, an f16 cache, the larger quant, the
default batch). One noisy run never decides between an f16 and a q8_0 cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from playbooks.steps.measure.bench_stats import distinct
from playbooks.steps.measure.tune_space import Candidate, Objective, Planned, simplicity


@dataclass
class Measured:
    """One candidate measured at one rung."""

    candidate: Candidate
    rung: int
    figure: float | None = None  # the objective's figure: higher is better (latency: negated)
    halfwidth: float | None = None  # its 95% half-width
    level: dict[str, Any] = field(default_factory=dict)  # the bench's level summary
    error: str | None = None
    reused: bool = False  # taken from an earlier run with the same inputs

    @property
    def estimate(self) -> dict[str, Any] | None:
        if self.figure is None:
            return None
        return {"mean": self.figure, "halfwidth": self.halfwidth}


def objective_figure(level: dict[str, Any], objective: Objective) -> tuple[float | None, float | None]:
    """The figure a level is ranked by and its 95% half-width.

    - single: the per-stream decode (the bench's judged figure) at one stream, its interval;
    - aggregate: the aggregate tok/s at as many streams as slots; its interval is the decode's
      relative half-width applied to it (the aggregate is one wall-clock ratio per level);
    - latency: TTFT p95, negated so higher is better, no interval (a percentile of few values).
    """
    decode = level.get("decode") or {}
    mean, hw = decode.get("mean"), decode.get("halfwidth")
    if objective == "single":
        return mean, hw
    if objective == "aggregate":
        agg = level.get("aggregate_tok_s")
        rel = decode.get("rel_halfwidth")
        return agg, (agg * rel if agg is not None and rel is not None else None)
    ttft = level.get("ttft_p95_s")
    return (-ttft if ttft is not None else None), None


def successive_halving(
    planned: Sequence[Planned],
    measure: Callable[[Candidate, int], Measured],
    rungs: int = 3,
    out_of_time: Callable[[], bool] = lambda: False,
) -> tuple[list[Measured], bool]:
    """Every measurement made, in order, and whether the budget ran out first (it is asked
    before every measurement but the first)."""
    alive = [p.candidate for p in planned]
    done: list[Measured] = []
    for rung in range(rungs):
        results: list[Measured] = []
        for c in alive:
            # the first candidate is always measured: a budget shorter than one measurement
            # still reports one figure and a winner, rather than nothing at all
            if (done or results) and out_of_time():
                return done + results, True
            results.append(measure(c, rung))
        done += results
        ranked = sorted(
            (m for m in results if m.error is None and m.figure is not None), key=lambda m: -(m.figure or 0)
        )
        if len(ranked) <= 2 or rung == rungs - 1:
            break
        alive = [m.candidate for m in ranked[: max(2, math.ceil(len(ranked) / 2))]]
    return done, False


def latest(measured: Sequence[Measured]) -> list[Measured]:
    """Each candidate's measurement at the highest rung it reached."""
    best: dict[Candidate, Measured] = {}
    for m in measured:
        if m.candidate not in best or m.rung >= best[m.candidate].rung:
            best[m.candidate] = m
    return list(best.values())


@dataclass(frozen=True)
class Verdict:
    winner: Measured | None
    tied_with: list[Measured]  # the candidates the winner could not be told apart from
    why: str


def choose(measured: Sequence[Measured], planned: Sequence[Planned]) -> Verdict:
    """The winner among the candidates that reached the last rung any reached (a candidate
    dropped early was measured less and is not compared with the finalists' longer runs)."""
    final = [m for m in latest(measured) if m.error is None and m.figure is not None]
    if not final:
        return Verdict(None, [], "no candidate was measured without an error")
    top_rung = max(m.rung for m in final)
    final = [m for m in final if m.rung == top_rung]
    options = {p.candidate: p.option for p in planned}
    best = max(final, key=lambda m: m.figure or 0)
    ties = [m for m in final if m is not best and distinct(m.estimate, best.estimate) is False]
    pool = [best, *ties]
    winner = min(pool, key=lambda m: simplicity(m.candidate, options.get(m.candidate)))
    if winner is best:
        why = "the best measured figure" + (
            f", and the simplest of {len(pool)} that the intervals cannot tell apart" if ties else ""
        )
    else:
        why = (
            f"tied with the best measured ({best.candidate.label()}: the 95% intervals overlap), "
            "and the simpler, safer configuration"
        )
    return Verdict(winner, [m for m in pool if m is not winner], why)
