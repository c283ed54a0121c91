"""Every changing task's report: conduct/converge.py runs the step's operations on the host;
this prints the per-host report (the full text of cut failures in a log). Exit 1 when an
operation failed."""

from __future__ import annotations

from playbooks.cli.render import render_report
from playbooks.conduct.converge import MakeOps, converge_host
from playbooks.conduct.logs import write_details
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings


def converge(
    settings: Settings,
    host_name: str,
    recipe: str | None,
    make_ops: MakeOps,
    dry_run: bool,
    served: list[Served] | None = None,
) -> int:
    """``served``: what make_ops acts on, when it is not what the host serves (a balancer)."""
    changes = converge_host(settings, host_name, recipe, make_ops, dry_run, served)
    render_report(changes, log=write_details(changes))
    return 1 if any(c.status == "failed" for c in changes) else 0
