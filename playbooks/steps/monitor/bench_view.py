"""Prometheus's view of one bench run (issue 58): the server's own counters over the run's
window beside what the bench sent and measured, and the host's GPUs over that window. Pure: the
queries and what their answers mean; conduct/bench_view.py asks them, cli/bench.py and the
Markdown report show the result.

The window is exact, not extrapolated. A counter's rise is its value at Prometheus's first
scrape after the run's last answer minus its value at the last scrape before the run's first
request: raw samples of a range selector, not ``increase()``, which stretches the rise it saw
to the window's edges. Everything the server did between those two scrapes is in it: the run's
requests, its probe and warm-ups too (which the bench's own figures leave out and ``sent``
counts), and anyone else's. So on a quiet server the tokens Prometheus saw equal the tokens the
bench received; more means other clients were served during the run. A counter that fell
inside the window (the server restarted) gives no figure and says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from playbooks.steps.monitor.top import Sample

#: the server's counters read as raw samples (llama-server's --metrics at the pin)
COUNTERS = {"tokens": "llamacpp:tokens_predicted_total", "decode_s": "llamacpp:tokens_predicted_seconds_total"}

#: one series' raw samples: (unix seconds, value)
Values = list[tuple[float, float]]


def _q(value: str) -> str:
    """A PromQL string literal: double quotes, backslash escapes (JSON's, for these names)."""
    return json.dumps(value)


def server_selector(result: Mapping[str, Any]) -> str:
    """The server the run measured, by the labels `invoke monitor` gives its target."""
    server = result.get("server") or {}
    return (
        f"{{job={_q('llama-server')},host={_q(result['host'])},service={_q(server.get('service', ''))},"
        f"model={_q(server.get('model', ''))}}}"
    )


def span_for(start: float, now: float, interval_s: float) -> int:
    """Seconds a range selector evaluated at ``now`` reaches back to hold a scrape before
    ``start`` (a scrape interval, with Prometheus's jitter, is the most that can separate them)."""
    return int(max(0.0, now - start)) + 2 * int(interval_s) + 2


def raw_query(counter: str, selector: str, span_s: int) -> str:
    return f"{COUNTERS[counter]}{selector}[{span_s}s]"


def window_queries(result: Mapping[str, Any], selector: str, span_s: int) -> dict[str, str]:
    """Over the window, evaluated at its last scrape: the most requests the server deferred and
    held at once, and per GPU of its host the lowest SM clock, the highest temperature and
    power, and every reason that held the clocks at some scrape (the GPU exporter's series)."""
    gpu = f"{{host={_q(result['host'])}}}"
    over = f"[{span_s}s]"
    return {
        "deferred": f"max_over_time(llamacpp:requests_deferred{selector}{over})",
        "busy": f"max_over_time(llamacpp:requests_processing{selector}{over})",
        "sm": f"min_over_time(voltaforge_gpu_sm_clock_hertz{gpu}{over})",
        "temp": f"max_over_time(voltaforge_gpu_temperature_celsius{gpu}{over})",
        "power": f"max_over_time(voltaforge_gpu_power_watts{gpu}{over})",
        "held": f"max_over_time(voltaforge_gpu_clocks_event_reason{gpu}{over}) == 1",
        "gpus": f"last_over_time(voltaforge_gpus{gpu}{over})",
    }


def parse_matrix(payload: Mapping[str, Any]) -> list[Values]:
    """Prometheus's answer to a range selector: each series' raw samples, oldest first."""
    if payload.get("status") != "success":
        raise ValueError(f"Prometheus answered {payload.get('errorType', '')}: {payload.get('error', payload)}")
    data = payload["data"]
    if data.get("resultType") != "matrix":
        raise ValueError(f"not a range vector: {data.get('resultType')}")
    return [[(float(t), float(v)) for t, v in series["values"]] for series in data["result"]]


def scraped_after(values: Values, end: float) -> bool:
    return any(t >= end for t, _ in values)


def rise(values: Values, start: float, end: float) -> tuple[float | None, tuple[float, float] | None, str | None]:
    """(the counter's rise from the last sample at or before ``start`` to the first at or after
    ``end``, those two samples' times, why there is no figure)."""
    before = [(t, v) for t, v in values if t <= start]
    after = [(t, v) for t, v in values if t >= end]
    if not before:
        return None, None, "Prometheus has no sample of it from before the run (its first scrape came after)"
    if not after:
        return None, None, "Prometheus has not scraped it since the run ended"
    (t0, v0), (t1, v1) = before[-1], after[0]
    inside = [v for t, v in values if t0 <= t <= t1]
    if any(b < a for a, b in zip(inside, inside[1:], strict=False)):
        return None, None, "its counters fell during the run: the server restarted"
    return v1 - v0, (t0, t1), None


def _gpu_rows(answers: Mapping[str, Sequence[Sample]]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for key, field, scale in (("sm", "sm_min_mhz", 1e-6), ("temp", "temp_max_c", 1.0), ("power", "power_max_w", 1.0)):
        for labels, value in answers.get(key, ()):
            rows.setdefault(labels.get("gpu", ""), {"gpu": labels.get("gpu", ""), "held": []})[field] = round(
                value * scale, 1
            )
    for labels, _ in answers.get("held", ()):
        row = rows.setdefault(labels.get("gpu", ""), {"gpu": labels.get("gpu", ""), "held": []})
        row["held"] = sorted({*row["held"], labels.get("reason", "")})
    return [rows[k] for k in sorted(rows, key=lambda g: (len(g), g))]


def run_view(
    result: Mapping[str, Any],
    series: Mapping[str, Values],
    answers: Mapping[str, Sequence[Sample]],
    source: str,
) -> dict[str, Any]:
    """The view kept in the result (``result["prometheus"]``): what Prometheus saw over the
    window beside what the bench sent, or ``{"error": ...}`` saying why there is none."""
    sent = result["sent"]
    tokens, window, why = rise(series.get("tokens", []), sent["from"], sent["to"])
    if why or tokens is None or window is None:
        return {"source": source, "error": why}
    decode_s, _, _ = rise(series.get("decode_s", []), sent["from"], sent["to"])
    gpus = answers.get("gpus", ())
    return {
        "source": source,
        "window": {"from": window[0], "to": window[1], "span_s": round(window[1] - window[0], 1)},
        "tokens_predicted": int(round(tokens)),
        "sent_tokens": sent["completion_tokens"],
        "sent_requests": sent["requests"],
        # llama-server's own time generating, summed over requests: its mean decode rate a stream
        "decode_tok_s": round(tokens / decode_s, 1) if decode_s else None,
        "deferred_max": _first(answers.get("deferred", ())),
        "busy_max": _first(answers.get("busy", ())),
        "gpus": _gpu_rows(answers),
        "gpus_seen": None if not gpus else int(gpus[0][1]),
    }


def single_stream(result: Mapping[str, Any]) -> float | None:
    """The bench's own single-stream decode tok/s (its level at concurrency 1), if it ran one."""
    level = next((lv for lv in result.get("levels") or [] if lv.get("concurrency") == 1), None)
    mean = ((level or {}).get("decode") or {}).get("mean")
    return None if mean is None else float(mean)


def _first(samples: Sequence[Sample]) -> int | None:
    return int(round(samples[0][1])) if samples else None


def agreement(view: Mapping[str, Any]) -> str:
    """The tokens line's verdict: equal, or how many more the server generated."""
    extra = view["tokens_predicted"] - view["sent_tokens"]
    if extra == 0:
        return "equal"
    if extra > 0:
        return f"{extra} more: other clients were served during the run"
    return f"{-extra} fewer: a scrape or the server lost some"


def view_rows(view: Mapping[str, Any], single_stream_tok_s: float | None) -> list[tuple[str, str, str]]:
    """(what, Prometheus, the bench) rows; an error is one row."""
    if view.get("error"):
        return [("Prometheus's view", view["error"], "")]
    rows = [
        (
            "tokens generated",
            f"{view['tokens_predicted']} ({agreement(view)})",
            f"{view['sent_tokens']} received in {view['sent_requests']} requests (probe and warm-ups included)",
        ),
        (
            "decode tok/s a stream",
            "-" if view["decode_tok_s"] is None else f"{view['decode_tok_s']:.1f} (the server's timing, every request)",
            "-" if single_stream_tok_s is None else f"{single_stream_tok_s:.1f} (single stream)",
        ),
        ("requests deferred, most", _n(view["deferred_max"]), ""),
        ("requests processing, most", _n(view["busy_max"]), ""),
    ]
    for g in view["gpus"]:
        figures = ", ".join(
            f
            for f in (
                _unit(g.get("sm_min_mhz"), "MHz SM lowest", "{:.0f}"),
                _unit(g.get("temp_max_c"), "C highest", "{:.0f}"),
                _unit(g.get("power_max_w"), "W highest", "{:.0f}"),
                "held by " + (", ".join(g["held"]) or "nothing"),
            )
            if f
        )
        rows.append((f"GPU {g['gpu']}", figures, ""))
    if not view["gpus"] and view.get("gpus_seen") == 0:
        rows.append(("GPUs", "none seen on the host (its GPU exporter says so)", ""))
    return rows


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _unit(value: float | None, unit: str, fmt: str) -> str:
    return "" if value is None else f"{fmt.format(value)} {unit}"


def view_markdown(view: Mapping[str, Any], single_stream_tok_s: float | None) -> list[str]:
    """The report's section: where the figures come from, then the rows as a table."""
    if view.get("error"):
        return ["## Prometheus's view of the run", "", f"- {view.get('source')}: {view['error']}", ""]
    w = view["window"]
    head = (
        f"From {view['source']}: the server's counters between its scrape before the run's first request "
        f"and its first after the last answer ({w['span_s']} s apart)."
    )
    rows = view_rows(view, single_stream_tok_s)
    return (
        ["## Prometheus's view of the run", "", head, "", "| | Prometheus | the bench |", "|---|---|---|"]
        + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        + [""]
    )
