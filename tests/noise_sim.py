"""A drifting, noisy machine, simulated from the measured data set (reports/bench/noise.json), and
the bench's comparison rules run on it: how often each calls an unchanged server changed, and
how often each flags a real change. Shared by tests/test_bench_method.py (few trials, seeded) and
scripts/bench_method.py (many, the published figures).

The machine: a run's true mean is the server's rate times (1 + drift x the run's place in the
series + a run effect drawn with sd ``run_sd``); its rounds are drawn around that with sd
``round_sd``; the bench's own stopping rule (bench_stats.settled: MIN_ROUNDS to ``cap``
rounds, until the half-width is within ``target``) decides how many rounds a run gets.

The rules:
- old: |a - b| > hypot(half-widths) (bench_stats.distinct before issue 34), each pair alone;
- new: bench_stats.distinct with RUN_NOISE, Bonferroni over the pairs compared together.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from playbooks.steps.measure import bench_stats


@dataclass(frozen=True)
class Machine:
    run_sd: float  # relative sd of a run's mean (the run effect)
    round_sd: float  # relative sd of one round around its run's mean
    drift: float = 0.0  # relative change of the true rate per run, in the order runs are made
    target: float = 0.02
    cap: int = 16


def run(rng: random.Random, m: Machine, rate: float, index: int) -> dict[str, Any]:
    """One bench run of a server whose true rate is ``rate``: the estimate as the bench stores it."""
    level = rate * (1 + m.drift * index + rng.gauss(0.0, m.run_sd))
    values: list[float] = []
    while True:
        values.append(rng.gauss(level, m.round_sd * rate))
        est = bench_stats.estimate(values)
        if bench_stats.settled(est, bench_stats.MIN_ROUNDS, m.cap, m.target):
            assert est is not None
            return est.as_dict(6)


def old_distinct(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return abs(a["mean"] - b["mean"]) > math.hypot(a["halfwidth"], b["halfwidth"])


def new_distinct(a: dict[str, Any], b: dict[str, Any], comparisons: int = 1) -> bool:
    return bool(bench_stats.distinct(a, b, comparisons=comparisons))


def compare_rates(m: Machine, trials: int, runs: int = 4, change: float = 0.0, seed: int = 1) -> dict[str, float]:
    """``runs`` runs made one after another; the last has its rate raised by ``change``. With no
    change: the share of trials in which any pair is called changed (the family-wise false-change
    rate of a compare over those runs). With a change: the share in which the changed run is told
    from the one before it (the power)."""
    rng = random.Random(seed)
    old = new = 0
    pairs = runs * (runs - 1) // 2
    for _ in range(trials):
        made = [run(rng, m, 100.0 * (1 + (change if i == runs - 1 else 0.0)), i) for i in range(runs)]
        if change:
            old += old_distinct(made[-2], made[-1])
            new += new_distinct(made[-2], made[-1])
        else:
            old += any(old_distinct(a, b) for a, b in itertools.combinations(made, 2))
            new += any(new_distinct(a, b, comparisons=pairs) for a, b in itertools.combinations(made, 2))
    return {"old": old / trials, "new": new / trials}


def tune_rates(m: Machine, trials: int, candidates: int = 4, better: float = 0.0, seed: int = 2) -> dict[str, float]:
    """A last rung of ``candidates`` measured one after another, the first the simplest. All equal
    (``better`` 0): the share of trials in which a rule names a winner other than the simplest
    (the wrong, needless change). One of them (the last measured) ``better`` faster: the share
    in which the rule names it, or ties it with the winner (not wrong)."""
    rng = random.Random(seed)
    wrong = {"old": 0, "new": 0}
    for _ in range(trials):
        rates = [100.0] * candidates
        if better:
            rates[-1] *= 1 + better
        made = [run(rng, m, r, i) for i, r in enumerate(rates)]
        best = max(range(candidates), key=lambda i: made[i]["mean"])
        for rule in ("old", "new"):
            tied = [
                i
                for i in range(candidates)
                if i == best
                or not (
                    old_distinct(made[i], made[best])
                    if rule == "old"
                    else new_distinct(made[i], made[best], comparisons=candidates - 1)
                )
            ]
            winner = min(tied)  # the simplest of those tied with the best
            if better:
                wrong[rule] += (candidates - 1) not in tied
            else:
                wrong[rule] += winner != 0
    return {k: v / trials for k, v in wrong.items()}


def machine_from_noise(noise: dict[str, Any], which: str = "busy", level: str = "1") -> Machine:
    """The machine of a measured set (reports/bench/noise.json ``extra.sets``): the run effect
    by the method of moments (variance of the run means less their mean squared standard
    error) after the drift's straight line is taken out, the rounds' spread and the drift."""
    decodes = [r["levels"][level]["decode"] for r in noise["extra"]["sets"][which]]
    means = [float(d["mean"]) for d in decodes]
    grand = sum(means) / len(means)
    k = len(means)
    xbar = (k - 1) / 2
    slope = sum((i - xbar) * (y - grand) for i, y in enumerate(means)) / sum((i - xbar) ** 2 for i in range(k))
    resid = [y - (grand + slope * (i - xbar)) for i, y in enumerate(means)]
    se2 = sum(float(d["stdev"]) ** 2 / int(d["n"]) for d in decodes) / k
    between = max(0.0, sum(r * r for r in resid) / (k - 2) - se2)
    round_sd = math.sqrt(sum(float(d["stdev"]) ** 2 for d in decodes) / k)
    return Machine(run_sd=math.sqrt(between) / grand, round_sd=round_sd / grand, drift=slope / grand)


def _history_line(at: int, sha: str, decode: dict[str, Any]) -> dict[str, Any]:
    level = {"concurrency": 1, "aggregate_tok_s": decode["mean"], "decode": {**decode, "source": "client"}}
    return {"at": f"t{at:04d}", "host": "box", "recipe": "r", "recipe_sha256": sha, "build": "b", "levels": [level]}


def compare_verdicts(
    m: Machine, trials: int, noise_runs: int = 4, change: float = 0.30, pool_runs: int = 8, seed: int = 3
) -> dict[str, float]:
    """`bench --compare` as scripts/bench_proof.py uses it, through the product's own code
    (bench_noise.host_noise, bench_compare.compare): ``noise_runs`` runs of an unchanged server
    (`bench --noise`), one more compared with them (unchanged: any of its two verdicts called
    changed is a false change), then the recipe changed so the rate moves by ``change`` and
    compared (called changed against the last configuration: the power). ``pool_runs`` 1 is
    the last run alone as the reference."""
    rng = random.Random(seed)
    false = power = 0
    for _ in range(trials):
        history = [_history_line(i, "a", run(rng, m, 100.0, i)) for i in range(noise_runs)]
        row = _compared(rng, m, history, "a", 100.0, pool_runs)
        false += bool(row["last"]["decode_outside_noise"] or row["best"]["decode_outside_noise"])
        row = _compared(rng, m, history, "b", 100.0 * (1 + change), pool_runs)
        power += bool(row["last"]["decode_outside_noise"])
    return {"false": false / trials, "power": power / trials}


def _compared(
    rng: random.Random, m: Machine, history: list[dict[str, Any]], sha: str, rate: float, pool_runs: int
) -> dict[str, Any]:
    """One more run of recipe ``sha`` compared with ``history`` (then appended to it), as
    `bench --compare` makes it: the host's noise from the history before it."""
    from playbooks.steps.measure import bench_compare, bench_noise

    line = _history_line(len(history), sha, run(rng, m, rate, len(history)))
    noise = bench_noise.host_noise(history)
    result = line | {"workload": {}, "host_noise": noise.as_dict() if noise else None}
    [row] = bench_compare.compare(result, history, pool_runs)
    history.append(line)
    return row
