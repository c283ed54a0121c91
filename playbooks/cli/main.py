"""The `voltaforge` console command of an installed wheel: Invoke's own Program over the same
collection as `invoke` in a checkout, so `voltaforge plan --recipe tiny-cpu` outside any
checkout is `invoke plan --recipe tiny-cpu` inside one."""

from __future__ import annotations

from invoke import Program

from playbooks import __version__
from playbooks.cli.tasks import ns

program = Program(name="voltaforge", binary="voltaforge", namespace=ns, version=__version__)
