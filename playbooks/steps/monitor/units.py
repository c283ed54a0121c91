"""The three parts `invoke monitor` runs, each one hardened unit (templates/monitor.service.j2,
scored by systemd-analyze in tests/test_monitor.py), or where systemd does not run, the unit's
own command line as a managed process (steps/serve/service_manager.py):

- **Prometheus** (Debian's package) on the monitor host, reading its configuration from
  /etc/voltaforge/monitor/, its data in its state directory, each scrape key a credential;
  reloaded on SIGHUP (``systemctl reload``): a target added or removed is no restart.
- **the node exporter** (Debian's prometheus-node-exporter) on every host of the fleet.
- **the slots exporter** (steps/monitor/slots_exporter.py, the same python3 and client library)
  beside Prometheus: each llama-server's /slots read at scrape time (its KV cache use), with the
  keys as its own credentials.
- **the GPU exporter** (steps/monitor/gpu_exporter.py, on the host's python3 with Debian's
  python3-prometheus-client and NVIDIA's pynvml.py shipped beside it) on every host, with exactly the NVIDIA device
  nodes the host has (none: no device at all; it then says it sees no GPU).

Each listens where the inventory's ``monitor:`` entry says, loopback by default, never on every
interface unless told to; each may reach only the addresses it needs (IPAddressAllow)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.units import exec_line, render_template

PROMETHEUS_UNIT = "voltaforge-prometheus.service"
NODE_UNIT = "voltaforge-node-exporter.service"
GPU_UNIT = "voltaforge-gpu-exporter.service"
SLOTS_UNIT = "voltaforge-slots-exporter.service"
#: Debian's own units for the packages: masked under systemd, so nothing starts them beside ours
DEBIAN_UNITS = {PROMETHEUS_UNIT: "prometheus.service", NODE_UNIT: "prometheus-node-exporter.service"}
CONFIG_DIR = "/etc/voltaforge/monitor"
PROMETHEUS_BIN = "/usr/bin/prometheus"
NODE_EXPORTER_BIN = "/usr/bin/prometheus-node-exporter"
PYTHON = "/usr/bin/python3"
#: systemd's data directory for Prometheus (StateDirectory=)
PROMETHEUS_STATE = "voltaforge-prometheus"
_DEVICE = re.compile(r"^/dev/nvidia[0-9]{1,2}$")
#: each part's program: what a managed process runs, and what its pid must still be to be stopped
PROGRAMS = {PROMETHEUS_UNIT: PROMETHEUS_BIN, NODE_UNIT: NODE_EXPORTER_BIN, GPU_UNIT: PYTHON, SLOTS_UNIT: PYTHON}


def process_state(prefix: str, unit: str) -> str:
    """A part's directory where it runs as a managed process (its pid file, log, and
    Prometheus's configuration and data), as a server's is (<prefix>/deploy/<service>)."""
    return f"{prefix}/deploy/{unit.removesuffix('.service')}"


@dataclass(frozen=True)
class Listen:
    address: str
    port: int

    def __post_init__(self) -> None:
        ipaddress.ip_address(self.address)  # a bind is an address, never a name
        if not 1 <= self.port <= 65535:
            raise VoltaforgeError(f"port {self.port} out of range")

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def _allowed(listen: Listen, peers: Sequence[str] | None) -> list[str] | None:
    """IPAddressAllow beyond localhost: None (no filter) when ``peers`` is None; a part that
    listens beyond loopback also talks to those who reach it there."""
    if peers is None:
        return None
    out = [str(ipaddress.ip_address(p)) for p in peers]
    if not ipaddress.ip_address(listen.address).is_loopback:
        out.append(listen.address)
    return sorted(set(out))


def credential_name(key_ref: str) -> str:
    return f"key-{key_ref}"


def credential_path(key_ref: str, unit: str = PROMETHEUS_UNIT) -> str:
    """Where a scrape key is under systemd: the unit's credentials directory (a fixed path)."""
    return f"/run/credentials/{unit}/{credential_name(key_ref)}"


def render_prometheus_unit(
    listen: Listen,
    config: str,
    storage: str,
    keys: Sequence[tuple[str, str]],
    peers: Sequence[str] | None,
) -> str:
    """``keys``: (api_key_ref, its file on this host); ``peers``: every address it scrapes
    beyond this host (None: any, when a target is a name rather than an address)."""
    argv = [
        PROMETHEUS_BIN,
        f"--config.file={config}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address={listen}",
    ]
    return render_template(
        "monitor.service.j2",
        unit_name=PROMETHEUS_UNIT,
        description="voltaforge monitor (Prometheus)",
        documentation="https://prometheus.io/docs/prometheus/2.42/configuration/configuration/",
        exec_start=exec_line(argv),
        reload_signal="HUP",
        credentials=[(credential_name(ref), path) for ref, path in keys],
        state_directory=PROMETHEUS_STATE,
        gpu_devices=[],
        peers=_allowed(listen, peers),
    )


def render_node_unit(listen: Listen, peers: Sequence[str] = ()) -> str:
    return render_template(
        "monitor.service.j2",
        unit_name=NODE_UNIT,
        description="voltaforge node exporter (prometheus-node-exporter)",
        documentation="https://github.com/prometheus/node_exporter",
        exec_start=exec_line([NODE_EXPORTER_BIN, f"--web.listen-address={listen}"]),
        reload_signal=None,
        credentials=[],
        state_directory=None,
        gpu_devices=[],
        peers=_allowed(listen, peers),
    )


def render_gpu_unit(listen: Listen, program: str, gpu_devices: Sequence[str], peers: Sequence[str] = ()) -> str:
    bad = [d for d in gpu_devices if not _DEVICE.match(d)]
    if bad:
        raise VoltaforgeError(f"{bad[0]!r} is not an NVIDIA GPU device node")
    return render_template(
        "monitor.service.j2",
        unit_name=GPU_UNIT,
        description="voltaforge GPU exporter (NVML)",
        documentation="file://" + program,
        exec_start=exec_line([PYTHON, program, f"--listen={listen}"]),
        reload_signal=None,
        credentials=[],
        state_directory=None,
        gpu_devices=sorted(gpu_devices),
        peers=_allowed(listen, peers),
    )


def render_slots_unit(
    listen: Listen, program: str, servers_file: str, keys: Sequence[tuple[str, str]], peers: Sequence[str] | None
) -> str:
    """``keys``: (api_key_ref, its file on this host), each a credential; ``peers``: the servers'
    addresses beyond this host (None: any)."""
    return render_template(
        "monitor.service.j2",
        unit_name=SLOTS_UNIT,
        description="voltaforge slots exporter (llama-server /slots)",
        documentation="file://" + program,
        exec_start=exec_line([PYTHON, program, f"--listen={listen}", f"--servers={servers_file}"]),
        reload_signal=None,
        credentials=[(credential_name(ref), path) for ref, path in keys],
        state_directory=None,
        gpu_devices=[],
        peers=_allowed(listen, peers),
    )
