"""The benchmark's statistics (pure): how sure a figure is, whether two figures differ, and
whether the client could time the tokens it reports on.

Why: `invoke tune` picks winners and `bench --compare` says whether a change mattered, so a
figure must say how much it moves when nothing changed, and that has two parts:

- **Within a run.** A level repeats rounds (one request per stream, all streams at once) after
  a warm-up. The unit of replication is the round: at concurrency c the streams of a round
  share every batch, so they are one observation, not c (the round's mean per-stream decode, its
  aggregate tokens over its wall time, its slowest stream's TTFT). A level runs at least
  MIN_ROUNDS rounds and repeats until the 95% half-width of the judged figure is within a
  target share of its mean or a cap is reached; a figure that stopped at the cap says so.
- **Between runs.** The same unchanged server measured minutes apart moves more than one run's
  interval says (measured: reports/bench/noise.json, several runs of one idle and one busy
  server). A run's mean is the server's true rate, times a run effect of relative standard
  deviation ``run_noise``, plus its own sampling error. Two figures measured in different runs
  (two bench runs, two tune candidates) carry that term on each side. ``run_noise`` is the
  host's own figure (bench_noise, pooled from its history) with the degrees of freedom it rests
  on; RUN_NOISE and RUN_NOISE_DF are this 2-core VM's, the defaults where none is given.

The test (:func:`difference`, :func:`distinct`): Welch's t on the difference of two means, with
each side's variance the run's squared standard error (stdev^2 / rounds) plus the between-run
variance (run_noise x mean)^2, and Welch-Satterthwaite degrees of freedom in which the
between-run term counts as what it was estimated from (the spread of a host's run means, run
effect plus a run's own error) with that data set's degrees of freedom (``noise_df``). A side
may be :func:`pooled`: the mean of k runs of one configuration, whose run term is divided by k
(`bench --compare` against the last configuration's recent runs). Two figures differ when the
absolute difference exceeds t_{1-alpha/2m}(df) times its standard error: alpha = 5% over the
m comparisons made together (Bonferroni), so the whole family calls an unchanged pair changed
at most 5% of the time; the power this leaves is :func:`detectable_change` (the smallest change
flagged 80% of the time), printed beside the verdict so a tie is never mistaken for "no change".

Whether the client can time tokens is decided from the arrival times themselves, not from a
fixed ms threshold: a streamed token arrives in its own read when the client keeps up, and
several arrive within one read when they come faster than the client reads (a tiny model at
2,800 tok/s: 63 tokens in 1.5 ms) or when the client itself is starved of CPU. Tokens that
arrive in bursts cannot be timed; tokens that arrive one by one can, whatever their rate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from playbooks.steps.measure.bench_client import Sample

#: two-sided 95% Student t quantiles (t_{0.975, df}) for df = 1..30, from the standard tables
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
#: the fewest rounds a level's interval rests on: the t quantile is 12.7 at 2 rounds (an
#: interval of 9 standard deviations), 3.18 at 4; a fifth round would narrow it by a further 22%
#: for 25% more gate time on every level
MIN_ROUNDS = 4

#: beyond these degrees of freedom t_quantile uses the Cornish-Fisher expansion
_SERIES_DF_MAX = 1000

#: a gap shorter than this share of the stream's mean gap: the token came in the same read
#: as the one before (a burst). Reads of one burst are microseconds apart, tokens one by one
#: about one mean gap; a fifth sits far from both.
BURST_GAP_SHARE = 0.2
#: tokens in bursts above this share: the client could not time the level's tokens. A client
#: descheduled now and then reads two tokens at once a few times in a stream; that leaves its
#: rate (first to last token) intact and stays below this share.
MAX_BURST_SHARE = 0.10
#: the share of tokens that must arrive in chunks of their own (TabbyAPI, for one, may put
#: several tokens in a chunk; a chunk per token is llama-server's way)
MIN_CHUNKS_PER_TOKEN = 0.9


def t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with an integer ``df``: the exact finite series
    (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(coverage: float, df: float) -> float:
    """The t that two-sided ``coverage`` of Student's t lies within (0.95: t_{0.975}), for
    ``df`` rounded down (fewer degrees of freedom: a wider, safe interval); by bisection on the
    exact distribution, to 1e-9."""
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be between 0 and 1, got {coverage}")
    if not math.isfinite(df) or df > _SERIES_DF_MAX:
        # the series is long there, and the Cornish-Fisher expansion is within 1e-6
        z = statistics.NormalDist().inv_cdf((1 + coverage) / 2)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    n = max(1, math.floor(df))
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, n) < coverage:
        hi *= 2
    while hi - lo > 1e-9 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, n) < coverage else (lo, mid)
    return (lo + hi) / 2


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (the table to 30, held to
    the exact distribution by a test; :func:`t_quantile` beyond)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else t_quantile(0.95, df)


@dataclass(frozen=True)
class Estimate:
    """A mean with its spread: n values (rounds), their standard deviation, the 95% half-width."""

    mean: float
    stdev: float
    n: int
    halfwidth: float  # 95% confidence half-width of the mean (inf with one value)

    @property
    def rel_halfwidth(self) -> float:
        return self.halfwidth / self.mean if self.mean else math.inf

    def as_dict(self, nd: int = 3) -> dict[str, Any]:
        finite = math.isfinite(self.halfwidth)
        return {
            "mean": round(self.mean, nd),
            "stdev": round(self.stdev, nd),
            "n": self.n,
            "halfwidth": round(self.halfwidth, nd) if finite else None,
            "rel_halfwidth": round(self.rel_halfwidth, 4) if finite else None,
        }


def estimate(values: Sequence[float | None]) -> Estimate | None:
    """Mean, standard deviation and 95% half-width of ``values`` (None for none)."""
    data = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not data:
        return None
    mean = statistics.fmean(data)
    if len(data) < 2:
        return Estimate(mean, 0.0, 1, math.inf)
    sd = statistics.stdev(data)
    return Estimate(mean, sd, len(data), t975(len(data) - 1) * sd / math.sqrt(len(data)))


def settled(est: Estimate | None, n_min: int, n_max: int, target: float) -> bool:
    """Stop repeating: the cap is reached, or there are at least ``n_min`` values and the
    half-width is within ``target`` of the mean."""
    if est is None:
        return False
    if est.n >= n_max:
        return True
    return est.n >= n_min and est.rel_halfwidth <= target


def halfwidth_text(d: dict[str, Any] | None, spec: str = ".1f") -> str:
    """`` ± 6.5`` for an estimate (``as_dict`` form), with ``, cap reached`` where the level
    stopped at its cap before the target (the interval is what the cap allowed, not the
    target); empty without an interval."""
    if not d or d.get("halfwidth") is None:
        return ""
    capped = ""
    if d.get("capped"):
        rel = d.get("rel_halfwidth")
        capped = f" ({rel:.1%}, cap reached)" if rel is not None else " (cap reached)"
    return f" ± {format(float(d['halfwidth']), spec)}{capped}"


# ------------------------------------------------------------------------------------------
# do two figures differ?
# ------------------------------------------------------------------------------------------

#: the relative standard deviation of a run's mean around the server's true rate, between runs
#: of one unchanged server (the run effect: drift, the machine's other load, the server's state).
#: From reports/bench/noise.json (scripts/bench_noise.py): the idle set's single stream, eight
#: runs of one server on this 2-core VM, 8.1% rounded up (the same server moved 123 to 161 tok/s
#: between runs minutes apart, each run's own half-width 3-14%). A dedicated host's is likely
#: smaller: gate.run_noise sets a host's own figure; tests/test_bench_method.py holds this one
#: to the file.
RUN_NOISE = 0.09
#: the run effect left once a straight-line drift is taken out: what two figures measured
#: interleaved (A B B A, tune's finalists) still carry per block; from the same set (8.8%: the
#: runs there did not drift in a line, they scattered, so interleaving buys little on this VM)
BLOCK_NOISE = 0.09
#: degrees of freedom RUN_NOISE was estimated with (the idle set's runs less one)
RUN_NOISE_DF = 7
#: the family-wise false-change rate of one search's or one compare's comparisons
ALPHA = 0.05
#: the power :func:`detectable_change` is stated at
POWER = 0.80
#: a rise past which :func:`detectable_change` calls no change detectable (20x the rate)
DETECTABLE_MAX = 20.0


def _se2_df(d: dict[str, Any]) -> tuple[float, int] | None:
    """A side's squared standard error and its degrees of freedom, from an ``as_dict`` form
    (stdev and n; an old record with a half-width and n only is backed out through t; a
    :func:`pooled` estimate carries both)."""
    if "se2" in d:
        return float(d["se2"]), int(d["df"])
    n = d.get("n")
    sd = d.get("stdev")
    if n is None or int(n) < 2:
        return None
    n = int(n)
    if sd is None:
        hw = d.get("halfwidth")
        if hw is None:
            return None
        sd = float(hw) / t975(n - 1) * math.sqrt(n)
    return float(sd) ** 2 / n, n - 1


def pooled(estimates: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """k runs' estimates of one figure (``as_dict`` forms, one configuration) as one: the mean
    of their means, whose squared standard error is the sum of theirs over k^2, and ``runs`` k,
    which :func:`difference` divides the between-run term by (k runs' effects average out as
    their sampling errors do). ``run_se2``/``run_df``: a typical one of those runs (the mean
    squared standard error), what the other side of :func:`detectable_change` is measured as.
    Estimates without an interval are left out; None when none has one."""
    sides = [(float(e["mean"]), found) for e in estimates if e and e.get("mean") is not None and (found := _se2_df(e))]
    if not sides:
        return None
    k = len(sides)
    se2 = [found[0] for _, found in sides]
    df = [found[1] for _, found in sides]
    return {
        "mean": statistics.fmean(m for m, _ in sides),
        "se2": sum(se2) / k**2,
        "df": sum(df),
        "runs": k,
        "run_se2": statistics.fmean(se2),
        "run_df": round(statistics.fmean(df)),
    }


def _one_run(d: dict[str, Any]) -> dict[str, Any]:
    """One run measured as a typical run of ``d`` (``d`` itself unless :func:`pooled`)."""
    if "runs" not in d:
        return d
    return {"mean": d["mean"], "se2": d["run_se2"], "df": d["run_df"]}


@dataclass(frozen=True)
class Difference:
    """b minus a, with its standard error, Welch-Satterthwaite degrees of freedom and the
    half-width at the stated coverage."""

    diff: float
    se: float
    df: float
    halfwidth: float
    comparisons: int

    @property
    def distinct(self) -> bool:
        return abs(self.diff) > self.halfwidth


def difference(
    a: dict[str, Any] | None,
    b: dict[str, Any] | None,
    run_noise: float = RUN_NOISE,
    comparisons: int = 1,
    alpha: float = ALPHA,
    noise_df: int = RUN_NOISE_DF,
) -> Difference | None:
    """The difference of two estimates (``as_dict`` form) measured in different runs, by the
    test of the module docstring; ``run_noise`` 0 for two figures of one run (or of blocks
    interleaved in one time window), with ``noise_df`` the degrees of freedom it was estimated
    with (a host's own figure: bench_noise). None when either side has no interval."""
    if not a or not b or a.get("mean") is None or b.get("mean") is None:
        return None
    sa, sb = _se2_df(a), _se2_df(b)
    if sa is None or sb is None:
        return None
    ma, mb = float(a["mean"]), float(b["mean"])
    # a pooled side (:func:`pooled`) is the mean of k runs: its run effect averages over them
    run_var = run_noise**2 * (ma**2 / int(a.get("runs", 1)) + mb**2 / int(b.get("runs", 1)))
    var = sa[0] + sb[0] + run_var
    if var <= 0:
        return Difference(mb - ma, 0.0, math.inf, 0.0, comparisons)
    # the run noise was estimated as the spread of a host's run means less their own squared
    # errors: it is as uncertain as that spread (run effect plus a run's own error: here the
    # whole variance, with ``noise_df``), not as a run effect alone would be; counted as its
    # own, the degrees of freedom come out too many and an unchanged pair is called changed too
    # often (simulated: tests/test_bench_noise.py). As a prediction from k runs' spread is
    # judged on k - 1 degrees of freedom, whatever their own errors.
    denom = sa[0] ** 2 / sa[1] + sb[0] ** 2 / sb[1] + (var**2 / noise_df if run_var else 0.0)
    df = var**2 / denom if denom > 0 else math.inf
    t = t_quantile(1 - alpha / max(1, comparisons), df)
    return Difference(mb - ma, math.sqrt(var), df, t * math.sqrt(var), comparisons)


def distinct(
    a: dict[str, Any] | None,
    b: dict[str, Any] | None,
    run_noise: float = RUN_NOISE,
    comparisons: int = 1,
    noise_df: int = RUN_NOISE_DF,
) -> bool | None:
    """Whether two estimates (``as_dict`` form) measured in different runs differ beyond their
    noise (:func:`difference`); None when either has no interval."""
    d = difference(a, b, run_noise, comparisons, noise_df=noise_df)
    return None if d is None else d.distinct


def detectable_change(
    a: dict[str, Any] | None,
    run_noise: float = RUN_NOISE,
    comparisons: int = 1,
    power: float = POWER,
    noise_df: int = RUN_NOISE_DF,
) -> float | None:
    """The smallest relative rise of ``a``'s mean that the test flags with probability
    ``power`` when the other side is one run measured as ``a`` was (same spread and rounds; as
    a typical one of its runs where ``a`` is :func:`pooled`):
    (t_{1-alpha/2m} + t_{power}) times the difference's standard error, over the mean, solved
    with the other side at the raised mean (its run term grows with it). None without an
    interval; infinity where no rise is enough: the run term grows with the raised mean, and
    once the noise times the two quantiles reaches one, it grows as fast as the rise (a 25%
    run noise at 5 degrees of freedom; the fixed point then climbs without end)."""
    if not a or not a.get("mean"):
        return None
    mean = abs(float(a["mean"]))
    delta = 0.0
    for _ in range(50):  # a fixed point: the raised side's run term depends on the rise
        d = difference(a, {**_one_run(a), "mean": mean * (1 + delta)}, run_noise, comparisons, noise_df=noise_df)
        if d is None:
            return None
        t_beta = t_quantile(2 * power - 1, d.df)  # the one-sided quantile at `power`
        nxt = (d.halfwidth + t_beta * d.se) / mean
        if abs(nxt - delta) < 1e-6:
            return nxt
        if nxt > DETECTABLE_MAX:
            break
        delta = nxt
    return math.inf


# ------------------------------------------------------------------------------------------
# can the client time these tokens?
# ------------------------------------------------------------------------------------------


def compressed_streams(samples: Sequence[Sample]) -> list[Sample]:
    """The streams that arrived whole, or nearly, within one read: a client descheduled while
    the server made the stream reads every token at once. Against its own mean gap none of its
    gaps is a burst (they are all microseconds), yet its first-to-last span is no decode time,
    and one such stream's rate (63 tokens in 0.1 ms: 600,000 tok/s) outweighs many true ones.
    A stream is compressed when its mean gap is under BURST_GAP_SHARE of the gap its tokens
    should have had: the server's own rate for that request where it reports one, else the
    level's median stream (TabbyAPI reports none)."""
    timed = [s for s in samples if s.error is None and len(s.chunks) >= 2]
    if not timed:
        return []
    gap = {id(s): (s.chunks[-1] - s.chunks[0]) / (len(s.chunks) - 1) for s in timed}
    typical = statistics.median(gap.values())
    out = []
    for s in timed:
        server = s.timings.get("predicted_per_second")
        expected = 1 / server if server and server > 0 else typical
        if gap[id(s)] < BURST_GAP_SHARE * expected:
            out.append(s)
    return out


def burst_gaps(sample: Sample) -> tuple[int, int]:
    """(gaps shorter than BURST_GAP_SHARE of the stream's mean gap, all gaps) of one stream."""
    gaps = sample.itls
    if len(gaps) < 2:
        return 0, len(gaps)
    mean_gap = (sample.chunks[-1] - sample.chunks[0]) / len(gaps)
    if mean_gap <= 0:
        return len(gaps), len(gaps)
    return sum(g < BURST_GAP_SHARE * mean_gap for g in gaps), len(gaps)


def arrivals(samples: Sequence[Sample]) -> dict[str, Any]:
    """Whether the client timed the tokens of these streams, from their arrival times: the
    streams that came whole within one read (:func:`compressed_streams`: they lend no rate
    whatever the verdict, and too many of them leave the level untimed), the share of the other
    streams' tokens that came in a burst within one read, the chunks per token, the verdict
    and, when the tokens cannot be timed, why."""
    ok = [s for s in samples if s.error is None and len(s.chunks) >= 2]
    whole = {id(s) for s in compressed_streams(ok)}
    counts = [burst_gaps(s) for s in ok if id(s) not in whole]
    bursts = sum(b for b, _ in counts)
    gaps = sum(g for _, g in counts)
    tokens = sum(s.completion_tokens or 0 for s in ok)
    chunks = sum(len(s.chunks) for s in ok)
    share = bursts / gaps if gaps else None
    per_token = chunks / tokens if tokens else None
    why = None
    if not ok:
        why = "no stream with two timed tokens"
    elif per_token is not None and per_token < MIN_CHUNKS_PER_TOKEN:
        why = f"the server sent {per_token:.2f} chunks per token: several tokens share a chunk"
    elif len(whole) > MAX_BURST_SHARE * len(ok):
        why = f"{len(whole)} of {len(ok)} streams arrived whole within one read: the client was not reading"
    elif share is not None and share > MAX_BURST_SHARE:
        why = (
            f"{share:.0%} of the tokens arrived in bursts within one read (over {MAX_BURST_SHARE:.0%}): they came "
            "faster than the client read them"
        )
    return {
        "burst_share": None if share is None else round(share, 4),
        "compressed_streams": len(whole),
        "chunks_per_token": None if per_token is None else round(per_token, 4),
        "timeable": why is None,
        "why_not": why,
    }
