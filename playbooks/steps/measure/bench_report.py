"""`invoke bench`'s reports: one sweep result, shown to people, kept for tools, remembered.

The benchmark (client, sweep, gate) produces one result dict; this module only shows it:

- ``write_reports``: ``bench.json`` (the dict itself), ``bench.md`` and ``bench.png`` in one
  folder, each written to a temp file beside it and renamed, so a reader never sees half a
  report and an interrupted run leaves no stray files.
- ``render_sweep_table``: the same table in the terminal (rich), with the gate line.
- ``append_history`` / ``read_history`` / ``compare`` / ``render_compare``: one JSON line per
  complete run on the controller; this run against the last and the best of the same host and
  recipe, per concurrency level.

Everything is pure except the files it is asked to write. Every decode rate stands beside the
roofline (bandwidth / bytes streamed per token) as a percentage: per stream that is the MBU, the
number that says whether the server or the memory is the limit. Aggregate rates above 100% are
not an error: a batched decode step reads the weights once for every stream in the batch. A
per-stream rate above it is, and says so (:mod:`roofline`); a cache-resident model has no
roofline and no percentage.

A level's per-stream decode is one figure wherever it is shown: :func:`bench.decode_figure`
(the judged estimate; in results and history written before it, the server's own where the
client could not time the tokens), never the client's own rate where that could not be timed.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.errors import VoltaforgeError
from playbooks.steps.measure import roofline as ceiling
from playbooks.steps.measure.bench import decode_figure
from playbooks.steps.measure.bench_noise import Counted, HostNoise, counted, missing_text
from playbooks.steps.measure.bench_stats import detectable_change, distinct, halfwidth_text, pooled
from playbooks.steps.measure.roofline import finite

REPORT_FILES = {"json": "bench.json", "markdown": "bench.md", "png": "bench.png"}

# The chart's size in pixels is FIGSIZE x DPI: 1000 x 600, fixed, never "tight", so two runs
# draw on the same canvas and their PNGs can be compared (and diffed byte for byte).
CHART_FIGSIZE_IN = (10.0, 6.0)
CHART_DPI = 100

# The metrics history and compare track per level: the ones a regression shows in first.
# per_stream_decode_tok_s is the judged figure (:func:`per_stream`), in old lines and new.
TRACKED = ("aggregate_tok_s", "per_stream_decode_tok_s", "ttft_p95_s")
# For TTFT lower is better; compare still reports the plain % change and leaves judging to people.


class IncompleteResult(VoltaforgeError, ValueError):
    """A partial sweep (interrupted, a level missing) kept out of the history it would skew."""


# ------------------------------------------------------------------------------------------
# atomic files
# ------------------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable[[io.BufferedWriter], None]) -> Path:
    """Write through ``write`` into a temp file beside ``path``, fsync, rename over ``path``.

    The temp file is on the same filesystem (rename is atomic) and hidden; it is removed on
    every failure, so nothing but finished files is ever left in the folder.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".vf-tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports are meant to be read and shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _atomic_write_bytes(path: Path, data: bytes) -> Path:
    def write(f: io.BufferedWriter) -> None:
        f.write(data)

    return _atomic_write(path, write)


# ------------------------------------------------------------------------------------------
# figures, shared by the markdown and the terminal tables
# ------------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    n = finite(v)
    return "-" if n is None else format(n * scale, spec)


def per_stream(level: dict[str, Any]) -> float | None:
    """The level's one per-stream decode figure (:func:`bench.decode_figure`), None for none."""
    return finite(decode_figure(level)) or None


def _of_roofline(v: Any, roofline: Any, bounded: bool = True) -> str:
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
        text = _of_roofline(per_stream(level), roofline)
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
                _of_roofline(lv.get("aggregate_tok_s"), roof, bounded=False),
                decode_text(lv, roof),
                _of_roofline(lv.get("server_predicted_per_second"), roof),
                "not timeable" if lv.get("crosscheck") else _fmt(crosscheck_ratio(lv), ".2f"),
                "/".join(_fmt(lv.get(f"ttft_{p}_s"), ".0f", 1000) for p in ("p50", "p95", "p99")),
                "/".join(_fmt(lv.get(f"itl_{p}_s"), ".1f", 1000) for p in ("p50", "p95")),
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


def _knee_text(result: dict[str, Any]) -> str:
    knee = result.get("knee")
    if not knee:
        return "no knee within the sweep: aggregate throughput still rose at the highest concurrency"
    return f"concurrency {knee.get('concurrency')}: {knee.get('why')}"


def _title(result: dict[str, Any]) -> str:
    return f"{result.get('recipe')} on {result.get('host')}, {result.get('at')}"


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
        f"- max temperature: {_fmt(s.get('max_temperature_c'), '.0f')} C",
        f"- SM clock: {_fmt(s.get('min_sm_clock_mhz'), '.0f')} to {_fmt(s.get('max_sm_clock_mhz'), '.0f')} MHz",
        f"- mean power: {_fmt(s.get('mean_power_w'), '.0f')} W",
    ]


def _llama_bench_rows(result: dict[str, Any]) -> list[list[str]]:
    lb = result["llama_bench"]
    first: dict[str, Any] = next((lv for lv in result.get("levels") or [] if lv.get("concurrency") == 1), {})

    def row(what: str, bench: Any, ours: Any, ceiling: Any) -> list[str]:
        b, o = finite(bench), finite(ours)
        return [
            what,
            _of_roofline(b, ceiling),
            _of_roofline(o, ceiling),
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
    out = [f"# Benchmark: {_md(_title(result))}", ""]
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
        f"- roofline: {_fmt(result.get('roofline_tok_s'))} tok/s per stream ({_md(result.get('roofline_basis'))})"
        if finite(result.get("roofline_tok_s"))
        else f"- roofline: none ({_md(result.get('roofline_basis') or 'not computed')})",
    ]
    if result.get("membw"):
        out.append(f"- host memory bandwidth: {_md(_membw_text(result['membw']))}")
    out += [
        f"- prefill ceiling: {_fmt(result.get('prefill_ceiling_tok_s'))} tok/s ({_md(result.get('prefill_basis'))})",
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
    out += ["## Knee and scaling", "", f"- knee: {_md(_knee_text(result))}"]
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
    return {kind: _atomic_write_bytes(out_dir / REPORT_FILES[kind], data) for kind, data in contents.items()}


# ------------------------------------------------------------------------------------------
# terminal
# ------------------------------------------------------------------------------------------


def render_sweep_table(result: dict[str, Any], console: Console) -> Table:
    """What `invoke bench` prints: the sweep table (the markdown's columns), the knee, the gate."""
    table = Table(title=Text(f"voltaforge bench: {_title(result)}"), caption=Text(roofline_note(result)))
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
    console.print(Text(f"knee: {_knee_text(result)}"))
    gate = result.get("gate") or {}
    console.print(Text(gate_line(result), style="green" if gate.get("passed") else "bold red"))
    for d in gate.get("diagnosis") or []:
        console.print(Text(f"  diagnosis: {d}"))
    return table


# ------------------------------------------------------------------------------------------
# history
# ------------------------------------------------------------------------------------------


def history_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The line one run leaves in the history: enough to compare, not the whole result."""
    return {
        "at": result.get("at"),
        "host": result.get("host"),
        "recipe": result.get("recipe"),
        "recipe_sha256": result.get("recipe_sha256"),
        "build": (result.get("server") or {}).get("build"),
        "gate_passed": (result.get("gate") or {}).get("passed"),
        "roofline_tok_s": result.get("roofline_tok_s"),
        "mbu": result.get("mbu"),
        "levels": [
            {
                "concurrency": lv.get("concurrency"),
                **tracked(lv),
                # the interval compare judges a change by (runs before the repeats have none)
                **({"decode": lv["decode"]} if lv.get("decode") else {}),
            }
            for lv in result.get("levels") or []
        ],
    }


def append_history(result: dict[str, Any], history_file: Path) -> None:
    """Add this run's summary as one JSON line. A result not marked complete is refused.

    Atomic: the old lines plus the new one go to a temp file that replaces the history, so a
    reader sees the history before or after, never a torn last line. (Two controllers
    appending at the same instant could lose one line; a bench holds the host's lock.)
    """
    if result.get("complete") is not True:
        raise IncompleteResult(
            f"not added to {history_file}: the result is incomplete (complete={result.get('complete')!r}); "
            "a partial sweep would be compared as if it were a run"
        )
    history_file = Path(history_file)
    history_file.parent.mkdir(parents=True, exist_ok=True)
    old = history_file.read_bytes() if history_file.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    line = json.dumps(history_summary(result), sort_keys=True, separators=(",", ":")) + "\n"
    _atomic_write_bytes(history_file, old + line.encode())


def read_history(history_file: Path, host: str | None = None, recipe: str | None = None) -> list[dict[str, Any]]:
    """The history's runs, oldest line first, optionally one host's and/or one recipe's."""
    history_file = Path(history_file)
    if not history_file.exists():
        return []
    runs = []
    for n, line in enumerate(history_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except json.JSONDecodeError as e:
            raise VoltaforgeError(f"{history_file}:{n}: not a JSON line ({e.msg}); remove or fix that line") from e
        if (host is None or run.get("host") == host) and (recipe is None or run.get("recipe") == recipe):
            runs.append(run)
    return runs


def _pct(now: Any, then: Any) -> float | None:
    n, t = finite(now), finite(then)
    return (n - t) / t * 100 if n is not None and t else None


def tracked(level: dict[str, Any]) -> dict[str, Any]:
    """The TRACKED figures of a level (a result's or a history line's, old or new): the
    per-stream decode is the judged one (:func:`per_stream`), whatever the old field held."""
    return {k: per_stream(level) if k == "per_stream_decode_tok_s" else level.get(k) for k in TRACKED}


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
    same = (now.get("decode") or {}).get("source") == (level.get("decode") or {}).get("source")
    same = same and noise is not None
    rsd, df = noise.at(level.get("concurrency")) if noise is not None else (0.0, 0)
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
        "decode_outside_noise": distinct(now.get("decode"), decode, rsd, COMPARED, df) if same else None,
        # what the test could have told: the smallest change flagged 80% of the time
        "detectable_pct": _detectable_pct(decode, rsd, df) if same else None,
        "run_noise": rsd if noise is not None else None,
    }


def _mean(values: Sequence[Any]) -> float | None:
    seen = [v for v in (finite(x) for x in values) if v is not None]
    return sum(seen) / len(seen) if seen else None


def _last_members(
    measured: Sequence[tuple[dict[str, Any], dict[str, Any]]], pool_runs: int = POOL_RUNS
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The last configuration's runs (the latest run's recipe, by its sha256, and build), its
    POOL_RUNS most recent, whether or not other configurations ran between them: one
    configuration's unchanged runs differ only by the run effect, so their mean is a reference
    with a fraction of one run's noise (``pool_runs`` 1: the last run alone). Only runs whose
    decode was measured as the latest's (the client's or the server's figure) and has an
    interval pool; otherwise the latest alone."""
    run, level = measured[-1]
    key = (run.get("recipe_sha256"), run.get("build"))
    source = (level.get("decode") or {}).get("source")
    same = [
        (r, lv)
        for r, lv in measured
        if (r.get("recipe_sha256"), r.get("build")) == key
        and (lv.get("decode") or {}).get("source") == source
        and (lv.get("decode") or {}).get("stdev") is not None
    ]
    return same[-pool_runs:] if same and same[-1][0] is run else [measured[-1]]


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
        last = _ref(_last_members(measured, pool_runs), now, sha, noise) if measured else None
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
    text = Text(_fmt(then, spec))
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
            cells += [Text(_fmt(r["now"].get(key), spec)), _change_text(r["last"], key, spec)]
            cells.append(_change_text(r["best"], key, spec))
        table.add_row(*cells)
    console.print(table)
    for r in rows:
        for label in ("last", "best"):
            ref = r[label]
            noise = (ref or {}).get("decode_outside_noise")
            pct = ((ref or {}).get("change_pct") or {}).get("per_stream_decode_tok_s")
            if noise is not None and pct is not None:
                verdict = "outside the noise: a real change" if noise else "within the noise: no change shown"
                if not noise and ref and ref.get("detectable_pct") is not None:
                    verdict += f" (a change of {ref['detectable_pct']:.0f}% or more would show 80% of the time)"
                elif not noise and ref:
                    verdict += " (at this noise no change would show 80% of the time)"
                what = f"concurrency {r['concurrency']}: per-stream decode {pct:+.1f}% against {_ref_name(label, ref)}"
                console.print(Text(f"{what}, {verdict}"))
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


def _ref_name(label: str, ref: dict[str, Any] | None) -> str:
    """``the last run``, ``the last 5 runs`` (a pooled reference), ``the best run``."""
    runs = (ref or {}).get("runs") or 1
    return f"the {label} {runs} runs" if runs > 1 else f"the {label} run"
