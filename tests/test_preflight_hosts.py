"""`invoke preflight` over real SSH: the private sshd (this machine: CUDA 13 + 11.8, no GPU,
not systemd-booted) and the booted Debian 12 container (systemd, no CUDA, no GPU)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, inventory_for

pytestmark = pytest.mark.slow


def preflight(inv, *args):
    return subprocess.run([sys.executable, "-m", "invoke", "preflight", *args, "--inventory", str(inv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def checks(stdout):
    data = json.loads(stdout)
    return data, {c["name"]: c for c in data["checks"]}


def test_preflight_sshd_host_real_facts(sshd_host, tmp_path):
    inv = inventory_for(tmp_path, "box", sshd_host, prefix=str(sshd_host.prefix / "vf"))
    r = preflight(inv, "--host", "box", "--recipe", "qwen2.5-14b-v100-16gb", "--json")
    data, c = checks(r.stdout)
    facts = data["facts"]
    assert facts["os"]["id"] == "debian" and facts["os"]["version_id"] == "12"
    assert facts["gpus"]["available"] is False and facts["gpus"]["reason"]
    kinds = {(t["kind"], tuple(t["release"])) for t in facts["toolkits"] if t["release"]}
    assert ("nvcc", (11, 8)) in kinds and any(k == "nvcc" and r[0] == 13 for k, r in kinds)
    assert c["mixed-toolkits"]["status"] == "warn"
    assert c["gpu"]["status"] == "fail" and c["gpu"]["blocking"]
    assert c["systemd"]["status"] == "fail"  # this machine is not systemd-booted
    assert r.returncode == 1 and data["ok"] is False
    # the table form says the same, and what to do
    r = preflight(inv, "--host", "box", "--recipe", "qwen2.5-14b-v100-16gb")
    assert "mixed-toolkits" in r.stdout and "not ready" in r.stdout and r.returncode == 1


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
