"""What every changing task shares below the command line: whether a prefix needs sudo, and the
shape of a step's operations (``MakeOps``) that `invoke toolchain`, `build`, `quantize` and
`deploy` run through cli/converge.py and `invoke provision` runs in order."""

from __future__ import annotations

from collections.abc import Callable

from playbooks.config.recipe import LoadedRecipe
from playbooks.facts import read_fact
from playbooks.facts.files import parse_writable, writable_command
from playbooks.host import Host
from playbooks.host.ops import Operation

#: (the recipe, the connected host, its install prefix, whether that needs sudo) -> the operations
MakeOps = Callable[[LoadedRecipe, Host, str, bool], list[Operation]]


def prefix_needs_sudo(host: Host, prefix: str) -> bool:
    """A prefix under a directory the user cannot write (e.g. /opt) is created with sudo."""
    return not parse_writable(read_fact(host, writable_command(prefix)))
