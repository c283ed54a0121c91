"""The real test hosts of tests/testhosts.py work, and work strictly.

Every connection goes through ``strict_connection``: the host's ``known_hosts`` is loaded and
``paramiko.RejectPolicy`` set before connecting (Fabric's default, AutoAddPolicy, would accept
any host key), so these tests also prove the fixtures hand out correct host keys.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import stat
import subprocess
import time
import types

import invoke
import paramiko
import pytest

from testhosts import strict_client, strict_connection

pytestmark = pytest.mark.slow

CONNECT_ERRORS = (paramiko.ssh_exception.NoValidConnectionsError, paramiko.SSHException, OSError)


# ---------------------------------------------------------------------------------------
# sshd_host
# ---------------------------------------------------------------------------------------


def test_sshd_host_runs_commands_and_puts_files(sshd_host, tmp_path):
    local = tmp_path / "payload.txt"
    local.write_text("hello from voltaforge\n")
    remote = f"{sshd_host.prefix}/payload.txt"
    with strict_connection(sshd_host) as c:
        assert c.run("id -un", hide=True).stdout.strip() == sshd_host.user
        c.put(str(local), remote)
        assert c.run(f"cat {remote}", hide=True).stdout == "hello from voltaforge\n"
    # The host shares this machine's filesystem: the file is really there, owned by the user.
    assert (sshd_host.prefix / "payload.txt").stat().st_uid == pwd.getpwnam(sshd_host.user).pw_uid


def test_sshd_host_attributes(sshd_host):
    assert sshd_host.hostname == "127.0.0.1"
    assert sshd_host.port != 22
    assert sshd_host.host_key_line.startswith(f"[127.0.0.1]:{sshd_host.port} ssh-ed25519 ")
    with open(sshd_host.known_hosts) as fh:
        assert fh.read() == sshd_host.host_key_line + "\n"
    assert os.readlink(f"/proc/{sshd_host.pid}/exe") == "/usr/sbin/sshd"
    st = sshd_host.prefix.stat()
    assert st.st_uid == pwd.getpwnam(sshd_host.user).pw_uid and stat.S_ISDIR(st.st_mode)
    assert list(sshd_host.prefix.iterdir()) == []
    assert sshd_host.sudo is None and sshd_host.sudoers_file is None


def test_strict_paramiko_client(sshd_host):
    client = strict_client(sshd_host.known_hosts)
    try:
        client.connect(sshd_host.hostname, sshd_host.port, username=sshd_host.user, **sshd_host.connect_kwargs)
        _, stdout, _ = client.exec_command("echo $HOME")
        assert stdout.read().decode().strip() == pwd.getpwnam(sshd_host.user).pw_dir
    finally:
        client.close()
    # The same command line for the OpenSSH client, equally strict.
    out = subprocess.run(sshd_host.ssh_command("id -un"), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == sshd_host.user


def test_unknown_host_key_is_rejected(sshd_host, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    conn = strict_connection(sshd_host, known_hosts=str(empty))
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        conn.open()


def test_changed_host_key_is_rejected(sshd_host):
    old_line, port = sshd_host.host_key_line, sshd_host.port
    new_line = sshd_host.regenerate_host_key()
    assert new_line != old_line and sshd_host.port == port
    with pytest.raises(paramiko.BadHostKeyException):
        strict_connection(sshd_host).open()
    sshd_host.trust_current_host_key()
    with strict_connection(sshd_host) as c:
        assert c.run("true", hide=True).ok


def test_stop_drops_connections_and_start_reuses_port(sshd_host):
    port = sshd_host.port
    c = strict_connection(sshd_host)
    c.open()
    sshd_host.stop()
    assert sshd_host.pid is None
    deadline = time.monotonic() + 5
    while c.transport.is_active() and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises((paramiko.SSHException, EOFError, OSError)):
        c.run("true", hide=True)
    c.close()
    with pytest.raises(CONNECT_ERRORS):
        strict_connection(sshd_host).open()

    sshd_host.start()
    assert sshd_host.port == port and sshd_host.pid
    with strict_connection(sshd_host) as c2:
        assert c2.run("echo back", hide=True).stdout == "back\n"


@pytest.mark.parametrize("sshd_host", [{"sudo": "nopasswd"}], indirect=True)
def test_sudo_nopasswd(sshd_host):
    assert oct(sshd_host.sudoers_file.stat().st_mode & 0o777) == "0o440"
    with strict_connection(sshd_host) as c:
        assert c.run("sudo -n id -u", hide=True).stdout.strip() == "0"
        assert c.sudo("id -un", hide=True).stdout.strip() == "root"


@pytest.mark.parametrize("sshd_host", [{"sudo": "password"}], indirect=True)
def test_sudo_that_wants_a_password(sshd_host):
    assert sshd_host.sudo == "password" and sshd_host.sudo_password
    with strict_connection(sshd_host) as c:
        r = c.run("sudo -n true", warn=True, hide=True)
        assert r.failed and "password is required" in r.stderr
        assert c.sudo("id -u", password=sshd_host.sudo_password, hide=True).stdout.strip() == "0"
        with pytest.raises(invoke.exceptions.AuthFailure):
            c.sudo("true", password="wrong-password", hide=True)


def test_teardown_removes_sudoers_and_prefix(make_sshd_host):
    host = make_sshd_host(sudo="password")
    dropin, prefix, pid = host.sudoers_file, host.prefix, host.pid
    assert dropin.exists()
    host.close()
    assert not dropin.exists() and not prefix.exists()
    assert not os.path.exists(f"/proc/{pid}")
    # The password was reset: no sudo rule and no usable password remain.
    plain = make_sshd_host()
    with strict_connection(plain) as c:
        assert c.run("sudo -n true", warn=True, hide=True).failed
    assert pwd.getpwnam(plain.user).pw_name == plain.user
    shadow = subprocess.run(["getent", "shadow", plain.user], capture_output=True, text=True).stdout
    assert shadow.split(":")[1] == "*"


# ---------------------------------------------------------------------------------------
# netns_host
# ---------------------------------------------------------------------------------------


def _root_ns_ipv4() -> set[str]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


def test_netns_host_only_reachable_through_its_veth(netns_host):
    addr = ipaddress.ip_address(netns_host.hostname)
    assert not addr.is_loopback and netns_host.port == 22
    assert netns_host.host_key_line.startswith(f"{netns_host.hostname} ssh-ed25519 ")
    assert netns_host.hostname not in _root_ns_ipv4()
    assert os.readlink(f"/proc/{netns_host.pid}/ns/net") != os.readlink("/proc/self/ns/net")

    with strict_connection(netns_host) as c:
        assert c.run("id -un", hide=True).stdout.strip() == netns_host.user
        inside = c.run("ip -o -4 addr show", hide=True).stdout
    assert netns_host.hostname in inside
    # Only lo and the veth end exist inside: none of this machine's own addresses.
    assert not (_root_ns_ipv4() - {"127.0.0.1", netns_host.link.host_addr}) & set(inside.split())

    # The same port on this machine's loopback is not this server.
    loopback = types.SimpleNamespace(
        hostname="127.0.0.1",
        port=netns_host.port,
        user=netns_host.user,
        key_filename=netns_host.key_filename,
        known_hosts=netns_host.known_hosts,
    )
    with pytest.raises(CONNECT_ERRORS):
        strict_connection(loopback).open()


# ---------------------------------------------------------------------------------------
# nspawn_host
# ---------------------------------------------------------------------------------------

UNIT = """\
[Unit]
Description=voltaforge test http server

[Service]
ExecStart=/usr/bin/python3 -m http.server 8765 --bind 127.0.0.1 --directory /srv/vf-http
"""


def test_nspawn_host_is_a_booted_systemd(nspawn_host):
    assert nspawn_host.port == 22 and nspawn_host.user == "deploy"
    assert nspawn_host.host_key_line.startswith(f"{nspawn_host.hostname} ssh-ed25519 ")
    with strict_connection(nspawn_host) as c:
        state = c.run("systemctl is-system-running", warn=True, hide=True).stdout.strip()
        assert state in ("running", "degraded"), c.run("systemctl --failed", hide=True).stdout
        assert c.run("id -un", hide=True).stdout.strip() == "deploy"
        assert c.run("hostname", hide=True).stdout.strip() == nspawn_host.machine
        assert c.run("cat /proc/1/comm", hide=True).stdout.strip() == "systemd"
        assert c.run(f"test -O {nspawn_host.prefix} && test -d {nspawn_host.prefix}", warn=True).ok
        start = time.monotonic()
        assert c.sudo("id -u", hide=True).stdout.strip() == "0"
        # libnss-myhostname + --resolv-conf=delete: sudo does not stall on DNS.
        assert time.monotonic() - start < 5
    assert nspawn_host.run_inside("id -u").stdout.strip() == "0"


def test_nspawn_host_rejects_unknown_host_key(nspawn_host, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        strict_connection(nspawn_host, known_hosts=str(empty)).open()


def test_nspawn_host_systemd_unit_lifecycle(nspawn_host, tmp_path):
    unit = tmp_path / "vf-http.service"
    unit.write_text(UNIT)
    with strict_connection(nspawn_host) as c:
        try:
            c.put(str(unit), "/tmp/vf-http.service")
            c.sudo("install -m 0644 /tmp/vf-http.service /etc/systemd/system/vf-http.service", hide=True)
            c.sudo("sh -c 'mkdir -p /srv/vf-http && echo served-by-systemd > /srv/vf-http/index.html'", hide=True)
            c.sudo("systemctl daemon-reload", hide=True)
            c.sudo("systemctl start vf-http.service", hide=True)
            assert c.run("systemctl is-active vf-http.service", hide=True).stdout.strip() == "active"
            body = c.run(
                "for i in $(seq 100); do curl -fsS http://127.0.0.1:8765/ && exit 0; sleep 0.05; done; exit 1",
                hide=True,
            ).stdout
            assert body == "served-by-systemd\n"
            # Bound to the container's loopback: not reachable from this machine.
            with pytest.raises(OSError):
                socket.create_connection((nspawn_host.hostname, 8765), timeout=2).close()
            journal = c.sudo("journalctl -u vf-http.service --no-pager", hide=True).stdout
            assert "voltaforge test http server" in journal
            # Writes land in the overlay, never in the cached rootfs.
            assert (nspawn_host.rootfs / "etc/systemd/system/vf-http.service").exists()
            assert not (nspawn_host.lower_dir / "etc/systemd/system/vf-http.service").exists()

            c.sudo("systemctl stop vf-http.service", hide=True)
            r = c.run("systemctl is-active vf-http.service", warn=True, hide=True)
            assert r.stdout.strip() == "inactive" and r.exited == 3
        finally:
            c.sudo(
                "sh -c 'systemctl stop vf-http.service; rm -rf /etc/systemd/system/vf-http.service"
                " /srv/vf-http /tmp/vf-http.service; systemctl daemon-reload'",
                warn=True,
                hide=True,
            )


# ---------------------------------------------------------------------------------------
# provisionable_nspawn_host
# ---------------------------------------------------------------------------------------


def test_the_image_name_is_the_one_the_rootfs_script_builds():
    from testhosts import BUILD_ROOTFS_SCRIPT, ROOTFS_TARBALL

    assert f'tarball="$cache/{ROOTFS_TARBALL}"' in BUILD_ROOTFS_SCRIPT.read_text()


def test_the_image_holds_what_the_toolchain_step_would_apt_install():
    """The container has no internet: a package the toolchain step finds missing could not
    be installed there, so the image carries every one of them."""
    import re

    from playbooks.steps.build.toolchain import BUILD_PACKAGES
    from testhosts import BUILD_ROOTFS_SCRIPT

    lists = re.findall(r'^packages="(?:\$packages,)?([^"]*)"$', BUILD_ROOTFS_SCRIPT.read_text(), re.M)
    assert set(BUILD_PACKAGES) <= {p for line in lists for p in line.split(",")}


@pytest.mark.parametrize("provisionable_nspawn_host", [{"ccache": None}], indirect=True)
def test_provisionable_nspawn_host_without_a_shared_ccache(provisionable_nspawn_host):
    host = provisionable_nspawn_host
    assert host.ccache is None and not any(b.startswith("--bind=") for b in host.binds)
    assert host.run_inside(f"test -e {host.prefix}/llama.cpp", check=False).returncode == 1


def test_provisionable_nspawn_host_installs_only_from_its_wheelhouse(provisionable_nspawn_host):
    from tests.wheelhouse import wheel_names

    host = provisionable_nspawn_host
    names = wheel_names(host.wheelhouse_on_controller)
    assert {"torch", "scikit-build-core", "ninja", "transformers", "numpy"} <= names.keys()
    with strict_connection(host) as c:
        # the build tools of the image
        for tool in ("gcc", "g++", "make", "cmake", "ccache"):
            assert c.run(f"command -v {tool}", warn=True, hide=True).ok, tool
        c.run("python3 -m venv /tmp/v", hide=True)
        # pip knows only the wheelhouse: what is there installs, anything else is not found
        # (at once: no index is asked, and there is no route out anyway)
        ok = c.run("/tmp/v/bin/pip install -q diskcache && /tmp/v/bin/pip show diskcache", hide=True).stdout
        assert f"Version: {names['diskcache']}" in ok
        start = time.monotonic()
        missing = c.run("/tmp/v/bin/pip install six", warn=True, hide=True)
        assert missing.exited == 1 and "No matching distribution found for six" in missing.stderr
        assert time.monotonic() - start < 15
        # the wheelhouse is read-only inside; the shared ccache is writable by deploy and is
        # where the build step's CCACHE_DIR under the prefix points
        assert not c.run(f"touch {host.wheelhouse}/x", warn=True, hide=True).ok
        assert c.run(f"readlink {host.prefix}/llama.cpp/ccache", hide=True).stdout.strip() == str(host.ccache)
        c.run(f"touch {host.ccache}/.vf-probe && rm {host.ccache}/.vf-probe", hide=True)
