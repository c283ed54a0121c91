"""`invoke bench`'s arithmetic (pure): the workload, each level's figures from its samples, the
knee, the ceilings beside them, output sanity and the gate with its diagnosis.

The method is the seed's, made repeatable: compute the ceiling, measure against it, say what
holds the figure down. Decode is judged against the bandwidth roofline (every weight byte a
token streams, over the memory's bandwidth: the datasheet's for a GPU, a measured copy rate
for a CPU); the server's own ``predicted_per_second`` is the cross-check of the client's
figure (within 5% at every level, or the report says the numbers disagree).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from playbooks.plan.engines import engine
from playbooks.steps.measure import roofline
from playbooks.steps.measure.bench_client import Sample
from playbooks.steps.measure.bench_stats import arrivals, compressed_streams, estimate

#: the client's decode rate must agree with the server's own this closely
CROSSCHECK_TOLERANCE = 0.05
#: aggregate tok/s rising less than this from one level to the next: the knee
KNEE_GAIN = 0.10
#: the longest whitespace-separated word a prompt is cut from (see prompts_for)
MAX_WORD_CHARS = 24
#: TTFT p95 growing more than this factor from one level to the next: latency exploded
KNEE_TTFT_FACTOR = 3.0


# ------------------------------------------------------------------------------------------
# the workload
# ------------------------------------------------------------------------------------------


#: the workload kinds (recipe gate.workload): the shipped text each cuts its prompts from, and
#: whether a prompt keeps the text's line breaks and indentation (code and long documents are
#: read as laid out; chat prompts are words joined by single spaces, as the bench always cut them)
WORKLOADS: dict[str, tuple[str, bool]] = {
    "chat": ("general.txt", False),
    "code": ("code.txt", True),
    "long": ("general.txt", True),
}


@dataclass(frozen=True)
class Corpus:
    """The pieces prompts are cut from: words, or words with the whitespace after each."""

    pieces: tuple[str, ...]
    joiner: str

    @classmethod
    def of(cls, text: str, layout: bool = False) -> Corpus:
        # a "word" of over MAX_WORD_CHARS is a run of text without spaces (a Chinese paragraph in
        # the shipped text): it is hundreds of tokens, not one or two, and a prompt landing on it
        # came out at 735 tokens where 16 were asked for, past the slot's context
        found = re.findall(r"\S+\s*", text) if layout else text.split()
        pieces = tuple(p for p in found if len(p.strip()) <= MAX_WORD_CHARS)
        return cls(pieces, "" if layout else " ")

    def cut(self, start: int, words: int) -> str:
        return self.joiner.join(self.pieces[start : start + words]).rstrip()


def prompts_for(text: str | Corpus, words: int, count: int, seed: int) -> list[str]:
    """``count`` prompts of ``words`` words each, cut from ``text`` at seeded offsets (real text:
    a real model's tokenizer sees real words; every request differs, so no prompt cache
    makes a level look faster than it is)."""
    corpus = text if isinstance(text, Corpus) else Corpus.of(text)
    pool = list(corpus.pieces)
    if not pool:
        raise ValueError("the prompt text is empty")
    while len(pool) < words + 1:
        pool = pool + pool
    grown = Corpus(tuple(pool), corpus.joiner)
    rng = random.Random(seed)
    return [grown.cut(rng.randrange(0, len(pool) - words), words) for _ in range(count)]


def words_for(target_tokens: int, probe_words: int, probe_tokens: int) -> int:
    """Words for a prompt of about ``target_tokens``, from one probe's tokens per word."""
    per_word = max(probe_tokens, 1) / max(probe_words, 1)
    return max(1, round(target_tokens / per_word))


# ------------------------------------------------------------------------------------------
# one level
# ------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    data = sorted(v for v in values if v is not None and math.isfinite(v))
    if not data:
        return None
    k = (len(data) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def client_rates(samples: Sequence[Sample]) -> dict[int, float]:
    """Each stream's own decode rate as the client timed it, by ``id`` of its sample: none for
    a failed stream, nor for one that arrived whole within one read (its span is no decode
    time: :func:`bench_stats.compressed_streams`)."""
    ok = [s for s in samples if s.error is None]
    whole = {id(s) for s in compressed_streams(ok)}
    return {id(s): rate for s in ok if (rate := s.decode_tok_s) and id(s) not in whole}


def judged_values(samples: Sequence[Sample]) -> tuple[list[float], str]:
    """The per-request decode rates a level is judged by, and whose they are: the client's
    (tokens after the first over the time after the first token, so the first token's delay is
    left out) where its tokens could be timed (:func:`bench_stats.arrivals`), else the server's
    own ``predicted_per_second``; the client's when the server reports none (TabbyAPI)."""
    ok = [s for s in samples if s.error is None]
    client = list(client_rates(ok).values())
    server = [s.timings["predicted_per_second"] for s in ok if "predicted_per_second" in s.timings]
    if server and not arrivals(ok)["timeable"]:
        return server, "server"
    return client, "client"


#: one round: the samples of its streams (one request each, all at once) and its wall time
Round = tuple[Sequence[Sample], float]


def _request_rate(s: Sample, source: str, client: dict[int, float]) -> float | None:
    if s.error is not None:
        return None
    if source == "server":
        return s.timings.get("predicted_per_second")
    return client.get(id(s))


def round_observations(rounds: Sequence[Round], source: str) -> dict[str, list[float | None]]:
    """Per round, one observation of each figure (the unit of replication: the streams of a
    round share every batch, so they are not independent of each other): the mean per-stream
    decode by ``source``'s rates, the aggregate (the round's tokens over its wall time) and the
    slowest stream's TTFT (what the last-served user of the round waited)."""
    decode: list[float | None] = []
    aggregate: list[float | None] = []
    ttft: list[float | None] = []
    client = client_rates([s for samples, _ in rounds for s in samples])
    for samples, took in rounds:
        ok = [s for s in samples if s.error is None]
        rates = [r for r in (_request_rate(s, source, client) for s in ok) if r]
        decode.append(statistics.fmean(rates) if rates else None)
        tokens = sum(s.completion_tokens or 0 for s in ok)
        aggregate.append(tokens / took if ok and took > 0 else None)
        waits = [t for t in (s.ttft for s in ok) if t is not None]
        ttft.append(max(waits) if waits else None)
    return {"decode": decode, "aggregate": aggregate, "ttft_worst": ttft}


def judged_rounds(rounds: Sequence[Round]) -> tuple[list[float | None], str]:
    """The per-round judged decode (:func:`round_observations`) and whose rates it averages
    (:func:`judged_values` decides, over every request of the level)."""
    _, source = judged_values([s for samples, _ in rounds for s in samples])
    return round_observations(rounds, source)["decode"], source


def as_rounds(samples: Sequence[Sample], concurrency: int, wall_s: float) -> list[Round]:
    """Samples without their round boundaries cut into rounds of ``concurrency`` in order, the
    wall time shared evenly (a caller that ran rounds passes them instead)."""
    cut = [samples[i : i + concurrency] for i in range(0, len(samples), max(1, concurrency))]
    return [(r, wall_s / len(cut)) for r in cut] if cut else []


def level_summary(
    concurrency: int,
    samples: Sequence[Sample],
    wall_s: float,
    warmup: int = 0,
    rounds: Sequence[Round] | None = None,
) -> dict[str, Any]:
    """One concurrency level's figures: aggregate over its wall time, the per-stream decode, the
    aggregate and the slowest TTFT each as a mean over rounds with its spread
    (:class:`bench_stats.Estimate`, n = rounds), the client's rate cross-checked against the
    server's own where the arrival times allow it, latency percentiles over requests, errors (a
    few quoted). ``warmup``: requests run before these, left out of every figure; ``rounds``:
    the samples as run (default: :func:`as_rounds`).

    One figure per quantity: ``decode`` (and ``per_stream_decode_tok_s``, its mean) is the
    judged per-stream decode; the client's own rate is ``client_decode_tok_s`` only where it
    could time the tokens, else a diagnostic under ``timing.client_rate_untimed``."""
    rounds = list(rounds) if rounds is not None else as_rounds(samples, concurrency, wall_s)
    ok = [s for s in samples if s.error is None]
    errors = [s.error for s in samples if s.error is not None]
    out_tokens = sum(s.completion_tokens or 0 for s in ok)
    client = estimate(list(client_rates(ok).values()))
    server = estimate([s.timings["predicted_per_second"] for s in ok if "predicted_per_second" in s.timings])
    timing = arrivals(ok)
    _, source = judged_values(ok)
    per_round = round_observations(rounds, source)
    judged = estimate(per_round["decode"])
    aggregate = estimate(per_round["aggregate"])
    worst_ttft = estimate(per_round["ttft_worst"])
    prefill_server = [s.timings["prompt_per_second"] for s in ok if "prompt_per_second" in s.timings]
    ttft = [t for t in (s.ttft for s in ok) if t is not None]
    itl = [x for s in ok for x in s.itls]
    e2e = [t for t in (s.e2e for s in ok) if t is not None]
    prompt = [s.prompt_tokens for s in ok if s.prompt_tokens]
    checked = bool(timing["timeable"] and client and server)
    if client and not timing["timeable"]:
        timing = {**timing, "client_rate_untimed": _r(client.mean, 3)}
    prefill = (
        statistics.median(prefill_server)
        if prefill_server
        else (statistics.median(p / t for p, t in zip(prompt, ttft, strict=False) if t) if prompt and ttft else None)
    )
    short = [s for s in ok if s.completion_tokens is not None and s.requested and s.completion_tokens < s.requested]
    # speculative decoding: the server's own counts of drafted and accepted tokens
    drafted = sum(int(s.timings.get("draft_n", 0)) for s in ok)
    accepted = sum(int(s.timings.get("draft_n_accepted", 0)) for s in ok)
    drafting = any("draft_n" in s.timings for s in ok)
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "rounds": len(rounds),
        "warmup_requests": warmup,
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "short_completions": len(short),
        "speculation": {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": _r(accepted / drafted if drafted else None),
        }
        if drafting
        else None,
        "aggregate_tok_s": _r(out_tokens / wall_s if wall_s > 0 and ok else 0.0, 3),
        "aggregate": None if aggregate is None else {**aggregate.as_dict(), "unit": "round"},
        "decode": None if judged is None else {**judged.as_dict(), "source": source, "unit": "round"},
        "per_stream_decode_tok_s": _r(judged.mean if judged else None, 3),
        "client_decode_tok_s": _r(client.mean if client and timing["timeable"] else None, 3),
        "server_predicted_per_second": _r(server.mean if server else None, 3),
        "server_decode": None if server is None else server.as_dict(),
        "timing": timing,
        "crosscheck_ratio": _r(client.mean / server.mean if checked and client and server else None),
        "crosscheck": None
        if timing["timeable"] or not server
        else f"not resolvable: {timing['why_not']}; judged by the server's own rate",
        "prefill_tok_s": _r(prefill, 3),
        "prompt_tokens": statistics.median(prompt) if prompt else None,
        "output_tokens": out_tokens,
        "ttft_worst": None if worst_ttft is None else {**worst_ttft.as_dict(4), "unit": "round"},
        "ttft_p50_s": _r(percentile(ttft, 50)),
        "ttft_p95_s": _r(percentile(ttft, 95)),
        "ttft_p99_s": _r(percentile(ttft, 99)),
        "itl_p50_s": _r(percentile(itl, 50), 5),
        "itl_p95_s": _r(percentile(itl, 95), 5),
        "itl_p99_s": _r(percentile(itl, 99), 5),
        "e2e_p50_s": _r(percentile(e2e, 50)),
        "e2e_p95_s": _r(percentile(e2e, 95)),
        "wall_s": _r(wall_s, 3),
    }


def decode_figure(level: dict[str, Any]) -> float:
    """The one per-stream decode figure of a level, for every reader (the gate, the MBU, the
    reports, the chart, the history, compare, the device check): the judged estimate's mean
    (``decode.mean``: the client's rates, or the server's own where the client could not time
    the tokens). A level stored before the estimates has none: the server's own where
    ``crosscheck`` says the client could not time them (its ``per_stream_decode_tok_s`` was then
    the client's untimeable figure), else ``per_stream_decode_tok_s``. 0.0 where there is none
    (a level whose every request failed)."""
    decode = level.get("decode") or {}
    if decode.get("mean") is not None:
        return float(decode["mean"])
    if level.get("crosscheck"):
        return level.get("server_predicted_per_second") or 0.0
    return level.get("per_stream_decode_tok_s") or 0.0


def find_knee(levels: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The level after which more concurrency stops paying: the aggregate rises less than
    KNEE_GAIN, or TTFT p95 grows more than KNEE_TTFT_FACTOR times."""
    for prev, cur in zip(levels, levels[1:], strict=False):
        a, b = prev.get("aggregate_tok_s") or 0, cur.get("aggregate_tok_s") or 0
        if a > 0 and b < a * (1 + KNEE_GAIN):
            gain = (b / a - 1) * 100
            return {
                "concurrency": prev["concurrency"],
                "why": f"aggregate {'rose' if gain >= 0 else 'fell'} {abs(gain):.0f}% from "
                f"{prev['concurrency']} to {cur['concurrency']}",
            }
        ta, tb = prev.get("ttft_p95_s"), cur.get("ttft_p95_s")
        if ta and tb and tb > ta * KNEE_TTFT_FACTOR:
            return {
                "concurrency": prev["concurrency"],
                "why": f"TTFT p95 grew {tb / ta:.1f}x from {prev['concurrency']} to {cur['concurrency']}",
            }
    return None


def scaling(levels: Sequence[dict[str, Any]], backend: str, gpu_is_volta: bool) -> str:
    """Whether concurrency can scale here at all: ExLlamaV2 on a V100 runs batch 1 (TabbyAPI's
    compatibility mode without flash-attn's paged attention), which is expected, not a bug."""
    if gpu_is_volta and not engine(backend).batches((7, 0)):
        return f"does not scale ({engine(backend).label} on V100: batch 1, by design)"
    if len(levels) < 2:
        return "one level only"
    first, last = levels[0].get("aggregate_tok_s") or 0, levels[-1].get("aggregate_tok_s") or 0
    return "scales" if first and last >= first * (1 + KNEE_GAIN) else "does not scale"


# ------------------------------------------------------------------------------------------
# output sanity
# ------------------------------------------------------------------------------------------


def sanity(samples: Sequence[Sample], random_weights: bool) -> dict[str, Any]:
    """Output checks that mean something for this model. Random test weights produce word
    salad and may loop on one token: only non-empty and finite are checked for them."""
    ok = [s for s in samples if s.error is None]
    checked = ["non_empty", "finite"]
    skipped: dict[str, str] = {}
    failures: list[str] = []
    empty = [s for s in ok if not s.text.strip()]
    if empty:
        failures.append(f"{len(empty)} of {len(ok)} completions were empty")
    bad = [s for s in ok if any(w in s.text.lower() for w in ("nan", "inf")) and _is_numeric_junk(s.text)]
    if bad:
        failures.append(f"{len(bad)} completions are NaN/inf text: {bad[0].text[:60]!r}")
    if random_weights:
        skipped["not_one_token_repeated"] = "random test weights: a loop on one token means nothing"
    else:
        checked.append("not_one_token_repeated")
        looped = [s for s in ok if _one_token_repeated(s.text)]
        if looped:
            failures.append(
                f"{len(looped)} of {len(ok)} completions repeat one token over and over: {looped[0].text[:60]!r}"
            )
    return {"checked": checked, "skipped": skipped, "failures": failures}


def _one_token_repeated(text: str) -> bool:
    words = text.split()
    if len(words) >= 4:
        return len(set(words)) == 1
    chars = text.strip()
    return len(chars) >= 8 and len(set(chars)) == 1


def _is_numeric_junk(text: str) -> bool:
    words = [w.strip(".,").lower() for w in text.split()]
    return bool(words) and sum(w in ("nan", "inf", "-inf") for w in words) * 2 >= len(words)


# ------------------------------------------------------------------------------------------
# the gate
# ------------------------------------------------------------------------------------------


def judge(result: dict[str, Any], thresholds: dict[str, float], seen: dict[str, Any]) -> dict[str, Any]:
    """Pass or fail with reasons (each threshold missed, each sanity failure, each level with
    errors, each cross-check beyond 5%) and a diagnosis from what was seen (``seen``: the
    deployment's load log, telemetry, the scaling verdict, the plan)."""
    reasons: list[str] = []
    levels = result.get("levels") or []
    if not result.get("complete", False):
        reasons.append(result.get("error") or "the sweep did not complete")
    first = levels[0] if levels else {}
    single = decode_figure(first) if first else 0.0
    if thresholds.get("min_tok_s") and single < thresholds["min_tok_s"]:
        reasons.append(f"single-stream decode {single:.1f} tok/s is below the gate's {thresholds['min_tok_s']:g}")
    mbu = result.get("mbu")
    fraction = thresholds.get("min_roofline_fraction") or 0.0
    # a fraction of a ceiling that does not bind (cache-resident) or that the rate exceeds (a
    # ceiling or measurement error) says nothing: not judged, and the diagnosis says so
    unjudged = bool(result.get("cache_resident")) or roofline.above(mbu)
    if fraction and not unjudged:
        if mbu is None:
            reasons.append(
                f"no roofline to judge the gate's {fraction:.0%} of it against: "
                f"{result.get('roofline_basis') or 'none computed'}"
            )
        elif mbu < fraction:
            reasons.append(
                f"decode reaches {mbu:.0%} of the roofline ({result.get('roofline_tok_s')} tok/s), below the gate's "
                f"{fraction:.0%}"
            )
    at = int(thresholds.get("at_concurrency") or 0)
    if thresholds.get("min_aggregate_tok_s") and at:
        level = next((lv for lv in levels if lv["concurrency"] == at), None)
        got = (level or {}).get("aggregate_tok_s") or 0.0
        if level is None:
            reasons.append(f"no level at concurrency {at} to judge the aggregate gate")
        elif got < thresholds["min_aggregate_tok_s"]:
            reasons.append(
                f"aggregate {got:.1f} tok/s at concurrency {at} is below the gate's "
                f"{thresholds['min_aggregate_tok_s']:g}"
            )
    if thresholds.get("max_ttft_ms") and first.get("ttft_p95_s") is not None:
        ttft_ms = first["ttft_p95_s"] * 1000
        if ttft_ms > thresholds["max_ttft_ms"]:
            reasons.append(f"single-stream TTFT p95 {ttft_ms:.0f} ms is above the gate's {thresholds['max_ttft_ms']:g}")
    for lv in levels:
        if lv.get("errors"):
            quoted = "; ".join(lv.get("error_samples") or [])
            reasons.append(
                f"{lv['errors']} of {lv['requests']} requests failed at concurrency {lv['concurrency']}: {quoted}"
            )
        ratio = lv.get("crosscheck_ratio")
        if ratio is not None and abs(ratio - 1) > CROSSCHECK_TOLERANCE and thresholds.get("crosscheck_gates", 1):
            # the client's own rate (a level stored before it had its own name: the old field)
            client = lv.get("client_decode_tok_s")
            client = lv.get("per_stream_decode_tok_s") if client is None else client
            reasons.append(
                f"at concurrency {lv['concurrency']} the client's decode {client} tok/s and the "
                f"server's own {lv['server_predicted_per_second']} differ by {abs(ratio - 1):.0%} (over 5%)"
            )
    reasons += list((result.get("sanity") or {}).get("failures") or [])
    diagnosis = diagnose(result, seen)
    if fraction and unjudged:
        why = roofline.DOES_NOT_BIND if result.get("cache_resident") else roofline.ABOVE_CEILING
        diagnosis.append(f"the gate's min_roofline_fraction {fraction:.0%} is not judged: {why}")
    return {"passed": not reasons, "reasons": reasons, "diagnosis": diagnosis, "thresholds": thresholds}


def diagnose(result: dict[str, Any], seen: dict[str, Any]) -> list[str]:
    """What explains the figures, from what was seen, most decisive first."""
    notes: list[str] = []
    mbu = result.get("mbu")
    if roofline.above(mbu):
        # before anything the figures may explain: the figures themselves are in doubt
        notes.append(
            f"decode at {mbu:.2f}x the bandwidth roofline ({result.get('roofline_tok_s')} tok/s, "
            f"{result.get('roofline_basis')}): {roofline.ABOVE_CEILING}"
        )
    offloaded = seen.get("offloaded")
    if offloaded and offloaded[0] < offloaded[1]:
        notes.append(
            f"layers on the CPU: the load log offloaded {offloaded[0]}/{offloaded[1]} layers; every token crosses PCIe"
        )
    for problem in seen.get("load_problems") or []:
        notes.append(f"the load log: {problem}")
    throttle = (result.get("telemetry") or {}).get("summary") or {}
    if throttle.get("throttled"):
        when = throttle.get("started_at_s")
        notes.append(
            f"the GPU throttled ({', '.join(throttle.get('reasons') or []) or 'clocks fell'})"
            + (f" from {when:.0f} s into the run" if when is not None else "")
        )
    if str(result.get("scaling", "")).startswith("does not scale"):
        notes.append(f"concurrency {result['scaling']}")
    if result.get("cache_resident"):
        notes.append(f"{result.get('roofline_basis')}: no bandwidth share (MBU) is given")
    if mbu is not None and mbu < 0.3 and not notes:
        notes.append(
            f"decode at {mbu:.0%} of the bandwidth roofline with nothing else seen: a small model is bound by "
            "per-token overhead (kernel launches, sampling, HTTP), not by memory"
        )
    if seen.get("context_over_plan"):
        notes.append(seen["context_over_plan"])
    return notes
