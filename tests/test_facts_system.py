"""System facts: the parsers against outputs captured on this machine (Debian 12, no systemd),
and the real fact commands run on this machine through the host layer (LocalHost, what
`--host local` uses), their parsed output checked against what the test reads itself with
Python's standard library."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from playbooks.config.inventory import resolve_host
from playbooks.facts import read_fact, system
from playbooks.facts.system import (
    DiskFree,
    MemInfo,
    OsRelease,
    PythonVersion,
    SystemdState,
    disk_free_command,
    parse_df,
    parse_meminfo,
    parse_nproc,
    parse_os_release,
    parse_python_version,
    parse_systemd,
    parse_uname_machine,
)
from playbooks.host import LocalHost, connect
from tests.helpers import fixture_body as fixture_text

NO_TOOLS = {"PATH": "/nonexistent-voltaforge-bin"}


def test_os_release_debian12():
    assert parse_os_release(fixture_text("thishost-os-release-debian12.txt")) == OsRelease(
        available=True,
        id="debian",
        id_like=(),
        version_id="12",
        codename="bookworm",
        pretty_name="Debian GNU/Linux 12 (bookworm)",
    )


def test_os_release_absent_and_command_fallback():
    assert parse_os_release("voltaforge: os-release not found\n").available is False
    assert parse_os_release("").reason == "no ID= line in os-release output"
    run = subprocess.run(["/bin/sh", "-c", system.OS_RELEASE_COMMAND], capture_output=True, text=True)
    assert run.returncode == 0


def test_df_with_missing_paths_walked_up():
    facts = parse_df(fixture_text("thishost-df-nearest-parent.txt"))
    assert list(facts) == [
        "/",
        "/dev/shm",
        "/opt/voltaforge/models/qwen2.5-32b",
        "relative/not/there",
        "/tmp/dir with space",
    ]
    root = DiskFree(
        path="/",
        existing_path="/",
        filesystem="/dev/vda",
        size_bytes=270553174016,
        used_bytes=31265845248,
        available_bytes=77678448640,
        mount_point="/",
    )
    assert facts["/"] == root
    assert facts["/dev/shm"] == DiskFree(
        path="/dev/shm",
        existing_path="/dev/shm",
        filesystem="tmpfs",
        size_bytes=25276059648,
        used_bytes=0,
        available_bytes=25276059648,
        mount_point="/dev/shm",
    )
    model = facts["/opt/voltaforge/models/qwen2.5-32b"]
    assert model.existing_path == "/opt" and model.exists is False
    assert (model.available_bytes, model.mount_point) == (77678448640, "/")
    assert facts["relative/not/there"].existing_path == "."
    spaced = facts["/tmp/dir with space"]
    assert spaced.exists and spaced.available_bytes == 77678448640


def test_df_command_runs_for_real(tmp_path):
    missing = tmp_path / "not" / "yet" / "there"
    (tmp_path / "a b").mkdir()
    run = subprocess.run(
        ["/bin/sh", "-c", disk_free_command([str(missing), str(tmp_path / "a b")])], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    facts = parse_df(run.stdout)
    assert facts[str(missing)].existing_path == str(tmp_path)
    assert facts[str(missing)].available_bytes > 0
    assert facts[str(tmp_path / "a b")].exists
    assert facts[str(tmp_path / "a b")].error is None


def test_df_error_kept_per_path():
    text = "### voltaforge-df path=/x\n### voltaforge-df existing=/x\ndf: /x: Permission denied\n"
    assert parse_df(text) == {"/x": DiskFree(path="/x", existing_path="/x", error="df: /x: Permission denied")}
    assert parse_df("") == {}


def test_meminfo_this_machine():
    assert parse_meminfo(fixture_text("thishost-proc-meminfo.txt")) == MemInfo(
        available=True,
        mem_total_bytes=24683652 * 1024,
        mem_available_bytes=24123084 * 1024,
        swap_total_bytes=0,
        swap_free_bytes=0,
    )
    absent = parse_meminfo("voltaforge: /proc/meminfo not found")
    assert absent.available is False and absent.reason == "no MemTotal in /proc/meminfo output"


def test_python_version_this_machine():
    assert parse_python_version(fixture_text("thishost-python3-version.txt")) == PythonVersion(
        available=True, path="/root/.pyenv/shims/python3", version=(3, 11, 7)
    )
    assert parse_python_version("Python 3.8.18").version == (3, 8, 18)


def test_python_command_without_python3():
    run = subprocess.run(["/bin/sh", "-c", system.PYTHON_VERSION_COMMAND], env=NO_TOOLS, capture_output=True, text=True)
    assert run.returncode == 0
    assert parse_python_version(run.stdout) == PythonVersion(available=False, reason="python3 not found")


def test_systemd_not_booted_this_machine():
    assert parse_systemd(fixture_text("thishost-systemd-not-booted.txt")) == SystemdState(
        systemd_running=False, booted=False, systemctl_present=True, state="offline"
    )


def test_systemd_states():
    assert parse_systemd("booted=yes\nstate=running\n").systemd_running is True
    assert parse_systemd("booted=yes\nstate=degraded\n").systemd_running is True
    assert parse_systemd("booted=yes\nstate=maintenance\n").systemd_running is False
    assert parse_systemd("booted=no\nstate=no-systemctl\n") == SystemdState(
        systemd_running=False, booted=False, systemctl_present=False, state=None
    )
    assert parse_systemd("").systemd_running is False


def test_systemd_command_without_systemctl():
    run = subprocess.run(["/bin/sh", "-c", system.SYSTEMD_COMMAND], env=NO_TOOLS, capture_output=True, text=True)
    assert run.returncode == 0
    assert parse_systemd(run.stdout).systemctl_present is False


def test_llc_this_machine():
    """cpu0's caches as sysfs gives them: the last level is L3, 32 MiB shared by both CPUs (not
    the 320 MiB `getconf LEVEL3_CACHE_SIZE` says here); an instruction cache never counts."""
    got = system.parse_llc(fixture_text("thishost-llc-sysfs-cacheinfo.txt"))
    assert got == system.LastLevelCache(available=True, level=3, size_bytes=32 * 2**20, shared_cpus="0-1")
    # an Arm board whose last level is a 2 MiB L2 (sizes in K); a line without shared_cpu_list
    arm = "level=1 type=Data size=32K shared=0\nlevel=2 type=Unified size=2048K\n"
    assert system.parse_llc(arm) == system.LastLevelCache(available=True, level=2, size_bytes=2 * 2**20)


def test_llc_absent_or_garbled_never_raises():
    for text in ("", "voltaforge: cpu cache sizes not found\n", "level=3 type=Unified size=\n", "garbage"):
        got = system.parse_llc(text)
        assert not got.available and got.size_bytes is None and got.reason
    assert "no sysfs cacheinfo" in system.parse_llc("voltaforge: cpu cache sizes not found").reason
    only_code = "level=1 type=Instruction size=32K shared=0"
    assert not system.parse_llc(only_code).available


def test_nproc_and_uname_this_machine():
    text = fixture_text("thishost-nproc-uname-m.txt")
    assert parse_nproc(text) == 2
    assert parse_uname_machine(text) == "x86_64"
    assert parse_uname_machine("arm64\n") == "aarch64"
    assert parse_uname_machine("ppc64le") == "ppc64le"
    assert parse_nproc("voltaforge: nproc not found") is None
    assert parse_uname_machine("voltaforge: uname not found") is None
    assert parse_nproc("") is None and parse_uname_machine("") is None


# --------------------------------------------------------------------------- real commands


@pytest.fixture
def local(monkeypatch):
    """This machine through the real host layer; the commands run as `bash -c COMMAND`."""
    for var in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT"):  # nproc would print these instead
        monkeypatch.delenv(var, raising=False)
    with connect(resolve_host("local")) as host:
        assert isinstance(host, LocalHost)
        yield host


def test_os_release_command_on_this_machine(local):
    want = platform.freedesktop_os_release()  # /etc/os-release, else /usr/lib/os-release
    got = parse_os_release(read_fact(local, system.OS_RELEASE_COMMAND))
    assert got == OsRelease(
        available=True,
        id=want["ID"].lower(),
        id_like=tuple(want.get("ID_LIKE", "").split()),
        version_id=want.get("VERSION_ID"),
        codename=want.get("VERSION_CODENAME") or want.get("UBUNTU_CODENAME"),
        pretty_name=want.get("PRETTY_NAME"),
    )


def test_meminfo_command_on_this_machine(local):
    got = parse_meminfo(read_fact(local, system.MEMINFO_COMMAND))
    # the kernel's total RAM through sysinfo(2), not through /proc/meminfo
    assert got.mem_total_bytes == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo = {
        k: int(v.split()[0]) * 1024
        for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    }
    assert got.available and got.mem_total_bytes == meminfo["MemTotal"]
    assert got.swap_total_bytes == meminfo["SwapTotal"]
    assert 0 < got.mem_available_bytes <= got.mem_total_bytes  # changes from one read to the next
    assert 0 <= got.swap_free_bytes <= got.swap_total_bytes


def test_nproc_command_on_this_machine(local):
    # nproc counts the CPUs this process may run on (affinity), like sched_getaffinity
    assert parse_nproc(read_fact(local, system.NPROC_COMMAND)) == len(os.sched_getaffinity(0))


def test_llc_command_on_this_machine(local):
    got = system.parse_llc(read_fact(local, system.LLC_COMMAND))
    index = [d for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*") if (d / "size").exists()]
    if not index:
        assert not got.available
        return
    kept = [d for d in index if (d / "type").read_text().strip() != "Instruction"]
    top = max(kept, key=lambda d: (int((d / "level").read_text()), int((d / "size").read_text().strip()[:-1])))
    assert got.level == int((top / "level").read_text())
    assert got.size_bytes == int((top / "size").read_text().strip().removesuffix("K")) * 1024


def test_uname_machine_command_on_this_machine(local):
    assert parse_uname_machine(read_fact(local, system.UNAME_MACHINE_COMMAND)) == platform.machine()


def test_systemd_command_on_this_machine(local):
    got = parse_systemd(read_fact(local, system.SYSTEMD_COMMAND))
    assert got.booted is os.path.isdir("/run/systemd/system")  # sd_booted(3)
    assert got.systemctl_present is bool(shutil.which("systemctl"))


def test_python_command_on_this_machine(local):
    python3 = shutil.which("python3")
    version = subprocess.run(
        [python3, "-c", "import sys; print(*sys.version_info[:3])"], capture_output=True, text=True, check=True
    ).stdout.split()
    got = parse_python_version(read_fact(local, system.PYTHON_VERSION_COMMAND))
    assert got == PythonVersion(available=True, path=python3, version=tuple(map(int, version)))
