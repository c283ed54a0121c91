"""Operations: read facts, compare with the wanted state, act only on the difference.

An :class:`Operation` is named after the state it ensures ("Ensure /opt/voltaforge exists").
It is a value: ``read(host)`` gathers its facts, ``decide(facts)`` (pure) returns a frozen
:class:`Decision` - the typed commands that close the gap and the reason - and ``apply``
runs a decision. Nothing about a host is stored on the operation, so one list of operations
serves many hosts at once, and decisions are tested table-driven without a host
(tests/data/operations/).

:func:`run_ops` drives a list on one host and returns one :class:`Change` per operation:
changed, ok (with the reason nothing was done) or failed (with a one-line summary of the
error; its full text, a command's output, in ``detail`` for a log file). A dry run stops
after deciding and prints the commands: exactly the plan a real run would follow.

Two shapes beside the idempotent default, for the steps that deploy services:
- ``idempotent = False``: an operation that acts on every run by nature (a smoke benchmark,
  a migration); it is reported as changed each time and the "second run changes nothing"
  checks leave it out, as pyinfra's ``is_idempotent=False`` does.
- ``notify``: names of :class:`Handler` s (daemon-reload, restart a service) that run once,
  after the operations, when any operation that notifies them changed something (Ansible's
  handlers).
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any, Literal

from playbooks.errors import HostError
from playbooks.facts import read_fact
from playbooks.facts.files import FileStat, parse_sha256, parse_stat, stat_command
from playbooks.host.base import Host
from playbooks.host.commands import check_mode, check_owner, check_path, write_file_command
from playbooks.words import clip

Status = Literal["changed", "ok", "failed"]


# ------------------------------------------------------------------------------------------
# commands and decisions
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shell:
    """A shell command run on the host (as root through ``sudo -n`` when ``sudo``)."""

    command: str
    sudo: bool = False

    def show(self) -> str:
        return self.command


@dataclass(frozen=True)
class Upload:
    """Bytes written atomically to a path on the host; they travel on stdin, never on argv."""

    path: str
    content: bytes = field(repr=False)
    mode: int = 0o644
    owner: str | None = None
    sudo: bool = False

    def __post_init__(self) -> None:
        check_path(self.path)
        check_mode(self.mode)
        check_owner(self.owner)

    @property
    def digest(self) -> str:
        return sha256(self.content).hexdigest()

    def show(self) -> str:
        return (
            f"{write_file_command(self.path, self.mode, self.owner)}"
            f"  # stdin: {len(self.content)} bytes, sha256 {self.digest[:12]}"
        )


@dataclass(frozen=True)
class Record:
    """A file whose content is only known while the operation runs (a build's stamp holds what
    its proof found). The operation's own ``apply`` writes it; it is listed so that a dry run
    shows every change."""

    path: str
    what: str
    meta: str = field(default="", repr=False)  # what the operation already knows (JSON)

    def show(self) -> str:
        return f"record {self.what} in {self.path}"


@dataclass(frozen=True)
class PushFile:
    """A file of the controller written atomically to the host, streamed (large archives)."""

    path: str
    local: Path
    sha256: str
    mode: int = 0o644

    def show(self) -> str:
        size = self.local.stat().st_size if self.local.exists() else "?"
        return f"push {self.local} ({size} bytes, sha256 {self.sha256[:12]}) to {self.path}"


@dataclass(frozen=True)
class Fetch:
    """A file of the host copied to the controller (a proven build into the fleet cache)."""

    path: str
    local: Path

    def show(self) -> str:
        return f"fetch {self.path} to the controller's {self.local}"


Command = Shell | Upload | Record | PushFile | Fetch


def run_command(host: Host, cmd: Command) -> None:
    if isinstance(cmd, Record):
        raise TypeError(f"{cmd.show()}: written by its operation's apply(), not run as a command")
    if isinstance(cmd, Upload):
        host.write_file(cmd.path, cmd.content, cmd.mode, sudo=cmd.sudo, owner=cmd.owner)
    elif isinstance(cmd, PushFile):
        with open(cmd.local, "rb") as fh:
            host.write_file(cmd.path, fh, cmd.mode)
    elif isinstance(cmd, Fetch):
        cmd.local.parent.mkdir(parents=True, exist_ok=True)
        host.get(cmd.path, cmd.local)
    else:
        (host.sudo if cmd.sudo else host.run)(cmd.command)


@dataclass(frozen=True)
class Decision:
    """What an operation decided for one host: the commands to run (none: nothing to do) and why."""

    commands: tuple[Command, ...]
    reason: str

    @classmethod
    def ok(cls, reason: str) -> Decision:
        return cls((), reason)

    @classmethod
    def act(cls, reason: str, *commands: Command) -> Decision:
        return cls(tuple(commands), reason)

    def shown(self) -> list[str]:
        return [c.show() for c in self.commands]


class OperationError(HostError):
    """The facts say the wanted state cannot be reached (e.g. a file where a directory must be)."""


@dataclass(frozen=True)
class Change:
    """What one operation did on one host."""

    host: str
    step: str
    status: Status
    why: str  # one line for the report (a failure's summary, see ``summarize``)
    commands: tuple[str, ...] = ()
    detail: str = ""  # a failure's full text (a command's output), for a log file; never shown in the report


# ------------------------------------------------------------------------------------------
# operations
# ------------------------------------------------------------------------------------------


class Operation:
    """Base class: subclasses set ``name`` and implement ``read`` and ``decide``."""

    name: str = "Operation"
    idempotent: bool = True
    notify: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """What the operation makes: two with one key are one (a host serving several recipes
        runs a shared build once, conduct/converge.py). The name, which names its target, unless
        the name leaves the target out."""
        return self.name

    def read(self, host: Host) -> Any:
        """The facts ``decide`` needs, read from the host (read-only)."""
        return None

    def decide(self, facts: Any) -> Decision:
        """Pure: facts in, commands and reason out. Raises OperationError when stuck."""
        raise NotImplementedError

    def check(self, host: Host) -> Decision:
        return self.decide(self.read(host))

    def apply(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            run_command(host, cmd)


@dataclass(frozen=True)
class Handler:
    """Commands run once at the end of a run when an operation that notifies it changed."""

    name: str
    commands: tuple[Command, ...]


def _owner_differs(st: FileStat, owner: str | None) -> bool:
    if owner is None:
        return False
    user, _, group = owner.partition(":")
    return st.owner != user or bool(group and st.group != group)


def _mode_owner_fixes(
    st: FileStat, path: str, mode: int, owner: str | None, sudo: bool
) -> tuple[list[Command], list[str]]:
    """(commands, what differs) to give an existing path this mode and owner."""
    q = shlex.quote(path)
    cmds: list[Command] = []
    diffs: list[str] = []
    if st.mode != mode:
        diffs.append(f"mode is {st.mode:04o}, want {mode:04o}")
        cmds.append(Shell(f"chmod {mode:04o} -- {q}", sudo))
    if owner is not None and _owner_differs(st, owner):
        diffs.append(f"owner is {st.owner}:{st.group}, want {owner}")
        cmds.append(Shell(f"chown -- {shlex.quote(owner)} {q}", sudo))
    return cmds, diffs


class EnsureDirectory(Operation):
    """A directory exists with this mode (and owner, when given)."""

    def __init__(
        self, path: str, mode: int = 0o755, owner: str | None = None, sudo: bool = False, notify: Sequence[str] = ()
    ):
        self.path = check_path(path)
        self.mode = check_mode(mode)
        check_owner(owner)
        self.owner, self.sudo, self.notify = owner, sudo, tuple(notify)
        self.name = f"Ensure {self.path} exists"

    def read(self, host: Host) -> FileStat | None:
        run = host.sudo if self.sudo else host.run
        return parse_stat(run(stat_command(self.path), stream=False).stdout)

    def decide(self, facts: FileStat | None) -> Decision:
        q = shlex.quote(self.path)
        if facts is None:
            cmds: list[Command] = [Shell(f"mkdir -p -m {self.mode:04o} -- {q}", self.sudo)]
            if self.owner:
                cmds.append(Shell(f"chown -- {shlex.quote(self.owner)} {q}", self.sudo))
            return Decision.act("directory is missing", *cmds)
        if facts.kind != "directory":
            raise OperationError(f"{self.path} exists but is a {facts.kind}, not a directory")
        cmds, diffs = _mode_owner_fixes(facts, self.path, self.mode, self.owner, self.sudo)
        owned = f", owner {self.owner}" if self.owner else ""
        return Decision.act("; ".join(diffs) or f"directory already exists with mode {self.mode:04o}{owned}", *cmds)


@dataclass(frozen=True)
class FileFacts:
    stat: FileStat | None
    sha256: str | None


def read_file_facts(host: Host, path: str, sudo: bool) -> FileFacts:
    run = host.sudo if sudo else host.run
    st = parse_stat(run(stat_command(path), stream=False).stdout)
    digest = host.sha256(path, sudo=sudo) if st is not None and st.is_file else None
    return FileFacts(st, digest)


def decide_file(upload: Upload, facts: FileFacts) -> Decision:
    """The decision for "this file holds exactly these bytes, with this mode and owner"."""
    if facts.stat is None:
        return Decision.act("file is missing", upload)
    if not facts.stat.is_file:
        raise OperationError(f"{upload.path} exists but is a {facts.stat.kind}, not a regular file")
    if facts.sha256 != upload.digest:
        have = (facts.sha256 or "?")[:12]
        return Decision.act(f"content differs (sha256 {have} on the host, {upload.digest[:12]} wanted)", upload)
    cmds, diffs = _mode_owner_fixes(facts.stat, upload.path, upload.mode, upload.owner, upload.sudo)
    return Decision.act("; ".join(diffs) or f"file is already up to date (sha256 {upload.digest[:12]})", *cmds)


@dataclass(frozen=True)
class PushedFacts:
    stat: FileStat | None
    sha256: str | None
    hashed: bool  # read whole (no quick-check record, or one that no longer matches)


class EnsurePushedFile(Operation):
    """A file of the controller whose sha256 is already known (a checked download) is on the
    host: compared by that sha256, streamed when it differs. Never read into memory here, and
    never hashed again on the controller (the pinned sdist is 77 MB: reading and hashing it
    here was a fifth of a no-op).

    On the host, rsync's quick check: a record beside the file (``<path>.vf-sha256``: the
    sha256, the size and the modification time it was written with) stands for the file while
    its size and time are unchanged, so a run does not hash 77 MB to find it unchanged; any
    other file is hashed, and a matching one gets its record."""

    def __init__(self, path: str, local: Path, sha256: str, mode: int = 0o644):
        self.path, self.local, self.sha256, self.mode = check_path(path), local, sha256, check_mode(mode)
        self.record = f"{self.path}.vf-sha256"
        self.name = f"Ensure {self.path} is up to date"

    def read(self, host: Host) -> PushedFacts:
        st = parse_stat(read_fact(host, stat_command(self.path)))
        f, r = shlex.quote(self.path), shlex.quote(self.record)
        out = read_fact(
            host,
            f"if [ -f {f} ]; then id=$(stat -L -c '%s %Y' -- {f}); "
            f'if [ -f {r} ] && [ "$(sed -n 2p {r})" = "$id" ]; then echo "recorded $(sed -n 1p {r})"; '
            f'else echo "hashed $(sha256sum < {f})"; fi; else echo missing; fi',
        ).split()
        kind = out[0] if out else ""
        return PushedFacts(st, parse_sha256(out[1]) if len(out) > 1 else None, kind != "recorded")

    def decide(self, facts: PushedFacts) -> Decision:
        f, r = shlex.quote(self.path), shlex.quote(self.record)
        keep = Shell(f"{{ echo {self.sha256}; stat -L -c '%s %Y' -- {f}; }} > {r}.new && mv -f -- {r}.new {r}")
        push = PushFile(self.path, self.local, self.sha256, self.mode)
        if facts.stat is None:
            return Decision.act("file is missing", push, keep)
        if not facts.stat.is_file:
            raise OperationError(f"{self.path} exists but is a {facts.stat.kind}, not a regular file")
        if facts.sha256 != self.sha256:
            have = (facts.sha256 or "?")[:12]
            return Decision.act(f"content differs (sha256 {have} on the host, {self.sha256[:12]} wanted)", push, keep)
        cmds, diffs = _mode_owner_fixes(facts.stat, self.path, self.mode, None, False)
        if facts.hashed:
            cmds.append(keep)
            diffs.append(f"sha256 {self.sha256[:12]} matches: its quick-check record written")
        return Decision.act("; ".join(diffs) or f"file is already up to date (sha256 {self.sha256[:12]})", *cmds)


# ------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------


#: raw output (a command's stderr) is cut to its first line, at most this long
SUMMARY_LIMIT = 300
#: a message that is one line is one written for people, its fix at the end: kept up to this
MESSAGE_LIMIT = 1000
FULL_OUTPUT_NOTE = "(full output in the log)"


def summarize(text: str) -> str:
    """One line for the report's why column out of an error's text: its first meaningful line
    (a Python traceback's is its last), cut to SUMMARY_LIMIT characters when the text has more
    lines; it ends with FULL_OUTPUT_NOTE exactly when something was left out. A one-line
    message is kept whole up to MESSAGE_LIMIT characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "failed without a message"
    if len(lines) == 1 and len(lines[0]) <= MESSAGE_LIMIT:
        return lines[0]
    if len(lines) == 2 and lines[0].startswith("command failed (exit"):
        # a command that printed one line: that line is the message, the command says where
        both = f"{lines[1]} ({lines[0]})"
        return both if len(both) <= SUMMARY_LIMIT else f"{clip(both, SUMMARY_LIMIT)} {FULL_OUTPUT_NOTE}"
    first = lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]
    limit = MESSAGE_LIMIT if len(lines) == 1 else SUMMARY_LIMIT
    cut = clip(first, limit)  # at a word, with an ellipsis (the whole is in the log)
    return f"{cut} {FULL_OUTPUT_NOTE}"


class Interrupted(HostError):
    """Ctrl-C: the run stops between operations (``run_ops``'s ``cancel``)."""


def _failed(host: Host, step: str, exc: HostError, shown: tuple[str, ...] = ()) -> Change:
    # The report has a host column: drop the "v100-01: " that standalone messages carry.
    text = str(exc).removeprefix(f"{host.name}: ")
    return Change(host.name, step, "failed", summarize(text), shown, detail=text)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def run_ops(
    host: Host,
    ops: Sequence[Operation],
    dry_run: bool = False,
    handlers: Sequence[Handler] = (),
    keep_going: bool = False,
    cancel: threading.Event | None = None,
) -> list[Change]:
    """Check and apply ``ops`` in order on one host; stop at the first failure.

    Operations after a failure are not attempted (they usually depend on it), so the list
    returned can be shorter than ``ops``. A dry run only reads facts: it prints the exact
    commands and reports them as "changed" without running them. (Later operations are
    checked against the host as it is, not as the earlier ones would leave it.) Handlers
    notified by a changed operation run once at the end, in the order given, unless
    something failed. ``keep_going`` (a dry run only): check every operation, failed or not
    (a reads pass, host/prefetch.py, that wants all of them). ``cancel``: once set (Ctrl-C),
    every operation not yet checked fails as interrupted, with nothing of it done.
    """
    keep_going = keep_going and dry_run
    by_name = {h.name: h for h in handlers}
    for op in ops:
        for name in op.notify:
            if name not in by_name:
                raise ValueError(f"{op.name} notifies {name!r}, which is not among the handlers")
    changes: list[Change] = []
    notified: set[str] = set()
    failed = False

    def record(change: Change) -> None:
        changes.append(change)
        host.printer.line(host.name, f"{change.status}: {change.step} - {change.why}")

    for op in ops:
        try:
            if cancel is not None and cancel.is_set():
                raise Interrupted("interrupted before this operation: nothing of it was done")
            decision = op.check(host)
        except HostError as exc:
            record(_failed(host, op.name, exc))
            failed = True
            if keep_going:
                continue
            break
        shown = tuple(decision.shown())
        if not decision.commands:
            record(Change(host.name, op.name, "ok", decision.reason or "already in the wanted state"))
            continue
        if dry_run:
            for line in shown:
                host.printer.line(host.name, f"would run: {line}")
            why = f"dry run: would run {_plural(len(shown), 'command')}"
            record(
                Change(host.name, op.name, "changed", f"{why} ({decision.reason})" if decision.reason else why, shown)
            )
        else:
            try:
                op.apply(host, decision)
            except HostError as exc:
                record(_failed(host, op.name, exc, shown))
                failed = True
                break
            record(Change(host.name, op.name, "changed", decision.reason, shown))
        notified.update(op.notify)
    if failed:
        return changes
    for handler in handlers:
        if handler.name not in notified:
            continue
        shown = tuple(c.show() for c in handler.commands)
        if dry_run:
            for line in shown:
                host.printer.line(host.name, f"would run: {line}")
            record(Change(host.name, handler.name, "changed", "dry run: notified by a change", shown))
            continue
        try:
            for cmd in handler.commands:
                run_command(host, cmd)
        except HostError as exc:
            record(_failed(host, handler.name, exc, shown))
            break
        record(Change(host.name, handler.name, "changed", "notified by a change", shown))
    return changes
