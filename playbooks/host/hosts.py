"""One small interface to a host, whether it is this machine or a server over SSH.

Every provisioning step talks to a :class:`Host`: ``run``/``sudo`` a command, write a file
atomically, read a hash. Two implementations share all the logic that matters (how a
command line is built, how output is streamed and redacted, how files are written) and
differ only in how bytes reach a process: :class:`LocalHost` (a subprocess, so demos and
tests need no sshd) and :class:`SshHost` (a Fabric ``Connection`` with strict host-key
checking).

Design choices, and why:

- Commands run as ``env LC_ALL=C VAR=... bash --noprofile --norc -o pipefail -c '<cmd>'``:
  nothing depends on the remote user's shell rc files, error messages are English (we match
  "No space left on device"), and a failing stage of a pipe fails the command.
- ``sudo`` is always ``sudo -n``: a sudo that wants a password fails at once with a clear
  error instead of prompting (and hanging). No password is ever read, sent or logged.
- File contents travel on the command's stdin, never on its command line (argv is visible
  to every user of the host in ``ps``), so secrets are safe and binary data is exact. That
  is also why SshHost executes on its own paramiko channel instead of ``Connection.run``:
  Invoke's runner decodes stdin as text and feeds it in 1000-byte chunks.
- Files are written to a temp file in the target directory, chmod-ed, then renamed over the
  target: readers see the old or the new file, never half of one, and a full disk leaves
  the old file untouched (the temp is removed).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import getpass
import io
import os
import posixpath
import re
import selectors
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO, Union

import paramiko

from playbooks.errors import HostError
from playbooks.config.inventory import HostSpec

Content = Union[bytes, BinaryIO]

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OWNER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*\$?(:[A-Za-z_][A-Za-z0-9_.-]*\$?)?$")
#: `timeout` sends TERM at the limit and KILL this many seconds later if still alive.
_KILL_AFTER_S = 5
_CHUNK = 64 * 1024
_SUDO_NEEDS_PASSWORD = "a password is required"


@dataclass(frozen=True)
class Result:
    """What a finished command printed and how it exited."""

    stdout: str
    stderr: str
    exited: int

    @property
    def ok(self) -> bool:
        return self.exited == 0


class Printer:
    """Prints remote output line by line, each line prefixed with its host: ``[v100-01] ...``.

    Plain ``print`` on purpose: remote output may contain ``[brackets]`` that rich would take
    for markup. One lock for all hosts, so lines of parallel hosts never interleave mid-line.
    ``quiet=True`` silences it; ``out`` defaults to the *current* ``sys.stdout``.
    """

    _lock = threading.Lock()

    def __init__(self, out: TextIO | None = None, quiet: bool = False):
        self.out = out
        self.quiet = quiet

    def line(self, host: str, text: str) -> None:
        if self.quiet:
            return
        with self._lock:
            print(f"[{host}] {text}", file=self.out or sys.stdout, flush=True)


class _LineSplitter:
    """Turns a stream of byte chunks into whole decoded lines for the printer."""

    def __init__(self, emit):
        self._emit = emit
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buf = ""

    def feed(self, data: bytes) -> None:
        self._buf += self._decoder.decode(data)
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._emit(line.rstrip("\r"))

    def flush(self) -> None:
        self._buf += self._decoder.decode(b"", final=True)
        if self._buf:
            self._emit(self._buf)
        self._buf = ""


def _validate_env(env: dict[str, str] | None) -> list[str]:
    out = []
    for name, value in (env or {}).items():
        if not _ENV_NAME_RE.match(name):
            raise ValueError(f"invalid environment variable name {name!r}: use letters, digits and _")
        if "\0" in str(value):
            raise ValueError(f"environment variable {name}: value contains a NUL byte")
        out.append(shlex.quote(f"{name}={value}"))
    return out


def build_command(cmd: str, *, env: dict[str, str] | None = None, sudo: bool = False,
                  timeout: float | None = None) -> str:
    """The exact shell line sent to the host for ``cmd``. Pure: tested with plain asserts.

    ``env LC_ALL=C`` comes first so sudo's own messages are English too; under sudo the
    caller's variables are set again *after* sudo (sudo resets the environment);
    ``timeout`` kills the command on the host itself, so a stuck command does not outlive
    our deadline. Variables are on the command line (visible in ``ps`` on the host): pass
    secrets in files (:meth:`Host.put_secret`), not in ``env``.
    """
    assigns = _validate_env(env)
    limit = []
    if timeout is not None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        limit = ["timeout", f"--kill-after={_KILL_AFTER_S}", f"{timeout:g}"]
    if sudo:
        parts = ["env", "LC_ALL=C", *limit, "sudo", "-n", "--", "env", "LC_ALL=C", *assigns]
    else:
        parts = ["env", "LC_ALL=C", *assigns, *limit]
    parts += ["bash", "--noprofile", "--norc", "-o", "pipefail", "-c", shlex.quote(cmd)]
    return " ".join(parts)


def check_path(path: str) -> str:
    if not path.startswith("/") or path.endswith("/") or "\0" in path or "\n" in path:
        raise ValueError(f"remote path must be an absolute file path, got {path!r}")
    return posixpath.normpath(path)


def check_owner(owner: str | None) -> None:
    if owner is not None and not _OWNER_RE.match(owner):
        raise ValueError(f"invalid owner {owner!r}: use 'user' or 'user:group'")


def write_file_command(path: str, mode: int, owner: str | None = None) -> str:
    """The shell script that writes its stdin to ``path`` atomically (temp file + rename).

    The temp file sits beside the target (same filesystem: ``mv`` is an atomic rename), is
    created 0600 by ``mktemp``, gets its final mode/owner *before* the rename, and is removed
    by the EXIT trap on any failure (a full disk, a killed command).
    """
    path = check_path(path)
    check_owner(owner)
    d, base = posixpath.split(path)
    tmp = posixpath.join(d, f".{base}.vf-XXXXXX")
    steps = [
        "set -e",
        "umask 077",
        f"tmp=$(mktemp {shlex.quote(tmp)})",
        "trap 'rm -f \"$tmp\"' EXIT",
        'cat > "$tmp"',
        f'chmod {mode:04o} "$tmp"',
    ]
    if owner:
        steps.append(f'chown {shlex.quote(owner)} "$tmp"')
    # -T: if the target is a directory, fail instead of moving the temp into it.
    steps.append(f'mv -fT "$tmp" {shlex.quote(path)}')
    return "; ".join(steps)


class Process:
    """A command started with :meth:`Host.spawn`, whose stdin stays open until closed."""

    #: What it wrote to stderr, once closed.
    stderr: str = ""
    _buf: bytes = b""
    _host: "Host"

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

    def close(self, timeout: float = 10) -> int:
        """Close its stdin (a ``cat`` then exits), wait, and return the exit code."""
        raise NotImplementedError


class Host:
    """The interface every provisioning step uses. Subclasses implement ``_exec``/``_spawn``."""

    def __init__(self, name: str, printer: Printer | None = None):
        self.name = name
        self.printer = printer or Printer()
        self._secrets: list[str] = []

    # -- to implement ------------------------------------------------------------------

    def _exec(self, command: str, *, stdin: Content | None, stream: bool,
              timeout: float | None, shown: str) -> tuple[bytes, bytes, int]:
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

    def run(self, cmd: str, *, check: bool = True, stream: bool = True,
            env: dict[str, str] | None = None, timeout: float | None = None,
            stdin: Content | None = None) -> Result:
        """Run ``cmd`` with bash on the host. ``check``: a non-zero exit raises HostError."""
        return self._run(cmd, sudo=False, check=check, stream=stream, env=env, timeout=timeout, stdin=stdin)

    def sudo(self, cmd: str, *, check: bool = True, stream: bool = True,
             env: dict[str, str] | None = None, timeout: float | None = None,
             stdin: Content | None = None) -> Result:
        """Like :meth:`run`, as root through ``sudo -n`` (never prompts; see module doc)."""
        return self._run(cmd, sudo=True, check=check, stream=stream, env=env, timeout=timeout, stdin=stdin)

    def _needs_sudo_binary(self, sudo: bool) -> bool:
        return sudo

    def _run(self, cmd, *, sudo, check, stream, env, timeout, stdin, raw=False):
        use_sudo = self._needs_sudo_binary(sudo)
        line = build_command(cmd, env=env, sudo=use_sudo, timeout=timeout)
        if stream:
            self._print(f"$ {'sudo ' if sudo else ''}{cmd}")
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

    def sudo_needs_password(self) -> HostError:
        return HostError(
            f"user {self.user} on {self.name} needs a password for sudo; voltaforge needs "
            "passwordless sudo (NOPASSWD) for the provisioning user"
        )

    def _failure(self, cmd: str, result: Result) -> str:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:]) or result.stdout.strip()[-400:]
        # redact before cutting to 80 characters, so no part of a secret survives the cut
        msg = f"{self.name}: command failed (exit {result.exited}): {self._redacted(cmd)[:80]}"
        return msg + (f"\n{self._redacted(tail)}" if tail else "")

    @property
    def user(self) -> str:
        return getpass.getuser()

    # -- files -----------------------------------------------------------------------------

    def exists(self, path: str, *, sudo: bool = False) -> bool:
        r = self._run(f"test -e {shlex.quote(path)}", sudo=sudo, check=False, stream=False,
                      env=None, timeout=None, stdin=None)
        if r.exited not in (0, 1):
            raise HostError(self._failure(f"test -e {path}", r))
        return r.ok

    def sha256(self, path: str, *, sudo: bool = False) -> str | None:
        """Hex SHA-256 of a regular file, None if there is none at ``path``."""
        q = shlex.quote(path)
        r = self._run(f"if [ -f {q} ]; then sha256sum < {q}; else exit 3; fi", sudo=sudo, check=False,
                      stream=False, env=None, timeout=None, stdin=None)
        if r.exited == 3:
            return None
        if not r.ok:
            raise HostError(self._failure(f"sha256sum < {path}", r))
        return r.stdout.split()[0]

    def write_file(self, remote_path: str, content: Content, mode: int, *, sudo: bool = False,
                   owner: str | None = None) -> None:
        """Write ``content`` to ``remote_path`` atomically (see :func:`write_file_command`)."""
        script = write_file_command(remote_path, mode, owner)
        r = self._run(script, sudo=sudo, check=False, stream=False, env=None, timeout=None, stdin=content)
        if r.ok:
            return
        if "No space left on device" in r.stderr or "Disk quota exceeded" in r.stderr:
            raise HostError(f"{self.name}: no space left on device at {remote_path}")
        tail = self._redacted(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.exited}")
        raise HostError(f"{self.name}: cannot write {remote_path}: {tail}")

    def put(self, local_path_or_bytes: bytes | str | os.PathLike, remote_path: str,
            mode: int | None = None, *, sudo: bool = False, owner: str | None = None) -> None:
        """Upload bytes or a local file (atomically). ``mode`` defaults to the local file's
        permission bits, or 0644 for bytes."""
        if isinstance(local_path_or_bytes, bytes):
            self.write_file(remote_path, local_path_or_bytes, 0o644 if mode is None else mode,
                            sudo=sudo, owner=owner)
            return
        local = Path(local_path_or_bytes)
        if mode is None:
            mode = local.stat().st_mode & 0o7777
        with open(local, "rb") as fh:
            self.write_file(remote_path, fh, mode, sudo=sudo, owner=owner)

    def put_secret(self, remote_path: str, secret: bytes, *, sudo: bool = False,
                   owner: str | None = None) -> None:
        """Write a secret with mode 0600. It travels on stdin (never argv) and is redacted."""
        self.redact(secret)
        self.write_file(remote_path, secret, 0o600, sudo=sudo, owner=owner)

    def read_bytes(self, path: str, *, sudo: bool = False) -> bytes:
        out, err, code = self._run(f"cat -- {shlex.quote(path)}", sudo=sudo, check=False, stream=False,
                                   env=None, timeout=None, stdin=None, raw=True)
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

    def spawn(self, cmd: str, *, sudo: bool = False) -> Process:
        """Start ``cmd`` and return at once, stdin kept open (for :func:`ops.host_lock`)."""
        return self._spawn(build_command(cmd, sudo=self._needs_sudo_binary(sudo)))


def _stdin_reader(stdin: Content | None) -> BinaryIO | None:
    if stdin is None or hasattr(stdin, "read"):
        return stdin
    return io.BytesIO(stdin)


# ------------------------------------------------------------------------------------------
# this machine
# ------------------------------------------------------------------------------------------


class _LocalProcess(Process):
    def __init__(self, host: "LocalHost", command: str):
        self._host = host
        self._proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=_local_env(), start_new_session=True)

    def _read_chunk(self, deadline: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(max(0.0, deadline - time.monotonic())):
                return None
        return os.read(fd, _CHUNK)

    def close(self, timeout: float = 10) -> int:
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
        reader = _stdin_reader(stdin)
        proc = subprocess.Popen(
            ["bash", "-c", command],
            stdin=subprocess.PIPE if reader is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_local_env(), start_new_session=True,
        )
        if reader is not None:
            def feed():
                try:
                    while chunk := reader.read(_CHUNK):
                        proc.stdin.write(chunk)
                except OSError:
                    pass  # the command stopped reading (it failed): its exit code says why
                finally:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            threading.Thread(target=feed, daemon=True).start()
        chunks = {proc.stdout: [], proc.stderr: []}
        splitters = {f: _LineSplitter(self._print) for f in chunks} if stream else {}
        # Backstop only: the `timeout` command on the host is what normally stops it.
        deadline = time.monotonic() + timeout + _KILL_AFTER_S + 5 if timeout else None
        with selectors.DefaultSelector() as sel:
            for f in chunks:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map():
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = sel.select(wait)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    raise HostError(f"{self.name}: timed out after {timeout:g} s running: "
                                    f"{self._redacted(shown)[:80]}")
                for key, _ in events:
                    data = os.read(key.fileobj.fileno(), _CHUNK)
                    if not data:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                        continue
                    chunks[key.fileobj].append(data)
                    if stream:
                        splitters[key.fileobj].feed(data)
        for s in splitters.values():
            s.flush()
        code = proc.wait()
        return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), code

    def _spawn(self, command: str) -> Process:
        return _LocalProcess(self, command)


# ------------------------------------------------------------------------------------------
# a server over SSH
# ------------------------------------------------------------------------------------------


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey):
        super().__init__("host key not in known_hosts")
        self.key = key


class _RejectUnknownHostKey(paramiko.RejectPolicy):
    """RejectPolicy that keeps the offered key, so the error can show its fingerprint."""

    def missing_host_key(self, client, hostname, key):
        raise _UnknownHostKey(key)


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class _SshProcess(Process):
    def __init__(self, host: "SshHost", command: str):
        self._host = host
        self._chan = host._open_channel(command)

    def _read_chunk(self, deadline: float) -> bytes | None:
        while True:
            if self._chan.recv_ready():
                return self._chan.recv(_CHUNK)
            if self._chan.eof_received or self._chan.closed:
                # data can arrive between the two checks: look once more before calling it the end
                return self._chan.recv(_CHUNK) if self._chan.recv_ready() else b""
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def close(self, timeout: float = 10) -> int:
        try:
            self._chan.shutdown_write()
            self._chan.status_event.wait(timeout)
            give_up = time.monotonic() + 2  # stderr may still follow the exit status
            while not (self._chan.eof_received or self._chan.closed) and time.monotonic() < give_up:
                time.sleep(0.005)
            while self._chan.recv_stderr_ready():
                self.stderr += self._chan.recv_stderr(_CHUNK).decode("utf-8", "replace")
            return self._chan.exit_status
        except (OSError, EOFError, paramiko.SSHException):
            return -1
        finally:
            self._chan.close()


class SshHost(Host):
    """A server reached over SSH through a Fabric ``Connection``, with strict host keys.

    Fabric's ``Connection`` trusts any host key on first use (``AutoAddPolicy``) and reads
    ~/.fabric.yaml and ~/.ssh/config. We give it a client that knows exactly the host keys
    of ``spec.known_hosts`` (or ~/.ssh/known_hosts) plus the key pinned in the inventory,
    rejects every other key, and we turn off Fabric's config files: the inventory (which
    already consulted ~/.ssh/config) is the only source of where and how to connect.
    """

    def __init__(self, spec: HostSpec, printer: Printer | None = None, connect_timeout: float = 10):
        import fabric

        super().__init__(spec.name, printer)
        self.spec = spec
        self.connect_timeout = connect_timeout
        self.known_hosts = os.path.expanduser(spec.known_hosts or "~/.ssh/known_hosts")
        connect_kwargs = {"banner_timeout": connect_timeout, "auth_timeout": connect_timeout}
        if spec.key_file:
            # Like IdentitiesOnly: the inventory named a key, so that key and nothing else.
            connect_kwargs.update(key_filename=[os.path.expanduser(spec.key_file)],
                                  look_for_keys=False, allow_agent=False)
        config = fabric.Config(lazy=True, overrides={"load_ssh_configs": False})
        self.conn = fabric.Connection(spec.host, user=spec.user or getpass.getuser(), port=spec.port,
                                      config=config, connect_timeout=connect_timeout,
                                      connect_kwargs=connect_kwargs)
        self.conn.client = self._strict_client()

    @property
    def user(self) -> str:
        return self.conn.user

    @property
    def where(self) -> str:
        return f"{self.name} ({self.spec.host}:{self.spec.port})"

    def _strict_client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        keys = client.get_host_keys()  # not load_host_keys(): that would save keys back
        if os.path.exists(self.known_hosts):
            try:
                keys.load(self.known_hosts)
            except (OSError, paramiko.SSHException) as exc:
                raise HostError(f"{self.where}: cannot read known_hosts {self.known_hosts}: {exc}") from None
        if self.spec.host_key:
            import base64

            keytype, b64 = self.spec.host_key.split()[:2]
            try:
                key = paramiko.PKey.from_type_string(keytype, base64.b64decode(b64))
            except Exception as exc:
                raise HostError(f"{self.where}: host_key in the inventory is not a valid {keytype} key: {exc}") from None
            keys.add(_known_hosts_name(self.spec.host, self.spec.port), keytype, key)
        client.set_missing_host_key_policy(_RejectUnknownHostKey())
        return client

    def open(self) -> "SshHost":
        """Connect now; every way it can fail becomes one HostError that says what to do."""
        if self.conn.is_connected:
            return self
        try:
            self.conn.open()
        except Exception as exc:
            self.conn.client.close()
            message = self._explain_connect_error(exc)
            if message is None:
                raise
            raise HostError(message) from None
        return self

    def _explain_connect_error(self, exc: Exception) -> str | None:
        where, host, port = self.where, self.spec.host, self.spec.port
        pin = "host_key: 'ssh-ed25519 AAAA...'"
        if isinstance(exc, _UnknownHostKey):
            return (
                f"{where}: host key not trusted (the server offered {_fingerprint(exc.key)}). "
                f"Check its fingerprint, then add it: ssh-keyscan -p {port} {host} >> {self._kh_shown()}, "
                f"or pin it in inventory.yaml as {pin}"
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            pinned = " (pinned in inventory.yaml)" if self.spec.host_key else f" (in {self._kh_shown()})"
            return (
                f"{where}: host key CHANGED: expected {_fingerprint(exc.expected_key)}{pinned}, the server "
                f"offered {_fingerprint(exc.key)}. Someone may be intercepting the connection "
                f"(man-in-the-middle), or the host was reinstalled. If you know why it changed, remove "
                f"the old key with: ssh-keygen -R {shlex.quote(_known_hosts_name(host, port))} -f "
                f"{self._kh_shown()} (or update host_key in inventory.yaml), then add the new one"
            )
        if isinstance(exc, paramiko.AuthenticationException):
            how = f"key {self.spec.key_file}" if self.spec.key_file else "the SSH agent and ~/.ssh keys"
            return f"{where}: authentication failed for user {self.user} with {how}"
        if isinstance(exc, socket.gaierror):
            return f"{where}: cannot resolve host name {host!r} ({exc.strerror})"
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            errnos = {e.errno for e in exc.errors.values()}
            if errnos <= {errno.ECONNREFUSED}:
                return f"{where}: {host}:{port} refused the connection (is sshd running, is the port right?)"
            first = next(iter(exc.errors.values()))
            return f"{where}: cannot connect to {host}:{port}: {first.strerror or first}"
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return f"{where}: timed out after {self.connect_timeout:g} s connecting to {host}:{port}"
        if isinstance(exc, OSError):
            return f"{where}: cannot connect to {host}:{port}: {exc.strerror or exc}"
        if isinstance(exc, paramiko.SSHException) and (
            "protocol banner" in str(exc) or str(exc) == "No existing session"
        ):
            # paramiko says the second when its handshake wait ends just before the banner read
            return (f"{where}: {host}:{port} accepted the connection but did not answer as an SSH "
                    f"server within {self.connect_timeout:g} s")
        if isinstance(exc, (paramiko.SSHException, EOFError)):
            return f"{where}: SSH handshake with {host}:{port} failed: {exc or type(exc).__name__}"
        return None

    def _kh_shown(self) -> str:
        home = os.path.expanduser("~")
        return "~" + self.known_hosts[len(home):] if self.known_hosts.startswith(home + "/") else self.known_hosts

    def close(self) -> None:
        self.conn.close()

    def _lost(self, shown: str) -> HostError:
        return HostError(f"connection to {self.where} lost while running: {self._redacted(shown)[:80]}")

    def _open_channel(self, command: str, shown: str = "") -> paramiko.Channel:
        self.open()
        try:
            chan = self.conn.transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
        except (OSError, EOFError, paramiko.SSHException):
            raise self._lost(shown or command) from None
        return chan

    def _exec(self, command, *, stdin, stream, timeout, shown):
        reader = _stdin_reader(stdin)
        chan = self._open_channel(command, shown)
        out, err = [], []
        if stream:
            split_out, split_err = _LineSplitter(self._print), _LineSplitter(self._print)
        pending = b""
        if reader is None:
            chan.shutdown_write()  # EOF right away: a command that reads stdin must not wait
        deadline = time.monotonic() + timeout + _KILL_AFTER_S + 5 if timeout else None
        idle = 0.001
        try:
            while True:
                busy = False
                if chan.recv_ready():
                    data = chan.recv(_CHUNK)
                    out.append(data)
                    if stream:
                        split_out.feed(data)
                    busy = True
                if chan.recv_stderr_ready():
                    data = chan.recv_stderr(_CHUNK)
                    err.append(data)
                    if stream:
                        split_err.feed(data)
                    busy = True
                if reader is not None and chan.send_ready():
                    pending = pending or reader.read(_CHUNK)
                    if pending:
                        try:
                            pending = pending[chan.send(pending):]
                        except OSError:
                            reader, pending = None, b""  # the command closed its stdin
                    else:
                        chan.shutdown_write()
                        reader = None
                    busy = True
                # OpenSSH may send the exit status before the last output: done only at EOF.
                if (chan.eof_received or chan.closed) and chan.exit_status_ready() \
                        and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if busy:
                    idle = 0.001
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    chan.close()
                    raise HostError(f"{self.name}: timed out after {timeout:g} s running: "
                                    f"{self._redacted(shown)[:80]}")
                # Poll, backing off to 50 ms while a long command is quiet; the exit status
                # (or a dropped connection) sets status_event and ends the wait at once.
                chan.status_event.wait(idle)
                idle = min(idle * 2, 0.05)
        except (EOFError, paramiko.SSHException):
            raise self._lost(shown) from None
        if stream:
            split_out.flush()
            split_err.flush()
        code = chan.exit_status
        chan.close()
        if code == -1:
            # No exit status (paramiko ignores "exit-signal"): a command killed by a signal,
            # or a dead connection. The server still sends EOF in the first case; in both,
            # a dying transport takes a moment to notice, so give it that moment.
            give_up = time.monotonic() + (0.3 if chan.eof_received else 2)
            while self.conn.transport.is_active() and time.monotonic() < give_up:
                time.sleep(0.02)
            if not self.conn.transport.is_active() or not chan.eof_received:
                raise self._lost(shown)
            raise HostError(f"{self.name}: killed by a signal while running: {self._redacted(shown)[:80]}")
        return b"".join(out), b"".join(err), code

    def _spawn(self, command: str) -> Process:
        return _SshProcess(self, command)


def connect(spec: HostSpec, printer: Printer | None = None) -> Host:
    """The Host for an inventory entry: LocalHost for ``local``, else a connected SshHost."""
    if spec.local:
        return LocalHost(spec.name, printer)
    return SshHost(spec, printer).open()
