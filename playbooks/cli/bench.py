"""`invoke bench`: the deployed server measured against its physical ceiling, the gate (exit 1
when it fails), the reports and the history (conduct/bench.py runs them), shown as tables."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.render import console
from playbooks.conduct.bench import bench_balancer, bench_host, bench_noise
from playbooks.conduct.bench_against import bench_against
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.bench_compare import compare, noise_line, render_compare
from playbooks.steps.measure.bench_noise import missing_text, noise_text, usable
from playbooks.steps.measure.bench_render import render_sweep_table
from playbooks.steps.monitor.bench_view import single_stream, view_rows


def run_bench(
    host_name: str,
    recipe: str | None = None,
    as_json: bool = False,
    show_compare: bool = False,
    settings: Settings | None = None,
    out_dir: Path | None = None,
    remeasure: bool = False,
) -> int:
    """A table per server (its gate, its reports; ``show_compare``: the change against the last
    and the best run) or JSON, a list for several. ``remeasure``: the host's memory bandwidth
    measured again instead of the stored figure."""
    runs = bench_host(host_name, recipe, settings or Settings(), out_dir, remeasure=remeasure)
    if as_json:
        results = [result for result, _, _ in runs]
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2, sort_keys=True))
    else:
        out = console()
        for result, files, earlier in runs:
            if len(runs) > 1:
                out.print(f"[bold]{result['recipe']}[/] on {result.get('server', {}).get('url', host_name)}")
            render_sweep_table(result, out)
            if result.get("prometheus"):
                render_prometheus_view(result, out)
            if show_compare:
                render_compare(compare(result, earlier), out)
                out.print(Text(noise_line(result)))
            out.print(f"reports: {files['json']}, {files['markdown']}, {files['png']}")
    return 0 if all(result["gate"]["passed"] for result, _, _ in runs) else 1


def render_prometheus_view(result: dict, out: Console) -> None:
    """The monitor's view of the run beside the bench's own figures (steps/monitor/bench_view.py)."""
    view = result["prometheus"]
    span = (view.get("window") or {}).get("span_s")
    over = f"over the run (between scrapes {span} s apart)" if span is not None else "over the run"
    table = Table(title=f"{view.get('source')}, {over}", title_justify="left")
    for col in ("", "Prometheus", "the bench"):
        table.add_column(col)
    for what, seen, own in view_rows(view, single_stream(result)):
        table.add_row(what, Text(seen, style="yellow") if view.get("error") else seen, own)
    out.print(table)


def run_bench_noise(
    host_name: str, runs: int, recipe: str | None = None, as_json: bool = False, settings: Settings | None = None
) -> int:
    """The unchanged server benched ``runs`` times, a line per run, then the host's run-to-run
    noise from its history (or what is still missing)."""
    done, noise = bench_noise(host_name, recipe, settings or Settings(), runs)
    if as_json:
        results = [result for result, _, _ in done]
        print(json.dumps({"runs": results, "host_noise": noise.as_dict() if noise else None}, indent=2, sort_keys=True))
    else:
        out = console()
        for i, (result, files, _) in enumerate(done, 1):
            single = next((lv for lv in result["levels"] if lv.get("concurrency") == 1), None)
            decode = ((single or {}).get("decode") or {}).get("mean")
            figure = f"single stream {decode:.1f} tok/s" if decode else "no single-stream figure"
            out.print(Text(f"run {i} of {len(done)}: {result['recipe']}, {figure}; {files['json']}"))
        host = done[-1][0]["host"] if done else host_name
        out.print(
            Text(f"{host}: {noise_text(noise)}" if noise is not None and usable(noise) else missing_text(host, noise))
        )
    return 0 if all(result["gate"]["passed"] for result, _, _ in done) else 1


def run_bench_lb(
    host_name: str, port: int, recipe: str | None = None, as_json: bool = False, settings: Settings | None = None
) -> int:
    """The recipe's workload through the balancer on ``host_name``:``port``: a row per level and
    a row per backend with its share. Exit 1 when a level failed."""
    result, path = bench_balancer(host_name, port, recipe, settings or Settings())
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        render_lb_table(result, console())
        console().print(f"result: {path}")
    return 1 if any(level.get("error") for level in result["levels"]) else 0


def render_lb_table(result: dict, out: Console) -> None:
    table = Table(title=f"{result['recipe']} through {result['via']}", title_justify="left")
    for col in ("streams", "requests", "aggregate tok/s", "TTFT p50", "backend", "its requests", "share"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for level in result["levels"]:
        backends = level.get("backends") or {}
        first = True
        for name, b in backends.items() or [("", {})]:
            lead = (
                [str(level["concurrency"]), str(level.get("requests", "")), f"{level.get('aggregate_tok_s') or 0:.1f}",
                 f"{(level.get('ttft_p50_s') or 0) * 1000:.0f} ms"]
                if first
                else ["", "", "", ""]
            )  # fmt: skip
            share = b.get("share")
            state = "" if b.get("up", True) else " (down)"
            table.add_row(*lead, name + state, str(b.get("requests", "")), "" if share is None else f"{share:.0%}")
            first = False
        if level.get("error"):
            table.add_row(str(level.get("concurrency", "")), "", "", "", Text(level["error"], style="red"), "", "")
    out.print(table)


def run_bench_against(
    host_name: str, other: str, recipe: str | None = None, as_json: bool = False, settings: Settings | None = None
) -> int:
    """The host's server (A) and ``other`` (B, beside it on the scratch port) interleaved in one
    run: a row per level with B's change and its verdict, or JSON. Exit 0: a comparison is no gate."""
    say = (lambda _line: None) if as_json else (lambda line: console().print(Text(f"{host_name}: {line}")))
    result, path = bench_against(host_name, recipe, other, settings or Settings(), say)
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    out = console()
    render_against_table(result, out)
    for level in result["levels"]:
        out.print(Text(level["verdict"]))
    d = result["design"]
    out.print(
        Text(
            f"design: {d['cycles']} cycles of A B B A, each block on a fresh process ({d['processes']} in all, a "
            f"warm-up round each; a block: at every level rounds of a request per stream, at least "
            f"{d['block_requests']} requests); judged at 5% over the {d['family']} level"
            f"{'s' if d['family'] != 1 else ''} from the cycles' own spread, a change called only when its interval "
            f"lies beyond {d['margin'] * 100:.0f}%"
        )
    )
    out.print(f"result: {path}")
    return 0


def render_against_table(result: dict, out: Console) -> None:
    a, b = result["a"], result["b"]
    table = Table(title=f"{b['recipe']} (B, port {b['port']}) against {a['recipe']} afresh (A, port {a['port']})")
    for col in ("concurrency", "A per-stream tok/s", "B per-stream tok/s", "B against A", "95% interval", "verdict"):
        table.add_column(col, justify="right")
    for level in result["levels"]:
        ch = level.get("change")
        figures = (
            [f"{ch['change'] * 100:+.1f}%", f"{ch['low'] * 100:+.1f}% to {ch['high'] * 100:+.1f}%"] if ch else ["", ""]
        )
        verdict = "" if not ch else "changed" if ch["distinct"] else "within the noise"
        table.add_row(
            str(level["concurrency"]),
            _tok(level["a"]["decode"]),
            _tok(level["b"]["decode"]),
            *figures,
            verdict,
        )
    out.print(table)


def _tok(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"
