"""How a voltaforge task is declared: once.

``@command(help={...})`` makes an Invoke task of a function that returns an exit code. The
function's signature is the flag list (Invoke reads it); each flag's help is the task's own
line, else the shared one below, so ``--host``, ``--recipe``, ``--inventory``, ``--dry-run``
and ``--json`` are spelled in one place. A flag without help, or help for no flag, fails at
import: the collection (``playbooks/cli/tasks.py``) that ``invoke --help``, the wheel's
``voltaforge`` command and the flag tests (tests/test_flags_all.py, tests/test_cli.py) all
read cannot drift from the function. The body runs through ``edge.run_command``: bad input is
one line and exit 2, a bug one line naming its log.

No short flags: ``-h`` means help, as everywhere else (``-v`` for ``--verbose`` where a task
asks for flags.ShortFlagTask).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from invoke import Context, Task, task

from playbooks.cli.edge import run_command

#: the flags several tasks share, with the one help line each has everywhere
SHARED_HELP = {
    "host": "inventory name, ~/.ssh/config name, address or 'local' (default: voltaforge.host in invoke.yaml, "
    "else local)",
    "recipe": "recipe name (recipes/NAME.yaml) or path (default: voltaforge.recipe, else the inventory's)",
    "inventory": "inventory file (default: voltaforge.inventory, else inventory.yaml)",
    "dry-run": "print the exact commands and change nothing",
    "json": "print JSON instead of tables",
}


def flag_names(body: Callable[..., Any]) -> list[str]:
    """The flags Invoke makes of a task function: its parameters after the context, dashed."""
    return [p.replace("_", "-") for p in list(inspect.signature(body).parameters)[1:]]


def command(
    help: dict[str, str] | None = None,  # noqa: A002 - Invoke's own name for it
    **task_options: Any,
) -> Callable[[Callable[..., int | None]], Task]:
    """An Invoke task of `body(c, **flags) -> exit code`, each flag's help its own or shared."""
    own = help or {}

    def declare(body: Callable[..., int | None]) -> Task:
        names = flag_names(body)
        if missing := [n for n in names if n not in own and n not in SHARED_HELP]:
            raise TypeError(f"task {body.__name__}: no help for --{', --'.join(missing)}")
        if stray := sorted(set(own) - set(names)):
            raise TypeError(f"task {body.__name__}: help for --{', --'.join(stray)}, which it does not take")

        @functools.wraps(body)  # Invoke reads the flags from the signature (inspect follows __wrapped__)
        def run(c: Context, *args: Any, **kwargs: Any) -> None:
            run_command(body, c, *args, **kwargs)

        helps = {n: own.get(n) or SHARED_HELP[n] for n in names}
        made = task(run, auto_shortflags=False, help=helps, **task_options)
        assert isinstance(made, Task)  # task() called with the body returns the Task itself
        return made

    return declare
