"""`invoke monitor`'s parts, each checked by the real tool that reads it (issue 57):

- the scrape configuration passes Debian's ``promtool check config`` (which also opens every
  credentials file it names) and never holds a key;
- the three units score <= 2.0 in ``systemd-analyze security --offline=true`` and verify;
- the GPU exporter, run on this machine's python3 with Debian's python3-prometheus-client:
  with the REAL NVML binding (nvidia-ml-py's pynvml.py, shipped beside it as a host gets it) and
  no driver here it exports that it
  sees no GPU, says why, and keeps answering; with a STAND-IN pynvml module answering the
  values of real V100 captures (tests/fixtures, named where used: there is no GPU here) its
  series carry exactly those values;
- Debian's packages are installed under a policy-rc.d that forbids starting them, run for real
  in a private mount namespace, the host's own policy-rc.d put back;
- the edge's exporter port is read from a configuration the balancer's renderer wrote;
- bad inventory entries are one message naming the place.
The whole chain (Prometheus scraping keyed servers behind the TLS edge) is
tests/test_monitor_real.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from playbooks.conduct.monitor import EXPORTER, PROBE, SLOTS_EXPORTER, nvml_binding
from playbooks.conduct.watch import watch_settings
from playbooks.config.inventory import load_inventory
from playbooks.config.monitor_spec import MonitorSpec, load_monitor
from playbooks.config.recipe import load_recipe
from playbooks.errors import RecipeError, UsageError
from playbooks.facts.system import parse_os_release
from playbooks.steps.monitor.edge import parse_edge_metrics
from playbooks.steps.monitor.packages import EnsurePackagesUnstarted, PackageFacts, parse_indexed
from playbooks.steps.monitor.scrape import Target, render_config
from playbooks.steps.monitor.units import (
    SLOTS_UNIT,
    Listen,
    credential_path,
    render_gpu_unit,
    render_node_unit,
    render_prometheus_unit,
    render_slots_unit,
)
from playbooks.steps.monitor.units_masked import EnsureUnitsMasked
from playbooks.steps.serve.balancer import Backend, Balancer, render_haproxy_config
from tests.helpers import fixture_body
from tests.test_telemetry import _h100_reasons, _reasons_mask, _v100_capture
from tests.testhosts import free_port

SYSTEM_PYTHON = "/usr/bin/python3"
needs_promtool = pytest.mark.skipif(not shutil.which("promtool"), reason="needs Debian's prometheus (promtool)")
needs_systemd = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")


def _system_has(module: str) -> bool:
    return subprocess.run([SYSTEM_PYTHON, "-c", f"import {module}"], capture_output=True).returncode == 0


needs_exporter_deps = pytest.mark.skipif(
    not _system_has("prometheus_client"),
    reason="needs Debian's python3-prometheus-client (ci/install-system-deps.sh)",
)


def _targets(key_file: str) -> list[Target]:
    server = (("engine", "llamacpp"), ("host", "gpu-01"), ("model", "qwen"), ("service", "voltaforge-qwen"))
    return [
        Target("prometheus", "127.0.0.1:9090"),
        Target("node", "127.0.0.1:9100", (("host", "local"),)),
        Target("gpu", "10.0.0.5:9835", (("host", "gpu-01"),)),
        Target("llama-server", "10.0.0.5:8080", server, credentials_file=key_file),
        Target("llama-server", "127.0.0.1:8081", (("host", "local"), ("model", "open"))),
        Target("llama-server", "127.0.0.1:8090", (("host", "local"), ("model", "a")),
               params=(("model", "a"), ("autoload", "false")), credentials_file=key_file),
        Target("edge", "127.0.0.1:8404", (("host", "local"),)),
    ]  # fmt: skip


@needs_promtool
def test_the_scrape_configuration_passes_promtool_and_holds_no_key(tmp_path):
    key = tmp_path / "key-lab"
    key.write_text("s3cret-key-value\n")
    key.chmod(0o600)
    text = render_config(_targets(str(key)), 15)
    assert "s3cret" not in text
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # one job per way of asking, each series' job the kind of thing scraped
    jobs = re.findall(r"^- job_name: (\S+)", text, re.M)
    assert jobs == ["edge", "gpu", "llama-server", "llama-server-key-lab", "llama-server-key-lab-a", "node",
                    "prometheus"]  # fmt: skip
    assert text.count("replacement: llama-server") == 2
    # the same targets in another order: the same file (a second run changes nothing)
    assert render_config(list(reversed(_targets(str(key)))), 15) == text
    # a missing credentials file is promtool's one line, naming it
    path.write_text(render_config(_targets(str(tmp_path / "gone")), 15))
    r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode != 0 and "gone" in r.stdout + r.stderr


def test_a_target_with_shell_or_yaml_in_it_is_refused():
    for bad in ("10.0.0.5:80; rm", "host:port", "a b:80"):
        with pytest.raises(Exception, match="is not host:port"):
            Target("node", bad)
    with pytest.raises(Exception, match="not plain text"):
        Target("node", "127.0.0.1:1", (("model", "a\nb"),))


@needs_systemd
@pytest.mark.parametrize("which", ["prometheus", "node", "gpu", "gpu-none", "slots"])
def test_each_unit_is_hardened_and_verifies(which, tmp_path):
    if which == "prometheus":
        text = render_prometheus_unit(
            Listen("127.0.0.1", 9090), "/etc/voltaforge/monitor/prometheus.yml", "/var/lib/voltaforge-prometheus",
            [("lab", "/etc/voltaforge/secrets/lab")], ["10.0.0.5"],
        )  # fmt: skip
        assert "LoadCredential=key-lab:/etc/voltaforge/secrets/lab" in text and "IPAddressAllow=10.0.0.5" in text
        assert credential_path("lab") == "/run/credentials/voltaforge-prometheus.service/key-lab"
        assert "ExecReload=/bin/kill -HUP $MAINPID" in text
    elif which == "slots":
        program = tmp_path / "slots_exporter.py"
        shutil.copy(SLOTS_EXPORTER, program)
        text = render_slots_unit(
            Listen("127.0.0.1", 9836), str(program), "/etc/voltaforge/monitor/slots.json",
            [("lab", "/etc/voltaforge/secrets/lab")], ["10.0.0.5"],
        )  # fmt: skip
        assert "LoadCredential=key-lab:/etc/voltaforge/secrets/lab" in text and "IPAddressAllow=10.0.0.5" in text
        assert credential_path("lab", SLOTS_UNIT) == "/run/credentials/voltaforge-slots-exporter.service/key-lab"
    elif which == "node":
        text = render_node_unit(Listen("127.0.0.1", 9100))
        assert "--web.listen-address=127.0.0.1:9100" in text and "IPAddressDeny=any" in text
    else:
        devices = ["/dev/nvidia0", "/dev/nvidia1"] if which == "gpu" else []
        program = tmp_path / "gpu_exporter.py"  # where verify finds it
        shutil.copy(EXPORTER, program)
        text = render_gpu_unit(Listen("127.0.0.1", 9835), str(program), devices)
        assert ("DeviceAllow=/dev/nvidia1 rw" in text) == bool(devices)
        assert ("PrivateDevices=yes" in text) == (not devices)
    path = tmp_path / f"voltaforge-{which}.service"
    path.write_text(text)
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
    assert m and float(m.group(1)) <= 2.0, r.stdout + r.stderr
    # its executables are Debian's (ci/install-system-deps.sh installs them) and python3
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_a_gpu_unit_takes_nvidia_device_nodes_only():
    with pytest.raises(Exception, match="not an NVIDIA GPU device node"):
        render_gpu_unit(Listen("127.0.0.1", 9835), "/x/gpu_exporter.py", ["/dev/sda"])


# --------------------------------------------------------------------------- the GPU exporter


def _exporter(tmp_path: Path, standin: str | None = None) -> tuple[subprocess.Popen, str]:
    """The exporter as a host runs it: its file and the probe beside it, on the system python3."""
    where = tmp_path / "monitor"
    where.mkdir()
    shutil.copy(EXPORTER, where / "gpu_exporter.py")
    shutil.copy(PROBE, where / "telemetry_probe.py")
    env = {"PATH": "/usr/bin:/bin"}
    if standin is None:
        shutil.copy(nvml_binding(), where / "pynvml.py")  # as `invoke monitor` ships it
    else:
        mod = tmp_path / "standin"
        mod.mkdir()
        (mod / "pynvml.py").write_text(standin)
        env["PYTHONPATH"] = str(mod)
    port = free_port()
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, str(where / "gpu_exporter.py"), f"--listen=127.0.0.1:{port}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2)
            return proc, url
        except httpx.HTTPError:
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the exporter did not listen")


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("voltaforge_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@needs_exporter_deps
def test_the_gpu_exporter_with_the_real_nvml_binding_and_no_driver_keeps_running(tmp_path):
    proc, url = _exporter(tmp_path)
    try:
        for _ in range(2):  # NVML is tried again at each scrape; the process stays up
            got = _series(httpx.get(url, timeout=10).text)
            assert got["voltaforge_gpus"] == 0
            [error] = [k for k in got if k.startswith("voltaforge_nvml_error")]
            # this machine: Debian's libnvidia-ml1 and no nvidia module (tests/nvml_env.py)
            assert 'kind="no-driver"' in error or 'kind="no-nvml-library"' in error, error
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


# Only GPU VALUES are stood in for (there is no GPU here). GPU 0 answers the V100-SXM2-32GB
# nvidia-smi -q capture (temperature, power draw and its 300 W limit, SM and memory clocks, no
# retired pages pending, 0 double-bit retired pages), its memory used and total, utilization and
# uncorrected ECC count from the V100-SXM2-32GB nvidia-smi table (driver 525: 308 MiB of 32768,
# 0 %, 0), its reasons from the H100 capture with HW Thermal Slowdown set Active; it has no
# fan and no corrected-ECC or single-bit page query (NOT_SUPPORTED, as queries a card lacks are).
STANDIN = '''
"""STAND-IN pynvml written by tests/test_monitor.py: one V100 answering captured values."""
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value


def _not_supported(*args):
    raise NVMLError(3)


class _Memory:
    used = {used_mib} * MIB
    total = {total_mib} * MIB


class _Util:
    gpu = {util}


def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetName(h): return b"Tesla V100-SXM2-32GB"
def nvmlDeviceGetUUID(h): return "GPU-standin"
def nvmlDeviceGetTemperature(h, s): return {temp}
def nvmlDeviceGetPowerUsage(h): return {power_mw}
def nvmlDeviceGetEnforcedPowerLimit(h): return {limit_mw}
def nvmlDeviceGetClockInfo(h, c): return {sm} if c == NVML_CLOCK_SM else {mem}
def nvmlDeviceGetMemoryInfo(h): return _Memory()
def nvmlDeviceGetUtilizationRates(h): return _Util()
def nvmlDeviceGetCurrentClocksEventReasons(h): return {mask}
def nvmlDeviceGetTotalEccErrors(h, kind, counter):
    return {uncorrected} if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else _not_supported()
def nvmlDeviceGetRetiredPages(h, cause):
    return [0] * {double_bit} if cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else _not_supported()
def nvmlDeviceGetRetiredPagesPendingStatus(h): return {pending}
'''


def _v100_table() -> dict[str, int]:
    """Memory, utilization and uncorrected ECC from the V100-SXM2-32GB nvidia-smi table."""
    text = fixture_body("nvidia-smi-v100-sxm2-32gb-driver525.txt")
    used, total, util = map(int, re.search(r"(\d+)MiB / +(\d+)MiB \| +(\d+)%", text).groups())
    ecc = int(re.search(r"\| +(\d+) \|\n\| N/A", text).group(1))
    return {"used_mib": used, "total_mib": total, "util": util, "uncorrected": ecc}


def _v100_q() -> dict[str, float]:
    text = fixture_body("nvidia-smi-q-v100-sxm2-32gb-temp-power-clocks.txt")
    return {
        "limit_w": float(re.search(r"Enforced Power Limit +: ([\d.]+) W", text).group(1)),
        "double_bit": int(re.search(r"Double Bit ECC +: (\d+)", text).group(1)),
        "pending": re.search(r"Pending +: (\w+)", text).group(1) == "Yes",
    }


def v100_standin() -> str:
    """The stand-in's text: one V100 answering the captures above (also tests/test_top.py's)."""
    cap, table, q = _v100_capture(), _v100_table(), _v100_q()
    assert table == {"used_mib": 308, "total_mib": 32768, "util": 0, "uncorrected": 0}
    assert q == {"limit_w": 300.0, "double_bit": 0, "pending": False}
    mask = _reasons_mask(_h100_reasons(idle=False, hw_thermal=True))
    standin = STANDIN.format(
        temp=int(cap["temp"]), power_mw=int(cap["power_w"] * 1000), limit_mw=int(q["limit_w"] * 1000),
        sm=int(cap["sm"]), mem=int(cap["mem"]), mask=mask, double_bit=q["double_bit"], pending=int(q["pending"]),
        **table,
    )  # fmt: skip
    return textwrap.dedent(standin)


@needs_exporter_deps
def test_the_gpu_exporter_exports_what_a_v100_answers(tmp_path):
    proc, url = _exporter(tmp_path, v100_standin())
    try:
        got = _series(httpx.get(url, timeout=10).text)
    finally:
        proc.terminate()
        proc.wait(10)
    g = '{gpu="0"}'
    assert got["voltaforge_gpus"] == 1
    assert got[f"voltaforge_gpu_temperature_celsius{g}"] == 32
    assert got[f"voltaforge_gpu_sm_clock_hertz{g}"] == 1290e6
    assert got[f"voltaforge_gpu_memory_clock_hertz{g}"] == 877e6
    assert got[f"voltaforge_gpu_power_watts{g}"] == pytest.approx(57.44)
    assert got[f"voltaforge_gpu_power_limit_watts{g}"] == 300
    assert got[f"voltaforge_gpu_memory_used_bytes{g}"] == 308 * 2**20
    assert got[f"voltaforge_gpu_memory_total_bytes{g}"] == 32768 * 2**20
    assert got[f"voltaforge_gpu_utilization_ratio{g}"] == 0
    reasons = {k.split('reason="')[1].rstrip('"}'): v for k, v in got.items() if "clocks_event_reason{" in k}
    assert reasons["hw_thermal_slowdown"] == 1 and sum(reasons.values()) == 1 and len(reasons) == 9
    assert got['voltaforge_gpu_ecc_errors_total{gpu="0",kind="uncorrected"}'] == 0
    assert got['voltaforge_gpu_retired_pages{cause="double_bit",gpu="0"}'] == 0
    assert got[f"voltaforge_gpu_retired_pages_pending{g}"] == 0
    # what the card does not answer is said once per query, not invented
    assert got['voltaforge_gpu_query_unsupported{gpu="0",query="ecc_corrected"}'] == 1
    assert got['voltaforge_gpu_query_unsupported{gpu="0",query="retired_single_bit"}'] == 1
    assert 'voltaforge_gpu_info{gpu="0",name="Tesla V100-SXM2-32GB",uuid="GPU-standin"}' in got


# --------------------------------------------------------------------------- packages, units


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
@pytest.mark.parametrize("own_policy", [True, False])
def test_packages_are_installed_under_a_policy_that_forbids_starting_them(own_policy, tmp_path):
    """The install command, run for real in a private mount namespace whose /usr/sbin is a
    scratch directory: during the install policy-rc.d answers 101 (invoke-rc.d and
    deb-systemd-invoke start nothing); after it, the host's own policy (or none) is back."""
    op = EnsurePackagesUnstarted(("prometheus",), "the monitor")
    debian = parse_os_release('ID=debian\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nVERSION_ID="12"\n')
    decision = op.decide(PackageFacts(set(), debian))
    install = decision.commands[-1].command
    assert "apt-get install" in install
    during = tmp_path / "during"
    probe = install.replace(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus",
        f"/usr/sbin/policy-rc.d prometheus start; echo $? > {during}",
    )
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    if own_policy:
        (sbin / "policy-rc.d").write_text("#!/bin/sh\n# the host's own\nexit 0\n")
        (sbin / "policy-rc.d").chmod(0o755)
    script = f"mount --bind {sbin} /usr/sbin && {probe}"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert during.read_text().strip() == "101"
    after = sbin / "policy-rc.d"
    assert after.exists() == own_policy and (not own_policy or "the host's own" in after.read_text())


def test_a_host_without_a_package_index_gets_the_packages_staged(tmp_path):
    """What the host's apt says decides: a candidate, its mirror; none (no lists), the
    controller's staged .debs, pushed, installed with dpkg under the policy, then removed."""
    # `apt-cache policy` as Debian 12's apt prints it, with lists and without
    with_lists = "prometheus:\n  Installed: (none)\n  Candidate: 2.42.0+ds-5+deb12u1\n  Version table:\n"
    assert parse_indexed(with_lists) == {"prometheus"}
    assert parse_indexed("N: Unable to locate package prometheus\n") == set()
    assert parse_indexed("prometheus:\n  Installed: (none)\n  Candidate: (none)\n") == set()
    deb = tmp_path / "prometheus_2.42.0+ds-5+deb12u1_amd64.deb"
    deb.write_bytes(b"!<arch>\n")
    op = EnsurePackagesUnstarted(("prometheus",), "the monitor", lambda *a: [deb], "/opt/vf/monitor/debs")
    debian = parse_os_release("ID=debian\nVERSION_CODENAME=bookworm\n")
    decision = op.decide(PackageFacts(set(), debian, (deb,)))
    shown = decision.shown()
    assert "no package index: 1 packages staged from the controller" in decision.reason
    assert any(line.startswith("push ") and deb.name in line for line in shown)
    assert "dpkg -i -- /opt/vf/monitor/debs/prometheus_2.42.0+ds-5+deb12u1_amd64.deb" in shown[-2]
    assert "policy-rc.d" in shown[-2] and shown[-1] == "rm -rf -- /opt/vf/monitor/debs"
    assert op.decide(PackageFacts({"prometheus"}, debian, None)).commands == ()


def test_debian_units_are_masked_once():
    op = EnsureUnitsMasked(("prometheus.service",))
    assert op.decide({"prometheus.service": "masked"}).commands == ()
    act = op.decide({"prometheus.service": "enabled"})
    assert act.reason == "prometheus.service is enabled" and "systemctl mask -- prometheus.service" in act.shown()[0]
    with pytest.raises(ValueError):
        EnsureUnitsMasked(("x; rm -rf /",))


def test_the_edges_exporter_is_read_from_its_rendered_configuration():
    recipe = load_recipe("tiny-cpu").recipe
    lb = Balancer(recipe, (Backend("local", "127.0.0.1", 8080),), port=8000, stats_port=18404)
    edge = parse_edge_metrics(render_haproxy_config(lb))
    assert edge is not None and (edge.address, edge.port, edge.exporter) == ("127.0.0.1", 18404, True)
    older = render_haproxy_config(lb).replace(
        "    http-request use-service prometheus-exporter if { path /metrics }\n", ""
    )
    assert parse_edge_metrics(older).exporter is False
    assert parse_edge_metrics("global\n    daemon\n") is None


# --------------------------------------------------------------------------- settings


def test_the_monitor_entry_and_its_flags(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  gpu-01: {host: 10.0.0.5}\nmonitor:\n  host: local\n  exporters: address\n")
    entry = load_monitor(inv)
    assert entry == MonitorSpec(host="local", exporters="address")
    watch = watch_settings(entry, list(load_inventory(inv)))
    assert (watch.host, watch.hosts, watch.bind, watch.port) == ("local", ("gpu-01", "local"), "127.0.0.1", 9090)
    assert watch_settings(entry, ["gpu-01"], hosts=["gpu-01"], port=19090).port == 19090
    with pytest.raises(UsageError, match="which host runs Prometheus"):
        watch_settings(MonitorSpec(), [])


@pytest.mark.parametrize(
    "entry,words",
    [
        ("monitor:\n  bind: everywhere\n", "bind"),
        ("monitor:\n  exporters: all\n", "exporters"),
        ("monitor:\n  port: 0\n", "port"),
        ("monitor:\n  hosts: [a, a]\n", "named twice"),
        ("monitor:\n  scrape_every: 5\n", "scrape_every"),
    ],
)
def test_a_bad_monitor_entry_is_one_message_naming_it(entry, words, tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(entry)
    with pytest.raises(RecipeError) as exc:
        load_monitor(inv)
    assert "monitor" in str(exc.value) and words in str(exc.value) and str(inv) in str(exc.value)


@pytest.mark.parametrize("program", [EXPORTER, SLOTS_EXPORTER], ids=["gpu", "slots"])
def test_the_exporter_program_is_python_3_8(program, tmp_path):
    """It runs on the host's own python3 (Debian 11's is 3.9): no syntax newer than 3.8."""
    r = subprocess.run(
        [sys.executable, "-c", f"import ast; ast.parse(open({str(program)!r}).read(), feature_version=(3, 8))"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


@needs_exporter_deps
def test_the_slots_exporter_says_why_a_server_cannot_be_read(tmp_path):
    """The program as the monitor host runs it (system python3, Debian's client library) against
    a small HTTP server answering what a llama-server can: 401 (a wrong key), 501 (--no-slots),
    an answer that is no list; and a port nobody listens on. A keyed server gets its key from
    its file as a bearer header. (The real /slots is read in tests/test_monitor_real.py.)"""
    import http.server
    import json
    import threading

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            code, body = {"/a/slots": (401, b"{}"), "/b/slots": (501, b"{}"), "/c/slots": (200, b'{"x": 1}')}.get(
                self.path, (200, b'[{"n_prompt_tokens": 7}, {"n_ctx": 512}]')
            )
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    (tmp_path / "key").write_text("k3y\n")
    servers = [
        {"url": f"{base}/{p}", "host": "h", "model": p, "service": f"voltaforge-{p}", "key_file": None}
        for p in ("a", "b", "c")
    ] + [
        {"url": base, "host": "h", "model": "ok", "service": "voltaforge-ok", "key_file": str(tmp_path / "key")},
        {"url": f"http://127.0.0.1:{free_port()}", "host": "h", "model": "gone", "service": "voltaforge-gone",
         "key_file": None},
    ]  # fmt: skip
    (tmp_path / "servers.json").write_text(json.dumps(servers))
    shutil.copy(SLOTS_EXPORTER, tmp_path / "slots_exporter.py")
    port = free_port()
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, str(tmp_path / "slots_exporter.py"), f"--listen=127.0.0.1:{port}",
         f"--servers={tmp_path / 'servers.json'}"],
        env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                got = _series(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
        httpd.shutdown()
    errors = {k.split('kind="')[1].split('"')[0]: k.split('model="')[1].split('"')[0]
              for k in got if k.startswith("voltaforge_slots_read_error")}  # fmt: skip
    assert errors == {"http-401": "a", "http-501": "b", "bad-answer": "c", "unreachable": "gone"}
    assert got['voltaforge_kv_tokens{host="h",model="ok",service="voltaforge-ok"}'] == 7
    assert "Bearer k3y" in seen and [k for k in got if k.startswith("voltaforge_kv_tokens")] == [
        'voltaforge_kv_tokens{host="h",model="ok",service="voltaforge-ok"}'
    ]
