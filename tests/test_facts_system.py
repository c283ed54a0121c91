"""System facts against outputs captured on this machine (Debian 12 container, no systemd)."""

import subprocess

from playbooks.facts import system
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
from tests.helpers import fixture_body as fixture_text

NO_TOOLS = {"PATH": "/nonexistent-voltaforge-bin"}




def test_os_release_debian12():
    assert parse_os_release(fixture_text("thishost-os-release-debian12.txt")) == OsRelease(
        available=True, id="debian", id_like=(), version_id="12", codename="bookworm",
        pretty_name="Debian GNU/Linux 12 (bookworm)",
    )


def test_os_release_absent_and_command_fallback():
    assert parse_os_release("voltaforge: os-release not found\n").available is False
    assert parse_os_release("").reason == "no ID= line in os-release output"
    run = subprocess.run(["/bin/sh", "-c", system.OS_RELEASE_COMMAND], capture_output=True,
                         text=True)
    assert run.returncode == 0


def test_df_with_missing_paths_walked_up():
    facts = parse_df(fixture_text("thishost-df-nearest-parent.txt"))
    assert list(facts) == ["/", "/dev/shm", "/opt/voltaforge/models/qwen2.5-32b",
                           "relative/not/there", "/tmp/dir with space"]
    root = DiskFree(path="/", existing_path="/", filesystem="/dev/vda",
                    size_bytes=270553174016, used_bytes=31265845248,
                    available_bytes=77678448640, mount_point="/")
    assert facts["/"] == root
    assert facts["/dev/shm"] == DiskFree(
        path="/dev/shm", existing_path="/dev/shm", filesystem="tmpfs", size_bytes=25276059648,
        used_bytes=0, available_bytes=25276059648, mount_point="/dev/shm")
    model = facts["/opt/voltaforge/models/qwen2.5-32b"]
    assert model.existing_path == "/opt" and model.exists is False
    assert (model.available_bytes, model.mount_point) == (77678448640, "/")
    assert facts["relative/not/there"].existing_path == "."
    spaced = facts["/tmp/dir with space"]
    assert spaced.exists and spaced.available_bytes == 77678448640


def test_df_command_runs_for_real(tmp_path):
    missing = tmp_path / "not" / "yet" / "there"
    (tmp_path / "a b").mkdir()
    run = subprocess.run(["/bin/sh", "-c", disk_free_command([str(missing), str(tmp_path / "a b")])],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    facts = parse_df(run.stdout)
    assert facts[str(missing)].existing_path == str(tmp_path)
    assert facts[str(missing)].available_bytes > 0
    assert facts[str(tmp_path / "a b")].exists
    assert facts[str(tmp_path / "a b")].error is None


def test_df_error_kept_per_path():
    text = "### voltaforge-df path=/x\n### voltaforge-df existing=/x\ndf: /x: Permission denied\n"
    assert parse_df(text) == {"/x": DiskFree(path="/x", existing_path="/x",
                                             error="df: /x: Permission denied")}
    assert parse_df("") == {}


def test_meminfo_this_machine():
    assert parse_meminfo(fixture_text("thishost-proc-meminfo.txt")) == MemInfo(
        available=True, mem_total_bytes=24683652 * 1024, mem_available_bytes=24123084 * 1024,
        swap_total_bytes=0, swap_free_bytes=0,
    )
    absent = parse_meminfo("voltaforge: /proc/meminfo not found")
    assert absent.available is False and absent.reason == "no MemTotal in /proc/meminfo output"


def test_python_version_this_machine():
    assert parse_python_version(fixture_text("thishost-python3-version.txt")) == PythonVersion(
        available=True, path="/root/.pyenv/shims/python3", version=(3, 11, 7))
    assert parse_python_version("Python 3.8.18").runs_gpu_probe
    assert not parse_python_version("Python 3.6.9").runs_gpu_probe


def test_python_command_without_python3():
    run = subprocess.run(["/bin/sh", "-c", system.PYTHON_VERSION_COMMAND], env=NO_TOOLS,
                         capture_output=True, text=True)
    assert run.returncode == 0
    assert parse_python_version(run.stdout) == PythonVersion(available=False,
                                                             reason="python3 not found")


def test_systemd_not_booted_this_machine():
    assert parse_systemd(fixture_text("thishost-systemd-not-booted.txt")) == SystemdState(
        systemd_running=False, booted=False, systemctl_present=True, state="offline")


def test_systemd_states():
    assert parse_systemd("booted=yes\nstate=running\n").systemd_running is True
    assert parse_systemd("booted=yes\nstate=degraded\n").systemd_running is True
    assert parse_systemd("booted=yes\nstate=maintenance\n").systemd_running is False
    assert parse_systemd("booted=no\nstate=no-systemctl\n") == SystemdState(
        systemd_running=False, booted=False, systemctl_present=False, state=None)
    assert parse_systemd("").systemd_running is False


def test_systemd_command_without_systemctl():
    run = subprocess.run(["/bin/sh", "-c", system.SYSTEMD_COMMAND], env=NO_TOOLS,
                         capture_output=True, text=True)
    assert run.returncode == 0
    assert parse_systemd(run.stdout).systemctl_present is False


def test_nproc_and_uname_this_machine():
    text = fixture_text("thishost-nproc-uname-m.txt")
    assert parse_nproc(text) == 2
    assert parse_uname_machine(text) == "x86_64"
    assert parse_uname_machine("arm64\n") == "aarch64"
    assert parse_uname_machine("ppc64le") == "ppc64le"
    assert parse_nproc("voltaforge: nproc not found") is None
    assert parse_uname_machine("voltaforge: uname not found") is None
    assert parse_nproc("") is None and parse_uname_machine("") is None
