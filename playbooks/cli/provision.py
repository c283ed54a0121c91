"""`invoke provision`: the summary table (one per host, and one for a fleet) and the exit code;
the run itself is the conductor's (conduct/provision.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.cli.live import LiveView
from playbooks.cli.render import console
from playbooks.conduct.provision import (
    DEFAULT_RECIPE,
    STEPS,
    HostOutcome,
    Options,
    Provisioner,
    resolve_targets,
)
from playbooks.conduct.roll import Roll, Rolled, rolled_line
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.gate import figures_line

# ------------------------------------------------------------------------------------------
# the summary
# ------------------------------------------------------------------------------------------

_STYLE = {
    "changed": "yellow",
    "ok": "green",
    "failed": "bold red",
    "would change": "yellow",
    "would run after the fix": "yellow",
    "not reached": "dim",
}


def render_summary(outcomes: Sequence[HostOutcome], out: Console, dry_run: bool = False) -> None:
    for o in outcomes:
        calls = f", {o.remote_calls} remote call{'s' if o.remote_calls != 1 else ''}" if o.remote_calls else ""
        title = f"provision {o.host} ({o.recipe}){' - dry run' if dry_run else ''}: {o.seconds:.1f} s{calls}"
        table = Table(title=title, title_justify="left")
        for col in ("step", "status", "time", "why"):
            table.add_column(col, overflow="fold")
        for s in o.steps:
            seconds = f"{s.seconds:.1f} s" if s.status != "not reached" or s.seconds else ""
            table.add_row(Text(s.step), Text(s.status, style=_STYLE.get(s.status, "")), Text(seconds), Text(s.why))
        out.print(table)
        failed = o.failure()
        if failed:
            out.print(Text(f"{o.host}: failed at {failed.step}: {failed.why}", style="bold red"))
            if o.fix:
                out.print(Text(f"fix: {o.fix}"))
        elif o.gate:
            out.print(Text(f"{o.host}: gate passed: {figures_line(o.gate)}", style="green"))
            if o.endpoint:
                out.print(Text(f"serving: {o.endpoint} (OpenAI API: /v1/completions, /v1/chat/completions)"))
            if o.reports:
                out.print(Text(f"reports: {o.reports.get('markdown')}"))
        out.print(Text(f"log: {o.log}", style="dim"))
    if len(outcomes) > 1:
        # a host's layout gives it a row per recipe
        layout = len({o.host for o in outcomes}) < len(outcomes)
        fleet = Table(title="provision: every host", title_justify="left")
        for col in ("host", *STEPS, "time", "result"):
            fleet.add_column(col, overflow="fold")
        for o in outcomes:
            failed = o.failure()
            result = f"failed at {failed.step}" if failed else figures_line(o.gate) if o.gate else "done"
            cells = [Text(s.status, style=_STYLE.get(s.status, "")) for s in o.steps]
            fleet.add_row(
                Text(f"{o.host} {o.recipe}" if layout else o.host), *cells, Text(f"{o.seconds:.1f} s"), Text(result)
            )
        out.print(fleet)
        bad = [f"{o.host} ({o.recipe})" if layout else o.host for o in outcomes if o.failed]
        ok = [o for o in outcomes if not o.failed]
        what = "recipes" if layout else "hosts"
        out.print(
            Text(f"{len(ok)} of {len(outcomes)} {what} provisioned" + (f"; failed: {', '.join(bad)}" if bad else ""))
        )


def render_roll(roll: Roll, out: Console, dry_run: bool) -> None:
    """The servers changed behind a balancer: in a dry run the order, per model; else each one's
    drain, what the balancer sent it while it was out, and how it ended."""
    for (balancer, model), servers in roll.planned.items():
        order = ", then ".join(servers)
        out.print(Text(f"rolling model {model} behind the balancer on {balancer}, one server at a time: {order}"))
    for r in roll.rolled:
        out.print(Text(rolled_line(r), style="green" if r.result == "changed" else "bold red"))
    for note in roll.notes:
        out.print(Text(f"note: {note}"))


def outcome_json(o: HostOutcome, rolled: Sequence[Rolled] = ()) -> dict[str, Any]:
    return {
        "host": o.host,
        "recipe": o.recipe,
        "failed": o.failed,
        "seconds": round(o.seconds, 2),
        "remote_calls": o.remote_calls,
        "steps": [{"step": s.step, "status": s.status, "seconds": round(s.seconds, 2), "why": s.why} for s in o.steps],
        "gate": o.gate,
        "endpoint": o.endpoint,
        "fix": o.fix,
        "reports": o.reports,
        "log": str(o.log),
        "rolled": [vars(r) for r in rolled if (r.host, r.recipe) == (o.host, o.recipe)],
    }


def run_provision(
    hosts: Sequence[str],
    recipe: str | None = None,
    default_recipe: str = DEFAULT_RECIPE,
    options: Options | None = None,
    settings: Settings | None = None,
    json_out: Path | None = None,
    verbose: bool = True,
) -> int:
    """``verbose``: every line live; else cli/live.py's quiet view (the task's default)."""
    import json

    options = options or Options()
    settings = settings or Settings()
    targets = resolve_targets(settings, hosts, recipe, default_recipe)
    view = LiveView(console(), verbose)
    prov = Provisioner(settings, options, view)
    try:
        with view:
            outcomes = prov.run(targets)
    except KeyboardInterrupt:
        prov.interrupt()
        print(
            "error: interrupted: no operation was left half-done (each switches in whole) and the host locks "
            f"are released; run the same command again to resume (logs: {prov.run_dir})",
            file=sys.stderr,
        )
        return 130
    render_summary(outcomes, console(), options.dry_run)
    render_roll(prov.roll, console(), options.dry_run)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps([outcome_json(o, prov.roll.rolled) for o in outcomes], indent=2) + "\n")
    return 1 if any(o.failed for o in outcomes) else 0
