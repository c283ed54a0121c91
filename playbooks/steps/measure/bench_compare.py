"""This run against the earlier runs of the same host and recipe (the bench history), per
concurrency level: against the last configuration's runs pooled and against the best, each
change judged against the run-to-run noise (bench_noise, bench_stats) before it is called one;
and the table `invoke bench --compare` prints."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.steps.measure.bench_figures import TRACKED, fmt
from playbooks.steps.measure.bench_history import tracked
from playbooks.steps.measure.bench_noise import Counted, HostNoise, counted, missing_text
from playbooks.steps.measure.bench_stats import detectable_change, distinct, pooled
from playbooks.steps.measure.roofline import finite


def _pct(now: Any, then: Any) -> float | None:
    n, t = finite(now), finite(then)
    return (n - t) / t * 100 if n is not None and t else None


#: the comparisons one level of a compare makes together (against the last and the best run)
COMPARED = 2
#: the most runs of the last configuration a compare pools as its "last" reference: enough
#: to take the reference's own run effect nearly out (its variance falls as 1/k), few enough
#: that a drift over days does not make the reference stale
POOL_RUNS = 8


def _ref(
    members: Sequence[tuple[dict[str, Any], dict[str, Any]]], now: dict[str, Any], sha: Any, noise: Counted | None
) -> dict[str, Any]:
    """One reference: a run's level, or the mean of several runs' levels of one configuration
    (the "last" reference, :func:`_last_members`), and now's change against it, judged by the
    level's own run-to-run noise where the host has one (bench_noise)."""
    run, level = members[-1]
    rows = [tracked(lv) for _, lv in members]
    values = {k: _mean([row[k] for row in rows]) for k in TRACKED}
    decodes = [lv.get("decode") for _, lv in members]
    decode = decodes[0] if len(decodes) == 1 else pooled(decodes)
    same = _source(now) == _source(level) and noise is not None
    rsd, df = noise.at(level.get("concurrency")) if noise is not None else (0.0, 0)
    verdict = distinct(now.get("decode"), decode, rsd, COMPARED, df) if same else None
    return {
        "at": run.get("at"),
        "first_at": members[0][0].get("at"),
        "runs": len(members),
        "build": run.get("build"),
        "recipe_sha256": run.get("recipe_sha256"),
        # an edited recipe (other flags, another quant) explains a change better than a regression
        "recipe_changed": run.get("recipe_sha256") != sha,
        "values": values,
        "change_pct": {k: _pct(now.get(k), values[k]) for k in TRACKED},
        # the per-stream decode's change by bench_stats' test (each run's rounds plus the
        # host's between-run noise, divided over a pooled reference's runs; the last and the
        # best are compared together, so at 5%/2 each): True outside the noise, False within
        # it, None where a run has no interval (runs before the repeats), the two are not the
        # same measurement (the client's and the server's) or the host has no noise figure
        "decode_outside_noise": verdict,
        # what the test could have told: the smallest change flagged 80% of the time
        "detectable_pct": _detectable_pct(decode, rsd, df) if same else None,
        "run_noise": rsd if noise is not None else None,
        # why the decode's change has no verdict, said beside it (None where it has one)
        # (a pooled reference's runs share their clock and all have an interval: its latest speaks)
        "no_verdict": None if verdict is not None else _why_no_verdict(now.get("decode"), level.get("decode"), noise),
    }


def _source(level: dict[str, Any]) -> Any:
    """Whose clock timed a level's per-stream decode: the client's, or the server's own figure
    where the client could not time the tokens (bench.py)."""
    return (level.get("decode") or {}).get("source")


#: the reason with no host noise figure: said once for every level, by :func:`noise_line`
NO_NOISE = "no figure for the noise between runs"
#: what each clock's figure is called where a compare says why it gives no verdict
CLOCKS = {"client": "timed by the client", "server": "the server's own figure"}


def _why_no_verdict(now: dict[str, Any] | None, then: dict[str, Any] | None, noise: Counted | None) -> str | None:
    """Why the per-stream decode's change cannot be judged, in words; None where it can
    (bench_stats.distinct gives None for the last reason too)."""
    if noise is None:
        return NO_NOISE
    ours, theirs = (now or {}).get("source"), (then or {}).get("source")
    if ours != theirs:
        # two clocks: their difference is the measurement's, not the server's
        said = (CLOCKS.get(str(x), f"measured as {x!r}") for x in (ours, theirs))
        return "this run's decode is {}, the reference's {}: not one measurement".format(*said)
    if not now or not then or now.get("stdev") is None or then.get("stdev") is None:
        return "a run has no interval (one round, or stored before the repeats)"
    return None


def _mean(values: Sequence[Any]) -> float | None:
    seen = [v for v in (finite(x) for x in values) if v is not None]
    return sum(seen) / len(seen) if seen else None


def _last_members(
    measured: Sequence[tuple[dict[str, Any], dict[str, Any]]], source: Any, pool_runs: int = POOL_RUNS
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The last configuration's runs (the latest run's recipe, by its sha256, and build), its
    POOL_RUNS most recent, whether or not other configurations ran between them: one
    configuration's unchanged runs differ only by the run effect, so their mean is a reference
    with a fraction of one run's noise (``pool_runs`` 1: the last run alone). Only runs whose
    decode was measured as this run's was (``source``: the client's or the server's figure)
    and has an interval pool, so that the change can be judged; where none of the
    configuration's runs was, the latest alone (shown without a verdict, and why)."""
    run, _ = measured[-1]
    key = (run.get("recipe_sha256"), run.get("build"))
    like = [
        (r, lv)
        for r, lv in measured
        if (r.get("recipe_sha256"), r.get("build")) == key
        and _source(lv) == source
        and (lv.get("decode") or {}).get("stdev") is not None
    ]
    return like[-pool_runs:] if like else [measured[-1]]


def _detectable_pct(decode: dict[str, Any] | None, noise: float, df: int) -> float | None:
    """The detectable change in %, None where there is none to state (no interval, or no rise
    would show: bench_stats.detectable_change's infinity; JSON has no infinity)."""
    found = detectable_change(decode, noise, comparisons=COMPARED, noise_df=df)
    return None if found is None or not math.isfinite(found) else round(found * 100, 1)


def compare_noise(result: dict[str, Any]) -> Counted | None:
    """The between-run noise a compare counts (bench_noise.counted): the recipe's own figure
    (gate.run_noise), else the host's, pooled from its history before this run (``host_noise``
    in the result), else None: no verdict, and the report says what to run."""
    given = finite((result.get("workload") or {}).get("run_noise"))
    kept = result.get("host_noise")
    return counted(str(result.get("host")), given, HostNoise(**kept) if kept else None)


def compare(
    result: dict[str, Any], history: Sequence[dict[str, Any]], pool_runs: int = POOL_RUNS
) -> list[dict[str, Any]]:
    """Per concurrency level of ``result``: its values, the last configuration's and the best run's, and % changes.

    Only runs of the same host and recipe count, and never this run itself (it may already be
    in the history). "Last" is the last configuration (:func:`_last_members`: up to POOL_RUNS
    runs of the latest run's recipe and build, their mean); "best" is the run with the highest
    aggregate tok/s at that level. A level no past run measured has ``last``/``best`` None.
    Each row: ``{"concurrency", "now": {metric: value}, "last": ref | None, "best": ref | None}``
    with ref ``{"at", "first_at", "runs", "build", "recipe_sha256", "recipe_changed", "values":
    {...}, "change_pct": {metric: % | None}, ...}`` (change = (now - then) / then; for TTFT a
    positive change is slower). The per-stream decode's verdict counts the noise of
    :func:`compare_noise`.
    """
    same = (result.get("host"), result.get("recipe"))
    past = [r for r in history if (r.get("host"), r.get("recipe")) == same and r.get("at") != result.get("at")]
    past.sort(key=lambda r: str(r.get("at")))
    noise = compare_noise(result)
    rows = []
    for lv in result.get("levels") or []:
        c = lv.get("concurrency")
        now = tracked(lv) | ({"decode": lv["decode"]} if lv.get("decode") else {})
        measured = [(run, pl) for run in past for pl in run.get("levels") or [] if pl.get("concurrency") == c]
        sha = result.get("recipe_sha256")
        last = _ref(_last_members(measured, _source(lv), pool_runs), now, sha, noise) if measured else None
        scored = [m for m in measured if finite(m[1].get("aggregate_tok_s")) is not None]
        best = _ref([max(scored, key=lambda m: m[1]["aggregate_tok_s"])], now, sha, noise) if scored else None
        rows.append({"concurrency": c, "now": now, "last": last, "best": best})
    return rows


def noise_line(result: dict[str, Any]) -> str:
    """What the compare counted as the noise between runs, or, without a figure, what to run."""
    noise = compare_noise(result)
    if noise is not None:
        return noise.line
    kept = result.get("host_noise")
    own = HostNoise(**kept) if kept else None
    return missing_text(str(result.get("host")), own) + "; the changes are shown without a verdict"


def _change_text(ref: dict[str, Any] | None, key: str, spec: str) -> Text:
    if ref is None:
        return Text("-")
    then, pct = ref["values"].get(key), ref["change_pct"].get(key)
    text = Text(fmt(then, spec))
    noise = ref.get("decode_outside_noise") if key == "per_stream_decode_tok_s" else None
    if pct is not None and noise is not None:
        # both runs have intervals: the change is judged by them, not by a fixed share
        style = ("green" if pct > 0 else "red") if noise else ""
        text.append(f" ({pct:+.1f}%, {'outside' if noise else 'within'} the noise)", style=style)
    elif pct is not None:
        # a throughput drop or a TTFT rise of more than 5% is worth a colour
        worse = pct < -5 if key != "ttft_p95_s" else pct > 5
        better = pct > 5 if key != "ttft_p95_s" else pct < -5
        text.append(f" ({pct:+.1f}%)", style="red" if worse else "green" if better else "")
    return text


def render_compare(rows: Sequence[dict[str, Any]], console: Console) -> Table:
    """This run against the last configuration (the mean of its recent runs) and the best run,
    per level: values and % change."""
    table = Table(title="voltaforge bench: against the history (same host and recipe)")
    columns = ["concurrency", "aggregate tok/s", "vs last", "vs best", "per-stream tok/s", "vs last", "vs best"]
    columns += ["TTFT p95 s", "vs last", "vs best"]
    for i, col in enumerate(columns):
        table.add_column(col, justify="right" if i else "left", overflow="fold")
    for r in rows:
        cells = [Text(str(r["concurrency"]))]
        for key, spec in (("aggregate_tok_s", ".1f"), ("per_stream_decode_tok_s", ".1f"), ("ttft_p95_s", ".3f")):
            cells += [Text(fmt(r["now"].get(key), spec)), _change_text(r["last"], key, spec)]
            cells.append(_change_text(r["best"], key, spec))
        table.add_row(*cells)
    console.print(table)
    for r in rows:
        for label in ("last", "best"):
            line = _verdict_line(r["concurrency"], label, r[label])
            if line:
                console.print(Text(line))
    refs = [r[k] for r in rows for k in ("last", "best") if r[k]]
    if not refs:
        console.print(Text("no earlier run of this host and recipe to compare with"))
    else:
        for label in ("last", "best"):
            seen = {(str(r[label]["first_at"]), str(r[label]["at"]), r[label]["runs"], str(r[label]["build"]),
                     r[label]["recipe_changed"]) for r in rows if r[label]}  # fmt: skip
            for first, at, runs, build, changed in sorted(seen):
                note = ", recipe changed since" if changed else ""
                when = f"run at {at}" if runs == 1 else f"{runs} runs of one configuration, {first} to {at}"
                console.print(Text(f"{label}: {when}, build {build}{note}"))
    return table


def _verdict_line(concurrency: Any, label: str, ref: dict[str, Any] | None) -> str | None:
    """The per-stream decode's change against one reference and its verdict, or why it has
    none; None where there is no change to state."""
    pct = ((ref or {}).get("change_pct") or {}).get("per_stream_decode_tok_s")
    if ref is None or pct is None:
        return None
    what = f"concurrency {concurrency}: per-stream decode {pct:+.1f}% against {_ref_name(label, ref)}"
    noise = ref.get("decode_outside_noise")
    if noise is None:
        why = ref.get("no_verdict")
        return f"{what}, no verdict: {why}" if why and why != NO_NOISE else None
    if noise:
        return f"{what}, outside the noise: a real change"
    shown = ref.get("detectable_pct")
    size = f"a change of {shown:.0f}% or more" if shown is not None else "at this noise no change"
    return f"{what}, within the noise: no change shown ({size} would show 80% of the time)"


def _ref_name(label: str, ref: dict[str, Any] | None) -> str:
    """``the last run``, ``the last 5 runs`` (a pooled reference), ``the best run``."""
    runs = (ref or {}).get("runs") or 1
    return f"the {label} {runs} runs" if runs > 1 else f"the {label} run"
