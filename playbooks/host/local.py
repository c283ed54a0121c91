"""This machine as a host, through ``bash -c`` subprocesses (``--host local``: no sshd needed)."""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import threading
import time
from typing import IO, cast

from playbooks.errors import HostError
from playbooks.host.base import CHUNK, Host, Process, stdin_reader
from playbooks.host.commands import KILL_AFTER_S
from playbooks.host.output import LineSplitter, Printer


class _LocalProcess(Process):
    def __init__(self, host: LocalHost, command: str):
        self._host = host
        self._proc = subprocess.Popen(
            ["bash", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_local_env(),
            start_new_session=True,
        )

    def _read_chunk(self, deadline: float) -> bytes | None:
        assert self._proc.stdout is not None  # stdout=PIPE in __init__
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(max(0.0, deadline - time.monotonic())):
                return None
        return os.read(fd, CHUNK)

    def close(self, timeout: float = 10) -> int:
        # all three are PIPEs (__init__)
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, 9)
            code = self._proc.wait()
        self.stderr = self._proc.stderr.read().decode("utf-8", "replace")
        self._proc.stdout.close()
        self._proc.stderr.close()
        return code


def _local_env() -> dict[str, str]:
    # BASH_ENV would make even a non-interactive bash source a file.
    return {k: v for k, v in os.environ.items() if k != "BASH_ENV"}


class LocalHost(Host):
    """This machine, through ``bash -c`` subprocesses (``--host local``: no sshd needed)."""

    def __init__(self, name: str = "local", printer: Printer | None = None):
        super().__init__(name, printer)

    def _needs_sudo_binary(self, sudo: bool) -> bool:
        # Already root: sudo would only add a dependency (and is often absent in containers).
        return sudo and os.geteuid() != 0

    def _exec(self, command, *, stdin, stream, timeout, shown):
        reader = stdin_reader(stdin)
        proc = subprocess.Popen(
            ["bash", "-c", command],
            stdin=subprocess.PIPE if reader is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_local_env(),
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None  # both PIPEs
        if reader is not None:
            pipe = proc.stdin
            assert pipe is not None  # stdin=PIPE when there is a reader

            def feed() -> None:
                try:
                    while chunk := reader.read(CHUNK):
                        pipe.write(chunk)
                except OSError:
                    pass  # the command stopped reading (it failed): its exit code says why
                finally:
                    with contextlib.suppress(OSError):
                        pipe.close()

            threading.Thread(target=feed, daemon=True).start()
        chunks: dict[IO[bytes], list[bytes]] = {proc.stdout: [], proc.stderr: []}
        splitters = {f: LineSplitter(self._print) for f in chunks} if stream else {}
        # Backstop only: the `timeout` command on the host is what normally stops it.
        deadline = time.monotonic() + timeout + KILL_AFTER_S + 5 if timeout else None
        with selectors.DefaultSelector() as sel:
            for f in chunks:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map():
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = sel.select(wait)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    raise HostError(f"{self.name}: timed out after {timeout:g} s running: {self._redacted(shown)[:80]}")
                for key, _ in events:
                    f = cast(IO[bytes], key.fileobj)  # the selector holds the pipes registered above
                    data = os.read(f.fileno(), CHUNK)
                    if not data:
                        sel.unregister(f)
                        f.close()
                        continue
                    chunks[f].append(data)
                    if stream:
                        splitters[f].feed(data)
        for s in splitters.values():
            s.flush()
        code = proc.wait()
        return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), code

    def _spawn(self, command: str) -> Process:
        return _LocalProcess(self, command)
