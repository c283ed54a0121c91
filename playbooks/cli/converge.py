"""The shape every changing task shares: resolve the host and its recipe (or its layout's
recipes, conduct/placements.py), connect, decide whether
the prefix needs sudo, build the step's operations, run them (under the host lock unless it is
a dry run) and print the per-host report. Exit 1 when an operation failed."""

from __future__ import annotations

from playbooks.cli.edge import write_details
from playbooks.cli.render import render_report
from playbooks.conduct.converge import MakeOps, prefix_needs_sudo, unique_ops
from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings
from playbooks.host.lock import host_lock
from playbooks.host.ops import run_ops


def converge(
    settings: Settings,
    host_name: str,
    recipe: str | None,
    make_ops: MakeOps,
    dry_run: bool,
    served: list[Served] | None = None,
) -> int:
    """``served``: what make_ops acts on, when it is not what the host serves (a balancer)."""
    spec = settings.host_spec(host_name)
    served = served or settings.serves(host_name, recipe)
    with settings.connect(spec) as host:
        sudo = prefix_needs_sudo(host, spec.prefix)
        # a host's layout: every recipe's operations, each shared one once
        ops = unique_ops([op for s in served for op in make_ops(s, host, spec.prefix, sudo)])
        if dry_run:
            changes = run_ops(host, ops, dry_run=True)
        else:
            with host_lock(host, spec.prefix, sudo=sudo):
                changes = run_ops(host, ops)
    render_report(changes, log=write_details(changes))
    return 1 if any(c.status == "failed" for c in changes) else 0
