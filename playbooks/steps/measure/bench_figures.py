"""The figures of one bench result as every view of it writes them (the Markdown report, the
terminal table, the chart's series, the history's tracked figures): each decode rate beside the
roofline (bandwidth / bytes streamed per token) as a percentage. Per stream that is the MBU, the
number that says whether the server or the memory is the limit. Aggregate rates above 100% are
not an error: a batched decode step reads the weights once for every stream in the batch. A
per-stream rate above it is, and says so (:mod:`roofline`); a cache-resident model has no
roofline and no percentage.

A level's per-stream decode is one figure wherever it is shown: :func:`bench.decode_figure`
(the judged estimate; in results and history written before it, the server's own where the
client could not time the tokens), never the client's own rate where that could not be timed."""

from __future__ import annotations

from typing import Any

from playbooks.steps.measure import roofline as ceiling
from playbooks.steps.measure.bench import decode_figure
from playbooks.steps.measure.bench_stats import halfwidth_text
from playbooks.steps.measure.roofline import finite

# The metrics history and compare track per level: the ones a regression shows in first.
# per_stream_decode_tok_s is the judged figure (:func:`per_stream`), in old lines and new.
TRACKED = ("aggregate_tok_s", "per_stream_decode_tok_s", "ttft_p95_s")
# For TTFT lower is better; compare still reports the plain % change and leaves judging to people.


def fmt(v: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    n = finite(v)
    return "-" if n is None else format(n * scale, spec)


def per_stream(level: dict[str, Any]) -> float | None:
    """The level's one per-stream decode figure (:func:`bench.decode_figure`), None for none."""
    return finite(decode_figure(level)) or None


def of_roofline(v: Any, roofline: Any, bounded: bool = True) -> str:
    """``61.0 (51%)``: a decode rate and its share of the single-stream roofline; a per-stream
    rate over it: ``(above the ceiling)``; ``bounded=False``: an aggregate, which may pass it."""
    n = finite(v)
    return "-" if n is None else f"{n:.1f}{ceiling.share_text(n, roofline, bounded)}"


def decode_text(level: dict[str, Any], roofline: Any) -> str:
    """``163.2 ± 3.1 (53%)``: the level's per-stream decode (the figure it is judged by) with its
    95% half-width and its share of the roofline; a ``*`` marks the server's own figure, used
    where the client could not time the tokens."""
    decode = level.get("decode") or {}
    mean = finite(decode.get("mean"))
    if mean is None:  # a level stored before the estimates
        text = of_roofline(per_stream(level), roofline)
        return text + ("*" if level.get("crosscheck") and text != "-" else "")
    hw = finite(decode.get("halfwidth"))
    # the cap reached short of the target: said beside the interval (``± 6.5 (4.7%, cap reached)``)
    text = f"{mean:.1f}" + (halfwidth_text(decode) if hw is not None else " (n=1)")
    text += ceiling.share_text(mean, roofline)
    return text + ("*" if decode.get("source") == "server" else "")


def crosscheck_ratio(level: dict[str, Any]) -> float | None:
    """Client-measured per-stream decode over the server's own ``predicted_per_second``.

    Near 1.0 the client measures what the server does; far from it, one of the two counts
    something else (prefill in the decode time, a slow SSE stream, a wrong token count).
    """
    given = finite(level.get("crosscheck_ratio"))
    if given is not None:
        return given
    if level.get("crosscheck"):  # the client could not time tokens this fast: no ratio
        return None
    # the client's own rate: client_decode_tok_s; a level stored before it had only the old field
    own = level["client_decode_tok_s"] if "client_decode_tok_s" in level else level.get("per_stream_decode_tok_s")
    client, server = finite(own), finite(level.get("server_predicted_per_second"))
    return client / server if client is not None and server else None


def sweep_columns(result: dict[str, Any]) -> list[str]:
    """The sweep table's headers; every "%" is of the single-stream roofline (:func:`roofline_note`)."""
    return [
        "concurrency",
        "aggregate tok/s",
        "per-stream decode tok/s ± 95% (MBU)",
        "server predicted tok/s",
        "client/server",
        "TTFT p50/p95/p99 ms",
        "ITL p50/p95 ms",
        "errors",
    ]


def roofline_note(result: dict[str, Any]) -> str:
    roof = finite(result.get("roofline_tok_s"))
    basis = result.get("roofline_basis")
    if roof:
        head = f"(%) = share of the single-stream roofline, {roof:.1f} tok/s ({basis})"
        rates = [(per_stream(lv), finite(lv.get("server_predicted_per_second"))) for lv in result.get("levels") or []]
        if any(v is not None and v > roof for pair in rates for v in pair):
            head += f"; {ceiling.ABOVE_CEILING_CELL} = a per-stream rate over it: a ceiling or measurement error"
    elif basis:
        head = f"no roofline, rates without a share: {basis}"
    else:
        head = "no roofline in this result: rates are shown without a share"
    return (
        f"{head}; ± = 95% confidence half-width of the mean; * = the server's own rate (the client could not "
        "time the tokens)"
    )


def sweep_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row of text per concurrency level, in the order of :func:`sweep_columns`."""
    roof = result.get("roofline_tok_s")
    rows = []
    for lv in result.get("levels") or []:
        errors, requests = lv.get("errors"), lv.get("requests")
        rows.append(
            [
                str(lv.get("concurrency")),
                of_roofline(lv.get("aggregate_tok_s"), roof, bounded=False),
                decode_text(lv, roof),
                of_roofline(lv.get("server_predicted_per_second"), roof),
                "not timeable" if lv.get("crosscheck") else fmt(crosscheck_ratio(lv), ".2f"),
                "/".join(fmt(lv.get(f"ttft_{p}_s"), ".0f", 1000) for p in ("p50", "p95", "p99")),
                "/".join(fmt(lv.get(f"itl_{p}_s"), ".1f", 1000) for p in ("p50", "p95")),
                f"{errors}/{requests}" if requests is not None else str(errors),
            ]
        )
    return rows


def gate_line(result: dict[str, Any]) -> str:
    gate = result.get("gate") or {}
    if not gate:
        return "gate: not run"
    if gate.get("passed"):
        return "gate: PASSED"
    reasons = gate.get("reasons") or []
    return "gate: FAILED" + (": " + "; ".join(str(r) for r in reasons) if reasons else "")


def knee_text(result: dict[str, Any]) -> str:
    knee = result.get("knee")
    if not knee:
        return "no knee within the sweep: aggregate throughput still rose at the highest concurrency"
    return f"concurrency {knee.get('concurrency')}: {knee.get('why')}"


def result_title(result: dict[str, Any]) -> str:
    return f"{result.get('recipe')} on {result.get('host')}, {result.get('at')}"
