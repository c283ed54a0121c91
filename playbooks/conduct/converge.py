"""What every changing task shares below the command line: whether a prefix needs sudo, and the
shape of a step's operations (``MakeOps``) that `invoke toolchain`, `build`, `quantize` and
`deploy` run through cli/converge.py and `invoke provision` runs in order."""

from __future__ import annotations

from collections.abc import Callable

from playbooks.conduct.placements import Served
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host import Host
from playbooks.host.lock import host_lock
from playbooks.host.ops import Change, Operation, run_ops

#: (the recipe, the connected host, its install prefix, whether that needs sudo) -> the operations
RecipeOps = Callable[[LoadedRecipe, Host, str, bool], list[Operation]]
#: the same for one recipe as a host serves it (its GPUs, port and units: conduct/placements.py)
MakeOps = Callable[[Served, Host, str, bool], list[Operation]]


def per_recipe(step: RecipeOps) -> MakeOps:
    """A step that needs only the recipe (toolchain, build, quantize), as a MakeOps."""

    def make(served: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        return step(served.loaded, host, prefix, sudo)

    return make


def unique_ops(ops: list[Operation]) -> list[Operation]:
    """Several recipes of a host's layout share operations (the build, the serve directory):
    one of each key (what it makes, host/ops.py) runs."""
    seen: set[str] = set()
    out = []
    for op in ops:
        if op.key not in seen:
            seen.add(op.key)
            out.append(op)
    return out


def prefix_needs_sudo(host: Host, prefix: str) -> bool:
    """A prefix under a directory the user cannot write (e.g. /opt) is created with sudo."""
    return not parse_writable(read_fact(host, writable_command(prefix)))


def converge_host(
    settings: Settings,
    host_name: str,
    recipe: str | None,
    make_ops: MakeOps,
    dry_run: bool,
    served: list[Served] | None = None,
) -> list[Change]:
    """The shape every changing task shares: resolve the host and its recipe (or its layout's
    recipes, conduct/placements.py), connect, decide whether the prefix needs sudo, build the
    step's operations (each shared one once), run them under the host lock unless it is a dry
    run. ``served``: what make_ops acts on, when it is not what the host serves (a balancer)."""
    spec = settings.host_spec(host_name)
    served = served or settings.serves(host_name, recipe)
    with settings.connect(spec) as host:
        sudo = prefix_needs_sudo(host, spec.prefix)
        ops = unique_ops([op for s in served for op in make_ops(s, host, spec.prefix, sudo)])
        return run_locked(host, spec.prefix, ops, dry_run, sudo)


def run_locked(host: Host, prefix: str, ops: list[Operation], dry_run: bool, sudo: bool) -> list[Change]:
    """Run ``ops`` under the host lock of ``prefix``; a dry run changes nothing, so it takes none."""
    if dry_run:
        return run_ops(host, ops, dry_run=True)
    with host_lock(host, prefix, sudo=sudo):
        return run_ops(host, ops)


#: (the connected host, its install prefix, whether that needs sudo) -> the operations: a step
#: that serves no recipe (the monitor and its exporters)
HostOps = Callable[[Host, str, bool], list[Operation]]


def converge_plain(settings: Settings, host_name: str, make_ops: HostOps, dry_run: bool) -> list[Change]:
    """converge_host for a step that serves no recipe."""
    spec = settings.host_spec(host_name)
    with settings.connect(spec) as host:
        sudo = prefix_needs_sudo(host, spec.prefix)
        return run_locked(host, spec.prefix, unique_ops(make_ops(host, spec.prefix, sudo)), dry_run, sudo)


def on_host(settings: Settings, name: str, make: Callable[[Host, str], list[Operation]], dry_run: bool) -> list[Change]:
    """Connect, build the operations, run them under the host lock (none for a dry run); a host
    that cannot be reached is one failed line, the others go on."""
    try:
        spec = settings.host_spec(name)
        with settings.connect(spec) as host:
            return run_locked(host, spec.prefix, make(host, spec.prefix), dry_run, prefix_needs_sudo(host, spec.prefix))
    except VoltaforgeError as exc:
        return [Change(name, "Connect", "failed", " ".join(str(exc).removeprefix(f"{name}: ").split()))]
