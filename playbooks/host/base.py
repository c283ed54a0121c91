"""The one interface every step uses to reach a host: :class:`Host` (run, sudo, files, spawn).

Two transports implement it (``local.py``, ``ssh.py``) and differ only in how bytes reach a
process; how a command line is built (``commands.py``), how output is streamed and redacted,
and how files are written are shared here.

File contents travel on the command's stdin, never on its command line (argv is visible to
every user of the host in ``ps``), so secrets are safe and binary data is exact.
"""

from __future__ import annotations

import contextlib
import getpass
import io
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

from playbooks.errors import HostError
from playbooks.facts.cuda import parse_nvcc_error
from playbooks.facts.files import parse_sha256, sha256_command
from playbooks.host.commands import build_command, write_file_command
from playbooks.host.output import Printer, Result
from playbooks.host.prefetch import Call, NotARead, Reads, batch_script, parse_batch

Content = bytes | BinaryIO
CHUNK = 64 * 1024
_SUDO_NEEDS_PASSWORD = "a password is required"


class Process:
    """A command started with :meth:`Host.spawn`, whose stdin stays open until closed."""

    #: What it wrote to stderr, once closed.
    stderr: str = ""
    _buf: bytes = b""
    _host: Host

    def _read_chunk(self, deadline: float) -> bytes | None:
        """Some stdout bytes (b"" at end of output), or None when the deadline passed."""
        raise NotImplementedError

    def read_line(self, timeout: float) -> str | None:
        """The next stdout line, or None at end of output; HostError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            data = self._read_chunk(deadline)
            if data is None:
                raise HostError(f"{self._host.name}: no answer after {timeout:g} s")
            if not data:
                break
            self._buf += data
        if not self._buf:
            return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("utf-8", "replace")

    def read(self, timeout: float) -> bytes:
        """The next stdout bytes (b"" at the end of output); HostError after ``timeout``."""
        if self._buf:
            data, self._buf = self._buf, b""
            return data
        chunk = self._read_chunk(time.monotonic() + timeout)
        if chunk is None:
            raise HostError(f"{self._host.name}: no output for {timeout:g} s")
        return chunk

    def close(self, timeout: float = 10) -> int:
        """Close its stdin (a ``cat`` then exits), wait, and return the exit code."""
        raise NotImplementedError


class Host:
    """The interface every provisioning step uses. Subclasses implement ``_exec``/``_spawn``."""

    def __init__(self, name: str, printer: Printer | None = None):
        self.name = name
        self.printer = printer or Printer()
        self._secrets: list[str] = []
        #: commands and scripts sent to the host (a no-op's count is its round trips)
        self.remote_calls = 0
        self._reads: Reads | None = None

    # -- to implement ------------------------------------------------------------------

    def _exec(
        self, command: str, *, stdin: Content | None, stream: bool, timeout: float | None, shown: str
    ) -> tuple[bytes, bytes, int]:
        """Run a full shell line; return (stdout, stderr, exit code)."""
        raise NotImplementedError

    def _spawn(self, command: str) -> Process:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- secrets -------------------------------------------------------------------------

    def redact(self, value: str | bytes) -> None:
        """Never print ``value``: it is replaced by ``***`` in output and error messages."""
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        for v in {value, value.strip()}:
            if v and v not in self._secrets:
                self._secrets.append(v)
        self._secrets.sort(key=len, reverse=True)  # longest first: no partial leftovers

    def _redacted(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _print(self, text: str) -> None:
        self.printer.line(self.name, self._redacted(text))

    # -- commands ------------------------------------------------------------------------

    def run(
        self,
        cmd: str,
        *,
        check: bool = True,
        stream: bool = True,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Content | None = None,
    ) -> Result:
        """Run ``cmd`` with bash on the host. ``check``: a non-zero exit raises HostError."""
        return self._run(cmd, sudo=False, check=check, stream=stream, env=env, timeout=timeout, stdin=stdin)

    def sudo(
        self,
        cmd: str,
        *,
        check: bool = True,
        stream: bool = True,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: Content | None = None,
    ) -> Result:
        """Like :meth:`run`, as root through ``sudo -n`` (never prompts; see module doc)."""
        return self._run(cmd, sudo=True, check=check, stream=stream, env=env, timeout=timeout, stdin=stdin)

    def _needs_sudo_binary(self, sudo: bool) -> bool:
        return sudo

    def _run(self, cmd, *, sudo, check, stream, env, timeout, stdin, raw=False):
        use_sudo = self._needs_sudo_binary(sudo)
        if self._reads is not None:
            out, err, code = self._read_from(self._reads, cmd, sudo, stream, env, timeout, stdin)
        else:
            line = build_command(cmd, env=env, sudo=use_sudo, timeout=timeout)
            if stream:
                self._print(f"$ {'sudo ' if sudo else ''}{cmd}")
            self.remote_calls += 1
            out, err, code = self._exec(line, stdin=stdin, stream=stream, timeout=timeout, shown=cmd)
        err_text = err.decode("utf-8", "replace")
        if use_sudo and code == 1 and _SUDO_NEEDS_PASSWORD in err_text:
            raise self.sudo_needs_password()
        if timeout is not None and code in (124, 137):
            raise HostError(f"{self.name}: timed out after {timeout:g} s running: {self._redacted(cmd)[:80]}")
        if raw:
            return out, err_text, code
        result = Result(out.decode("utf-8", "replace"), err_text, code)
        if check and not result.ok:
            raise HostError(self._failure(cmd, result))
        return result

    # -- reads in one round trip (host/prefetch.py) ---------------------------------------------

    @contextlib.contextmanager
    def reading(self, reads: Reads) -> Iterator[Reads]:
        """A reads pass: every command is answered from ``reads`` (a miss is remembered and
        answered as empty); one that streams or writes raises NotARead. Nothing reaches the host."""
        self._reads = reads
        try:
            yield reads
        finally:
            self._reads = None

    def _read_from(self, reads, cmd, sudo, stream, env, timeout, stdin) -> tuple[bytes, bytes, int]:
        if stream or (stdin is not None and not isinstance(stdin, bytes)):
            raise NotARead(f"{self.name}: not a read: {self._redacted(cmd)[:80]}")
        return reads.answer(Call(cmd, bool(sudo), tuple(sorted((env or {}).items())), timeout, stdin))

    def fetch_reads(self, reads: Reads, calls: list[Call]) -> None:
        """Run these reads in one remote call (the script on stdin) and keep their answers."""
        script, marker = batch_script(calls, [self._needs_sudo_binary(c.sudo) for c in calls])
        self.remote_calls += 1
        shown = f"{len(calls)} reads at once"
        line = build_command("exec bash --noprofile --norc -s")
        out, err, code = self._exec(line, stdin=script.encode(), stream=False, timeout=None, shown=shown)
        try:
            answers = parse_batch(out, marker, len(calls))
        except HostError as exc:
            tail = err.decode("utf-8", "replace").strip()[-300:]
            raise HostError(f"{self.name}: {exc} (exit {code}){': ' + tail if tail else ''}") from None
        reads.answers.update(zip(calls, answers, strict=True))

    def sudo_needs_password(self) -> HostError:
        return HostError(
            f"user {self.user} on {self.name} needs a password for sudo; voltaforge needs "
            "passwordless sudo (NOPASSWD) for the provisioning user"
        )

    def failure(self, cmd: str, result: Result) -> HostError:
        """The error ``run`` raises for a failed command, for a caller that ran it with
        ``check=False`` to read its output first."""
        return HostError(self._failure(cmd, result))

    def _failure(self, cmd: str, result: Result) -> str:
        lines = result.stderr.strip().splitlines()
        # a full disk, or a toolchain error (CUDA 13's nvcc refusing sm_70, a stray ptxas, a
        # host gcc too new: facts/cuda.parse_nvcc_error), is said once, early, and then buried
        # under make's and the compiler's follow-up errors: keep its line, it is the cause
        early = lines[:-5]
        full = [x for x in early if "No space left on device" in x][:1]
        toolchain = [e.line for e in parse_nvcc_error("\n".join(early))][:1]
        tail = "\n".join(full + toolchain + lines[-5:]) or result.stdout.strip()[-400:]
        # redact before cutting to 80 characters, so no part of a secret survives the cut
        msg = f"{self.name}: command failed (exit {result.exited}): {self._redacted(cmd)[:80]}"
        return msg + (f"\n{self._redacted(tail)}" if tail else "")

    @property
    def user(self) -> str:
        return getpass.getuser()

    # -- files -----------------------------------------------------------------------------

    def exists(self, path: str, *, sudo: bool = False) -> bool:
        r = self._run(
            f"test -e {shlex.quote(path)}", sudo=sudo, check=False, stream=False, env=None, timeout=None, stdin=None
        )
        if r.exited not in (0, 1):
            raise HostError(self._failure(f"test -e {path}", r))
        return r.ok

    def sha256(self, path: str, *, sudo: bool = False) -> str | None:
        """Hex SHA-256 of a regular file, None if there is none at ``path`` (the files fact)."""
        r = self._run(sha256_command(path), sudo=sudo, check=False, stream=False, env=None, timeout=None, stdin=None)
        if not r.ok:
            raise HostError(self._failure(f"sha256sum < {path}", r))
        return parse_sha256(r.stdout)

    def write_file(
        self, remote_path: str, content: Content, mode: int, *, sudo: bool = False, owner: str | None = None
    ) -> None:
        """Write ``content`` to ``remote_path`` atomically (see :func:`write_file_command`)."""
        if self._reads is not None:
            raise NotARead(f"{self.name}: not a read: writing {remote_path}")
        script = write_file_command(remote_path, mode, owner)
        r = self._run(script, sudo=sudo, check=False, stream=False, env=None, timeout=None, stdin=content)
        if r.ok:
            return
        if "No space left on device" in r.stderr or "Disk quota exceeded" in r.stderr:
            raise HostError(f"{self.name}: no space left on device at {remote_path}")
        tail = self._redacted(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.exited}")
        raise HostError(f"{self.name}: cannot write {remote_path}: {tail}")

    def put(
        self,
        local_path_or_bytes: bytes | str | os.PathLike,
        remote_path: str,
        mode: int | None = None,
        *,
        sudo: bool = False,
        owner: str | None = None,
    ) -> None:
        """Upload bytes or a local file (atomically). ``mode`` defaults to the local file's
        permission bits, or 0644 for bytes."""
        if isinstance(local_path_or_bytes, bytes):
            self.write_file(remote_path, local_path_or_bytes, 0o644 if mode is None else mode, sudo=sudo, owner=owner)
            return
        local = Path(local_path_or_bytes)
        if mode is None:
            mode = local.stat().st_mode & 0o7777
        with open(local, "rb") as fh:
            self.write_file(remote_path, fh, mode, sudo=sudo, owner=owner)

    def read_bytes(self, path: str, *, sudo: bool = False) -> bytes:
        out, err, code = self._run(
            f"cat -- {shlex.quote(path)}",
            sudo=sudo,
            check=False,
            stream=False,
            env=None,
            timeout=None,
            stdin=None,
            raw=True,
        )
        if code != 0:
            raise HostError(self._redacted(f"{self.name}: cannot read {path}: {err.strip() or f'exit {code}'}"))
        return out

    def get(self, remote: str, local: str | os.PathLike, *, sudo: bool = False) -> None:
        """Download ``remote`` to ``local`` (written to a temp file, then renamed)."""
        data = self.read_bytes(remote, sudo=sudo)
        local = Path(local)
        tmp = local.with_name(f".{local.name}.vf-tmp-{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def forward(self, port: int) -> Iterator[int]:
        """A local port that reaches ``127.0.0.1:port`` on the host (a service that listens on
        the host's loopback only). Here: the same port; over SSH: a forwarded one."""
        yield port

    def spawn(self, cmd: str, *, sudo: bool = False) -> Process:
        """Start ``cmd`` and return at once, stdin kept open (for :func:`ops.host_lock`)."""
        if self._reads is not None:
            raise NotARead(f"{self.name}: not a read: starting {self._redacted(cmd)[:80]}")
        self.remote_calls += 1
        return self._spawn(build_command(cmd, sudo=self._needs_sudo_binary(sudo)))


def stdin_reader(stdin: Content | None) -> BinaryIO | None:
    if stdin is None or hasattr(stdin, "read"):
        return cast("BinaryIO | None", stdin)  # hasattr does not narrow the union
    return io.BytesIO(stdin)
