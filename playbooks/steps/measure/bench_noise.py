"""A host's run-to-run noise, pooled from its own bench history (pure).

Why per host: how far an unchanged server's figure moves between runs is the machine's fact,
not the tool's. The 9% measured once on a shared 2-core VM (bench_stats.RUN_NOISE) is far
too wide for a dedicated V100 box and may be too narrow for a busy one; borrowed, it makes
`bench --compare` blind to real changes on a quiet host and credulous on a loud one.

The figure: runs of one host with the same recipe (its sha256) and the same build are
unchanged runs of one server configuration. Within such a group a run's mean per-stream
decode is the server's true rate times a run effect of relative standard deviation sigma, plus
its own sampling error (bench_stats' model), so the spread of the group's means, relative to
their mean, is sigma^2 plus the runs' own squared relative standard errors on average; sigma^2
is that difference, per level, averaged over the levels, and pooled over the groups weighted by
their degrees of freedom (runs - 1; the levels of one run are one run, not several). A host
has a figure once those degrees of freedom reach MIN_DF; `invoke bench --noise N` runs the
unchanged server N times to get there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from playbooks.steps.measure.bench_stats import BLOCK_NOISE, RUN_NOISE, RUN_NOISE_DF

#: the fewest degrees of freedom a host's figure rests on (four unchanged runs of one server)
MIN_DF = 3
#: what `invoke bench --noise` runs by default: a figure in one go, and on enough degrees of
#: freedom (5) that a compare resolves a 30% change where runs move by 3.6% (this VM's, the
#: proof's): simulated through the compare itself, called 95% of the time after six runs and
#: 77% after four (the t quantile at 3 degrees of freedom is the price; tests/test_bench_noise.py)
NOISE_RUNS = 6


@dataclass(frozen=True)
class HostNoise:
    """A host's run-to-run noise: ``rsd`` (relative standard deviation of a run's mean) with
    its degrees of freedom, from ``runs`` runs in ``groups`` unchanged configurations, the
    oldest and newest of them."""

    rsd: float
    df: int
    runs: int
    groups: int
    oldest: str | None
    newest: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"rsd": round(self.rsd, 4)}


def _decode(level: dict[str, Any]) -> tuple[float, float] | None:
    """(mean, squared standard error) of a history level's per-stream decode, or None."""
    d = level.get("decode") or {}
    mean, sd, n = d.get("mean"), d.get("stdev"), d.get("n")
    if not isinstance(mean, (int, float)) or mean <= 0 or not isinstance(sd, (int, float)) or not n or int(n) < 2:
        return None
    return float(mean), float(sd) ** 2 / int(n)


def _group_variance(runs: list[dict[str, Any]]) -> float | None:
    """sigma^2 of one group of unchanged runs: per level, the variance of the runs' relative
    means less their mean relative squared standard error; averaged over the levels."""
    by_level: dict[Any, list[tuple[float, float]]] = {}
    for run in runs:
        for level in run.get("levels") or []:
            found = _decode(level)
            if found:
                by_level.setdefault(level.get("concurrency"), []).append(found)
    per_level = []
    for seen in by_level.values():
        if len(seen) < 2:
            continue
        centre = statistics.fmean(m for m, _ in seen)
        spread = statistics.variance([m / centre for m, _ in seen])
        own = statistics.fmean(se2 for _, se2 in seen) / centre**2
        per_level.append(spread - own)
    return statistics.fmean(per_level) if per_level else None


def host_noise(history: Iterable[dict[str, Any]]) -> HostNoise | None:
    """The pooled figure of one host's history lines (bench_report.read_history(path, host)),
    or None when no group has two runs with intervals. Below MIN_DF degrees of freedom it is
    returned all the same: the caller says it is not enough (:func:`usable`)."""
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for run in history:
        if not any(_decode(level) for level in run.get("levels") or []):
            continue  # a line from before the repeats: no interval to weigh it by
        groups.setdefault((run.get("recipe"), run.get("recipe_sha256"), run.get("build")), []).append(run)
    weighted, df, runs, used, times = 0.0, 0, 0, 0, []
    for members in groups.values():
        v = _group_variance(members)
        if v is None:
            continue
        k = len(members)
        weighted += (k - 1) * v
        df += k - 1
        runs += k
        used += 1
        times += [str(r["at"]) for r in members if r.get("at")]
    if not df:
        return None
    rsd = math.sqrt(max(weighted / df, 0.0))  # a spread below the runs' own errors: no run effect seen
    return HostNoise(rsd, df, runs, used, min(times, default=None), max(times, default=None))


def usable(noise: HostNoise | None) -> bool:
    return noise is not None and noise.df >= MIN_DF


@dataclass(frozen=True)
class Counted:
    """The between-run noise a comparison counts: ``rsd`` with the degrees of freedom it rests
    on, ``block`` for figures interleaved in one window (tune's finalists), and the line that
    says where it came from. ``borrowed``: no figure of the host's or the recipe's, this VM's."""

    rsd: float
    df: int
    block: float
    line: str
    borrowed: bool = False


def counted(host: str, given: float | None, own: HostNoise | None) -> Counted | None:
    """The noise a compare counts: the recipe's own figure (gate.run_noise), else the host's
    from its history once it rests on MIN_DF degrees of freedom, else None (no verdict, and
    :func:`missing_text` says what to run)."""
    if given is not None:
        return Counted(given, RUN_NOISE_DF, given, f"noise between runs: {given:.1%}, the recipe's gate.run_noise")
    if own is not None and usable(own):
        return Counted(own.rsd, own.df, own.rsd, f"noise between runs: {noise_text(own)}, {host}'s own history")
    return None


def counted_or_borrowed(host: str, given: float | None, own: HostNoise | None) -> Counted:
    """What a tune counts: it must pick a winner, so without a figure of its own it borrows
    this 2-core VM's (bench_stats.RUN_NOISE) and says so."""
    found = counted(host, given, own)
    if found is not None:
        return found
    line = f"{missing_text(host, own)}; until then ties are judged with {RUN_NOISE:.0%}, measured on a shared 2-core VM"
    return Counted(RUN_NOISE, RUN_NOISE_DF, BLOCK_NOISE, line, borrowed=True)


def missing_text(host: str, noise: HostNoise | None) -> str:
    """What a host without a figure of its own says, and what to run."""
    have = "no unchanged runs" if noise is None else f"{noise.runs} unchanged runs ({noise.df} degrees of freedom)"
    return (
        f"{host} has no run-to-run noise figure of its own ({have} in the bench history; {MIN_DF} degrees of "
        f"freedom needed): run `invoke bench --host {host} --noise {NOISE_RUNS}` against the unchanged server"
    )


def noise_text(noise: HostNoise) -> str:
    """``7.9% between runs (12 runs, 9 degrees of freedom, 2026-12-01 to 2026-12-05)``."""
    when = f", {noise.oldest[:10]} to {noise.newest[:10]}" if noise.oldest and noise.newest else ""
    return f"{noise.rsd:.1%} between runs ({noise.runs} runs, {noise.df} degrees of freedom{when})"
