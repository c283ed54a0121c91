"""Operations: read facts, compare with the wanted state, act only on the difference.

An :class:`Operation` is named after the state it ensures ("Ensure /opt/voltaforge exists").
``check`` reads facts from the host and returns the commands that would close the gap (none:
nothing to do, and ``reason`` says why); ``apply`` runs them. :func:`run_ops` drives a list
of operations on one host and returns one :class:`Change` per operation: changed, ok (with
the reason nothing was done) or failed (with the error). A dry run stops after ``check``
and prints the commands, so it is exactly the plan a real run would follow.

Facts are a command plus a pure parser (``parse_stat``), so parsers are tested on captured
output without a host.
"""

from __future__ import annotations

import getpass
import os
import posixpath
import shlex
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from hashlib import sha256
from typing import Iterator, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from playbooks.errors import HostError
from playbooks.host.hosts import Host, check_owner, check_path, write_file_command

Status = Literal["changed", "ok", "failed"]


@dataclass
class Change:
    """What one operation did on one host."""

    host: str
    step: str
    status: Status
    why: str
    commands: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# facts
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileStat:
    kind: str  # stat's %F: "directory", "regular file", "regular empty file", ...
    mode: int
    owner: str
    group: str

    @property
    def is_file(self) -> bool:
        return self.kind in ("regular file", "regular empty file")


def stat_command(path: str) -> str:
    # -L: follow symlinks (a prefix that is a symlink to a big disk is normal).
    q = shlex.quote(path)
    return f"if [ -e {q} ]; then stat -L -c '%F|%a|%U|%G' -- {q}; else echo missing; fi"


def parse_stat(output: str) -> FileStat | None:
    """Parse ``stat_command`` output: None when the path does not exist."""
    text = output.strip()
    if text == "missing":
        return None
    kind, mode, owner, group = text.rsplit("|", 3)
    return FileStat(kind, int(mode, 8), owner, group)


def file_stat(host: Host, path: str, *, sudo: bool = False) -> FileStat | None:
    run = host.sudo if sudo else host.run
    return parse_stat(run(stat_command(path), stream=False).stdout)


def _owner_differs(st: FileStat, owner: str | None) -> bool:
    if owner is None:
        return False
    user, _, group = owner.partition(":")
    return st.owner != user or bool(group and st.group != group)


# ------------------------------------------------------------------------------------------
# operations
# ------------------------------------------------------------------------------------------


class Operation:
    """Base class. Subclasses set ``name`` and implement ``check``.

    ``check(host)`` reads facts and returns the commands that close the gap, setting
    ``reason`` to what differs; an empty list (or None) means nothing to do and ``reason``
    says why. ``apply(host, commands)`` runs them (as root when ``sudo``).
    """

    name: str = "Operation"
    sudo: bool = False
    reason: str = ""

    def check(self, host: Host) -> list[str] | None:
        raise NotImplementedError

    def apply(self, host: Host, commands: list[str]) -> None:
        run = host.sudo if self.sudo else host.run
        for cmd in commands:
            run(cmd)


def _mode(mode: int) -> int:
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise ValueError(f"mode must be an int between 0 and 0o7777, got {mode!r}")
    return mode


def _mode_owner_fixes(st: FileStat, path: str, mode: int, owner: str | None) -> tuple[list[str], list[str]]:
    """(commands, what differs) to give an existing path this mode and owner."""
    q = shlex.quote(path)
    cmds, diffs = [], []
    if st.mode != mode:
        diffs.append(f"mode is {st.mode:04o}, want {mode:04o}")
        cmds.append(f"chmod {mode:04o} -- {q}")
    if _owner_differs(st, owner):
        diffs.append(f"owner is {st.owner}:{st.group}, want {owner}")
        cmds.append(f"chown -- {shlex.quote(owner)} {q}")
    return cmds, diffs


class EnsureDirectory(Operation):
    """A directory exists with this mode (and owner, when given)."""

    def __init__(self, path: str, mode: int = 0o755, owner: str | None = None, sudo: bool = False):
        self.path = check_path(path)
        self.mode = _mode(mode)
        check_owner(owner)
        self.owner, self.sudo = owner, sudo
        self.name = f"Ensure {self.path} exists"

    def check(self, host: Host) -> list[str]:
        q = shlex.quote(self.path)
        st = file_stat(host, self.path, sudo=self.sudo)
        if st is None:
            self.reason = "directory is missing"
            cmds = [f"mkdir -p -m {self.mode:04o} -- {q}"]
            if self.owner:
                cmds.append(f"chown -- {shlex.quote(self.owner)} {q}")
            return cmds
        if st.kind != "directory":
            raise HostError(f"{host.name}: {self.path} exists but is a {st.kind}, not a directory")
        cmds, diffs = _mode_owner_fixes(st, self.path, self.mode, self.owner)
        owned = f", owner {self.owner}" if self.owner else ""
        self.reason = "; ".join(diffs) or f"directory already exists with mode {self.mode:04o}{owned}"
        return cmds


class EnsureFile(Operation):
    """A file holds exactly ``content`` with this mode (and owner, when given).

    The content is hashed here and compared with the host's sha256: it is uploaded only when
    it differs (atomically, see ``Host.write_file``); a mode or owner difference alone is
    fixed with chmod/chown, without an upload.
    """

    def __init__(self, path: str, content: bytes, mode: int = 0o644, sudo: bool = False,
                 owner: str | None = None):
        self.path = check_path(path)
        self.content = bytes(content)
        self.mode = _mode(mode)
        check_owner(owner)
        self.owner, self.sudo = owner, sudo
        self.digest = sha256(self.content).hexdigest()
        self.name = f"Ensure {self.path} is up to date"
        self._upload = (
            f"{write_file_command(self.path, self.mode, owner)}"
            f"  # stdin: {len(self.content)} bytes, sha256 {self.digest[:12]}"
        )

    def check(self, host: Host) -> list[str]:
        st = file_stat(host, self.path, sudo=self.sudo)
        if st is None:
            self.reason = "file is missing"
            return [self._upload]
        if not st.is_file:
            raise HostError(f"{host.name}: {self.path} exists but is a {st.kind}, not a regular file")
        have = host.sha256(self.path, sudo=self.sudo)
        if have != self.digest:
            self.reason = f"content differs (sha256 {have[:12]} on the host, {self.digest[:12]} wanted)"
            return [self._upload]
        cmds, diffs = _mode_owner_fixes(st, self.path, self.mode, self.owner)
        self.reason = "; ".join(diffs) or f"file is already up to date (sha256 {self.digest[:12]})"
        return cmds

    def apply(self, host: Host, commands: list[str]) -> None:
        for cmd in commands:
            if cmd == self._upload:
                host.write_file(self.path, self.content, self.mode, sudo=self.sudo, owner=self.owner)
            else:
                (host.sudo if self.sudo else host.run)(cmd)


# ------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------


def _why(host: Host, exc: HostError) -> str:
    # The report has a host column: drop the "v100-01: " that standalone messages carry.
    return str(exc).removeprefix(f"{host.name}: ")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def run_ops(host: Host, ops: list[Operation], dry_run: bool = False) -> list[Change]:
    """Check and apply ``ops`` in order on one host; stop at the first failure.

    Operations after a failure are not attempted (they usually depend on it), so the list
    returned can be shorter than ``ops``. A dry run only reads facts: it prints the exact
    commands and reports them as "changed" without running them. (Later operations are
    checked against the host as it is, not as the earlier ones would leave it.)
    """
    changes: list[Change] = []
    for op in ops:
        op.reason = ""
        try:
            commands = list(op.check(host) or [])
        except HostError as exc:
            changes.append(Change(host.name, op.name, "failed", _why(host, exc)))
            host.printer.line(host.name, f"failed: {op.name} - {changes[-1].why}")
            break
        if not commands:
            change = Change(host.name, op.name, "ok", op.reason or "already in the wanted state")
        elif dry_run:
            for cmd in commands:
                host.printer.line(host.name, f"would run: {cmd}")
            why = f"dry run: would run {_plural(len(commands), 'command')}"
            change = Change(host.name, op.name, "changed", f"{why} ({op.reason})" if op.reason else why, commands)
        else:
            try:
                op.apply(host, commands)
            except HostError as exc:
                changes.append(Change(host.name, op.name, "failed", _why(host, exc), commands))
                host.printer.line(host.name, f"failed: {op.name} - {changes[-1].why}")
                break
            change = Change(host.name, op.name, "changed", op.reason, commands)
        changes.append(change)
        host.printer.line(host.name, f"{change.status}: {op.name} - {change.why}")
    return changes


LOCK_NAME = ".voltaforge.lock"
_BUSY_EXIT = 75  # EX_TEMPFAIL


@contextmanager
def host_lock(host: Host, prefix: str, *, sudo: bool = False, timeout: float = 30) -> Iterator[str]:
    """Hold ``<prefix>/.voltaforge.lock`` on the host for the duration of the block.

    Design: a process on the host takes ``flock -n`` on the file and then blocks in ``cat``
    on the stdin we keep open over our SSH session. Leaving the block closes that stdin:
    cat exits and the kernel drops the lock. If voltaforge crashes or the connection drops,
    sshd closes the channel, cat sees EOF, and the lock is dropped just the same. So a lock
    is never stale, and there is no PID/hostname heuristics to get wrong (a ``mkdir`` lock
    would need those, and a PID from another machine cannot be checked). The holder writes
    who and since when into the file, for the message a second run gets.

    Creates ``prefix`` when missing (the lock must live where every run looks). A dry run
    only reads and does not need the lock. Yields the lock path.
    """
    prefix = check_path(prefix)
    lock = posixpath.join(prefix, LOCK_NAME)
    ql = shlex.quote(lock)
    since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    info = f"since {since} by {getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"
    script = (
        f"mkdir -p -- {shlex.quote(prefix)} && exec 9>>{ql} || exit 1; "
        f"if ! flock -n 9; then echo \"busy $(cat {ql})\"; exit {_BUSY_EXIT}; fi; "
        f"printf '%s\\n' {shlex.quote(info)} > {ql}; echo locked; exec cat >/dev/null"
    )
    proc = host.spawn(script, sudo=sudo)
    try:
        line = proc.read_line(timeout)
    except BaseException:
        proc.close()
        raise
    if line != "locked":
        code = proc.close()
        if line and line.startswith("busy"):
            held = line.removeprefix("busy").strip() or "by a run that is just starting"
            raise HostError(
                f"{host.name} is being provisioned by another voltaforge run (lock {lock} held {held})"
            )
        if "a password is required" in proc.stderr:
            raise host.sudo_needs_password()
        raise HostError(f"{host.name}: cannot take the lock {lock} (exit {code}): {proc.stderr.strip()}")
    try:
        yield lock
    finally:
        proc.close()


# ------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------

_STYLE = {"changed": "yellow", "ok": "green", "failed": "bold red"}


def render_report(changes: list[Change], console: Console | None = None) -> Table:
    """Print one table, host | step | status | why, and a count per host; returns the table."""
    console = console or Console()
    table = Table(title="voltaforge: what changed")
    for col in ("host", "step", "status", "why"):
        table.add_column(col, overflow="fold")
    for c in changes:
        # Text, not markup strings: a path or an error may contain [brackets].
        table.add_row(Text(c.host), Text(c.step), Text(c.status, style=_STYLE[c.status]), Text(c.why))
    console.print(table)
    for host in dict.fromkeys(c.host for c in changes):
        counts = {s: sum(1 for c in changes if c.host == host and c.status == s) for s in _STYLE}
        console.print(f"{host}: {counts['changed']} changed, {counts['ok']} ok, {counts['failed']} failed")
    return table
