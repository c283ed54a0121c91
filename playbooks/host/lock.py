"""The host lock: one voltaforge run at a time per host prefix, never stale."""

from __future__ import annotations

import getpass
import os
import posixpath
import shlex
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

from playbooks.errors import HostError
from playbooks.host.base import Host
from playbooks.host.commands import check_path

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
        f'if ! flock -n 9; then echo "busy $(cat {ql})"; exit {_BUSY_EXIT}; fi; '
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
            raise HostError(f"{host.name} is being provisioned by another voltaforge run (lock {lock} held {held})")
        if "a password is required" in proc.stderr:
            raise host.sudo_needs_password()
        raise HostError(f"{host.name}: cannot take the lock {lock} (exit {code}): {proc.stderr.strip()}")
    try:
        yield lock
    finally:
        proc.close()
