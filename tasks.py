"""voltaforge's Invoke tasks, for `invoke` in a checkout: the collection lives in the package
(playbooks/cli/tasks.py), so the installed `voltaforge` command runs exactly the same tasks."""

import sys

# Invoke turns bytecode caching off while it loads a tasks file (a stale tasks.pyc once confused
# its users), and the switch stays off for every module imported after it: each run compiled
# all of playbooks/ from source, a quarter of a second of a no-op's CPU. Python checks each
# cached file against its source; the interpreter's own setting (PYTHONDONTWRITEBYTECODE, -B)
# still decides.
sys.dont_write_bytecode = bool(sys.flags.dont_write_bytecode)

from playbooks.cli.tasks import ns  # noqa: E402 - after the switch above

__all__ = ["ns"]
