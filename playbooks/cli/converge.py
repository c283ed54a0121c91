"""The shape every changing task shares: resolve the host and its recipe, connect, decide whether
the prefix needs sudo, build the step's operations, run them (under the host lock unless it is
a dry run) and print the per-host report. Exit 1 when an operation failed."""

from __future__ import annotations

from collections.abc import Callable

from playbooks.cli.edge import write_details
from playbooks.cli.render import render_report
from playbooks.cli.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.facts import read_fact
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host import Host
from playbooks.host.lock import host_lock
from playbooks.host.ops import Operation, run_ops

#: (the recipe, the connected host, its install prefix, whether that needs sudo) -> the operations
MakeOps = Callable[[LoadedRecipe, Host, str, bool], list[Operation]]


def prefix_needs_sudo(host: Host, prefix: str) -> bool:
    """A prefix under a directory the user cannot write (e.g. /opt) is created with sudo."""
    return not parse_writable(read_fact(host, writable_command(prefix)))


def converge(settings: Settings, host_name: str, recipe: str | None, make_ops: MakeOps, dry_run: bool) -> int:
    spec = settings.host_spec(host_name)
    loaded = settings.load_recipe(settings.recipe_for(host_name, recipe))
    with settings.connect(spec) as host:
        sudo = prefix_needs_sudo(host, spec.prefix)
        ops = make_ops(loaded, host, spec.prefix, sudo)
        if dry_run:
            changes = run_ops(host, ops, dry_run=True)
        else:
            with host_lock(host, spec.prefix, sudo=sudo):
                changes = run_ops(host, ops)
    render_report(changes, log=write_details(changes))
    return 1 if any(c.status == "failed" for c in changes) else 0
