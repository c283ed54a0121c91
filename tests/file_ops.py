"""Two operations that only the tests use: the plainest file and the plainest command, the
vehicles the operation machinery (host/ops.run_ops: dry run, twice, handlers, a full disk) is
tested with. The product's own operations each keep a file of their own kind (a unit, a model
link, pip's configuration through host/ops.decide_file)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from playbooks.host import Host
from playbooks.host.ops import (
    Command,
    Decision,
    FileFacts,
    Operation,
    Upload,
    check_mode,
    check_path,
    decide_file,
    read_file_facts,
)


class RunCommand(Operation):
    """Run a command on every run: not idempotent by nature (say why in ``reason``)."""

    idempotent = False

    def __init__(self, name: str, command: Command, reason: str, notify: Sequence[str] = ()):
        self.name, self.command, self.reason, self.notify = name, command, reason, tuple(notify)

    def decide(self, facts: Any) -> Decision:
        return Decision.act(self.reason, self.command)


class EnsureFile(Operation):
    """A file holds exactly ``content`` with this mode (and owner, when given).

    The content is hashed here and compared with the host's sha256: it is uploaded only when
    it differs (atomically, see ``Host.write_file``); a mode or owner difference alone is
    fixed with chmod/chown, without an upload.
    """

    def __init__(
        self,
        path: str,
        content: bytes,
        mode: int = 0o644,
        sudo: bool = False,
        owner: str | None = None,
        notify: Sequence[str] = (),
    ):
        self.upload = Upload(check_path(path), bytes(content), check_mode(mode), owner, sudo)
        self.path, self.sudo, self.notify = self.upload.path, sudo, tuple(notify)
        self.name = f"Ensure {self.path} is up to date"

    def read(self, host: Host) -> FileFacts:
        return read_file_facts(host, self.path, self.sudo)

    def decide(self, facts: FileFacts) -> Decision:
        return decide_file(self.upload, facts)
