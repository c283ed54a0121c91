"""`invoke bench`'s reports of one sweep result, shown to people and kept for tools:
``write_reports`` writes ``bench.json`` (the dict itself), ``bench.md`` and ``bench.png`` in one
folder, each atomically (steps/measure/atomic_files.py); ``render_sweep_table`` prints the same
table in the terminal (rich), with the gate line. Pure except the files it is asked to write;
the figures are bench_figures'."""

from __future__ import annotations

import io
import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.steps.measure import roofline as ceiling
from playbooks.steps.measure.atomic_files import atomic_write_bytes
from playbooks.steps.measure.bench_figures import (
    fmt,
    gate_line,
    knee_text,
    of_roofline,
    per_stream,
    result_title,
    roofline_note,
    sweep_columns,
    sweep_rows,
)
from playbooks.steps.measure.roofline import finite
from playbooks.steps.monitor.bench_view import single_stream, view_markdown

REPORT_FILES = {"json": "bench.json", "markdown": "bench.md", "png": "bench.png"}

# The chart's size in pixels is FIGSIZE x DPI: 1000 x 600, fixed, never "tight", so two runs
# draw on the same canvas and their PNGs can be compared (and diffed byte for byte).
CHART_FIGSIZE_IN = (10.0, 6.0)
CHART_DPI = 100


# ------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------


def _md(text: Any) -> str:
    """Text from a host or a server in a Markdown table cell or line: pipes and newlines are data."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def _telemetry_lines(telemetry: dict[str, Any]) -> list[str]:
    s = telemetry.get("summary") or {}
    if s.get("throttled"):
        when = finite(s.get("started_at_s"))
        at = f" from {when:.1f} s into the sweep" if when is not None else ""
        reasons = ", ".join(str(r) for r in s.get("reasons") or []) or "no reason reported"
        throttle = f"**throttled**{at}: {_md(reasons)}"
    else:
        throttle = "not throttled"
    return [
        f"- source: {_md(telemetry.get('source'))}",
        f"- {throttle}",
        f"- max temperature: {fmt(s.get('max_temperature_c'), '.0f')} C",
        f"- SM clock: {fmt(s.get('min_sm_clock_mhz'), '.0f')} to {fmt(s.get('max_sm_clock_mhz'), '.0f')} MHz",
        f"- mean power: {fmt(s.get('mean_power_w'), '.0f')} W",
    ]


def _llama_bench_rows(result: dict[str, Any]) -> list[list[str]]:
    lb = result["llama_bench"]
    first: dict[str, Any] = next((lv for lv in result.get("levels") or [] if lv.get("concurrency") == 1), {})

    def row(what: str, bench: Any, ours: Any, ceiling: Any) -> list[str]:
        b, o = finite(bench), finite(ours)
        return [
            what,
            of_roofline(b, ceiling),
            of_roofline(o, ceiling),
            f"{o / b:.2f}" if b and o is not None else "-",
        ]

    return [
        row(
            "decode (tg) tok/s", lb.get("tg_tok_s"), per_stream(first) if first else None, result.get("roofline_tok_s")
        ),
        row("prefill (pp) tok/s", lb.get("pp_tok_s"), first.get("prefill_tok_s"), result.get("prefill_ceiling_tok_s")),
    ]


def _requests_text(workload: dict[str, Any]) -> str:
    bounds = workload.get("requests_per_level")
    if isinstance(bounds, dict) and bounds:
        spans = ", ".join(f"{c}: {lo}-{hi}" for c, (lo, hi) in bounds.items())
        target = finite(workload.get("ci_target"))
        until = f" until the 95% half-width is within {target:.0%} of the mean" if target else ""
        return f"after a warm-up round, requests per level (concurrency: fewest-most) {spans}{until}"
    if bounds is not None:
        return f"{bounds} requests per level"
    return "requests per level not recorded"


def _client_text(result: dict[str, Any]) -> str:
    where = str(result.get("client") or "not recorded")
    cpu = result.get("client_cpu") or {}
    cores = finite(cpu.get("cores"))
    if cpu.get("on_served_host"):
        share = f": it took {cores:.2f} of the host's {cpu.get('host_cpus')} CPUs" if cores is not None else ""
        return f"{where}, on the served host (it competes with the server for CPU{share})"
    took = f", {cores:.2f} CPUs of its own" if cores is not None else ""
    return f"{where}, not on the served host{took}"


def _membw_text(membw: dict[str, Any]) -> str:
    gb = finite(membw.get("gb_s"))
    probe = membw.get("probe") or {}
    trials = [t for t in probe.get("trials") or [] if finite(t) is not None]
    spread = f", trials {min(trials):.1f}-{max(trials):.1f} GB/s" if trials else ""
    figure = f"{gb:.1f} GB/s" if gb is not None else "not measured"
    return f"{figure} (best of {len(trials) or '?'}{spread}; {membw.get('source')})"


def render_markdown(result: dict[str, Any]) -> str:
    """The report people read: gate first, then the sweep, then what explains it."""
    server = result.get("server") or {}
    workload = result.get("workload") or {}
    gate = result.get("gate") or {}
    out = [f"# Benchmark: {_md(result_title(result))}", ""]
    if result.get("complete") is False:
        out += ["**INCOMPLETE RUN**: not every level finished; not kept in the history.", ""]
    out += [
        f"- server: {_md(server.get('kind'))}, build {_md(server.get('build') or 'not recorded')}, "
        f"at {_md(server.get('url') or 'port ' + str(server.get('port')))}",
        f"- model: `{_md(server.get('model'))}`",
        f"- recipe sha256: `{_md(result.get('recipe_sha256'))}`",
        f"- workload: {workload.get('prompt_tokens')} prompt tokens, {workload.get('max_tokens')} tokens out per "
        f"request (EOS ignored), seed {workload.get('seed')}; {_md(_requests_text(workload))}",
        f"- client: {_md(_client_text(result))}",
        f"- roofline: {fmt(result.get('roofline_tok_s'))} tok/s per stream ({_md(result.get('roofline_basis'))})"
        if finite(result.get("roofline_tok_s"))
        else f"- roofline: none ({_md(result.get('roofline_basis') or 'not computed')})",
    ]
    if result.get("membw"):
        out.append(f"- host memory bandwidth: {_md(_membw_text(result['membw']))}")
    out += [
        f"- prefill ceiling: {fmt(result.get('prefill_ceiling_tok_s'))} tok/s ({_md(result.get('prefill_basis'))})",
        f"- MBU: {_md(ceiling.mbu_text(result))}",
        "",
        "## Gate",
        "",
        f"**{'PASSED' if gate.get('passed') else 'FAILED' if gate else 'NOT RUN'}**",
        "",
    ]
    for title, items in (("Reasons", gate.get("reasons")), ("Diagnosis", gate.get("diagnosis"))):
        if items:
            out += [f"{title}:", ""] + [f"- {_md(i)}" for i in items] + [""]
    if gate.get("thresholds"):
        out += ["Thresholds: " + ", ".join(f"{_md(k)} {_md(v)}" for k, v in sorted(gate["thresholds"].items())), ""]
    out += ["## Sweep", "", _md(roofline_note(result)), ""]
    out += _md_table(sweep_columns(result), sweep_rows(result)) + [""]
    out += [
        "MBU is the per-stream decode rate over the roofline. An aggregate above 100% is batching "
        "(one decode step reads the weights once for every stream); client/server near 1.00 means the "
        "client measures what the server reports.",
        "",
    ]
    errors = [lv for lv in result.get("levels") or [] if lv.get("errors")]
    for lv in errors:
        samples = "; ".join(_md(s) for s in lv.get("error_samples") or []) or "no sample kept"
        out.append(f"- errors at concurrency {lv.get('concurrency')}: {samples}")
    out += [""] if errors else []
    out += ["## Knee and scaling", "", f"- knee: {_md(knee_text(result))}"]
    out += [f"- scaling: {_md(result.get('scaling') or 'not judged')}", ""]
    if result.get("telemetry"):
        out += ["## Telemetry", ""] + _telemetry_lines(result["telemetry"]) + [""]
    if result.get("llama_bench"):
        lb = result["llama_bench"]
        note = "(%) = share of the roofline (decode) or the prefill ceiling (prefill)"
        out += ["## llama-bench cross-check", "", note, ""]
        header = ["", "llama-bench", "this sweep, concurrency 1", "sweep / llama-bench"]
        out += _md_table(header, _llama_bench_rows(result))
        out += ["", f"`{_md(lb.get('command'))}`", ""]
    if result.get("prometheus"):
        out += view_markdown(result["prometheus"], single_stream(result))
    sanity = result.get("sanity")
    if sanity:
        out += ["## Sanity", "", "- checked: " + (", ".join(_md(c) for c in sanity.get("checked") or []) or "nothing")]
        out += [f"- skipped {_md(k)}: {_md(v)}" for k, v in sorted((sanity.get("skipped") or {}).items())]
        out += [f"- **failed**: {_md(f)}" for f in sanity.get("failures") or []] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------
# chart
# ------------------------------------------------------------------------------------------


def chart_png(result: dict[str, Any]) -> bytes:
    """The chart as PNG bytes: throughput vs concurrency on a log2 axis, TTFT p95 on the right.

    Drawn on a Figure with its own Agg canvas, never pyplot: no display is touched, no global
    figure state is shared between threads, and nothing needs closing. The PNG carries no
    "Software" text chunk (the matplotlib version), so the same data gives the same bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    levels = sorted(result.get("levels") or [], key=lambda lv: lv.get("concurrency") or 0)
    conc = [lv.get("concurrency") for lv in levels]

    series = chart_series(result)
    fig = Figure(figsize=CHART_FIGSIZE_IN, dpi=CHART_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(conc, series["aggregate_tok_s"], marker="o", color="tab:blue", label="aggregate tok/s")
    ax.plot(conc, series["per_stream_decode_tok_s"], marker="s", color="tab:green", label="per-stream decode tok/s")
    roof = finite(result.get("roofline_tok_s"))
    if roof:
        ax.axhline(
            roof,
            linestyle="--",
            color="tab:red",
            label=f"single-stream roofline {roof:.1f} tok/s ({result.get('roofline_basis')})",
        )
    elif result.get("roofline_basis"):  # none drawn: the legend says why (cache-resident)
        ax.plot([], [], linestyle="none", label=f"no roofline: {result.get('roofline_basis')}")
    if conc:
        ax.set_xscale("log", base=2)  # only with data: matplotlib cannot log-scale an empty axis
        ax.xaxis.set_major_locator(FixedLocator(conc))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in conc])
    ax.set_xlabel("concurrency (streams)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)

    ttft = ax.twinx()
    ttft.plot(conc, series["ttft_p95_s"], marker="^", linestyle=":", color="tab:orange", label="TTFT p95 (s)")
    ttft.set_ylabel("TTFT p95 s")
    ttft.set_ylim(bottom=0)

    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ttft.get_legend_handles_labels()
    # below the plot: inside it the legend would hide the high-concurrency points it explains
    ax.legend(handles + h2, labels + l2, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize="small")
    gate = (result.get("gate") or {}).get("passed")
    ax.set_title(
        f"{result.get('recipe')} on {result.get('host')} ({result.get('at')})"
        + ("" if gate is None else ", gate " + ("passed" if gate else "FAILED"))
    )
    fig.tight_layout()  # arranges inside the fixed canvas; the pixel size does not change
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=CHART_DPI, metadata={"Software": None})
    return buf.getvalue()


def chart_series(result: dict[str, Any]) -> dict[str, list[float]]:
    """The chart's lines, by concurrency (NaN: a figure missing): the aggregate, the one
    per-stream decode figure (:func:`per_stream`) and TTFT p95."""
    levels = sorted(result.get("levels") or [], key=lambda lv: lv.get("concurrency") or 0)

    def nan(v: float | None) -> float:
        return math.nan if v is None else v

    return {
        "aggregate_tok_s": [nan(finite(lv.get("aggregate_tok_s"))) for lv in levels],
        "per_stream_decode_tok_s": [nan(per_stream(lv)) for lv in levels],
        "ttft_p95_s": [nan(finite(lv.get("ttft_p95_s"))) for lv in levels],
    }


# ------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------


def result_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True) + "\n"


def write_reports(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """``bench.json``, ``bench.md``, ``bench.png`` in ``out_dir`` (made if missing), each atomic.

    Everything is rendered before the first file is written: a chart that cannot be drawn
    leaves the folder as it was, not with a JSON beside an older chart.
    """
    out_dir = Path(out_dir)
    contents = {
        "json": result_json(result).encode(),
        "markdown": render_markdown(result).encode(),
        "png": chart_png(result),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    return {kind: atomic_write_bytes(out_dir / REPORT_FILES[kind], data) for kind, data in contents.items()}


# ------------------------------------------------------------------------------------------
# terminal
# ------------------------------------------------------------------------------------------


def render_sweep_table(result: dict[str, Any], console: Console) -> Table:
    """What `invoke bench` prints: the sweep table (the markdown's columns), the knee, the gate."""
    table = Table(title=Text(f"voltaforge bench: {result_title(result)}"), caption=Text(roofline_note(result)))
    rows = sweep_rows(result)
    for i, col in enumerate(sweep_columns(result)):
        # headers wrap to their figures' width, so the figures never do: left to itself rich
        # shares the width by header length and puts a "(50%)" on a line of its own
        widest = max([len(r[i]) for r in rows] + [8])
        header = Text(textwrap.fill(col, widest, break_long_words=False))
        table.add_column(header, justify="right" if i else "left", overflow="fold")
    for row in rows:
        table.add_row(*(Text(c) for c in row))
    console.print(table)
    if result.get("complete") is False:
        console.print(Text("incomplete run: not kept in the history", style="bold yellow"))
    console.print(Text(f"knee: {knee_text(result)}"))
    gate = result.get("gate") or {}
    console.print(Text(gate_line(result), style="green" if gate.get("passed") else "bold red"))
    for d in gate.get("diagnosis") or []:
        console.print(Text(f"  diagnosis: {d}"))
    return table
