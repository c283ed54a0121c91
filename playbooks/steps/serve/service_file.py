"""A rendered file installed on a host (a unit, a config, an environment file): uploaded only
when it differs; a dry run prints the unified diff."""

from __future__ import annotations

import difflib
import hashlib
import shlex
from dataclasses import dataclass

from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, Record, Upload, run_command


@dataclass(frozen=True)
class ServiceFile:
    """A rendered file and where it goes on this host."""

    path: str
    text: str
    mode: int = 0o644
    sudo: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Diff(Record):
    """A unified diff, shown by a dry run; applying it is the Upload beside it."""

    def show(self) -> str:
        return self.meta


class EnsureServiceFile(Operation):
    """A rendered file holds exactly what the recipe renders; a dry run shows the diff."""

    def __init__(self, f: ServiceFile):
        self.file = f
        self.upload = Upload(f.path, f.text.encode(), f.mode, None, f.sudo)
        self.name = f"Ensure {f.path} is up to date"

    def read(self, host: Host) -> str | None:
        q = shlex.quote(self.file.path)
        run = host.sudo if self.file.sudo else host.run
        out = run(f"if [ -f {q} ]; then echo present; cat -- {q}; fi", check=False, stream=False).stdout
        return out.split("\n", 1)[1] if out.startswith("present\n") else None

    def decide(self, facts: str | None) -> Decision:
        if facts == self.file.text:
            return Decision.ok(f"unchanged (sha256 {self.file.sha256[:12]})")
        diff = "".join(
            difflib.unified_diff(
                (facts or "").splitlines(keepends=True),
                self.file.text.splitlines(keepends=True),
                "/dev/null" if facts is None else f"{self.file.path} (on the host)",
                f"{self.file.path} (rendered)",
                n=1,
            )
        ).rstrip("\n")
        shown = Diff(self.file.path, "the diff", diff)
        if facts is None:
            return Decision.act("not installed yet", shown, self.upload)
        changed = sum(1 for line in diff.splitlines() if line.startswith(("+", "-")) and line[1:2] not in "+-")
        return Decision.act(f"{changed} line(s) differ", shown, self.upload)

    def apply(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            if not isinstance(cmd, Diff):
                run_command(host, cmd)
