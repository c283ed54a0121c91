"""The host layer: transports (local, SSH), the commands they run, operations and the host lock.

``connect(spec)`` is the way in: a LocalHost for ``local``, else a connected SshHost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from playbooks.config.inventory import HostSpec
from playbooks.host.base import Host, Process
from playbooks.host.local import LocalHost
from playbooks.host.output import Printer, Result

if TYPE_CHECKING:
    from playbooks.host.ssh import SshHost

__all__ = ["Host", "LocalHost", "Printer", "Process", "Result", "SshHost", "connect"]


def __getattr__(name: str) -> Any:
    # paramiko is a tenth of the start-up: imported only when a host is reached over SSH
    if name == "SshHost":
        from playbooks.host.ssh import SshHost

        return SshHost
    raise AttributeError(name)


def connect(spec: HostSpec, printer: Printer | None = None, connect_timeout: float = 10) -> Host:
    """The Host for an inventory entry: LocalHost for ``local``, else a connected SshHost."""
    if spec.local:
        return LocalHost(spec.name, printer)
    from playbooks.host.ssh import SshHost

    return SshHost(spec, printer, connect_timeout=connect_timeout).open()
