"""`invoke preflight` over real SSH and on this machine. Every fact the tests assert is one the
test establishes itself, independently of voltaforge's fact commands: read from this machine
(os-release, sd_booted's /run/systemd/system, each nvcc/ptxas run for its version), or set up
by the test (a PATH with the CUDA 13 nvcc from PyPI first), so they hold on any image."""

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from playbooks.facts.cuda import STANDARD_TOOLKIT_DIRS
from tests.helpers import ROOT, inventory_for
from tests.toolkits import DEBIAN_NVCC, cuda13_first_path, needs_debian_cuda118

pytestmark = pytest.mark.slow


def preflight(inv, *args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "invoke", "preflight", *args, "--inventory", str(inv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def checks(stdout):
    data = json.loads(stdout)
    return data, {c["name"]: c for c in data["checks"]}


def cuda_releases(path: str) -> dict[str, tuple[int, int]]:
    """Every nvcc/ptxas on `path` and in the standard places, run for its release (the test's
    own scan: its own regex on `--version`, no voltaforge parser)."""
    found = {}
    dirs = [d for d in path.split(":") if d] + [d for pattern in STANDARD_TOOLKIT_DIRS for d in glob.glob(pattern)]
    for d in dirs:
        for tool in ("nvcc", "ptxas"):
            exe = os.path.join(d, tool)
            if exe in found or not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
                continue
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
            m = re.search(r"release (\d+)\.(\d+),", out)
            if m:
                found[exe] = (int(m.group(1)), int(m.group(2)))
    return found


def systemd_expected() -> str:
    """sd_booted(3): booted with systemd iff /run/systemd/system exists; then usable when
    `systemctl is-system-running` says running or degraded. Not booted with it: a warning for
    a llama.cpp recipe without an API key (deploy runs it as a managed process), as here."""
    if not os.path.isdir("/run/systemd/system"):
        return "warn"
    state = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True).stdout.strip()
    return "pass" if state in ("running", "degraded") else "fail"


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.startswith("GPU ")


def test_preflight_sshd_host_real_facts(sshd_host, tmp_path):
    """The private sshd shares this machine: its facts are this machine's, as the login
    session of its user sees them."""
    session_path = subprocess.run(
        sshd_host.ssh_command('printf %s "$PATH"'), capture_output=True, text=True, timeout=60, check=True
    ).stdout
    releases = cuda_releases(session_path)
    os_release = platform.freedesktop_os_release()

    inv = inventory_for(tmp_path, "box", sshd_host, prefix=str(sshd_host.prefix / "vf"))
    r = preflight(inv, "--host", "box", "--recipe", "qwen2.5-14b-v100-16gb", "--json")
    data, c = checks(r.stdout)
    facts = data["facts"]
    assert facts["os"]["id"] == os_release["ID"] and facts["os"]["version_id"] == os_release.get("VERSION_ID")
    assert {(t["kind"], t["path"], tuple(t["release"])) for t in facts["toolkits"] if t["release"]} == {
        (os.path.basename(exe), exe, rel) for exe, rel in releases.items()
    }
    several = len(set(releases.values())) > 1
    assert ("mixed-toolkits" in c) is several
    if several:
        assert c["mixed-toolkits"]["status"] == "warn"
    assert c["systemd"]["status"] == systemd_expected()
    assert facts["gpus"]["available"] is gpu_present()
    if not gpu_present():
        assert facts["gpus"]["reason"] and c["gpu"]["status"] == "fail" and c["gpu"]["blocking"]
        assert r.returncode == 1 and data["ok"] is False
        # the table form says the same, and what to do
        r = preflight(inv, "--host", "box", "--recipe", "qwen2.5-14b-v100-16gb")
        assert "no NVIDIA GPU visible" in r.stdout and "not ready" in r.stdout and r.returncode == 1


@needs_debian_cuda118
def test_preflight_warns_about_the_mixed_toolkits_the_test_put_on_path(tmp_path):
    """`--host local` with a PATH the test built: the CUDA 13 nvcc from PyPI first, Debian's
    CUDA 11.8 after it. The warning must name CUDA 13's ptxas as the one first on PATH."""
    path = cuda13_first_path()
    cuda13_bin = path.split(":")[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA")} | {"PATH": path}
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts: {}\n")
    r = preflight(inv, "--host", "local", "--recipe", "qwen2.5-14b-v100-16gb", "--json", env=env)
    data, c = checks(r.stdout)
    on_path = sorted(
        (t["on_path_index"], t["path"], tuple(t["release"]))
        for t in data["facts"]["toolkits"]
        if t["kind"] == "nvcc" and t["on_path_index"] is not None
    )
    assert on_path[:2] == [(0, f"{cuda13_bin}/nvcc", (13, 0)), (1, DEBIAN_NVCC, (11, 8))]
    assert c["mixed-toolkits"]["status"] == "warn"
    assert f"the ptxas first on PATH is {cuda13_bin}/ptxas (CUDA 13.0)" in c["mixed-toolkits"]["detail"]
    assert c["cuda-on-path"]["status"] == "warn" and f"{cuda13_bin}/nvcc" in c["cuda-on-path"]["detail"]
    assert c["cuda-toolkit"]["status"] == "pass" and DEBIAN_NVCC in c["cuda-toolkit"]["detail"]


def test_preflight_local_tiny_cpu_is_ready_with_or_without_systemd(tmp_path):
    """The CPU recipe needs no GPU, and without systemd deploy runs it as a managed process:
    ready here whether or not this machine was booted with systemd (then a warning)."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts: {}\n")
    r = preflight(inv, "--host", "local", "--recipe", "tiny-cpu", "--json")
    data, c = checks(r.stdout)
    assert c["systemd"]["status"] == systemd_expected() and not c["systemd"]["blocking"]
    if c["systemd"]["status"] == "warn":
        assert "managed process, not restarted at boot" in c["systemd"]["detail"]
    assert r.returncode == 0 and data["ok"], r.stdout


def test_preflight_nspawn_host_tiny_cpu_is_ready(nspawn_host, tmp_path):
    inv = inventory_for(tmp_path, "ct", nspawn_host, prefix="/opt/voltaforge-test")
    r = preflight(inv, "--host", "ct", "--recipe", "tiny-cpu", "--json")
    data, c = checks(r.stdout)
    assert c["systemd"]["status"] == "pass" and c["python"]["status"] == "pass"
    assert c["fit"]["status"] == "pass" and c["disk"]["status"] == "pass"
    assert r.returncode == 0 and data["ok"], r.stdout


def test_preflight_unknown_host_key_is_refused(sshd_host, tmp_path):
    (tmp_path / "empty_known_hosts").write_text("")
    inv = inventory_for(tmp_path, "box", sshd_host)
    inv.write_text(inv.read_text().replace(str(sshd_host.known_hosts), str(tmp_path / "empty_known_hosts")))
    r = preflight(inv, "--host", "box")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not trusted" in r.stderr and "ssh-keyscan" in r.stderr
