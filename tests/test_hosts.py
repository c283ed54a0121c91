"""The host layer (playbooks/host/) against real hosts: this machine (LocalHost) and a private sshd (SshHost).

Failure tests make the fault for real (an empty known_hosts, a regenerated host key, a closed
port, a name under the reserved .invalid TLD, a sudo that wants a password, an sshd killed
mid-command) and check two things: the message a user reads, and that the host was left as
it was.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest

from playbooks.config.inventory import HostSpec
from playbooks.errors import HostError
from playbooks.host import LocalHost, Printer, SshHost, connect
from playbooks.host.commands import build_command, write_file_command
from testhosts import _descendants, free_port
from tests import helpers

#: Tests that start a real sshd or container (see the marker in pyproject.toml).
slow = pytest.mark.slow

ALL_BYTES = bytes(range(256)) * 64 + b"no trailing newline"


def spec_for(h, **over) -> HostSpec:
    """The shared test-host spec (tests/helpers.py), named ``v100-test``, fields overridden
    (an empty known_hosts, a closed port, ...) and validated as inventory.yaml would be."""
    base = helpers.spec_for(h, name="v100-test").model_dump(exclude_unset=True)
    return HostSpec(**{**base, **over})


@pytest.fixture
def ssh(sshd_host):
    host = connect(spec_for(sshd_host))
    yield host
    host.close()


@pytest.fixture
def local():
    return LocalHost()


def spy_commands(host) -> list[str]:
    """Record every shell line the host executes (to prove what never appears in one)."""
    seen: list[str] = []
    real = host._exec

    def spy(command, **kw):
        seen.append(command)
        return real(command, **kw)

    host._exec = spy
    return seen


# ------------------------------------------------------------------------------------------
# command building (pure)
# ------------------------------------------------------------------------------------------


def test_build_command_plain_and_full():
    assert build_command("echo hi") == "env LC_ALL=C bash --noprofile --norc -o pipefail -c 'echo hi'"
    assert build_command("echo $X", env={"X": "1"}, timeout=2.5) == (
        "env LC_ALL=C X=1 timeout --kill-after=5 2.5 bash --noprofile --norc -o pipefail -c 'echo $X'"
    )
    assert build_command("cat $F", env={"F": "a b'c"}, sudo=True, timeout=30) == (
        "env LC_ALL=C timeout --kill-after=5 30 sudo -n -- env LC_ALL=C 'F=a b'\"'\"'c' "
        "bash --noprofile --norc -o pipefail -c 'cat $F'"
    )


@pytest.mark.parametrize("name", ["A B", "1X", "X-Y", "", "X;rm -rf /", "X=Y"])
def test_build_command_rejects_bad_env_names(name):
    with pytest.raises(ValueError, match="invalid environment variable name"):
        build_command("true", env={name: "v"})


def test_write_file_command_is_atomic_and_quoted():
    cmd = write_file_command("/opt/my dir/f'x", 0o640, owner="root:deploy")
    assert "tmp=$(mktemp '/opt/my dir/.f'\"'\"'x.vf-XXXXXX')" in cmd
    assert "trap 'rm -f \"$tmp\"' EXIT" in cmd and 'chmod 0640 "$tmp"' in cmd
    assert cmd.endswith("mv -fT \"$tmp\" '/opt/my dir/f'\"'\"'x'")
    with pytest.raises(ValueError):
        write_file_command("relative/path", 0o644)
    with pytest.raises(ValueError):
        write_file_command("/x", 0o644, owner="root; rm -rf /")


# ------------------------------------------------------------------------------------------
# LocalHost
# ------------------------------------------------------------------------------------------


def test_local_run_streams_prefixed_lines(local, capsys):
    r = local.run("echo one; echo two >&2; printf three")
    assert (r.stdout, r.stderr, r.exited, r.ok) == ("one\nthree", "two\n", 0, True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[local] $ echo one; echo two >&2; printf three"
    assert set(out[1:]) == {"[local] one", "[local] two", "[local] three"}

    local.run("echo hidden", stream=False)
    local.printer.quiet = True
    local.run("echo silenced")
    assert capsys.readouterr().out == ""


def test_local_failure_is_a_host_error_unless_check_false(local):
    with pytest.raises(HostError) as exc:
        local.run("echo oops >&2; exit 3", stream=False)
    assert str(exc.value) == "local: command failed (exit 3): echo oops >&2; exit 3\noops"
    r = local.run("exit 4", check=False, stream=False)
    assert (r.exited, r.ok) == (4, False)
    # pipefail: a failing first stage fails the command
    assert local.run("false | cat", check=False, stream=False).exited == 1


def test_local_env_is_exact_and_ignores_bash_env(local, tmp_path, monkeypatch):
    rc = tmp_path / "rc"
    rc.write_text("echo FROM-RC; export VF_PROBE=from-rc\n")
    monkeypatch.setenv("BASH_ENV", str(rc))
    value = "spaces  'quotes' \"dq\" $HOME `id` ;|&"
    r = local.run('printf %s "$VF_PROBE"', env={"VF_PROBE": value}, stream=False)
    assert r.stdout == value
    assert local.run('printf %s "$VF_PROBE"', env={"VF_PROBE": value}, timeout=5, stream=False).stdout == value
    assert local.sudo('printf %s "$VF_PROBE"', env={"VF_PROBE": value}, timeout=5, stream=False).stdout == value


def test_local_timeout_kills_the_command(local, tmp_path):
    marker = tmp_path / "late"
    start = time.monotonic()
    with pytest.raises(HostError, match=r"^local: timed out after 0.5 s running: sleep 5; touch"):
        local.run(f"sleep 5; touch {marker}", timeout=0.5, stream=False)
    assert time.monotonic() - start < 3
    time.sleep(0.2)
    assert not marker.exists()


def test_local_files_round_trip(local, tmp_path):
    target = tmp_path / "sub" / "data.bin"
    target.parent.mkdir()
    assert not local.exists(str(target)) and local.sha256(str(target)) is None
    local.write_file(str(target), ALL_BYTES, 0o640)
    assert target.read_bytes() == ALL_BYTES
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    import hashlib

    assert local.sha256(str(target)) == hashlib.sha256(ALL_BYTES).hexdigest()
    assert local.exists(str(target)) and local.sha256(str(tmp_path)) is None  # a dir is no file
    local.get(str(target), tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == ALL_BYTES
    script = tmp_path / "tool.sh"
    script.write_text("#!/bin/sh\necho tool\n")
    script.chmod(0o750)
    local.put(script, str(tmp_path / "sub" / "tool.sh"))  # mode follows the local file
    assert stat.S_IMODE((tmp_path / "sub" / "tool.sh").stat().st_mode) == 0o750
    assert sorted(p.name for p in target.parent.iterdir()) == ["data.bin", "tool.sh"]  # no temp left


def test_local_write_into_directory_target_fails_cleanly(local, tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(HostError, match=r"^local: cannot write .*/d: mv: cannot overwrite directory"):
        local.write_file(str(tmp_path / "d"), b"x", 0o644)
    assert list(tmp_path.iterdir()) == [tmp_path / "d"] and list((tmp_path / "d").iterdir()) == []


def test_local_sudo_as_root_runs_directly(local):
    seen = spy_commands(local)
    assert local.sudo("id -u", stream=False).stdout.strip() == "0"
    assert "sudo" not in seen[0]


def test_secrets_travel_on_stdin_and_are_redacted(local, tmp_path, capsys):
    secret = b"hf_Sup3rS3cretT0ken"
    seen = spy_commands(local)
    local.redact(secret)  # as steps/serve/secrets.read_api_key does with a key it read
    local.write_file(str(tmp_path / "token"), secret, 0o600)
    assert (tmp_path / "token").read_bytes() == secret
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    assert not any(secret.decode() in c for c in seen)
    # Once registered, a secret never shows in output or error messages.
    local.run(f"cat {tmp_path / 'token'}; echo")
    with pytest.raises(HostError) as exc:
        local.run(f"echo {secret.decode()} >&2; exit 1", stream=False)
    printed = capsys.readouterr().out
    assert secret.decode() not in printed + str(exc.value)
    assert "[local] ***" in printed and "echo *** >&2" in str(exc.value)


# ------------------------------------------------------------------------------------------
# SshHost: working
# ------------------------------------------------------------------------------------------


@slow
def test_ssh_run_streams_and_returns(ssh, sshd_host, capsys):
    assert isinstance(ssh, SshHost)
    r = ssh.run("id -un; echo err >&2")
    assert (r.stdout, r.stderr, r.exited) == (f"{sshd_host.user}\n", "err\n", 0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[v100-test] $ id -un; echo err >&2"
    assert set(out[1:]) == {f"[v100-test] {sshd_host.user}", "[v100-test] err"}
    assert ssh.run("exit 7", check=False, stream=False).exited == 7
    with pytest.raises(HostError, match=r"^v100-test: command failed \(exit 7\): exit 7$"):
        ssh.run("exit 7", stream=False)


@slow
def test_ssh_env_and_stdin_are_exact(ssh):
    value = "a 'b' \"c\" $HOME `id` ;|&\\"
    assert ssh.run('printf %s "$VF_X"', env={"VF_X": value}, stream=False).stdout == value
    assert ssh.run('printf %s "$VF_X"', env={"VF_X": value}, timeout=5, stream=False).stdout == value
    # A command that reads stdin gets EOF at once instead of hanging.
    assert ssh.run("cat", stream=False, timeout=5).stdout == ""


@slow
def test_ssh_files_round_trip(ssh, sshd_host, tmp_path):
    import hashlib

    remote = f"{sshd_host.prefix}/models/blob.bin"
    ssh.run(f"mkdir {sshd_host.prefix}/models", stream=False)
    assert ssh.sha256(remote) is None and not ssh.exists(remote)
    ssh.write_file(remote, ALL_BYTES, 0o600)
    assert (sshd_host.prefix / "models/blob.bin").read_bytes() == ALL_BYTES
    assert ssh.sha256(remote) == hashlib.sha256(ALL_BYTES).hexdigest() and ssh.exists(remote)
    ssh.get(remote, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == ALL_BYTES
    big = os.urandom(3 * 1024 * 1024)
    ssh.put(big, remote, 0o644)
    assert (sshd_host.prefix / "models/blob.bin").read_bytes() == big
    assert stat.S_IMODE((sshd_host.prefix / "models/blob.bin").stat().st_mode) == 0o644
    assert os.listdir(sshd_host.prefix / "models") == ["blob.bin"]


@slow
def test_ssh_a_written_secret_is_never_on_a_command_line(ssh, sshd_host, capsys):
    secret = b"sk-live-0123456789abcdef"
    seen = spy_commands(ssh)
    ssh.redact(secret)
    ssh.write_file(f"{sshd_host.prefix}/api.key", secret, 0o600)
    path = sshd_host.prefix / "api.key"
    assert path.read_bytes() == secret and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not any(secret.decode() in c for c in seen)
    ssh.run(f"cat {path}")
    assert secret.decode() not in capsys.readouterr().out


@slow
def test_ssh_timeout_kills_the_remote_command(ssh, sshd_host):
    marker = sshd_host.prefix / "late"
    start = time.monotonic()
    with pytest.raises(HostError, match="^v100-test: timed out after 1 s running: sleep 30"):
        ssh.run(f"sleep 30; touch {marker}", timeout=1, stream=False)
    assert time.monotonic() - start < 5
    assert ssh.run("pgrep -u $(id -u) -fx 'sleep 30' || true", stream=False).stdout == ""
    assert not marker.exists()


def test_ctrl_c_during_a_remote_command_is_not_swallowed(ssh, sshd_host):
    # the host layer runs commands on its own channels, not through Invoke's runner (which
    # answers a KeyboardInterrupt by writing \x03 to the command's stdin and waiting on): a
    # Ctrl-C during a remote command must reach the caller, and soon (provision's exit 130)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    # Python's own handler, as in a terminal (a suite run in the background starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ssh.run("sleep 30", stream=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 5
    # the connection is still usable (a run stops on the interrupt; nothing is left broken)
    assert ssh.run("echo after", stream=False).stdout.strip() == "after"


@slow
@pytest.mark.parametrize("sshd_host", [{"sudo": "nopasswd"}], indirect=True)
def test_ssh_sudo_nopasswd(ssh, sshd_host):
    assert ssh.sudo("id -u", stream=False).stdout.strip() == "0"
    # sudo resets the environment: the variables must still arrive, timeout or not
    assert ssh.sudo('printf %s "$V"', env={"V": "x y"}, timeout=5, stream=False).stdout == "x y"
    target = f"{sshd_host.prefix}/root-owned"
    ssh.write_file(target, b"x\n", 0o640, sudo=True, owner="root:root")
    st = (sshd_host.prefix / "root-owned").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o640)
    assert ssh.sha256(target, sudo=True) is not None


# ------------------------------------------------------------------------------------------
# SshHost: faults
# ------------------------------------------------------------------------------------------


def assert_untouched(h):
    assert list(h.prefix.iterdir()) == []


@slow
def test_unknown_host_key(sshd_host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostError) as exc:
        connect(spec_for(sshd_host, known_hosts=str(empty)))
    msg = str(exc.value)
    port = sshd_host.port
    assert msg.startswith(f"v100-test (127.0.0.1:{port}): host key not trusted (the server offered ssh-ed25519 SHA256:")
    assert f"Check its fingerprint, then add it: ssh-keyscan -p {port} 127.0.0.1 >> {empty}" in msg
    assert "pin it in inventory.yaml as host_key:" in msg
    assert empty.read_text() == ""  # nothing was added behind the user's back
    assert_untouched(sshd_host)


@slow
def test_pinned_host_key_is_enough(sshd_host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    pin = " ".join(sshd_host.host_key_line.split()[1:3])
    with connect(spec_for(sshd_host, known_hosts=str(empty), host_key=pin)) as host:
        assert host.run("echo pinned", stream=False).stdout == "pinned\n"


@slow
def test_changed_host_key(sshd_host):
    old_line = sshd_host.host_key_line
    sshd_host.regenerate_host_key()
    with pytest.raises(HostError) as exc:
        connect(spec_for(sshd_host))
    msg = str(exc.value)
    assert msg.startswith(f"v100-test (127.0.0.1:{sshd_host.port}): host key CHANGED: expected ssh-ed25519 SHA256:")
    assert "man-in-the-middle" in msg
    assert f"ssh-keygen -R '[127.0.0.1]:{sshd_host.port}' -f {sshd_host.known_hosts}" in msg
    with open(sshd_host.known_hosts) as fh:
        assert fh.read() == old_line + "\n"  # the old key is still there: nothing was "fixed"
    assert_untouched(sshd_host)


@slow
def test_changed_pinned_host_key(sshd_host):
    pin = " ".join(sshd_host.host_key_line.split()[1:3])
    sshd_host.regenerate_host_key()
    with pytest.raises(HostError, match=r"host key CHANGED: .*\(pinned in inventory.yaml\)"):
        connect(spec_for(sshd_host, host_key=pin))


@slow
def test_closed_port(sshd_host):
    port = free_port()
    with pytest.raises(HostError) as exc:
        connect(spec_for(sshd_host, port=port))
    assert str(exc.value) == (
        f"v100-test (127.0.0.1:{port}): 127.0.0.1:{port} refused the connection (is sshd running, is the port right?)"
    )


@slow
def test_unresolvable_host_name(sshd_host):
    start = time.monotonic()
    with pytest.raises(HostError) as exc:
        connect(spec_for(sshd_host, host="v100-01.voltaforge.invalid", port=22))
    assert str(exc.value).startswith(
        "v100-test (v100-01.voltaforge.invalid:22): cannot resolve host name 'v100-01.voltaforge.invalid'"
    )
    assert time.monotonic() - start < 15


@slow
def test_wrong_client_key(sshd_host, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    with pytest.raises(HostError) as exc:
        connect(spec_for(sshd_host, key_file=str(other)))
    assert str(exc.value) == (
        f"v100-test (127.0.0.1:{sshd_host.port}): authentication failed for user {sshd_host.user} with key {other}"
    )
    assert_untouched(sshd_host)


@slow
def test_server_that_never_speaks_ssh(sshd_host):
    """A port that accepts but never answers (a hung sshd, a wrong service): no hang."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        host = SshHost(spec_for(sshd_host, port=port), connect_timeout=1)
        start = time.monotonic()
        with pytest.raises(HostError) as exc:
            host.open()
        assert str(exc.value) == (
            f"v100-test (127.0.0.1:{port}): 127.0.0.1:{port} accepted the connection but did not answer "
            "as an SSH server within 1 s"
        )
        assert time.monotonic() - start < 10


@slow
def test_unreachable_host_times_out(netns_host):
    """The host's network goes dark (its interface is down): a timeout, not a hang."""
    netns = ["ip", "netns", "exec", netns_host.netns, "ip", "link", "set", "eth0"]
    subprocess.run([*netns, "down"], check=True)
    try:
        host = SshHost(spec_for(netns_host), connect_timeout=1)
        start = time.monotonic()
        with pytest.raises(HostError) as exc:
            host.open()
        assert time.monotonic() - start < 5
        assert str(exc.value) == (
            f"v100-test ({netns_host.hostname}:22): timed out after 1 s connecting to {netns_host.hostname}:22"
        )
    finally:
        subprocess.run([*netns, "up"], check=True)
    assert_untouched(netns_host)


@slow
@pytest.mark.parametrize("sshd_host", [{"sudo": "password"}], indirect=True)
def test_sudo_that_wants_a_password_fails_fast(ssh, sshd_host, capsys, monkeypatch):
    target = sshd_host.prefix / "made-by-root"
    # Even a password lying around in Fabric's/Invoke's environment is never used or shown.
    monkeypatch.setenv("FABRIC_SUDO_PASSWORD", sshd_host.sudo_password)
    monkeypatch.setenv("INVOKE_SUDO_PASSWORD", sshd_host.sudo_password)
    seen = spy_commands(ssh)
    start = time.monotonic()
    with pytest.raises(HostError) as exc:
        ssh.sudo(f"touch {target}", timeout=20)
    assert time.monotonic() - start < 10  # no prompt waited for an answer
    assert str(exc.value) == (
        f"user {sshd_host.user} on v100-test needs a password for sudo; voltaforge needs "
        "passwordless sudo (NOPASSWD) for the provisioning user"
    )
    assert sshd_host.sudo_password not in capsys.readouterr().out + " ".join(seen)
    assert "sudo -n --" in seen[0]
    assert not target.exists()


def _run_in_thread(fn):
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _wait_for_remote(sshd_host, pattern: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["pgrep", "-u", sshd_host.user, "-fx", pattern], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"{pattern!r} never started"
        time.sleep(0.02)


@slow
def test_connection_dropped_mid_command(ssh, sshd_host):
    t, box = _run_in_thread(lambda: ssh.run("sleep 30", stream=False))
    _wait_for_remote(sshd_host, "sleep 30")
    start = time.monotonic()
    sshd_host.stop()
    t.join(15)
    assert not t.is_alive() and time.monotonic() - start < 10
    assert isinstance(box.get("error"), HostError), box
    assert str(box["error"]) == f"connection to v100-test (127.0.0.1:{sshd_host.port}) lost while running: sleep 30"
    # The host is gone: the next command says so instead of hanging.
    with pytest.raises(HostError, match="refused the connection"):
        ssh.run("true", stream=False)


@slow
def test_session_killed_mid_command_then_reconnects(ssh, sshd_host):
    long_cmd = "sleep 31 # " + "x" * 100
    t, box = _run_in_thread(lambda: ssh.run(long_cmd, stream=False))
    _wait_for_remote(sshd_host, "sleep 31")
    # Kill this connection's sshd processes, not the listener: like a network drop.
    for pid in _descendants(sshd_host.pid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    t.join(15)
    assert str(box.get("error")) == (
        f"connection to v100-test (127.0.0.1:{sshd_host.port}) lost while running: {long_cmd[:80]}"
    )
    assert ssh.run("echo again", stream=False).stdout == "again\n"


@slow
def test_command_killed_by_a_signal_is_not_a_lost_connection(ssh):
    with pytest.raises(HostError, match=r"^v100-test: killed by a signal while running: kill -9 \$\$$"):
        ssh.run("kill -9 $$", stream=False)
    assert ssh.run("echo still here", stream=False).stdout == "still here\n"


@slow
def test_printer_prefix_is_the_inventory_name(sshd_host, capsys):
    with connect(spec_for(sshd_host, name="v100-01"), printer=Printer()) as host:
        host.run("echo hello")
    assert "[v100-01] hello" in capsys.readouterr().out.splitlines()


def test_a_full_disk_stays_in_the_failure_message_under_later_errors():
    """A compiler or `ar` says "No space left on device" once and make adds its own errors after
    it: the failure keeps that line (the cause) beside the last five."""
    from playbooks.host import LocalHost

    script = "echo 'ar: lib.a: No space left on device' >&2; for i in 1 2 3 4 5 6; do echo make$i >&2; done; exit 2"
    with pytest.raises(HostError) as info:
        LocalHost().run(script, stream=False)
    lines = str(info.value).splitlines()
    assert lines[1] == "ar: lib.a: No space left on device" and lines[2:] == [f"make{i}" for i in range(2, 7)]
