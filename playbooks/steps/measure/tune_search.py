"""`invoke tune`'s search (pure): successive halving over the planned candidates, and the
winner with the tie rule. Measuring is a function given to it (the conductor deploys a scratch
server and benches it), so the search itself is tested without a server.

Successive halving: every survivor is measured briefly (rung 0: the bench's fewest requests),
the better half by the objective's figure is measured again longer (rung 1: twice the
requests), and so on, until one or two remain, the rungs run out or the budget does. A
candidate that fails (the server would not start, every request failed) is kept in the table
with its reason and leaves the race.

The winner: the best figure of the last rung each candidate reached; a candidate the test of
bench_stats.difference cannot tell from the best (Welch's t on the two means, each side's
variance its rounds' standard error plus the between-run noise, alpha 5% over the comparisons
with the best) is tied with it, and a tie goes to the simpler, safer configuration
(tune_space.simplicity: no speculation, an f16 cache, the larger quant, the default batch).
One noisy run never decides between an f16 and a q8_0 cache.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from playbooks.steps.measure.bench_stats import BLOCK_NOISE, RUN_NOISE, RUN_NOISE_DF, distinct, t975
from playbooks.steps.measure.tune_cost import Costs
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
    stdev: float | None = None  # the spread of the figure's observations (rounds)
    n: int | None = None  # how many observations (rounds)
    block: int | None = None  # one of the finalists' interleaved blocks (0, 1), not a rung's measurement
    interleaved: bool = False  # the two blocks of a finalist combined (:func:`combined`)
    reference: bool = False  # the previous rung's leader measured again at its own rung's workload

    @classmethod
    def of_level(
        cls, candidate: Candidate, rung: int, level: dict[str, Any], objective: Objective, reused: bool = False
    ) -> Measured:
        est = objective_figure(level, objective) or {}
        return cls(
            candidate,
            rung,
            est.get("mean"),
            est.get("halfwidth"),
            level,
            level.get("error"),
            reused,
            est.get("stdev"),
            est.get("n"),
        )

    @property
    def estimate(self) -> dict[str, Any] | None:
        if self.figure is None:
            return None
        return {"mean": self.figure, "halfwidth": self.halfwidth, "stdev": self.stdev, "n": self.n}


def objective_figure(level: dict[str, Any], objective: Objective) -> dict[str, Any] | None:
    """The figure a level is ranked by, as an estimate over the level's rounds (mean, stdev, n,
    95% half-width; bench_stats: a round is the unit of replication), higher is better:

    - single: the judged per-stream decode (``decode``);
    - aggregate: the aggregate tok/s at as many streams as slots (``aggregate``: each round's
      tokens over its wall time);
    - latency: the slowest stream's TTFT per round (``ttft_worst``), negated.

    A level stored before rounds were the unit has no ``aggregate`` or ``ttft_worst``: its
    aggregate and TTFT p95 come without an interval (and so tie with nothing)."""
    if objective == "single":
        decode = level.get("decode")
        return dict(decode) if decode and decode.get("mean") is not None else None
    if objective == "aggregate":
        agg = level.get("aggregate")
        if agg and agg.get("mean") is not None:
            return dict(agg)
        old = level.get("aggregate_tok_s")
        return None if old is None else {"mean": old, "halfwidth": None}
    worst = level.get("ttft_worst")
    if worst and worst.get("mean") is not None:
        return {**worst, "mean": -float(worst["mean"])}
    ttft = level.get("ttft_p95_s")
    return None if ttft is None else {"mean": -ttft, "halfwidth": None}


@dataclass
class Budget:
    """The search's clock: ``total_s`` from :meth:`start`, and the cost model
    (tune_cost.Costs) that predicts each measurement before it starts and learns from each
    fresh one. A measurement starts only when its predicted cost fits what is left; the first
    one's prediction is a floor and `invoke tune` refuses a budget below it before the search
    (:meth:`refusal`).

    The bound: the search ends within ``total_s`` plus one measurement's length. Each
    measurement starts with its prediction inside what is left, so the search passes the budget
    only by how far its last measurement outlasted its prediction, which is less than that
    measurement's whole length. When the budget stops the search, every candidate it did not
    reach is listed with its prediction (``skipped``), and whether a later rung or the
    finalists' interleaving was left out (``cut``)."""

    total_s: float
    costs: Costs
    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    took: list[float] = field(default_factory=list)
    skipped: list[tuple[Candidate, int, float, float]] = field(default_factory=list)  # (c, rung, predicted, left)
    cut: list[str] = field(default_factory=list)  # what else the budget left out

    def start(self) -> None:
        self.started = self.clock()

    def used(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    def left(self) -> float:
        return self.total_s - self.used()

    def record(self, c: Candidate, rung: int, seconds: float) -> None:
        self.took.append(seconds)
        self.costs.record(c, rung, seconds)

    def predict(self, c: Candidate, rung: int) -> float:
        return self.costs.predict(c, rung)

    def refusal(self, first: Candidate) -> str | None:
        """Why the budget cannot hold even the first measurement (its floor), or None."""
        floor = self.predict(first, 0)
        if floor <= self.total_s:
            return None
        return (
            f"a budget of {self.total_s:.0f} s cannot hold even the first measurement: its floor is {floor:.0f} s "
            f"(its weights read and its requests decoded at the roofline); give --budget {math.ceil(floor)}s or more"
        )

    def admits(self, c: Candidate, rung: int) -> bool:
        """Whether the candidate's predicted cost fits what is left; a refusal is kept in
        ``skipped``."""
        left, cost = self.left(), self.predict(c, rung)
        if left > 0 and cost <= left:
            return True
        self.skipped.append((c, rung, cost, max(left, 0.0)))
        return False

    def stop(self, rest: Sequence[Candidate], rung: int, later: str | None) -> None:
        """The search stops at ``rung``: the candidates it did not reach there, and what
        came after (``later``: the rungs or the interleaving not run), listed."""
        left = max(self.left(), 0.0)
        self.skipped += [(c, rung, self.predict(c, rung), left) for c in rest]
        if later:
            self.cut.append(later)

    def as_dict(self) -> dict[str, Any]:
        return {
            "planned_s": round(self.total_s, 1),
            "used_s": round(self.used(), 1),
            "longest_s": round(max(self.took, default=0.0), 1),
            "skipped": [
                {"candidate": c.label(), "rung": r, "predicted_s": round(p, 1), "left_s": round(left, 1)}
                for c, r, p, left in self.skipped
            ],
            "cut": list(self.cut),
        }


def promoted(n: int) -> int:
    """How many of a rung's ``n`` ranked candidates go on to the next: the better half, and at
    least two (tune --dry-run's schedule uses the same rule)."""
    return max(2, math.ceil(n / 2))


def successive_halving(
    planned: Sequence[Planned],
    measure: Callable[[Candidate, int], Measured],
    rungs: int = 3,
    budget: Budget | None = None,
    reference: Callable[[Candidate, int], Measured] | None = None,
) -> tuple[list[Measured], bool]:
    """Every measurement made, in order, and whether the budget stopped the search first: each
    measurement is made only when the budget admits its predicted cost (:class:`Budget`: a
    budget below the first one's floor is refused before the search); each fresh
    measurement's time corrects the predictions after it.

    ``reference``: before each rung after the first, the previous rung's leader is measured
    again at that rung's workload (``reference(c, rung)``, marked ``reference``), so the drift
    between rungs is seen (:func:`rung_drift`); the verdict never reads it."""
    alive = [p.candidate for p in planned]
    done: list[Measured] = []

    def timed(fn: Callable[[Candidate, int], Measured], c: Candidate, rung: int) -> Measured:
        t0 = budget.clock() if budget else 0.0
        m = fn(c, rung)
        if budget is not None and not m.reused:
            budget.record(c, rung, budget.clock() - t0)
        return m

    def stopped(rest: Sequence[Candidate], rung: int) -> tuple[list[Measured], bool]:
        if budget is not None:
            later = f"the rungs after rung {rung}, " if rung < rungs - 1 else ""
            budget.stop(rest, rung, f"{later}the finalists' interleaving (where the search would have reached them)")
        return done, True

    leader: Measured | None = None
    for rung in range(rungs):
        # a leader kept from an earlier run has no fresh figure to repeat: no reference then
        if reference is not None and leader is not None and not leader.reused:
            if budget is not None and not budget.admits(leader.candidate, rung - 1):
                return stopped(alive, rung)
            done.append(replace(timed(reference, leader.candidate, rung - 1), reference=True))
        results: list[Measured] = []
        for i, c in enumerate(alive):
            if budget is not None and not budget.admits(c, rung):
                return stopped(alive[i + 1 :], rung)
            m = timed(measure, c, rung)
            results.append(m)
            done.append(m)
        ranked = sorted(
            (m for m in results if m.error is None and m.figure is not None), key=lambda m: -(m.figure or 0)
        )
        if len(ranked) <= 2 or rung == rungs - 1:
            break
        leader = ranked[0]
        alive = [m.candidate for m in ranked[: promoted(len(ranked))]]
    return done, False


def rung_drift(measured: Sequence[Measured]) -> list[dict[str, Any]]:
    """Each reference against the measurement it repeats (same candidate, rung and workload,
    made a rung earlier): how far the machine moved between rungs, which the figures of
    different rungs carry and the verdict (last rung only) does not."""
    out: list[dict[str, Any]] = []
    for ref in measured:
        if not ref.reference or ref.figure is None:
            continue
        first = next(
            (
                m
                for m in measured
                if m.candidate == ref.candidate and m.rung == ref.rung and not m.reference and m.block is None
            ),
            None,
        )
        if first is None or not first.figure:
            continue
        out.append(
            {
                "candidate": ref.candidate.label(),
                "rung": ref.rung,
                "first": first.figure,
                "again": ref.figure,
                "moved_pct": round((ref.figure / first.figure - 1) * 100, 2),
            }
        )
    return out


def pair_noise(a: Measured, b: Measured, run_noise: float = RUN_NOISE, block_noise: float = BLOCK_NOISE) -> float:
    """The between-run noise a comparison of two figures carries: RUN_NOISE for figures measured
    apart; for two finalists measured interleaved (A B B A) the drift's straight line cancels in
    each one's mean of two blocks, and what is left is each block's own run effect
    (BLOCK_NOISE), halved in variance by the two blocks."""
    if a.interleaved and b.interleaved:
        return block_noise / math.sqrt(2)
    return run_noise


def contenders(
    measured: Sequence[Measured], run_noise: float = RUN_NOISE, noise_df: int = RUN_NOISE_DF
) -> tuple[Candidate, Candidate] | None:
    """The last rung's best and the nearest candidate the test (figures measured apart) cannot
    tell from it: the two measured again interleaved, so the decision between them rests on
    figures of one time window. None when the best stands alone. ``run_noise``: the host's
    between-run noise (the recipe's gate.run_noise where it gives one), with the degrees of
    freedom it rests on."""
    final = [m for m in latest(measured) if m.error is None and m.figure is not None]
    if len(final) < 2:
        return None
    top = max(m.rung for m in final)
    final = [m for m in final if m.rung == top]
    best = max(final, key=lambda m: m.figure or 0)
    tied = [
        m
        for m in final
        if m is not best and distinct(m.estimate, best.estimate, run_noise, len(final) - 1, noise_df) is False
    ]
    if not tied:
        return None
    return best.candidate, max(tied, key=lambda m: m.figure or 0).candidate


def interleave(
    pair: tuple[Candidate, Candidate],
    measure_block: Callable[[Candidate, int], Measured],
    budget: Budget | None = None,
    rung: int = 0,
) -> list[Measured]:
    """The two contenders measured A B B A (a straight-line drift cancels in each one's mean of
    its two blocks); stops where the budget does not admit the next block."""
    a, b = pair
    blocks: list[Measured] = []
    for c, i in ((a, 0), (b, 0), (b, 1), (a, 1)):
        if budget is not None and not budget.admits(c, rung):
            budget.stop([], rung, f"the finalists' interleaved blocks {len(blocks) + 1}-4 of 4")
            break
        t0 = budget.clock() if budget else 0.0
        m = measure_block(c, i)
        if budget is not None and not m.reused:
            budget.record(c, rung, budget.clock() - t0)
        blocks.append(m)
    return blocks


def combined(blocks: Sequence[Measured]) -> Measured | None:
    """A candidate's two interleaved blocks as one figure: the mean of the two block means, its
    standard error sqrt(se0^2 + se1^2) / 2 (carried as stdev over the pooled rounds); None when
    a block is missing or failed."""
    ok = [m for m in blocks if m.error is None and m.figure is not None and m.stdev is not None and m.n]
    if len(ok) != 2:
        return None
    b0, b1 = sorted(ok, key=lambda m: m.block or 0)
    n = int(b0.n or 0) + int(b1.n or 0)
    se = math.sqrt((b0.stdev or 0) ** 2 / int(b0.n or 1) + (b1.stdev or 0) ** 2 / int(b1.n or 1)) / 2
    figure = ((b0.figure or 0) + (b1.figure or 0)) / 2
    # the t of the pooled rounds' degrees of freedom (each block's n - 1), as bench_stats' estimate
    halfwidth = t975(n - 2) * se if n > 2 else None
    level = dict(b1.level) | {"blocks": [b0.level, b1.level]}
    return Measured(
        b0.candidate,
        b0.rung,
        figure,
        halfwidth,
        level,
        None,
        b0.reused and b1.reused,
        se * math.sqrt(n),
        n,
        None,
        True,
    )


def drift(blocks: Sequence[Measured]) -> float | None:
    """How far the figures moved across the interleaved window: the mean over the contenders of
    block 1 over block 0, less one."""
    moves = []
    for c in {m.candidate for m in blocks}:
        pair = sorted((m for m in blocks if m.candidate == c and m.figure), key=lambda m: m.block or 0)
        if len(pair) == 2 and pair[0].figure:
            moves.append((pair[1].figure or 0) / pair[0].figure - 1)
    return statistics.fmean(moves) if moves else None


def latest(measured: Sequence[Measured]) -> list[Measured]:
    """Each candidate's measurement at the highest rung it reached (an interleaved finalist's
    combined figure over its rung's; the raw blocks and the rung references are not rung
    measurements)."""
    best: dict[Candidate, Measured] = {}
    for m in measured:
        if m.block is not None or m.reference:
            continue
        if m.candidate not in best or m.rung >= best[m.candidate].rung:
            best[m.candidate] = m
    return list(best.values())


@dataclass(frozen=True)
class Verdict:
    winner: Measured | None
    tied_with: list[Measured]  # the candidates the winner could not be told apart from
    why: str


def choose(
    measured: Sequence[Measured],
    planned: Sequence[Planned],
    run_noise: float = RUN_NOISE,
    block_noise: float = BLOCK_NOISE,
    noise_df: int = RUN_NOISE_DF,
) -> Verdict:
    """The winner among the candidates that reached the last rung any reached (a candidate
    dropped early was measured less and is not compared with the finalists' longer runs);
    ``run_noise``/``block_noise``: the host's (the recipe's gate.run_noise where it gives one),
    with the degrees of freedom ``noise_df`` they rest on."""
    final = [m for m in latest(measured) if m.error is None and m.figure is not None]
    if not final:
        return Verdict(None, [], "no candidate was measured without an error")
    top_rung = max(m.rung for m in final)
    final = [m for m in final if m.rung == top_rung]
    options = {p.candidate: p.option for p in planned}
    best = max(final, key=lambda m: m.figure or 0)
    # the best against each other finalist: the family's false-change rate held at ALPHA
    others = len(final) - 1
    ties = [
        m
        for m in final
        if m is not best
        and distinct(m.estimate, best.estimate, pair_noise(m, best, run_noise, block_noise), others, noise_df) is False
    ]
    pool = [best, *ties]
    winner = min(pool, key=lambda m: simplicity(m.candidate, options.get(m.candidate)))
    if winner is best:
        why = "the best measured figure" + (
            f", and the simplest of {len(pool)} that the intervals cannot tell apart" if ties else ""
        )
    else:
        why = (
            f"tied with the best measured ({best.candidate.label()}: the difference is within the noise), "
            "and the simpler, safer configuration"
        )
    return Verdict(winner, [m for m in pool if m is not winner], why)
