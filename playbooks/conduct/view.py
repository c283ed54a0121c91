"""What a conductor reports to: each host's lines, through host/output.py's Printer (the plain
one prints them prefixed with the host). cli/live.py draws its live view from the same lines by
subclassing it, and `tune --json` sends them to stderr with a plain one: cli/ takes it from
here, so the command line depends on the conductors' interface, never on the host layer
(tests/test_layers.py)."""

from __future__ import annotations

from playbooks.host.output import Printer

__all__ = ["Printer"]
