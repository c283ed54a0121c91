"""A server over SSH as a host: a Fabric ``Connection`` with strict host-key checking.

SshHost executes on its own paramiko channel instead of ``Connection.run``: Invoke's runner
decodes stdin as text and feeds it in 1000-byte chunks, and file contents (secrets included)
travel on stdin.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, cast

import paramiko

from playbooks.config.inventory import HostSpec
from playbooks.errors import HostError
from playbooks.host.base import CHUNK, Host, Process, stdin_reader
from playbooks.host.commands import KILL_AFTER_S
from playbooks.host.output import LineSplitter, Printer

# paramiko's transport thread logs a traceback at ERROR when a handshake fails (a port that
# answers but is no SSH server); with no handler Python would print it on stderr beside the one
# line voltaforge gives for the same failure. Its records reach a handler the user configures.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


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
    def __init__(self, host: SshHost, command: str):
        self._host = host
        self._chan = host._open_channel(command)

    def _read_chunk(self, deadline: float) -> bytes | None:
        while True:
            if self._chan.recv_ready():
                return self._chan.recv(CHUNK)
            if self._chan.eof_received or self._chan.closed:
                # data can arrive between the two checks: look once more before calling it the end
                return self._chan.recv(CHUNK) if self._chan.recv_ready() else b""
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
                self.stderr += self._chan.recv_stderr(CHUNK).decode("utf-8", "replace")
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
        connect_kwargs: dict[str, Any] = {"banner_timeout": connect_timeout, "auth_timeout": connect_timeout}
        if spec.key_file:
            # Like IdentitiesOnly: the inventory named a key, so that key and nothing else.
            connect_kwargs.update(
                key_filename=[os.path.expanduser(spec.key_file)], look_for_keys=False, allow_agent=False
            )
        config = fabric.Config(lazy=True, overrides={"load_ssh_configs": False})
        self.conn = fabric.Connection(
            spec.host,
            user=spec.user or getpass.getuser(),
            port=spec.port,
            config=config,
            connect_timeout=connect_timeout,
            connect_kwargs=connect_kwargs,
        )
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
                raise HostError(
                    f"{self.where}: host_key in the inventory is not a valid {keytype} key: {exc}"
                ) from None
            keys.add(_known_hosts_name(self.spec.host, self.spec.port), keytype, key)
        client.set_missing_host_key_policy(_RejectUnknownHostKey())
        return client

    @contextlib.contextmanager
    def forward(self, port: int) -> Iterator[int]:
        """A local port forwarded to the host's 127.0.0.1:port over this SSH connection.

        Our own small forwarder rather than Fabric's ``forward_local``: that one re-raises, when
        its context exits, any broken pipe its pump threads saw, and an HTTP client closing a
        kept-alive connection is exactly that. Here each accepted connection gets a
        ``direct-tcpip`` channel and two pumps; a peer that goes away just ends its pair.
        """
        self.open()
        transport = self.conn.client.get_transport()
        if transport is None:
            raise HostError(f"{self.where}: the SSH connection is gone")
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.2)
        stop = threading.Event()
        # every open pair, so a connection found dead can end them all: a lost SSH connection
        # does not reach a channel's recv (measured: a forwarded stream whose sshd was killed
        # hung until the client's own read timeout), so the client would wait its whole timeout
        pairs: list[tuple[Any, Any]] = []

        def pump(src: Any, dst: Any) -> None:
            try:
                while True:
                    data = src.recv(CHUNK)
                    if not data:
                        break
                    dst.sendall(data)
            except (OSError, EOFError, paramiko.SSHException):
                pass
            finally:
                for end in (src, dst):
                    # a socket is shut down before it is closed: the other pump may be blocked
                    # in recv on it, and a bare close then sends the HTTP client no FIN
                    if isinstance(end, socket.socket):
                        with contextlib.suppress(Exception):
                            end.shutdown(socket.SHUT_RDWR)
                    with contextlib.suppress(Exception):
                        end.close()

        def alive() -> bool:
            """An SSH_MSG_IGNORE to the server: to a dead peer the kernel answers with a reset,
            and the next send fails (so a lost connection is seen within a second or two)."""
            try:
                transport.send_ignore()
            except (OSError, EOFError, paramiko.SSHException):
                return False
            return transport.is_active()

        def end_all() -> None:
            for client, chan in pairs:
                # shutdown, not only close: a close does not wake the pump blocked in recv on
                # it, and the HTTP client would see no end of its stream
                with contextlib.suppress(Exception):
                    client.shutdown(socket.SHUT_RDWR)
                for end in (client, chan):
                    with contextlib.suppress(Exception):
                        end.close()

        def accept() -> None:
            try:
                serve()
            finally:
                # however the loop ends (stopped, connection lost, an error paramiko raises
                # that nobody listed), no client is left waiting on a pair nobody pumps:
                # measured in CI, an EOFError from open_channel on a dead transport killed
                # this thread before end_all, and the gate's client hung for its whole timeout
                if not stop.is_set() or not transport.is_active():
                    end_all()
                    # and no new connection is taken and left unanswered: with the listener
                    # still open but nobody accepting, the kernel completes each connect from
                    # its backlog and the client waits out its whole read timeout (the gate's
                    # next concurrency level hung 300 s per request in CI: stops 25 and 26)
                    with contextlib.suppress(OSError):
                        listener.close()

        def serve() -> None:
            checked = time.monotonic()
            while not stop.is_set():
                if time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    if not alive():
                        return  # every client sees its connection closed, at once (accept's finally)
                try:
                    client, addr = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                try:
                    chan = transport.open_channel("direct-tcpip", ("127.0.0.1", port), addr)
                except (paramiko.SSHException, OSError, EOFError):
                    client.close()
                    if not transport.is_active():
                        return
                    continue
                pairs.append((client, chan))
                threading.Thread(target=pump, args=(client, chan), daemon=True).start()
                threading.Thread(target=pump, args=(chan, client), daemon=True).start()

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        try:
            yield listener.getsockname()[1]
        finally:
            stop.set()
            acceptor.join(2)
            listener.close()

    def open(self) -> SshHost:
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
            # SSHClient.connect only collects socket errors (OSError); the stub says Exception
            errors = cast(Mapping[Any, OSError], exc.errors)
            errnos = {e.errno for e in errors.values()}
            if errnos <= {errno.ECONNREFUSED}:
                return f"{where}: {host}:{port} refused the connection (is sshd running, is the port right?)"
            first = next(iter(errors.values()))
            return f"{where}: cannot connect to {host}:{port}: {first.strerror or first}"
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return f"{where}: timed out after {self.connect_timeout:g} s connecting to {host}:{port}"
        if isinstance(exc, OSError):
            return f"{where}: cannot connect to {host}:{port}: {exc.strerror or exc}"
        if isinstance(exc, paramiko.SSHException) and (
            "protocol banner" in str(exc) or str(exc) == "No existing session"
        ):
            # paramiko says the second when its handshake wait ends just before the banner read
            return (
                f"{where}: {host}:{port} accepted the connection but did not answer as an SSH "
                f"server within {self.connect_timeout:g} s"
            )
        if isinstance(exc, (paramiko.SSHException, EOFError)):
            return f"{where}: SSH handshake with {host}:{port} failed: {exc or type(exc).__name__}"
        return None

    def _kh_shown(self) -> str:
        home = os.path.expanduser("~")
        return "~" + self.known_hosts[len(home) :] if self.known_hosts.startswith(home + "/") else self.known_hosts

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
        reader = stdin_reader(stdin)
        chan = self._open_channel(command, shown)
        out, err = [], []
        if stream:
            split_out, split_err = LineSplitter(self._print), LineSplitter(self._print)
        pending = b""
        if reader is None:
            chan.shutdown_write()  # EOF right away: a command that reads stdin must not wait
        deadline = time.monotonic() + timeout + KILL_AFTER_S + 5 if timeout else None
        idle = 0.001
        try:
            while True:
                busy = False
                if chan.recv_ready():
                    data = chan.recv(CHUNK)
                    out.append(data)
                    if stream:
                        split_out.feed(data)
                    busy = True
                if chan.recv_stderr_ready():
                    data = chan.recv_stderr(CHUNK)
                    err.append(data)
                    if stream:
                        split_err.feed(data)
                    busy = True
                if reader is not None and chan.send_ready():
                    pending = pending or reader.read(CHUNK)
                    if pending:
                        try:
                            pending = pending[chan.send(pending) :]
                        except OSError:
                            reader, pending = None, b""  # the command closed its stdin
                    else:
                        chan.shutdown_write()
                        reader = None
                    busy = True
                # OpenSSH may send the exit status before the last output: done only at EOF.
                if (
                    (chan.eof_received or chan.closed)
                    and chan.exit_status_ready()
                    and not chan.recv_ready()
                    and not chan.recv_stderr_ready()
                ):
                    break
                if busy:
                    idle = 0.001
                    continue
                if deadline is not None and time.monotonic() > deadline:
                    chan.close()
                    raise HostError(f"{self.name}: timed out after {timeout:g} s running: {self._redacted(shown)[:80]}")
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
