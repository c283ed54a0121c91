"""The benchmark's statistics (pure): how sure a figure is, and whether the client could time
the tokens it reports on.

Why: `invoke tune` picks winners by comparing bench results, so a figure must say how much it
moves when nothing changed. Each concurrency level repeats rounds of requests until the 95%
confidence half-width of its per-stream decode is within a target share of the mean (2% by
default) or a cap is reached; the result keeps mean, standard deviation, n and the half-width,
and two results are told apart only when their intervals say so.

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
_Z975 = 1.959964

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


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (table to 30, then the
    Cornish-Fisher expansion, within 1e-4 of the exact value there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Estimate:
    """A mean with its spread: n values, their standard deviation, the 95% half-width."""

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


def estimate(values: Sequence[float]) -> Estimate | None:
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


def distinct(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool | None:
    """Whether two estimates (``as_dict`` form) differ beyond their noise: the difference of the
    means exceeds the half-width of that difference (the two half-widths added in quadrature,
    Welch's interval with each side's own t). None when either has no interval."""
    if not a or not b:
        return None
    ha, hb, ma, mb = a.get("halfwidth"), b.get("halfwidth"), a.get("mean"), b.get("mean")
    if ha is None or hb is None or ma is None or mb is None:
        return None
    return abs(float(ma) - float(mb)) > math.hypot(float(ha), float(hb))


# ------------------------------------------------------------------------------------------
# can the client time these tokens?
# ------------------------------------------------------------------------------------------


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
    share of tokens that came in a burst within one read, the chunks per token, the verdict
    and, when the tokens cannot be timed, why."""
    ok = [s for s in samples if s.error is None and len(s.chunks) >= 2]
    bursts = sum(burst_gaps(s)[0] for s in ok)
    gaps = sum(burst_gaps(s)[1] for s in ok)
    tokens = sum(s.completion_tokens or 0 for s in ok)
    chunks = sum(len(s.chunks) for s in ok)
    share = bursts / gaps if gaps else None
    per_token = chunks / tokens if tokens else None
    why = None
    if not ok:
        why = "no stream with two timed tokens"
    elif per_token is not None and per_token < MIN_CHUNKS_PER_TOKEN:
        why = f"the server sent {per_token:.2f} chunks per token: several tokens share a chunk"
    elif share is not None and share > MAX_BURST_SHARE:
        why = (
            f"{share:.0%} of the tokens arrived in bursts within one read (over {MAX_BURST_SHARE:.0%}): they came "
            "faster than the client read them"
        )
    return {
        "burst_share": None if share is None else round(share, 4),
        "chunks_per_token": None if per_token is None else round(per_token, 4),
        "timeable": why is None,
        "why_not": why,
    }
