"""Two configurations measured in one run, their rounds interleaved, each block on a fresh
process, and the change between them judged from the cycles (pure).

Why: two bench runs minutes apart differ by more than either run's interval says (a run effect:
bench_stats, bench_noise); on a shared VM that effect is 6-16% between runs and moves in modes
that last minutes, so two runs tell apart only changes several times that size. Measured in one
window, A and B share the window's mode and drift, and only what differs between them is left.
One more effect is left that one window cannot see: a server process keeps its own speed for its
whole life (measured: one deployed process 27% below two others of the same recipe, each steady
within 15% over seven runs: reports/bench/process-effect.json). So the unit replicated is the
process: every cycle starts its own.

The design: CYCLES cycles of four blocks in the order A B B A (a block: at every concurrency
level, rounds of one request per stream, at least BLOCK_REQUESTS requests), so a drift that is
linear over a cycle falls equally on both sides, and each side follows the other as often as
itself. Every block runs on a process started for it: four processes a cycle. (Until 2026-12-06
the middle B B shared one process: B's second block then ran on a process one block warmer than
any of A's, an edge the design handed one side only; the proof at 72a4d43 called one unchanged
level of 18 changed, +3.4% for B at t 4.6, reports/bench/proof.json.) Per cycle and level one
observation: the log of B's mean over A's mean across its blocks. The change is exp(mean) - 1,
judged by a one-sample t test on the cycles' logs (cycles - 1 degrees of freedom), at 5% over the
levels of one run (Bonferroni: a run calls an unchanged pair changed at any level at most 5% of
the time). No host noise figure enters: the cycles carry their own spread, processes' included,
which is the point.

A change is called only when its whole interval lies beyond MARGIN (2%) either way: an interval
that excludes 0 but not +-2% says "no change of 2% or more shown". Two identical recipes are
never served quite alike here (two unit names, two ports, two processes' memory), and a run of
32 processes resolves a difference of about 1% (the proof's unchanged pairs: se 0.7% at two
streams), so without a margin a real but immaterial 1-3% would be called a change. The margin is
what asv's `compare` does with its factor (1.1 by default); 2% is a fifth of the smallest change
this design was built to call (10%, tests/test_paired.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from playbooks.steps.measure.bench_stats import ALPHA, POWER, t_quantile

#: one cycle's blocks: each side as often first as second, each after the other as often as after itself
ORDER = ("a", "b", "b", "a")
#: cycles per level: 8 give 7 degrees of freedom (t over three levels 3.13, where 6 cycles' is
#: 3.53: with the se's sqrt(6/8), a 23% smaller change resolved). The proof's Q6_K change (10-16%
#: here) was called in 2 of 3 runs at 6 cycles (reports/bench/proof.json at f42cf28); a run is
#: a third longer, about 4 minutes on this machine
CYCLES = 8
#: the least change called, either way: a change is "changed" only when its interval lies wholly
#: beyond it (the module's docstring says why)
MARGIN = 0.02
#: the fewest requests a block holds at a level: single requests at one stream move from one to
#: the next by several percent here, and four halve a block's share of that
BLOCK_REQUESTS = 4


def rounds_per_block(concurrency: int) -> int:
    """Whole rounds of ``concurrency`` streams making at least BLOCK_REQUESTS requests."""
    return max(1, math.ceil(BLOCK_REQUESTS / max(1, concurrency)))


def schedule(cycles: int = CYCLES) -> list[tuple[int, str, int]]:
    """The run order: (cycle, side, the side's block within the cycle: 0 or 1) per block. The
    same block index on both sides gets the same prompts, so both sides answer the same requests."""
    out = []
    for cycle in range(cycles):
        seen = {"a": 0, "b": 0}
        for side in ORDER:
            out.append((cycle, side, seen[side]))
            seen[side] += 1
    return out


@dataclass(frozen=True)
class PairedChange:
    """B against A at one level: the relative change, its interval and the verdict."""

    change: float  # exp(mean of the cycles' log ratios) - 1
    low: float  # the interval at the family's coverage, as relative changes
    high: float
    cycles: int
    se: float  # of the mean log ratio
    comparisons: int
    detectable: float  # the smallest rise called with probability POWER, relative
    margin: float = MARGIN  # the least change called, relative

    @property
    def distinct(self) -> bool:
        """Changed: the whole interval beyond the margin, either way (in logs, so symmetric)."""
        edge = math.log1p(self.margin)
        return math.log1p(self.low) > edge or math.log1p(self.high) < -edge

    def as_dict(self) -> dict[str, Any]:
        return {
            "change": round(self.change, 5),
            "low": round(self.low, 5),
            "high": round(self.high, 5),
            "cycles": self.cycles,
            "df": self.cycles - 1,
            "se_log": round(self.se, 6),
            "comparisons": self.comparisons,
            "detectable": round(self.detectable, 5),
            "margin": self.margin,
            "distinct": self.distinct,
        }


def cycle_logs(blocks: Sequence[tuple[int, str, float | None]]) -> list[float]:
    """Per cycle, ln(B's mean / A's mean) over its blocks ((cycle, side, figure) in run order); a
    cycle missing a side's figure (a failed round) is left out whole."""
    by_cycle: dict[int, dict[str, list[float]]] = {}
    for cycle, side, figure in blocks:
        sides = by_cycle.setdefault(cycle, {"a": [], "b": [], "bad": []})
        if figure is None or figure <= 0:
            sides["bad"].append(0.0)
        else:
            sides[side].append(figure)
    return [
        math.log(statistics.fmean(s["b"]) / statistics.fmean(s["a"]))
        for _, s in sorted(by_cycle.items())
        if s["a"] and s["b"] and not s["bad"]
    ]


def paired_change(
    blocks: Sequence[tuple[int, str, float | None]],
    comparisons: int = 1,
    alpha: float = ALPHA,
    power: float = POWER,
    margin: float = MARGIN,
) -> PairedChange | None:
    """The change of B against A from interleaved blocks (:func:`cycle_logs`), tested at
    ``alpha`` over ``comparisons`` (Bonferroni) beyond ``margin``; None with fewer than two
    whole cycles."""
    logs = cycle_logs(blocks)
    n = len(logs)
    if n < 2:
        return None
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(n)
    t = t_quantile(1 - alpha / max(1, comparisons), n - 1)
    t_beta = t_quantile(2 * power - 1, n - 1)  # the one-sided quantile at `power`
    return PairedChange(
        change=math.exp(mean) - 1,
        low=math.exp(mean - t * se) - 1,
        high=math.exp(mean + t * se) - 1,
        cycles=n,
        se=se,
        comparisons=comparisons,
        detectable=math.exp(math.log1p(margin) + (t + t_beta) * se) - 1,
        margin=margin,
    )


def verdict_text(concurrency: int, p: PairedChange | None) -> str:
    """One line per level, in the words `--compare` uses."""
    if p is None:
        return f"concurrency {concurrency}: per-stream decode: too few whole cycles to judge"
    family = f"{p.comparisons} level{'s' if p.comparisons != 1 else ''}"
    change = f"{p.change * 100:+.1f}% (95% over {family}: {p.low * 100:+.1f}% to {p.high * 100:+.1f}%)"
    if p.distinct:
        return (
            f"concurrency {concurrency}: per-stream decode {change} against the deployed recipe, "
            f"outside the noise and beyond {p.margin * 100:.0f}%: changed"
        )
    return (
        f"concurrency {concurrency}: per-stream decode {change} against the deployed recipe, within the noise "
        f"or {p.margin * 100:.0f}%: no change of {p.margin * 100:.0f}% or more shown (a change of "
        f"{p.detectable * 100:.1f}% or more would show {POWER * 100:.0f}% of the time)"
    )
