"""Every changing task's report: conduct/converge.py runs the step's operations on the host;
this prints the per-host report (the full text of cut failures in a log). Exit 1 when an
operation failed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from playbooks.cli.render import render_report
from playbooks.conduct.converge import MakeOps, converge_host
from playbooks.conduct.logs import write_details
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings

if TYPE_CHECKING:  # a report is drawn from the changes; cli/ never runs a host itself
    from playbooks.host.ops import Change


def converge(
    settings: Settings,
    host_name: str,
    recipe: str | None,
    make_ops: MakeOps,
    dry_run: bool,
    served: list[Served] | None = None,
) -> int:
    """``served``: what make_ops acts on, when it is not what the host serves (a balancer)."""
    return report(converge_host(settings, host_name, recipe, make_ops, dry_run, served))


def report(changes: list[Change]) -> int:
    """The per-host report (the full text of cut failures in a log); 1 when an operation failed."""
    render_report(changes, log=write_details(changes))
    return 1 if any(c.status == "failed" for c in changes) else 0
