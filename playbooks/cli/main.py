"""The `voltaforge` console command of an installed wheel: Invoke's own Program over the same
collection as `invoke` in a checkout, so `voltaforge plan --recipe tiny-cpu` outside any
checkout is `invoke plan --recipe tiny-cpu` inside one.

One difference: a configuration file Invoke itself cannot read or merge (a YAML syntax error,
a mapping where a single value belongs, ``voltaforge: 5``) is one line and exit 2 here, as a
bad value of a key is, where plain `invoke` shows its own traceback before any task runs."""

from __future__ import annotations

import json
import sys

from invoke import Program
from invoke.config import AmbiguousMergeError
from invoke.util import yaml

from playbooks import __version__
from playbooks.cli.tasks import ns

CONFIG_ERRORS = (AmbiguousMergeError, yaml.YAMLError, json.JSONDecodeError)


class VoltaforgeProgram(Program):
    def parse_core(self, argv: list[str] | None) -> None:
        super().parse_core(argv)
        # Invoke turns bytecode caching off for a tasks file it loads (see tasks.py at the top);
        # this program loads none, and the tasks' own imports are cached like any package's
        sys.dont_write_bytecode = bool(sys.flags.dont_write_bytecode)

    def run(self, argv: list[str] | None = None, exit: bool = True) -> None:
        try:
            super().run(argv, exit)
        except CONFIG_ERRORS as exc:
            text = " ".join(str(exc).split())
            print(f"error: the Invoke configuration (invoke.yaml, ~/.invoke.yaml or -f FILE): {text}", file=sys.stderr)
            sys.exit(2)


program = VoltaforgeProgram(name="voltaforge", binary="voltaforge", namespace=ns, version=__version__)
