"""`invoke monitor` under systemd, on a host with no package index (issue 57): a booted Debian 12
container (its own, not the session's shared one: it installs packages), reached over SSH,
whose apt knows no package (debootstrap leaves no lists; the container has no network).

Held: the dry run says the packages are staged from the controller and installs nothing; the
run stages them on this controller (its apt resolves what the container lacks against the
container's own dpkg database), pushes them, installs them with dpkg under a policy that keeps
them from starting; Debian's own units are masked; the three voltaforge units are active,
unprivileged, and score <= 2.0 in systemd's LIVE exposure analysis of the running units; only
127.0.0.1 listens on their ports; Prometheus has all three targets up (the GPU exporter saying
it sees no GPU); a second run changes nothing; a changed scrape interval is a reload of the same
process (``systemctl reload``: its MainPID unchanged)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from playbooks.cli.monitor import run_monitor
from playbooks.conduct.settings import Settings
from tests.helpers import host_entry
from tests.test_balancer_real import wait_for
from tests.testhosts import start_nspawn_host

pytestmark = pytest.mark.slow
UNITS = (
    "voltaforge-prometheus.service",
    "voltaforge-node-exporter.service",
    "voltaforge-gpu-exporter.service",
    "voltaforge-slots-exporter.service",
)
PORTS = (9090, 9100, 9835, 9836)

# run by the container's python3: Prometheus's targets, as (job, health) pairs
TARGETS = (
    "import json, urllib.request; d = json.load(urllib.request.urlopen('http://127.0.0.1:9090/api/v1/targets'));"
    "print(json.dumps(sorted((t['labels']['job'], t['health']) for t in d['data']['activeTargets'])))"
)


@pytest.mark.timeout(900)
def test_monitor_under_systemd_on_a_host_without_a_package_index(tmp_path, capsys):
    box = start_nspawn_host(tmp_path / "nspawn")
    try:
        inv = tmp_path / "inventory.yaml"

        def write(interval: int) -> None:
            inv.write_text(yaml.safe_dump({
                "hosts": {"box": host_entry(box) | {"prefix": str(box.prefix)}},
                "monitor": {"host": "box", "scrape_interval_s": interval},
            }))  # fmt: skip

        write(1)
        settings = Settings(inventory=inv)

        def on_box(command: str) -> str:
            with settings.connect(settings.host_spec("box")) as h:
                return h.sudo(command, check=False, stream=False).stdout

        assert "Candidate" not in on_box("LC_ALL=C apt-cache policy prometheus 2>&1")  # no package index
        assert run_monitor(settings=settings, dry_run=True) == 0
        out = capsys.readouterr().out
        assert "no package index" in out and "staged from the controller" in out, out[-3000:]
        assert "install ok installed" not in on_box("dpkg-query -W -f='${Status}' prometheus 2>&1")

        assert run_monitor(settings=settings) == 0, capsys.readouterr().out[-5000:]
        capsys.readouterr()
        assert on_box(f"systemctl is-active {' '.join(UNITS)}").split() == ["active"] * 4
        masked = on_box("systemctl is-enabled prometheus.service prometheus-node-exporter.service 2>&1").split()
        assert masked == ["masked", "masked"]
        listening = on_box("ss -Hltn").split("\n")
        for port in PORTS:
            binds = sorted(
                {line.split()[3] for line in listening if line.split() and line.split()[3].endswith(f":{port}")}
            )
            assert binds == [f"127.0.0.1:{port}"], (port, listening)
        for unit in UNITS:
            user = on_box(f"systemctl show -p User -p DynamicUser --value {unit}").split()
            assert "yes" in user, (unit, user)
            live = on_box(f"systemd-analyze security --no-pager {unit} 2>&1")
            m = re.search(r"Overall exposure level for \S+: ([\d.]+)", live)
            assert m and float(m.group(1)) <= 2.0, live[-2000:]
        wait_for(lambda: json.loads(on_box(f"python3 -c \"{TARGETS}\"")) ==
                 [["gpu", "up"], ["node", "up"], ["prometheus", "up"], ["slots", "up"]], 30)  # fmt: skip
        gpus = on_box(
            "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9835/metrics').read().decode())\""
        )
        assert "voltaforge_gpus 0.0" in gpus and 'voltaforge_nvml_error{kind="' in gpus

        assert run_monitor(settings=settings) == 0
        assert "box: 0 changed" in capsys.readouterr().out

        pid = on_box("systemctl show -p MainPID --value voltaforge-prometheus.service").strip()
        write(2)
        assert run_monitor(settings=settings) == 0
        out = capsys.readouterr().out
        assert re.search(r"box: 2 changed, \d+ ok, 0 failed", out), out[-3000:]
        assert on_box("systemctl show -p MainPID --value voltaforge-prometheus.service").strip() == pid
        assert "scrape_interval: 2s" in on_box("cat /etc/voltaforge/monitor/prometheus.yml")

        # --remove: the three stopped, disabled and gone with their configuration and data;
        # Debian's packages and the masks on its own units stay (nothing may start on :9090)
        assert run_monitor(settings=settings, remove=True) == 0
        assert re.search(r"box: 5 changed, 0 ok, 0 failed", capsys.readouterr().out)
        assert on_box(f"systemctl is-active {' '.join(UNITS)}").split() == ["inactive"] * 4
        left = on_box(
            f"ls -d /etc/systemd/system/voltaforge-* /etc/voltaforge/monitor /var/lib/voltaforge-prometheus "
            f"/var/lib/private/voltaforge-prometheus {box.prefix}/monitor 2>/dev/null"
        )
        assert left.strip() == "", left
        masked = on_box("systemctl is-enabled prometheus.service prometheus-node-exporter.service 2>&1").split()
        assert masked == ["masked", "masked"]
        assert "install ok installed" in on_box("dpkg-query -W -f='${Status}' prometheus 2>&1")
        assert not [line for line in on_box("ss -Hltn").split("\n") if ":9090 " in line or ":9100 " in line]
        assert run_monitor(settings=settings, remove=True) == 0
        assert "box: 0 changed, 5 ok, 0 failed" in capsys.readouterr().out
    finally:
        box.close()
