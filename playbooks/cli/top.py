"""`invoke top`: the fleet live, from the monitor's Prometheus (conduct/top.py): a table of
servers and one of GPUs, redrawn in place every ``interval`` seconds on a terminal until Ctrl-C;
one snapshot when the output is not a terminal (a pipe, a file) or with ``--once``."""

from __future__ import annotations

import time

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from playbooks.cli.render import console
from playbooks.conduct.settings import Settings
from playbooks.conduct.top import watching
from playbooks.conduct.watch import inventory_hosts, watch_settings
from playbooks.steps.monitor.top import View

GIB = 2**30


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_view(view: View, source: str) -> Group:
    servers = Table(title=f"servers ({source})", title_justify="left")
    for col in ("host", "model", "service", "state", "tok/s", "tok/s a stream", "slots busy", "KV use", "deferred",
                "waiting at edge"):  # fmt: skip
        servers.add_column(col, justify="right" if col.startswith(("tok", "slots", "KV", "def", "wait")) else "left")
    for s in view.servers:
        busy = "-" if s.busy is None else f"{s.busy}/{'?' if s.slots is None else s.slots}"
        servers.add_row(
            s.host, s.model, s.service, "up" if s.up else "[red]down[/red]", _f(s.tok_s), _f(s.stream_tok_s), busy,
            _f(None if s.kv_use is None else s.kv_use * 100, "{:.0f}%"), _f(s.deferred, "{}"), _f(s.edge_waiting, "{}"),
        )  # fmt: skip
    parts: list[Table | Text] = [servers] if view.servers else [Text(f"{source}: no llama-server among its targets")]
    if view.gpus:
        gpus = Table(title="GPUs", title_justify="left")
        for col in ("host", "gpu", "name", "SM MHz", "temp C", "power W", "util", "memory GiB", "held by"):
            gpus.add_column(col, justify="left" if col in ("host", "name", "held by") else "right")
        for g in view.gpus:
            power = f"{_f(g.power_w, '{:.0f}')}/{_f(g.limit_w, '{:.0f}')}"
            memory = f"{_f(None if g.used_bytes is None else g.used_bytes / GIB)}/" + _f(
                None if g.total_bytes is None else g.total_bytes / GIB
            )
            held = ", ".join(g.held) or "-"
            gpus.add_row(
                g.host, g.gpu, g.name, _f(g.sm_mhz, "{:.0f}"), _f(g.temp_c, "{:.0f}"), power,
                _f(None if g.util is None else g.util * 100, "{:.0f}%"), memory,
                f"[yellow]{held}[/yellow]" if g.held else held,
            )  # fmt: skip
        parts.append(gpus)
    parts += [Text(line) for line in view.no_gpu]
    return Group(*parts)


def run_top(
    host_name: str | None = None,
    interval_s: float = 2.0,
    once: bool = False,
    settings: Settings | None = None,
    default_host: str | None = None,
) -> int:
    settings = settings or Settings()
    watch = watch_settings(settings.monitor(), inventory_hosts(settings), host_name, default_host=default_host)
    out = console()
    # Ctrl-C is how a watch ends, at any moment: while connecting or on its first read as much as
    # between frames (invoke would turn it into exit 1 with a traceback).
    try:
        with watching(settings, watch) as (read, source):
            view = read()
            if once or not out.is_terminal:
                out.print(render_view(view, source))
                return 0
            with Live(render_view(view, source), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(render_view(read(), source), refresh=True)
    except KeyboardInterrupt:
        return 0
