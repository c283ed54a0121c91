"""What one measurement of `invoke tune` costs, predicted before it starts (pure).

A candidate's cost is its own plan's: the scratch deploy reads its artifact (the weights at
LOAD_BYTES_S, a fast read: the page cache or an NVMe disk) and the rung's requests decode
``max_tokens`` each at the candidate's roofline rate (the single-stream roofline times the
streams, or the aggregate roofline). Both parts are floors: nothing loads or decodes faster
than that, and the warm-up, prompt processing, HTTP and the server's start are not in them.

So the first prediction is a floor: a budget below the first measurement's floor cannot hold
even that one, and `invoke tune` refuses it up front with the figure it needs. Each fresh
measurement then corrects the predictions after it: its time over its floor is a factor, the
candidate's own last one for its later rungs, and the median of all so far for a candidate not
yet measured (the others ran the same deploy and client on the same host).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from playbooks.config.recipe import Gate
from playbooks.steps.measure.tune_space import Candidate, Objective, Planned

#: the artifact's read rate the floor assumes (bytes/s): a fast disk or the page cache; a slower
#: disk only makes the real deploy longer, which the first correction takes in
LOAD_BYTES_S = 2.0e9


def requests_for(rung: int, concurrency: int) -> int:
    """The fewest requests a level runs at ``rung`` (conduct/tune_candidates.rung_gate's rule:
    rung 0 the fewest, each rung twice the last; a level may run up to four times as many)."""
    return max(2 * concurrency, 4) * 2**rung


def streams_for(objective: Objective, c: Candidate) -> int:
    """One stream for the single-stream objective; every slot busy for the others."""
    return 1 if objective == "single" else c.parallel


def floor_s(p: Planned, g: Gate, objective: Objective, rung: int) -> float:
    """The least one measurement of ``p`` at ``rung`` can take: its artifact read, and its
    rung's requests (and the warm-up's) decoded at its roofline rate."""
    conc = streams_for(objective, p.candidate)
    rate = p.predicted_tok_s if objective == "aggregate" else p.single_tok_s * conc
    tokens = (requests_for(rung, conc) + conc) * g.max_tokens  # and the warm-up round
    decode = tokens / rate if rate > 0 else 0.0
    return p.option.weights_bytes / LOAD_BYTES_S + decode


@dataclass
class Costs:
    """Each candidate's predicted cost: its floor (:func:`floor_s`) times the factor measured
    so far (its own last, else the median of all, else 1: the floor itself)."""

    floor: Callable[[Candidate, int], float]
    factors: dict[Candidate, float] = field(default_factory=dict)
    history: list[float] = field(default_factory=list)

    def predict(self, c: Candidate, rung: int) -> float:
        return self.floor(c, rung) * self.factor(c)

    def factor(self, c: Candidate) -> float:
        if c in self.factors:
            return self.factors[c]
        return statistics.median(self.history) if self.history else 1.0

    def record(self, c: Candidate, rung: int, seconds: float) -> None:
        floor = self.floor(c, rung)
        if floor > 0:
            self.factors[c] = seconds / floor
            self.history.append(seconds / floor)


def plan_costs(planned: list[Planned], g: Gate, objective: Objective) -> Costs:
    """The cost model of one search over ``planned``."""
    by = {p.candidate: p for p in planned}
    return Costs(lambda c, rung: floor_s(by[c], g, objective, rung))
