"""Real SSH test hosts for voltaforge's tests: start them, hand them out, tear them down.

Three kinds of host, from cheapest to most realistic (measurements and the reasoning behind
every flag come from ``shared/testhosts.md``):

``sshd_host`` (:class:`SshdHost`, ~0.3 s, function scope)
    A private OpenSSH server on 127.0.0.1 and a random free port, with its own config, host
    key, client key and ``authorized_keys``, logging in as a dedicated unprivileged user.
    It shares this machine's filesystem and users, so every host gets its own install
    ``prefix``. Optional sudo (``"nopasswd"`` / ``"password"``) through a sudoers.d drop-in.

``netns_host`` (:class:`SshdHost` with ``netns`` set, ~0.3 s, function scope)
    The same sshd, started inside its own network namespace and reachable from this
    (root) namespace only through a veth pair, at ``hostname`` (the namespace end of a /30).

``nspawn_host`` (:class:`NspawnHost`, a few seconds, session scope)
    A Debian 12 system booted by ``systemd-nspawn -b`` in its own network namespace: real
    systemd, journald, sudo and apt layout. Login ``deploy`` (passwordless sudo). The rootfs
    comes from ``ci/build-test-rootfs.sh`` (cached tarball), is unpacked once into the cache
    and booted through an overlay mount, so the cache stays clean and each session starts
    from a fresh system.

``provisionable_nspawn_host`` (:class:`NspawnHost`, a few seconds, function scope)
    The same Debian 12 container, booted fresh for each test, staged like an air-gapped lab
    stages a host so voltaforge can provision it without internet: the image carries the
    Debian packages provisioning needs (python3-venv, g++, make, cmake, ccache); the Python
    packages come from a wheelhouse on the controller (tests/wheelhouse.py, built once),
    bind-mounted read-only at ``/opt/voltaforge-wheels``, with ``/etc/pip.conf`` saying
    ``no-index`` and ``find-links`` there, so pip on the host installs from it and nothing
    else. A ccache directory in the test cache is bind-mounted writable and linked from
    ``<prefix>/llama.cpp/ccache`` (where the build step puts its cache), so the server's
    compile is warm across containers and sessions (the bindings' is not: pip builds them in
    a random temporary directory, so their compiler command lines never repeat).

Every host is verified with strict host-key checking: the fixture knows the host key before
the first connection (it generated it) and writes it to ``known_hosts``; use
:func:`strict_connection` (Fabric) or :func:`strict_client` (paramiko), which load that file and
set :class:`paramiko.RejectPolicy` -- never ``AutoAddPolicy``, which is Fabric's default.

If the machine cannot run a kind of host (not root, a tool missing) the fixture skips with
the reason; in strict mode (``VOLTAFORGE_STRICT=1``, exported by ci/test.sh; see
tests/strict.py) it fails instead, so CI can never silently skip the real-host tests.

Names of everything created system-wide (network namespaces, veths, cgroups, sudoers
drop-ins) embed this process's pid and a counter, so parallel sessions (xdist workers, CI
jobs on one machine) never clash, and :func:`reap_stale_resources` can remove what a killed
session left behind (only for pids that are no longer alive).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import itertools
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import paramiko
import pytest

from strict import strict_mode

__all__ = [
    "HostSetupError",
    "NetnsLink",
    "NspawnHost",
    "SshdHost",
    "ensure_rootfs_tarball",
    "ensure_test_user",
    "known_hosts_name",
    "make_sshd_host",
    "netns_host",
    "nspawn_host",
    "provisionable_nspawn_host",
    "reap_stale_resources",
    "remove_test_user",
    "sshd_host",
    "start_nspawn_host",
    "strict_client",
    "strict_connection",
    "testhost_user",
]

SSHD = "/usr/sbin/sshd"
REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_ROOTFS_SCRIPT = REPO_ROOT / "ci" / "build-test-rootfs.sh"
SUDOERS_DIR = Path("/etc/sudoers.d")
#: /30 subnets for veth pairs are taken from here (checked against addresses in use).
VETH_POOL = ipaddress.ip_network("10.213.0.0/16")
#: The cached image ci/build-test-rootfs.sh builds; its version is in the name (see there).
ROOTFS_TARBALL = "rootfs-bookworm-v3.tar.zst"
#: Inside a provisionable container: the wheelhouse (read-only) and the shared ccache.
CONTAINER_WHEELHOUSE = PurePosixPath("/opt/voltaforge-wheels")
CONTAINER_CCACHE = PurePosixPath("/var/cache/voltaforge-ccache")
#: Prefix of every system-wide name this module creates; see reap_stale_resources().
NAME_PREFIX = "vf-"


def _process_counter() -> Iterator[int]:
    """One counter per process for every copy of this module: conftest imports it as
    ``testhosts``, most tests as ``tests.testhosts``, two module objects. Each had its own counter,
    so a test's nspawn host and a fixture's shared container got one netns name in one worker
    (cold runs 82 and 83: "File exists", then the shared container unreachable)."""
    holder = sys.modules.setdefault("_vf_testhosts_names", types.ModuleType("_vf_testhosts_names"))
    counter: Iterator[int] = holder.__dict__.setdefault("counter", itertools.count(1))
    return counter


_counter = _process_counter()


class HostSetupError(RuntimeError):
    """A test host could not be started or stopped; the message carries the log tail."""


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------


def _unique_tag() -> tuple[int, int]:
    """(pid, counter): unique among live processes, and parseable for stale reaping."""
    return os.getpid(), next(_counter)


def _run(cmd: list[str], *, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise HostSetupError(f"{' '.join(cmd)!r} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _lock_file() -> Path:
    base = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    return base / "voltaforge-testhosts.lock"


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    """Machine-wide lock: picking a free /30 and creating it must be atomic across sessions."""
    with open(_lock_file(), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of ``pids`` is alive (a zombie counts as gone); whether they all went."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _keygen(path: Path, comment: str) -> str:
    """ed25519 key pair at ``path``/``path.pub``; returns the public line (type, base64, comment)."""
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return path.with_name(path.name + ".pub").read_text().strip()


def known_hosts_name(host: str, port: int) -> str:
    """The host field of a known_hosts line: ``host`` for port 22, else ``[host]:port``."""
    return host if port == 22 else f"[{host}]:{port}"


def _host_key_line(host: str, port: int, pub_line: str) -> str:
    keytype, b64 = pub_line.split()[:2]
    return f"{known_hosts_name(host, port)} {keytype} {b64}"


def _wait_tcp(host: str, port: int, timeout: float, alive=lambda: True) -> None:
    """Wait until something accepts on host:port; ``alive()`` False aborts early."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise HostSetupError(f"server for {host}:{port} exited before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise HostSetupError(f"nothing listens on {host}:{port} after {timeout:.0f} s") from e
            time.sleep(0.02)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the caller retries if it is taken meanwhile)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _unavailable(reason: str):
    """Skip (developer machine) or fail (strict mode: VOLTAFORGE_STRICT=1, tests/strict.py).

    The suite-wide hook would turn the skip into a failure as well; failing here directly
    keeps the message specific when this module is used outside the suite."""
    if strict_mode():
        pytest.fail(f"test host unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


def require(*, binaries: tuple[str, ...] = (), what: str = "this test host") -> None:
    """Skip/fail unless we are root and every binary exists (absolute path or on PATH)."""
    if os.geteuid() != 0:
        _unavailable(f"{what} needs root (user, sshd, netns and nspawn setup)")
    missing = [b for b in binaries if not (Path(b).exists() if b.startswith("/") else shutil.which(b))]
    if missing:
        _unavailable(f"{what} needs {', '.join(missing)} (install with ci/install-system-deps.sh)")


# --------------------------------------------------------------------------------------
# strict SSH clients
# --------------------------------------------------------------------------------------


def strict_client(known_hosts: str | os.PathLike) -> paramiko.SSHClient:
    """A paramiko client that trusts exactly ``known_hosts`` and rejects anything else."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return client


def strict_connection(host, *, user: str | None = None, known_hosts: str | None = None, **connect_kwargs):
    """A ``fabric.Connection`` to a test host with strict host-key checking.

    Fabric's ``Connection`` installs ``AutoAddPolicy`` (trust on first use); we load the
    host's ``known_hosts`` and switch to ``RejectPolicy`` before anything connects, so an
    unknown or changed host key raises instead of being silently accepted. Agent and
    ``~/.ssh`` keys are off so only the test key can authenticate. ``known_hosts``
    overrides the host's file (e.g. an empty one, to prove unknown hosts are refused).
    """
    import fabric

    kwargs = {
        "key_filename": host.key_filename,
        "look_for_keys": False,
        "allow_agent": False,
        **connect_kwargs,
    }
    # No ~/.ssh/config (it could rewrite host/port/user); no stdin mirroring (pytest's
    # captured stdin raises on read, and tests never type into remote commands).
    config = fabric.Config(overrides={"load_ssh_configs": False, "run": {"in_stream": False}})
    conn = fabric.Connection(
        host.hostname,
        port=host.port,
        user=user or host.user,
        connect_kwargs=kwargs,
        connect_timeout=10,
        config=config,
    )
    conn.client.load_host_keys(str(known_hosts or host.known_hosts))
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return conn


def _ssh_command(host, command: str, user: str) -> list[str]:
    """``ssh`` argv for ``host``: only its key, only its known_hosts, never a prompt."""
    return [
        "ssh",
        "-F",
        "/dev/null",  # no user/system ssh_config rewriting host, port or user
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={host.known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "IdentityAgent=none",
        "-o",
        "ConnectTimeout=5",
        "-o",
        "LogLevel=ERROR",
        "-i",
        host.key_filename,
        "-p",
        str(host.port),
        f"{user}@{host.hostname}",
        "--",
        command,
    ]


# --------------------------------------------------------------------------------------
# the test user and sudo
# --------------------------------------------------------------------------------------


#: Test users are named ``vf-test-<pid>``: one per test session (process).
TEST_USER_PREFIX = "vf-test-"


def default_test_user() -> str:
    """``vf-test-<pid>``: this session's own login user.

    One user per session (not one shared ``vf-test``) because sudo rules and the sudo
    password belong to the *user*: two sessions running at once (two CI jobs, xdist
    workers) would otherwise see each other's sudoers drop-ins and overwrite each
    other's password -- measured: a parallel run failed ``sudo`` that way.
    """
    return f"{TEST_USER_PREFIX}{os.getpid()}"


def ensure_test_user(name: str | None = None) -> pwd.struct_passwd:
    """Create (idempotent) the unprivileged login user of ``sshd_host``/``netns_host``.

    ``useradd -m`` gives it a home (Fabric's sftp starts there); ``usermod -p '*'`` because
    with ``UsePAM no`` sshd treats a ``!`` password (useradd's default) as a *locked*
    account and refuses even key logins, while ``*`` just means "no password matches".
    The ``testhost_user`` fixture removes it at the end of the session
    (:func:`remove_test_user`); :func:`reap_stale_resources` removes those of dead sessions.
    """
    name = name or default_test_user()
    with _global_lock():
        try:
            pwd.getpwnam(name)
        except KeyError:
            for attempt in range(20):  # useradd exits 10 while another tool locks /etc/passwd
                proc = _run(
                    ["useradd", "-m", "-U", "-s", "/bin/bash", "-c", "voltaforge test host", name], check=attempt == 19
                )
                if proc.returncode == 0:
                    break
                time.sleep(0.1)
        _run(["usermod", "-p", "*", name])
    return pwd.getpwnam(name)


def remove_test_user(name: str) -> None:
    """``userdel -r`` (home and group too); ``-f`` if a stray process still runs as it."""
    with _global_lock():
        for args in (["userdel", "-r"], ["userdel", "-r", "-f"]):
            _run([*args, name], check=False)
            try:
                pwd.getpwnam(name)
            except KeyError:
                return


class SudoersDropIn:
    """A validated ``/etc/sudoers.d`` drop-in for the test user, removed on :meth:`remove`.

    ``"nopasswd"``: ``NOPASSWD: ALL``. ``"password"``: sudo asks for the user's password
    every time (``timestamp_timeout=0``, so one success does not mask the next prompt); a
    random password is set with ``chpasswd`` and exposed as :attr:`password`, and reset to
    ``*`` on removal. The file is written under a dotted name (sudo ignores files with a
    ``.`` in ``@includedir``), checked with ``visudo -cf``, then renamed into place: a broken
    file never becomes active, since a syntax error there would break sudo machine-wide.
    """

    def __init__(self, user: str, mode: str):
        if mode not in ("nopasswd", "password"):
            raise ValueError(f"sudo must be 'nopasswd', 'password' or None, not {mode!r}")
        pid, n = _unique_tag()
        self.user = user
        self.mode = mode
        self.path = SUDOERS_DIR / f"{NAME_PREFIX}{pid}-{n}"
        self.password: str | None = None

    def install(self) -> None:
        if self.mode == "nopasswd":
            body = f"{self.user} ALL=(ALL:ALL) NOPASSWD: ALL\n"
        else:
            self.password = secrets.token_urlsafe(12)
            _run(["chpasswd"], input=f"{self.user}:{self.password}\n")
            body = f"Defaults:{self.user} lecture=never, timestamp_timeout=0\n{self.user} ALL=(ALL:ALL) ALL\n"
        text = f"# voltaforge test host (pid {os.getpid()}), removed at teardown\n{body}"
        tmp = SUDOERS_DIR / f".{self.path.name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o440)
        try:
            _run(["visudo", "-cf", str(tmp)])
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.password is not None:
            _run(["usermod", "-p", "*", self.user], check=False)
            self.password = None


# --------------------------------------------------------------------------------------
# network namespaces
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class NetnsLink:
    """A network namespace joined to this (root) namespace by a veth pair on a /30.

    ``host_addr`` sits on ``host_if`` in the root namespace; ``peer_addr`` on ``eth0``
    inside ``name``. Loopback inside is brought up (``lo`` starts down in a new netns and
    many services bind 127.0.0.1). No route or NAT beyond the /30: a host in there can talk
    to this machine's ``host_addr`` and nothing else.
    """

    name: str
    host_if: str
    ns_if: str
    host_addr: str
    peer_addr: str
    prefixlen: int = 30

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    @classmethod
    def create(cls) -> NetnsLink:
        pid, n = _unique_tag()
        name = f"{NAME_PREFIX}{pid}-{n}"
        host_if = f"vf{pid}h{n}"[:15]  # interface names are limited to 15 bytes
        with _global_lock():
            host_addr, peer_addr = _pick_subnet(pid * 7919 + n)
            link = cls(name, host_if, "eth0", host_addr, peer_addr)
            try:
                _run(["ip", "netns", "add", name])
                _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", name])
                _run(["ip", "addr", "add", f"{host_addr}/30", "dev", host_if])
                _run(["ip", "link", "set", host_if, "up"])
                _run(["ip", "-n", name, "addr", "add", f"{peer_addr}/30", "dev", "eth0"])
                _run(["ip", "-n", name, "link", "set", "eth0", "up"])
                _run(["ip", "-n", name, "link", "set", "lo", "up"])
            except BaseException:
                link.destroy()
                raise
        return link

    def destroy(self) -> None:
        """Remove veth and namespace; safe to call twice or on a half-built link."""
        _run(["ip", "link", "del", self.host_if], check=False)
        _run(["ip", "netns", "del", self.name], check=False)


def _pick_subnet(seed: int) -> tuple[str, str]:
    """A /30 from VETH_POOL that overlaps no IPv4 address or route of the root namespace."""
    used = []
    for cmd in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        for tok in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", _run(cmd).stdout):
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(tok, strict=False))
    subnets = VETH_POOL.num_addresses // 4
    for i in range(subnets):
        net = ipaddress.ip_network((int(VETH_POOL.network_address) + ((seed + i) % subnets) * 4, 30))
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            hosts = list(net.hosts())
            return str(hosts[0]), str(hosts[1])
    raise HostSetupError(f"no free /30 left in {VETH_POOL}")


# --------------------------------------------------------------------------------------
# private sshd (loopback or netns)
# --------------------------------------------------------------------------------------

_SSHD_CONFIG = """\
# voltaforge test sshd ({tag}); see tests/testhosts.py
Port {port}
# Loopback (or the netns veth address) only: never reachable from outside this machine.
ListenAddress {listen}
# Own host key, pid file and authorized_keys: nothing shared with a system sshd.
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
# Keys only, like the servers voltaforge provisions.
PasswordAuthentication no
KbdInteractiveAuthentication no
# No PAM: this machine's PAM session stack (loginuid, logind, motd) is not meant for a
# throwaway sshd. Side effect: a '!' password now means "locked", hence usermod -p '*'.
UsePAM no
# /tmp (where authorized_keys lives) is world-writable; StrictModes would reject it.
StrictModes no
AllowUsers {user}
PermitRootLogin no
# Fabric's put/get use SFTP; in-process server, no external sftp-server binary needed.
Subsystem sftp internal-sftp
PrintMotd no
PrintLastLog no
LogLevel VERBOSE
"""


@dataclasses.dataclass
class SshdHost:
    """A private OpenSSH server; yielded by ``sshd_host`` (loopback) and ``netns_host``.

    Connect to ``hostname``:``port`` as ``user`` with ``key_filename``; trust exactly
    ``known_hosts`` (which holds ``host_key_line``). ``prefix`` is an empty directory the
    user owns, for this host's installs (the host shares this machine's filesystem).
    """

    hostname: str
    port: int
    user: str
    key_filename: str
    known_hosts: str
    host_key_line: str
    prefix: Path
    pid: int | None
    #: None, "nopasswd" or "password" (then :attr:`sudo_password` is the user's password).
    sudo: str | None = None
    sudo_password: str | None = None
    #: Network namespace name (netns_host only) and the veth link.
    netns: str | None = None
    link: NetnsLink | None = None
    config_dir: Path | None = None
    log_file: Path | None = None
    sudoers_file: Path | None = None

    _proc: subprocess.Popen | None = dataclasses.field(default=None, repr=False)
    _cleanups: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack, repr=False)
    _listen: str = dataclasses.field(default="", repr=False)
    _authorized_keys: Path | None = dataclasses.field(default=None, repr=False)
    _host_key: Path | None = dataclasses.field(default=None, repr=False)
    _tag: str = dataclasses.field(default="", repr=False)
    _env: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    _under: list[str] = dataclasses.field(default_factory=list, repr=False)

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        config_dir: Path,
        *,
        user: str | None = None,
        sudo: str | None = None,
        netns: bool = False,
        port: int | None = None,
        env: dict[str, str] | None = None,
        under: list[str] | None = None,
    ) -> SshdHost:
        """Configure and start a server; on any failure everything created is undone.

        ``env``: variables set in every session (sshd's ``SetEnv``), e.g. ``PIP_CONFIG_FILE``
        for a host in its own network namespace, whose pip reaches no index. ``under``: a
        command sshd runs under (tests/exec_trace.py's strace: every session's execs recorded);
        :attr:`pid` is then that command's, and stopping the host stops both.

        ``config_dir`` (e.g. pytest's ``tmp_path``) receives the config, host key, client
        key, known_hosts and the sshd log (kept by pytest for post-mortems). Because sshd
        reads ``authorized_keys`` with the *user's* uid and pytest's base temp is 0700,
        ``authorized_keys`` and the ``prefix`` live in a separate ``/tmp/vf-<pid>-<n>-sshd-*``
        directory, removed at teardown. In a netns the default port is 22 (the namespace
        has its own port space); on loopback a random free port.
        """
        binaries = [SSHD, "ssh-keygen", "useradd", "usermod"]
        if sudo:
            binaries += ["sudo", "visudo", "chpasswd"]
        if netns:
            binaries += ["ip"]
        require(binaries=tuple(binaries), what="netns_host" if netns else "sshd_host")
        account = ensure_test_user(user)
        stack = contextlib.ExitStack()
        try:
            config_dir = Path(config_dir)
            config_dir.mkdir(parents=True, exist_ok=True)
            pid, n = _unique_tag()
            tag = f"{NAME_PREFIX}{pid}-{n}"

            share = Path(tempfile.mkdtemp(prefix=f"{tag}-sshd-", dir="/tmp"))
            stack.callback(shutil.rmtree, share, True)
            os.chmod(share, 0o755)
            prefix = share / "prefix"
            prefix.mkdir()
            os.chown(prefix, account.pw_uid, account.pw_gid)
            authorized_keys = share / "authorized_keys"

            client_key = config_dir / "id_ed25519"
            authorized_keys.write_text(_keygen(client_key, f"voltaforge-test-client-{tag}") + "\n")
            os.chmod(authorized_keys, 0o644)
            host_key = config_dir / "ssh_host_ed25519_key"
            host_pub = _keygen(host_key, f"voltaforge-test-host-{tag}")

            link = None
            if netns:
                link = NetnsLink.create()
                stack.callback(link.destroy)
                hostname, listen, port = link.peer_addr, link.peer_addr, port or 22
            else:
                hostname, listen = "127.0.0.1", "127.0.0.1"

            host = cls(
                hostname=hostname,
                port=port or free_port(),
                user=account.pw_name,
                key_filename=str(client_key),
                known_hosts=str(config_dir / "known_hosts"),
                host_key_line="",
                prefix=prefix,
                pid=None,
                sudo=sudo,
                netns=link.name if link else None,
                link=link,
                config_dir=config_dir,
                log_file=config_dir / "sshd.log",
            )
            host._listen = listen
            host._env = dict(env or {})
            host._under = list(under or [])
            host._authorized_keys = authorized_keys
            host._tag = tag
            host._host_key = host_key
            host.host_key_line = _host_key_line(hostname, host.port, host_pub)
            host.trust_current_host_key()

            if sudo:
                dropin = SudoersDropIn(account.pw_name, sudo)
                stack.callback(dropin.remove)
                dropin.install()
                host.sudoers_file = dropin.path
                host.sudo_password = dropin.password

            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privsep chroot
            stack.callback(host.stop)
            host._start(pick_new_port=port is None and not netns)
            host._cleanups = stack
            return host
        except BaseException:
            stack.close()
            raise

    @property
    def config_file(self) -> Path:
        # The tag in the name lets reap_stale_resources() find sshds of dead sessions.
        return self.config_dir / f"{self._tag}.sshd_config"

    def _write_config(self) -> None:
        for name, value in self._env.items():
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) or any(c in value for c in " \t\n\"'"):
                raise HostSetupError(f"SetEnv {name}={value!r}: a plain NAME=VALUE without spaces or quotes")
        set_env = "".join(f"SetEnv {k}={v}\n" for k, v in self._env.items())
        self.config_file.write_text(
            set_env
            + _SSHD_CONFIG.format(
                tag=self._tag,
                port=self.port,
                listen=self._listen,
                host_key=self._host_key,
                pid_file=self.config_dir / "sshd.pid",
                authorized_keys=self._authorized_keys,
                user=self.user,
            )
        )

    def _start(self, *, pick_new_port: bool) -> None:
        attempts = 5 if pick_new_port else 1
        for attempt in range(attempts):
            self._write_config()
            _run([SSHD, "-t", "-f", str(self.config_file)])
            prefix = self.link.exec_prefix() if self.link else []
            # -D: stay in the foreground, so self.pid is sshd itself (no pidfile race);
            # -E: log to our file instead of syslog (there is no syslog daemon here);
            # absolute path: sshd refuses to re-exec itself otherwise.
            with open(self.log_file, "ab") as log:
                self._proc = subprocess.Popen(
                    [*prefix, *self._under, SSHD, "-D", "-f", str(self.config_file), "-E", str(self.log_file)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            self.pid = self._proc.pid
            try:
                _wait_tcp(self.hostname, self.port, 10, alive=lambda: self._proc.poll() is None)
                return
            except HostSetupError as exc:
                log_tail = _tail(self.log_file)
                self.stop()
                if attempt + 1 < attempts and "Address already in use" in log_tail:
                    self.port = free_port()  # lost the race for the port: take another
                    pub = self._host_key.with_name(self._host_key.name + ".pub").read_text()
                    self.host_key_line = _host_key_line(self.hostname, self.port, pub)
                    self.trust_current_host_key()
                    continue
                raise HostSetupError(f"{exc}\n--- {self.log_file} ---\n{log_tail}") from None

    def start(self) -> None:
        """(Re)start sshd on the same address and port, with the current host key."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._start(pick_new_port=False)

    def stop(self, timeout: float = 5) -> None:
        """Stop sshd *and* drop every open connection (like a host going away).

        sshd puts each connection in its own session, so killing the listener alone would
        leave established connections working; we SIGTERM the listener and all of its
        descendants (connection monitors, their children, the user's commands).
        """
        proc, self._proc, self.pid = self._proc, None, None
        if proc is None:
            return
        victims = _descendants(proc.pid)
        _signal([proc.pid], signal.SIGTERM)
        _signal(victims, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal([proc.pid, *victims], signal.SIGKILL)
            proc.wait(timeout)
        # and its children gone too: a connection's child forked just before the signal still
        # holds a copy of the listening socket until it exits, so a restart on the same port
        # failed to bind while that child answered the readiness probe and then reset the
        # client (seen in cold run 65a: "Bind to port ... failed: Address already in use")
        if not _gone(victims, timeout):
            _signal(victims, signal.SIGKILL)
            _gone(victims, timeout)

    def regenerate_host_key(self) -> str:
        """Give the server a new host key and restart it; ``known_hosts`` keeps the OLD key.

        For "changed host key" tests: a strict client must now refuse to connect
        (``paramiko.BadHostKeyException``). :attr:`host_key_line` is the new line;
        call :meth:`trust_current_host_key` to accept it. Returns the new line.
        """
        running = self._proc is not None
        self.stop()
        pub = _keygen(self._host_key, f"voltaforge-test-host-{self._tag}-regen")
        self.host_key_line = _host_key_line(self.hostname, self.port, pub)
        if running:
            self.start()
        return self.host_key_line

    def trust_current_host_key(self) -> None:
        """Rewrite ``known_hosts`` to contain exactly :attr:`host_key_line`."""
        Path(self.known_hosts).write_text(self.host_key_line + "\n")

    def close(self) -> None:
        """Stop sshd and undo everything: sudoers drop-in, password, netns, prefix dir."""
        self._cleanups.close()

    @property
    def connect_kwargs(self) -> dict:
        return {"key_filename": self.key_filename, "look_for_keys": False, "allow_agent": False}

    def log(self) -> str:
        """The sshd log (``LogLevel VERBOSE``): auth decisions, connections, errors."""
        return self.log_file.read_text(errors="replace") if self.log_file else ""

    def ssh_command(self, command: str, *, user: str | None = None) -> list[str]:
        """An OpenSSH client command line with strict host-key checking for this host."""
        return _ssh_command(self, command, user or self.user)


# --------------------------------------------------------------------------------------
# nspawn (Debian 12 with systemd)
# --------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge")


def ensure_rootfs_tarball(timeout: float = 1800) -> Path:
    """The cached Debian 12 rootfs tarball, built by ci/build-test-rootfs.sh if missing."""
    tarball = cache_dir() / ROOTFS_TARBALL
    if tarball.is_file() and tarball.stat().st_size > 0:
        return tarball
    require(binaries=("debootstrap", "zstd", "chroot"), what="building the nspawn rootfs")
    proc = subprocess.run(
        ["bash", str(BUILD_ROOTFS_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "VOLTAFORGE_CACHE": str(cache_dir())},
    )
    if proc.returncode != 0 or not tarball.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise HostSetupError(f"{BUILD_ROOTFS_SCRIPT} failed ({proc.returncode}):\n{tail}")
    return tarball


def _unpacked_rootfs(tarball: Path) -> Path:
    """Unpack the tarball once into the cache (keyed by its size and mtime) and return it.

    This tree is only ever the read-only *lower* layer of an overlay, so it never changes
    after unpacking and can be shared by parallel sessions. Unpacks to a temp dir and
    renames, so a half-unpacked tree is never used; stale trees of older tarballs are
    removed when no overlay uses them. Each image version unpacks under its own directory
    (``rootfs-bookworm-v3.d``), so sessions of older checkouts booting the older image never
    see their tree removed by this one.
    """
    st = tarball.stat()
    stamp = f"{st.st_size}-{st.st_mtime_ns}"
    root = tarball.with_name(tarball.name.removesuffix(".tar.zst") + ".d")
    target = root / stamp
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
        try:
            _run(
                [
                    "tar",
                    "--zstd",
                    "--numeric-owner",
                    "--xattrs",
                    "--xattrs-include=*",
                    "-xpf",
                    str(tarball),
                    "-C",
                    str(tmp),
                ],
                timeout=600,
            )
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        mounts = Path("/proc/mounts").read_text()
        for old in root.iterdir():
            if old != target and old.name[0] != "." and str(old) not in mounts:
                shutil.rmtree(old, ignore_errors=True)
    return target


def _cgroup_roots() -> list[Path]:
    """Hierarchies nspawn needs a cgroup of its own in (hybrid: name=systemd + unified)."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # pure cgroup v2
        return [base]
    return [p for p in (base / "systemd", base / "unified") if (p / "cgroup.procs").exists()]


def _cgroup_procs(cg: Path) -> list[int]:
    pids = []
    for dirpath, _dirs, files in os.walk(cg):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(x) for x in Path(dirpath, "cgroup.procs").read_text().split()]
    return pids


def _remove_cgroup(cg: Path) -> None:
    """rmdir a cgroup and its children, deepest first (cgroupfs only allows rmdir)."""
    if not cg.exists():
        return
    for dirpath, _dirs, _files in sorted(os.walk(cg), key=lambda w: -w[0].count("/")):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dirpath)


@dataclasses.dataclass
class NspawnHost:
    """A booted Debian 12 container; yielded by ``nspawn_host``.

    Connect to ``hostname`` (the container's veth address) port ``port`` (22) as ``user``
    (``deploy``, passwordless sudo) with ``key_filename``, trusting exactly ``known_hosts``.
    The same key logs in as ``root``, which :meth:`run_inside` uses. ``prefix`` is a
    directory *inside the container* owned by ``deploy``. ``rootfs`` is the container's
    root as seen from this machine (the overlay mount), ``lower_dir`` the shared read-only
    cached tree under it.

    A provisionable host (:func:`start_nspawn_host` with ``wheelhouse``/``ccache``) also has
    ``wheelhouse``, the wheelhouse's path inside (pip's only source there; on this machine:
    ``wheelhouse_on_controller``), and ``ccache``, the shared ccache directory inside;
    ``binds`` are the systemd-nspawn arguments that mount them.
    """

    hostname: str
    port: int
    user: str
    key_filename: str
    known_hosts: str
    host_key_line: str
    machine: str
    netns: str
    pid: int | None
    rootfs: Path
    lower_dir: Path
    prefix: PurePosixPath = PurePosixPath("/opt/voltaforge-test")
    sudo: str = "nopasswd"
    sudo_password: str | None = None
    link: NetnsLink | None = None
    log_file: Path | None = None
    cgroups: tuple[Path, ...] = ()
    wheelhouse: PurePosixPath | None = None
    wheelhouse_on_controller: Path | None = None
    ccache: PurePosixPath | None = None
    #: systemd-nspawn --bind/--bind-ro arguments: controller directories seen inside.
    binds: tuple[str, ...] = ()

    _proc: subprocess.Popen | None = dataclasses.field(default=None, repr=False)
    _cleanups: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack, repr=False)

    def ssh_command(self, command: str, *, user: str = "root") -> list[str]:
        """An OpenSSH client command line with strict host-key checking for this host."""
        return _ssh_command(self, command, user)

    def run_inside(
        self, command: str, *, check: bool = True, timeout: float = 60, user: str = "root"
    ) -> subprocess.CompletedProcess:
        """Run a shell command in the container (as root over SSH, strict host key).

        SSH rather than ``ip netns exec``: that would only share the container's network,
        not its filesystem, PID namespace or systemd. Returns the CompletedProcess (text);
        with ``check`` a non-zero exit raises :class:`HostSetupError`.
        """
        proc = subprocess.run(self.ssh_command(command, user=user), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise HostSetupError(
                f"inside {self.machine}: {command!r} exited {proc.returncode}: "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def start(self, timeout: float = 60) -> None:
        """Boot the container and wait until systemd finished booting (running/degraded).

        The launcher shell moves itself into the container's own cgroups first, then execs
        ``systemd-nspawn``; see :func:`start_nspawn_host` for every flag.
        """
        if self._proc is not None and self._proc.poll() is None:
            return
        procs_files = " ".join(str(cg / "cgroup.procs") for cg in self.cgroups)
        cmd = [
            "sh",
            "-c",
            'for f in $VF_CGROUP_PROCS; do echo $$ > "$f" || exit 111; done; exec "$@"',
            "vf-nspawn",
            "systemd-nspawn",
            # Boot the image's own init (systemd) instead of running a single command.
            "-b",
            "-D",
            str(self.rootfs),
            "--machine",
            self.machine,
            "--hostname",
            self.machine,
            # The netns prepared with a veth pair: the container is reachable at its
            # veth address from here, and sees nothing else of this machine's network.
            f"--network-namespace-path={self.link.path}",
            # No systemd-machined here (PID 1 is not systemd, no system bus).
            "--register=no",
            # Otherwise nspawn asks systemd over D-Bus for a transient scope and exits
            # with "Failed to open system bus"; we provide the cgroup ourselves.
            "--keep-unit",
            # No TTY in CI; the console goes to a pipe (it prints nothing: read the
            # journal inside instead).
            "--console=pipe",
            # No DNS server exists: an empty resolver config plus libnss-myhostname in the
            # image make `sudo` resolve the hostname locally instead of stalling ~20 s.
            "--resolv-conf=delete",
            # Keep the journal inside the container (no links into this machine's /var/log).
            "--link-journal=no",
            # Let the container's systemd load BPF programs: nspawn's default seccomp filter
            # refuses bpf(), and then a unit's IPAddressAllow=/IPAddressDeny= is silently not
            # enforced (tests/test_ip_filter_real.py proves the filter drops a connection).
            "--system-call-filter=bpf",
            # A provisionable host's wheelhouse (read-only) and shared ccache (writable).
            *self.binds,
        ]
        with open(self.log_file, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # = setsid: nspawn must not share our session/TTY
                env={**os.environ, "VF_CGROUP_PROCS": procs_files},
            )
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout
        try:
            _wait_tcp(self.hostname, self.port, timeout, alive=lambda: self._proc.poll() is None)
            while True:
                left = deadline - time.monotonic()
                proc = self.run_inside("systemctl is-system-running --wait", check=False, timeout=max(left, 5))
                state = proc.stdout.strip()
                if state in ("running", "degraded"):
                    break
                if self._proc.poll() is not None or left <= 0:
                    raise HostSetupError(
                        f"container {self.machine} did not boot: state {state!r} {proc.stderr.strip()}"
                    )
                time.sleep(0.2)
        except BaseException as exc:
            self.stop()
            raise HostSetupError(f"{exc}\n--- {self.log_file} ---\n{_tail(self.log_file)}") from None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to nspawn = clean poweroff of the container (~2 s); SIGKILL if stuck.

        If nspawn has to be killed, the container's processes would survive it (they are
        not its children in our PID namespace's eyes), so everything left in the
        container's cgroups is killed as well -- all of it was started by this host.
        """
        proc, self._proc, self.pid = self._proc, None, None
        if proc is None:
            return
        _signal([proc.pid], signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal([proc.pid], signal.SIGKILL)
            proc.wait(10)
        for cg in self.cgroups:
            _signal(_cgroup_procs(cg), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_cgroup_procs(cg) for cg in self.cgroups) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the container, unmount the overlay, remove netns, veth and cgroups."""
        self._cleanups.close()

    @property
    def connect_kwargs(self) -> dict:
        return {"key_filename": self.key_filename, "look_for_keys": False, "allow_agent": False}


def start_nspawn_host(
    work_dir: Path,
    *,
    boot_timeout: float = 60,
    wheelhouse: Path | None = None,
    ccache: Path | None = None,
) -> NspawnHost:
    """Prepare and boot one Debian 12 container; call ``.close()`` when done.

    Steps: cached tarball (built if missing) -> unpacked once into the cache -> overlay
    mount with the upper dir in ``work_dir`` (so writes never reach the cache and each
    call starts fresh; chosen over ``--volatile=overlay`` because we must write the per-boot
    keys into the tree *before* boot and keep them on disk) -> per-boot machine-id,
    SSH host key and authorized_keys written into the tree -> known_hosts from that host
    key (no ssh-keyscan, no trust on first use) -> netns + veth -> own cgroups -> boot.

    ``wheelhouse``: a directory of wheels on this machine, bind-mounted read-only at
    ``/opt/voltaforge-wheels`` with an ``/etc/pip.conf`` (``no-index``, ``find-links`` there)
    written into the tree: pip in the container installs from it and nothing else.
    ``ccache``: a directory on this machine, bind-mounted writable at
    ``/var/cache/voltaforge-ccache``, owned by ``deploy``, and linked from
    ``<prefix>/llama.cpp/ccache`` (the build step's CCACHE_DIR under the default prefix).
    """
    require(
        binaries=("systemd-nspawn", "ip", "ssh", "ssh-keygen", "tar", "zstd", "mount", "umount"), what="nspawn_host"
    )
    if "overlay" not in Path("/proc/filesystems").read_text():
        _unavailable("nspawn_host needs overlayfs in the kernel")
    cg_roots = _cgroup_roots()
    if not cg_roots:
        _unavailable("nspawn_host needs a cgroup hierarchy (/sys/fs/cgroup/systemd or cgroup2)")
    reap_stale_resources()
    tarball = ensure_rootfs_tarball()
    lower = _unpacked_rootfs(tarball)

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    pid, n = _unique_tag()
    machine = f"{NAME_PREFIX}{pid}-{n}"
    stack = contextlib.ExitStack()
    try:
        layer = Path(tempfile.mkdtemp(prefix=f"{machine}-", dir=work_dir))
        stack.callback(shutil.rmtree, layer, True)
        upper, ovl_work, merged = layer / "upper", layer / "work", layer / "rootfs"
        for d in (upper, ovl_work, merged):
            d.mkdir()
        _run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={upper},workdir={ovl_work}",
                str(merged),
            ]
        )
        stack.callback(_umount, merged)

        # Per-boot identity, written before boot so we know the host key in advance.
        (merged / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
        host_key = merged / "etc/ssh/ssh_host_ed25519_key"
        host_pub = _keygen(host_key, f"voltaforge-test-{machine}")
        client_key = work_dir / f"{machine}-id_ed25519"
        client_pub = _keygen(client_key, f"voltaforge-test-client-{machine}")
        deploy = _passwd_entry(merged, "deploy")
        for home, uid, gid in (("root", 0, 0), ("home/deploy", deploy[0], deploy[1])):
            ssh_dir = merged / home / ".ssh"
            ssh_dir.mkdir(mode=0o700, exist_ok=True)
            os.chown(ssh_dir, uid, gid)
            ak = ssh_dir / "authorized_keys"
            ak.write_text(client_pub + "\n")
            os.chmod(ak, 0o600)
            os.chown(ak, uid, gid)
        prefix_dir = merged / "opt/voltaforge-test"
        prefix_dir.mkdir(parents=True, exist_ok=True)
        os.chown(prefix_dir, deploy[0], deploy[1])
        binds = []
        if wheelhouse is not None:
            binds.append(f"--bind-ro={Path(wheelhouse).resolve()}:{CONTAINER_WHEELHOUSE}")
            (merged / "etc/pip.conf").write_text(_pip_conf(CONTAINER_WHEELHOUSE))
        if ccache is not None:
            binds.append(f"--bind={_shared_ccache_dir(Path(ccache), deploy)}:{CONTAINER_CCACHE}")
            (prefix_dir / "llama.cpp").mkdir()
            os.chown(prefix_dir / "llama.cpp", deploy[0], deploy[1])
            (prefix_dir / "llama.cpp" / "ccache").symlink_to(CONTAINER_CCACHE)

        link = NetnsLink.create()
        stack.callback(link.destroy)
        known_hosts = work_dir / f"{machine}-known_hosts"
        host = NspawnHost(
            hostname=link.peer_addr,
            port=22,
            user="deploy",
            key_filename=str(client_key),
            known_hosts=str(known_hosts),
            host_key_line=_host_key_line(link.peer_addr, 22, host_pub),
            machine=machine,
            netns=link.name,
            pid=None,
            rootfs=merged,
            lower_dir=lower,
            link=link,
            log_file=work_dir / f"{machine}-nspawn.log",
            wheelhouse=CONTAINER_WHEELHOUSE if wheelhouse is not None else None,
            wheelhouse_on_controller=Path(wheelhouse).resolve() if wheelhouse is not None else None,
            ccache=CONTAINER_CCACHE if ccache is not None else None,
            binds=tuple(binds),
        )
        known_hosts.write_text(host.host_key_line + "\n")

        cgroups = []
        for root in cg_roots:
            cg = root / machine
            cg.mkdir()
            stack.callback(_remove_cgroup, cg)
            cgroups.append(cg)
        host.cgroups = tuple(cgroups)

        stack.callback(host.stop)
        host.start(boot_timeout)
        host._cleanups = stack
        return host
    except BaseException:
        stack.close()
        raise


def _pip_conf(find_links: PurePosixPath) -> str:
    return (
        "# voltaforge test host: an offline host's pip installs only from the wheelhouse\n"
        "# (tests/wheelhouse.py, bind-mounted read-only by tests/testhosts.py)\n"
        "[global]\n"
        "no-index = true\n"
        f"find-links = {find_links}\n"
        "disable-pip-version-check = true\n"
    )


def _shared_ccache_dir(path: Path, owner: tuple[int, int]) -> Path:
    """The ccache directory a container shares with later ones, owned by its ``deploy``."""
    path.mkdir(parents=True, exist_ok=True)
    st = path.stat()
    if (st.st_uid, st.st_gid) != owner:  # a new directory, or an image whose deploy moved
        _run(["chown", "-R", f"{owner[0]}:{owner[1]}", str(path)], timeout=300)
    return path.resolve()


def _passwd_entry(rootfs: Path, user: str) -> tuple[int, int]:
    for line in (rootfs / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise HostSetupError(f"no user {user!r} in {rootfs}/etc/passwd (rebuild the rootfs tarball)")


def _umount(path: Path) -> None:
    for _ in range(20):
        if _run(["umount", str(path)], check=False).returncode == 0:
            return
        if str(path) not in Path("/proc/mounts").read_text():
            return
        time.sleep(0.1)
    _run(["umount", "-l", str(path)], check=False)


# --------------------------------------------------------------------------------------
# stale resources of dead sessions
# --------------------------------------------------------------------------------------

_STALE_RE = re.compile(rf"^{re.escape(NAME_PREFIX)}(\d+)-\d+$")
_reaped = False


def reap_stale_resources() -> None:
    """Remove what *dead* test sessions (killed with SIGKILL, say) left behind.

    Only names of the form ``vf-<pid>-<n>`` whose pid is no longer alive are touched:
    containers still running in such a cgroup (nspawn is started with setsid, so it
    outlives its session) are powered off, and sshds started with ``vf-<pid>-<n>.sshd_config``
    stopped; then overlay mounts, cgroups, netns, sudoers drop-ins, ``/tmp/vf-*-sshd-*``
    directories and ``vf-test-<pid>`` users are removed. A netns is only deleted when no
    process is left in it. Runs once per process.
    """
    global _reaped
    if _reaped or os.geteuid() != 0:
        return
    _reaped = True

    def dead(name: str) -> bool:
        m = _STALE_RE.match(name)
        return bool(m) and not _pid_alive(int(m.group(1)))

    stale_cgroups = [
        cg for root in _cgroup_roots() for cg in root.glob(f"{NAME_PREFIX}*") if cg.is_dir() and dead(cg.name)
    ]
    if any(_cgroup_procs(cg) for cg in stale_cgroups):
        # Everything in these cgroups was started by a test host of a dead session.
        for cg in stale_cgroups:
            _signal(_cgroup_procs(cg), signal.SIGTERM)  # nspawn: clean poweroff
        deadline = time.monotonic() + 10
        while any(_cgroup_procs(cg) for cg in stale_cgroups) and time.monotonic() < deadline:
            time.sleep(0.1)
        for cg in stale_cgroups:
            _signal(_cgroup_procs(cg), signal.SIGKILL)
        time.sleep(0.2)
    for cg in stale_cgroups:
        if not _cgroup_procs(cg):
            _remove_cgroup(cg)
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "overlay" and fields[1].endswith("/rootfs"):
            m = re.search(rf"/({re.escape(NAME_PREFIX)}\d+-\d+)-[^/]*/rootfs$", fields[1])
            if m and dead(m.group(1)):
                _umount(Path(fields[1]))

    stale_sshds = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{entry}/exe") != SSHD:
                continue
            # sshd rewrites its title ("sshd: /usr/sbin/sshd -D -f ... [listener]").
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            m = re.search(rf"-f\s*\S*/({re.escape(NAME_PREFIX)}\d+-\d+)\.sshd_config", cmdline.replace("\0", " "))
            if m and dead(m.group(1)):
                stale_sshds.append(int(entry))
    _signal(stale_sshds, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while any(_pid_alive(p) for p in stale_sshds) and time.monotonic() < deadline:
        time.sleep(0.05)

    netns_dir = Path("/run/netns")
    if netns_dir.is_dir() and shutil.which("ip"):
        for ns in netns_dir.iterdir():
            if dead(ns.name) and not _run(["ip", "netns", "pids", ns.name], check=False).stdout.strip():
                _run(["ip", "netns", "del", ns.name], check=False)
    if SUDOERS_DIR.is_dir():
        for f in SUDOERS_DIR.glob(f"{NAME_PREFIX}*"):
            if dead(f.name):
                f.unlink(missing_ok=True)
    for d in Path("/tmp").glob(f"{NAME_PREFIX}*-sshd-*"):
        m = re.match(rf"^({re.escape(NAME_PREFIX)}\d+-\d+)-sshd-", d.name)
        if m and dead(m.group(1)) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    for entry in pwd.getpwall():
        m = re.match(rf"^{re.escape(TEST_USER_PREFIX)}(\d+)$", entry.pw_name)
        if m and not _pid_alive(int(m.group(1))):
            remove_test_user(entry.pw_name)


# --------------------------------------------------------------------------------------
# pytest fixtures (registered by tests/conftest.py)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def testhost_user() -> Iterator[pwd.struct_passwd]:
    """The unprivileged login user of sshd_host/netns_host (``vf-test-<pid>``).

    Created once per session, removed (with its home) at the end of the session.
    """
    require(binaries=("useradd", "usermod", "userdel"), what="the test user")
    reap_stale_resources()
    account = ensure_test_user()
    try:
        yield account
    finally:
        remove_test_user(account.pw_name)


@pytest.fixture
def make_sshd_host(tmp_path, testhost_user):
    """Factory: ``make_sshd_host(sudo=None|"nopasswd"|"password", netns=False, port=None)``.

    Every host made is closed at teardown (also when the test fails).
    """
    hosts: list[SshdHost] = []

    def make(**kwargs) -> SshdHost:
        host = SshdHost.create(tmp_path / f"sshd{len(hosts)}", user=testhost_user.pw_name, **kwargs)
        hosts.append(host)
        return host

    yield make
    for host in reversed(hosts):
        host.close()


@pytest.fixture
def sshd_host(request, make_sshd_host) -> SshdHost:
    """A private sshd on 127.0.0.1:<free port> (see :class:`SshdHost`).

    Options via indirect parametrization, e.g.
    ``@pytest.mark.parametrize("sshd_host", [{"sudo": "password"}], indirect=True)``.
    """
    return make_sshd_host(**getattr(request, "param", {}))


@pytest.fixture
def netns_host(request, make_sshd_host) -> SshdHost:
    """A private sshd in its own network namespace, port 22 on its veth address."""
    return make_sshd_host(netns=True, **getattr(request, "param", {}))


@pytest.fixture(scope="session")
def nspawn_host(tmp_path_factory) -> Iterator[NspawnHost]:
    """A booted Debian 12 container shared by the session (see :class:`NspawnHost`).

    Tests share it: undo what you change (stop/disable units, remove files), or use
    :func:`start_nspawn_host` for a private one.
    """
    host = start_nspawn_host(tmp_path_factory.mktemp("nspawn"))
    try:
        yield host
    finally:
        host.close()


def shared_nspawn_ccache() -> Path:
    """The ccache directory provisionable containers share, in the test cache: the server
    compiled in one container (or an earlier session) warms the next one's compile."""
    return cache_dir() / "ccache-nspawn"


@pytest.fixture
def provisionable_nspawn_host(request, tmp_path) -> Iterator[NspawnHost]:
    """A fresh Debian 12 container that voltaforge can provision without internet (see the
    module docstring): the image's build tools, the wheelhouse as pip's only source
    (``host.wheelhouse`` inside), a shared ccache (``host.ccache`` inside, linked from
    ``<host.prefix>/llama.cpp/ccache``; a test provisioning another prefix links its own).
    Booted for each test, so every test starts from nothing but the image.

    Options via indirect parametrization, e.g.
    ``@pytest.mark.parametrize("provisionable_nspawn_host", [{"ccache": None}], indirect=True)``:
    ``ccache``: a directory on this machine to share (default :func:`shared_nspawn_ccache`),
    or None for no shared cache (the build step then keeps one inside the container).
    """
    from tests.wheelhouse import ensure_wheelhouse

    options = {"ccache": shared_nspawn_ccache(), **getattr(request, "param", {})}
    require(binaries=("systemd-nspawn",), what="provisionable_nspawn_host")
    wheelhouse = ensure_wheelhouse()
    host = start_nspawn_host(tmp_path / "nspawn", wheelhouse=wheelhouse, ccache=options["ccache"])
    try:
        yield host
    finally:
        host.close()
