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
is that difference, per level, pooled over the groups weighted by their degrees of freedom
(runs - 1). Each level keeps its own figure, and a compare judges a level by it: the levels of
one server move differently (measured here: one stream within 3% run to run while two streams
jumped between 61 and 95 tok/s, a batching mode, not a run effect the other levels share).
The host's one figure (tune's, and the line's headline) is the levels' mean variance, on the
degrees of freedom of the runs (the levels of one run are one run, not several). A host, or a
level, has a figure once those degrees of freedom reach MIN_DF; `invoke bench --noise N` runs
the unchanged server N times to get there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
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
    oldest and newest of them; ``levels``: each concurrency's own (``{"2": [rsd, df]}``)."""

    rsd: float
    df: int
    runs: int
    groups: int
    oldest: str | None
    newest: str | None
    levels: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        levels = {c: [round(r, 4), int(d)] for c, (r, d) in self.levels.items()}
        return asdict(self) | {"rsd": round(self.rsd, 4), "levels": levels}

    def at(self, concurrency: Any) -> tuple[float, int] | None:
        """The level's own figure once it rests on MIN_DF degrees of freedom, else None."""
        found = self.levels.get(str(concurrency))
        return (float(found[0]), int(found[1])) if found and int(found[1]) >= MIN_DF else None


def _decode(level: dict[str, Any]) -> tuple[float, float] | None:
    """(mean, squared standard error) of a history level's per-stream decode, or None."""
    d = level.get("decode") or {}
    mean, sd, n = d.get("mean"), d.get("stdev"), d.get("n")
    if not isinstance(mean, (int, float)) or mean <= 0 or not isinstance(sd, (int, float)) or not n or int(n) < 2:
        return None
    return float(mean), float(sd) ** 2 / int(n)


def _group_variance(runs: list[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """sigma^2 of one group of unchanged runs per level, with its degrees of freedom: the
    variance of the runs' relative means less their mean relative squared standard error."""
    by_level: dict[Any, list[tuple[float, float]]] = {}
    for run in runs:
        for level in run.get("levels") or []:
            found = _decode(level)
            if found:
                by_level.setdefault(level.get("concurrency"), []).append(found)
    per_level = {}
    for c, seen in by_level.items():
        if len(seen) < 2:
            continue
        centre = statistics.fmean(m for m, _ in seen)
        spread = statistics.variance([m / centre for m, _ in seen])
        own = statistics.fmean(se2 for _, se2 in seen) / centre**2
        per_level[str(c)] = (spread - own, len(seen) - 1)
    return per_level


def host_noise(history: Iterable[dict[str, Any]]) -> HostNoise | None:
    """The pooled figure of one host's history lines (bench_history.read_history(path, host)),
    or None when no group has two runs with intervals. Below MIN_DF degrees of freedom it is
    returned all the same: the caller says it is not enough (:func:`usable`)."""
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for run in history:
        if not any(_decode(level) for level in run.get("levels") or []):
            continue  # a line from before the repeats: no interval to weigh it by
        groups.setdefault((run.get("recipe"), run.get("recipe_sha256"), run.get("build")), []).append(run)
    weighted, df, runs, used, times = 0.0, 0, 0, 0, []
    level_sum: dict[str, float] = {}
    level_df: dict[str, int] = {}
    for members in groups.values():
        found = _group_variance(members)
        if not found:
            continue
        k = len(members)
        weighted += (k - 1) * statistics.fmean(v for v, _ in found.values())
        df += k - 1
        runs += k
        used += 1
        times += [str(r["at"]) for r in members if r.get("at")]
        for c, (v, d) in found.items():
            level_sum[c] = level_sum.get(c, 0.0) + d * v
            level_df[c] = level_df.get(c, 0) + d
    if not df:
        return None
    # a spread below the runs' own errors: no run effect seen
    rsd = math.sqrt(max(weighted / df, 0.0))
    levels = {c: [math.sqrt(max(level_sum[c] / d, 0.0)), d] for c, d in sorted(level_df.items(), key=_level_key)}
    return HostNoise(rsd, df, runs, used, min(times, default=None), max(times, default=None), levels)


def _level_key(item: tuple[str, int]) -> tuple[int, str]:
    return (int(item[0]), item[0]) if item[0].isdigit() else (1 << 30, item[0])


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
    own: HostNoise | None = None

    def at(self, concurrency: Any) -> tuple[float, int]:
        """What a level's comparison counts: the host's figure for that level where it has
        one, else the host's one figure (or the recipe's, or the borrowed)."""
        level = self.own.at(concurrency) if self.own is not None else None
        return level if level is not None else (self.rsd, self.df)


def counted(host: str, given: float | None, own: HostNoise | None) -> Counted | None:
    """The noise a compare counts: the recipe's own figure (gate.run_noise), else the host's
    from its history once it rests on MIN_DF degrees of freedom, else None (no verdict, and
    :func:`missing_text` says what to run)."""
    if given is not None:
        return Counted(given, RUN_NOISE_DF, given, f"noise between runs: {given:.1%}, the recipe's gate.run_noise")
    if own is not None and usable(own):
        line = f"noise between runs: {noise_text(own)}, {host}'s own history"
        return Counted(own.rsd, own.df, own.rsd, line, own=own)
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
    """``7.9% between runs (12 runs, 9 degrees of freedom, 2026-12-01 to 2026-12-05; by
    concurrency: 1: 2.4%, 2: 11.0%)``."""
    when = f", {noise.oldest[:10]} to {noise.newest[:10]}" if noise.oldest and noise.newest else ""
    levels = ", ".join(f"{c}: {r:.1%}" for c, (r, _) in noise.levels.items())
    by = f"; by concurrency: {levels}" if len(noise.levels) > 1 else ""
    return f"{noise.rsd:.1%} between runs ({noise.runs} runs, {noise.df} degrees of freedom{when}{by})"
