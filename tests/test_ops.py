"""playbooks/host/ops.py: every operation converges, then is a no-op that says why.

Each operation runs on real hosts (this machine, a private sshd, a Debian 12 container for
sudo): dry run first (prints the commands, changes nothing: checked on the filesystem), then
twice for real (changed, then ok with a reason). Faults: a full disk, a path in the way, a
second concurrent run.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import threading
import time
from hashlib import sha256

import pytest
from rich.console import Console
from test_hosts import spec_for

from playbooks.cli.render import render_report
from playbooks.errors import HostError
from playbooks.facts.files import FileStat, parse_stat
from playbooks.host import LocalHost, connect
from playbooks.host.lock import LOCK_NAME, host_lock
from playbooks.host.ops import (
    FULL_OUTPUT_NOTE,
    Change,
    EnsureDirectory,
    Shell,
    run_ops,
    summarize,
)
from tests.file_ops import EnsureFile, RunCommand


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.slow)])
def target(request, tmp_path):
    """(host, base directory on it) for LocalHost and for SshHost on a private sshd."""
    if request.param == "local":
        yield LocalHost(), tmp_path
        return
    sshd = request.getfixturevalue("sshd_host")
    with connect(spec_for(sshd)) as host:
        yield host, sshd.prefix


def statuses(changes: list[Change]) -> list[tuple[str, str]]:
    return [(c.status, c.why) for c in changes]


# ------------------------------------------------------------------------------------------
# facts (pure)
# ------------------------------------------------------------------------------------------

# Captured from `stat -L -c '%F|%a|%U|%G'` (GNU coreutils 9.1, Debian 12).
STAT_OUTPUTS = {
    "directory|755|root|root\n": FileStat("directory", 0o755, "root", "root"),
    "regular empty file|600|deploy|deploy\n": FileStat("regular empty file", 0o600, "deploy", "deploy"),
    "regular file|4755|root|root\n": FileStat("regular file", 0o4755, "root", "root"),
    "missing\n": None,
}


@pytest.mark.parametrize("output", STAT_OUTPUTS)
def test_parse_stat(output):
    assert parse_stat(output) == STAT_OUTPUTS[output]


def test_operations_validate_their_input():
    with pytest.raises(ValueError):
        EnsureDirectory("relative", 0o755)
    with pytest.raises(ValueError):
        EnsureDirectory("/x", 0o10000)
    with pytest.raises(ValueError):
        EnsureFile("/x", b"", owner="a b")


# ------------------------------------------------------------------------------------------
# EnsureDirectory / EnsureFile: dry run, then twice
# ------------------------------------------------------------------------------------------


def test_ensure_directory(target, capsys):
    host, base = target
    path = base / "opt" / "voltaforge"
    op = EnsureDirectory(str(path), 0o750)
    assert op.name == f"Ensure {path} exists"

    dry = run_ops(host, [op], dry_run=True)
    assert statuses(dry) == [("changed", "dry run: would run 1 command (directory is missing)")]
    assert list(dry[0].commands) == [f"mkdir -p -m 0750 -- {path}"]
    assert f"[{host.name}] would run: mkdir -p -m 0750 -- {path}" in capsys.readouterr().out
    assert not (base / "opt").exists()

    assert statuses(run_ops(host, [op])) == [("changed", "directory is missing")]
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o750
    assert statuses(run_ops(host, [op])) == [("ok", "directory already exists with mode 0750")]

    path.chmod(0o700)
    assert statuses(run_ops(host, [op], dry_run=True)) == [
        ("changed", "dry run: would run 1 command (mode is 0700, want 0750)")
    ]
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert statuses(run_ops(host, [op])) == [("changed", "mode is 0700, want 0750")]
    assert statuses(run_ops(host, [op]))[0][0] == "ok"


def test_ensure_file(target, capsys):
    host, base = target
    path = base / "llama-server.env"
    v1, v2 = b"LLAMA_ARG_CTX_SIZE=8192\n", b"LLAMA_ARG_CTX_SIZE=16384\n"
    op = EnsureFile(str(path), v1, 0o640)

    dry = run_ops(host, [op], dry_run=True)
    assert statuses(dry) == [("changed", "dry run: would run 1 command (file is missing)")]
    assert dry[0].commands[0].endswith(f'mv -fT "$tmp" {path}  # stdin: 24 bytes, sha256 {sha256(v1).hexdigest()[:12]}')
    assert "would run: set -e; umask 077; tmp=$(mktemp" in capsys.readouterr().out
    assert list(base.iterdir()) == []

    assert statuses(run_ops(host, [op])) == [("changed", "file is missing")]
    assert path.read_bytes() == v1 and stat.S_IMODE(path.stat().st_mode) == 0o640
    ok = run_ops(host, [op])
    assert statuses(ok) == [("ok", f"file is already up to date (sha256 {sha256(v1).hexdigest()[:12]})")]

    op2 = EnsureFile(str(path), v2, 0o640)
    assert run_ops(host, [op2], dry_run=True)[0].why.startswith("dry run: would run 1 command (content differs")
    assert path.read_bytes() == v1
    changed = run_ops(host, [op2])
    assert statuses(changed) == [
        (
            "changed",
            f"content differs (sha256 {sha256(v1).hexdigest()[:12]} on the host, {sha256(v2).hexdigest()[:12]} wanted)",
        )
    ]
    assert path.read_bytes() == v2 and run_ops(host, [op2])[0].status == "ok"

    # A mode difference alone is a chmod, not an upload (same inode).
    inode = path.stat().st_ino
    path.chmod(0o666)
    assert statuses(run_ops(host, [op2])) == [("changed", "mode is 0666, want 0640")]
    assert path.stat().st_ino == inode and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert run_ops(host, [op2])[0].status == "ok"
    assert sorted(p.name for p in base.iterdir()) == ["llama-server.env"]  # no temp files left


def test_failure_stops_the_host_and_says_why(target):
    host, base = target
    (base / "models").write_text("a file where a directory should be\n")
    ops = [
        EnsureDirectory(str(base / "models"), 0o755),
        EnsureDirectory(str(base / "never-made"), 0o755),
    ]
    changes = run_ops(host, ops)
    assert statuses(changes) == [("failed", f"{base / 'models'} exists but is a regular file, not a directory")]
    assert sorted(p.name for p in base.iterdir()) == ["models"]

    changes = run_ops(host, [EnsureFile(str(base / "no-such-dir" / "f"), b"x"), *ops[1:]])
    assert changes[0].status == "failed" and len(changes) == 1
    assert changes[0].why.startswith(f"cannot write {base / 'no-such-dir' / 'f'}: mktemp: failed to create file")
    assert sorted(p.name for p in base.iterdir()) == ["models"]


@pytest.mark.slow
def test_disk_full_leaves_no_partial_file(sshd_host):
    """A real ENOSPC: a 64 KiB tmpfs mounted on the host's prefix."""
    disk = sshd_host.prefix / "small"
    disk.mkdir()
    uid = sshd_host.prefix.stat().st_uid
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,mode=0755,uid={uid}", "tmpfs", str(disk)], check=True)
    try:
        path = disk / "model.gguf"
        with connect(spec_for(sshd_host)) as host:
            assert run_ops(host, [EnsureFile(str(path), b"old weights\n")])[0].status == "changed"
            changes = run_ops(
                host, [EnsureFile(str(path), os.urandom(256 * 1024)), EnsureDirectory(str(disk / "after"))]
            )
        assert statuses(changes) == [("failed", f"no space left on device at {path}")]
        assert os.listdir(disk) == ["model.gguf"]  # no temp file, nothing after the failure
        assert path.read_bytes() == b"old weights\n"  # the old file is intact
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_ops_with_sudo_on_a_systemd_host(nspawn_host):
    """Root-owned paths through `sudo -n` as deploy, on a booted Debian 12."""
    spec = spec_for(nspawn_host)
    etc = "/etc/voltaforge-ops-test"
    ops = [
        EnsureDirectory(etc, 0o750, owner="root:deploy", sudo=True),
        EnsureFile(f"{etc}/server.env", b"PORT=8080\n", 0o640, owner="root:deploy", sudo=True),
    ]
    with connect(spec) as host:
        try:
            dry = run_ops(host, ops, dry_run=True)
            assert [c.status for c in dry] == ["changed", "changed"]
            assert not host.exists(etc)
            first = run_ops(host, ops)
            assert statuses(first) == [("changed", "directory is missing"), ("changed", "file is missing")]
            assert list(first[0].commands) == [f"mkdir -p -m 0750 -- {etc}", f"chown -- root:deploy {etc}"]
            listing = host.sudo(f"stat -c '%n %a %U:%G' {etc} {etc}/server.env", stream=False).stdout
            assert listing == f"{etc} 750 root:deploy\n{etc}/server.env 640 root:deploy\n"
            # deploy can read it through the group, not write it
            assert host.run(f"cat {etc}/server.env", stream=False).stdout == "PORT=8080\n"
            second = run_ops(host, ops)
            assert statuses(second) == [
                ("ok", "directory already exists with mode 0750, owner root:deploy"),
                ("ok", f"file is already up to date (sha256 {sha256(b'PORT=8080' + bytes([10])).hexdigest()[:12]})"),
            ]
            host.sudo(f"chown deploy {etc}", stream=False)
            assert statuses(run_ops(host, ops[:1])) == [("changed", "owner is deploy:deploy, want root:deploy")]
        finally:
            host.sudo(f"rm -rf {etc}", stream=False)


# ------------------------------------------------------------------------------------------
# host lock
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lock_refuses_a_second_run_and_is_released(sshd_host):
    spec = spec_for(sshd_host)
    prefix = str(sshd_host.prefix / "voltaforge")
    lock = f"{prefix}/{LOCK_NAME}"
    with connect(spec) as first, connect(spec) as second:
        with host_lock(first, prefix) as held:
            assert held == lock
            with pytest.raises(HostError) as exc:
                with host_lock(second, prefix):
                    pytest.fail("two runs held the lock")
            msg = str(exc.value)
            assert msg.startswith(f"v100-test is being provisioned by another voltaforge run (lock {lock} held since ")
            assert f"pid {os.getpid()})" in msg
        with host_lock(second, prefix):  # released: the next run gets it
            pass


@pytest.mark.slow
def test_two_concurrent_runs_one_wins(sshd_host):
    """Two real runs start at the same instant; exactly one provisions, the other is told."""
    spec = spec_for(sshd_host)
    prefix = str(sshd_host.prefix)
    barrier = threading.Barrier(2)
    results: dict[int, object] = {}

    def provision(i: int) -> None:
        with connect(spec) as host:
            host.printer.quiet = True
            barrier.wait()
            try:
                with host_lock(host, prefix):
                    changes = run_ops(host, [EnsureDirectory(f"{prefix}/run{i}", 0o755)])
                    time.sleep(1)  # still provisioning when the other run tries
                results[i] = changes
            except HostError as exc:
                results[i] = exc

    threads = [threading.Thread(target=provision, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [r for r in results.values() if isinstance(r, HostError)]
    wins = [i for i, r in results.items() if isinstance(r, list)]
    assert len(errors) == 1 and len(wins) == 1, results
    assert "is being provisioned by another voltaforge run" in str(errors[0])
    assert sorted(p.name for p in sshd_host.prefix.iterdir()) == [LOCK_NAME, f"run{wins[0]}"]


@pytest.mark.slow
def test_lock_is_released_when_the_connection_drops(sshd_host):
    spec = spec_for(sshd_host)
    prefix = str(sshd_host.prefix)
    crashed = connect(spec)
    cm = host_lock(crashed, prefix)
    cm.__enter__()
    crashed.conn.client.close()  # like voltaforge killed: the lock is never released by us
    with connect(spec) as other:
        deadline = time.monotonic() + 10
        while True:
            try:
                with host_lock(other, prefix):
                    break
            except HostError:
                assert time.monotonic() < deadline, "the lock outlived its connection"
                time.sleep(0.1)


@pytest.mark.slow
def test_lock_with_sudo_on_a_systemd_host(nspawn_host):
    """A root-owned prefix: the lock holder runs under `sudo -n`, and creates the prefix."""
    prefix = "/opt/voltaforge-locktest"
    spec = spec_for(nspawn_host)
    with connect(spec) as first, connect(spec) as second:
        try:
            with host_lock(first, prefix, sudo=True):
                assert first.sudo(f"stat -c %U {prefix}", stream=False).stdout == "root\n"
                with pytest.raises(HostError, match="is being provisioned by another voltaforge run"):
                    with host_lock(second, prefix, sudo=True):
                        pass
            with host_lock(second, prefix, sudo=True):
                pass
        finally:
            first.sudo(f"rm -rf {prefix}", stream=False)


def test_lock_on_local_host(tmp_path):
    a, b = LocalHost(), LocalHost()
    with host_lock(a, str(tmp_path / "p")):
        with pytest.raises(HostError, match="^local is being provisioned by another voltaforge run"):
            with host_lock(b, str(tmp_path / "p")):
                pass
    with host_lock(b, str(tmp_path / "p")):
        pass


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------


def test_render_report():
    changes = [
        Change("v100-01", "Ensure /opt/voltaforge exists", "ok", "directory already exists with mode 0755"),
        Change("v100-01", "Ensure /opt/voltaforge/[x].env is up to date", "changed", "file is missing", ("...",)),
        Change("v100-02", "Ensure /opt/voltaforge exists", "failed", "no space left on device at /opt/voltaforge/f"),
    ]
    console = Console(file=io.StringIO(), width=200, color_system=None)
    render_report(changes, console)
    text = console.file.getvalue()
    for word in (
        "host",
        "step",
        "status",
        "why",
        "directory already exists with mode 0755",
        "/opt/voltaforge/[x].env",
        "no space left on device at /opt/voltaforge/f",
    ):
        assert word in text
    assert "v100-01: 1 changed, 1 ok, 0 failed" in text and "v100-02: 0 changed, 0 ok, 1 failed" in text


def test_a_long_failure_is_one_line_in_the_report_and_whole_in_detail(tmp_path, monkeypatch, capsys):
    """A command that fails with 40 lines of output (pip's retries, a compiler's errors): the
    why column holds one line, the first, and says the rest is in the log; detail holds it all."""
    from playbooks.conduct.logs import write_details

    script = 'for i in $(seq 1 40); do echo "pip line $i: WARNING: Retrying after connection broken" >&2; done; exit 1'
    (change,) = run_ops(LocalHost(), [RunCommand("Install torch", Shell(script), "always")])
    assert change.status == "failed" and len(change.why.splitlines()) == 1
    assert change.why.startswith("command failed (exit 1): for i in") and change.why.endswith(FULL_OUTPUT_NOTE)
    assert len(change.why) <= 300 + len(FULL_OUTPUT_NOTE) + 1 and "pip line 40" not in change.why
    assert "pip line 40: WARNING" in change.detail and change.detail.startswith("command failed (exit 1)")
    # what run_ops printed while it ran: one line for the failure too
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[local] failed:")]
    assert len(printed) == 1 and printed[0].endswith(FULL_OUTPUT_NOTE)
    # the table: the summary, not the output
    console = Console(file=io.StringIO(), width=200, color_system=None)
    monkeypatch.setenv("VOLTAFORGE_LOG_DIR", str(tmp_path / "logs"))
    log = write_details([change])
    render_report([change], console, log=log)
    text = console.file.getvalue()
    assert "pip line 2:" not in text and f"the full output of what failed is in {log}" in text
    assert (
        log is not None and "pip line 40: WARNING" in log.read_text() and "== local: Install torch" in log.read_text()
    )
    # nothing cut, nothing to write
    ok = Change("local", "step", "failed", "no space left on device at /x", detail="no space left on device at /x")
    assert write_details([ok]) is None


@pytest.mark.parametrize(
    "text,why",
    [
        ("no space left on device at /opt/vf/f", "no space left on device at /opt/vf/f"),
        ("  one line\n\n", "one line"),
        ("", "failed without a message"),
        ("first\nsecond", f"first {FULL_OUTPUT_NOTE}"),
        ("x" * 400 + "\nsecond", "x" * 299 + f"… {FULL_OUTPUT_NOTE}"),  # one word: cut inside it
        ("words " * 80 + "\nsecond", "words " * 49 + f"words… {FULL_OUTPUT_NOTE}"),  # at a word
        ("y" * 400, "y" * 400),  # one line written for people: its fix is at the end, kept
        ("z" * 1200, "z" * 999 + f"… {FULL_OUTPUT_NOTE}"),
        ("Traceback (most recent call last):\n  File x\nValueError: bad", f"ValueError: bad {FULL_OUTPUT_NOTE}"),
        (
            "command failed (exit 1): umask 077; key=x\nthe key has characters",
            "the key has characters (command failed (exit 1): umask 077; key=x)",
        ),
    ],
)
def test_summarize(text, why):
    assert summarize(text) == why


def test_handlers_run_once_when_notified_and_not_when_nothing_changed(tmp_path):
    """Two files notify the same handler: it runs once after both changed, not on a no-op
    run; a non-idempotent operation acts every time and says so."""
    from playbooks.host.ops import Handler, Shell

    log = tmp_path / "handler.log"
    host = LocalHost()
    ops = [
        EnsureFile(str(tmp_path / "a.conf"), b"a\n", notify=["reload"]),
        EnsureFile(str(tmp_path / "b.conf"), b"b\n", notify=["reload"]),
        RunCommand("Count runs", Shell(f"echo run >> {tmp_path}/runs"), "a smoke check runs every time"),
    ]
    handlers = [Handler("reload", (Shell(f"echo reload >> {log}"),)), Handler("unused", (Shell("false"),))]
    dry = run_ops(host, ops, dry_run=True, handlers=handlers)
    assert [c.step for c in dry][-1] == "reload" and not log.exists()
    first = run_ops(host, ops, handlers=handlers)
    assert [(c.step, c.status) for c in first][-1] == ("reload", "changed")
    assert log.read_text() == "reload\n"
    second = run_ops(host, ops, handlers=handlers)
    assert [c.status for c in second] == ["ok", "ok", "changed"]  # the non-idempotent one acts again
    assert second[2].why == "a smoke check runs every time"
    assert log.read_text() == "reload\n" and (tmp_path / "runs").read_text() == "run\nrun\n"
    with pytest.raises(ValueError, match="not among the handlers"):
        run_ops(host, [EnsureFile(str(tmp_path / "c"), b"", notify=["nope"])], handlers=handlers)


@pytest.mark.slow
def test_one_operation_list_on_two_hosts_at_once(nspawn_host, tmp_path):
    """Operations are values: the same list runs on this machine and on the container in
    parallel threads, each host gets its own decisions (changed, then ok)."""
    import concurrent.futures

    path = f"/tmp/vf-parallel-{os.getpid()}"
    ops = [EnsureDirectory(path, 0o755), EnsureFile(f"{path}/x.env", b"X=1\n", 0o600)]
    local = LocalHost()
    remote = connect(spec_for(nspawn_host))
    try:
        for expected in ("changed", "ok"):
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                results = list(pool.map(lambda h: run_ops(h, ops), [local, remote]))
            for changes in results:
                assert [c.status for c in changes] == [expected, expected], changes
            assert {c.host for c in results[0]} == {"local"} and {c.host for c in results[1]} == {remote.name}
    finally:
        local.run(f"rm -rf {path}", check=False, stream=False)
        remote.run(f"rm -rf {path}", check=False, stream=False)
        remote.close()
