"""voltaforge's Invoke tasks, for `invoke` in a checkout: the collection lives in the package
(playbooks/cli/tasks.py), so the installed `voltaforge` command runs exactly the same tasks."""

from playbooks.cli.tasks import ns

__all__ = ["ns"]
