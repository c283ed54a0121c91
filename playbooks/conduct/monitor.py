"""`invoke monitor`: one Prometheus for the fleet (steps/monitor/) scraping what
conduct/monitor_targets.py found:

- on every host of the fleet: its node exporter and GPU exporter (Debian's packages; ours on
  its python3), as hardened units, or managed processes where systemd does not run;
- on the monitor host: Prometheus, its configuration and rules, each scrape key a credential;
  beside it the slots exporter, which reads each server's /slots (its KV cache use).

Compute first: the targets and every file are decided before a host changes; a second run
changes nothing; a server added or removed changes the configuration, which Prometheus reloads
(steps/monitor/reload.py). After the run, the monitor host tries each target's port and names,
in one line each, those it cannot reach, with the address tried; Prometheus runs for the rest.
`invoke monitor --stop` / `--remove`: conduct/monitor_off.py."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.fleet import same_host
from playbooks.conduct.monitor_targets import Found
from playbooks.conduct.watch import Watch, exporter_listen
from playbooks.config.inventory import HostSpec
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.monitor.packages import EnsurePackagesUnstarted
from playbooks.steps.monitor.reload import EnsureConfigLoaded
from playbooks.steps.monitor.rules import render_rules
from playbooks.steps.monitor.scrape import Target, render_config
from playbooks.steps.monitor.staged_debs import stage_debs
from playbooks.steps.monitor.units import (
    CONFIG_DIR,
    DEBIAN_UNITS,
    GPU_UNIT,
    NODE_UNIT,
    PROMETHEUS_STATE,
    PROMETHEUS_UNIT,
    SLOTS_UNIT,
    Listen,
    credential_name,
    credential_path,
    process_state,
    render_gpu_unit,
    render_node_unit,
    render_prometheus_unit,
    render_slots_unit,
)
from playbooks.steps.monitor.units_masked import EnsureUnitsMasked
from playbooks.steps.serve.secrets import SECRETS_DIR, CheckSecret, EnsureCredentialCopy
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, parse_exec_start

#: the telemetry probe the GPU exporter imports its reason table from, shipped beside it
PROBE = Path(__file__).resolve().parents[1] / "facts" / "probes" / "telemetry_probe.py"
#: the exporter programs (run on the host's python3; never imported here)
EXPORTER = Path(__file__).resolve().parents[1] / "steps" / "monitor" / "gpu_exporter.py"
SLOTS_EXPORTER = EXPORTER.with_name("slots_exporter.py")


def nvml_binding() -> Path:
    """NVIDIA's pynvml.py (PyPI nvidia-ml-py, a dependency of voltaforge), shipped beside the
    exporter: found through the package's own file list, never a stand-in earlier on sys.path."""
    files = importlib.metadata.files("nvidia-ml-py") or []
    found = [Path(str(f.locate())) for f in files if str(f).endswith("pynvml.py")]
    if not found:
        raise VoltaforgeError("nvidia-ml-py has no pynvml.py here: reinstall voltaforge (pip install -e .)")
    return found[0]


def _beyond_loopback(addresses: Sequence[str]) -> list[str] | None:
    """The addresses beyond loopback a unit may talk to; None when one is a name (no filter)."""
    out = []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a.strip("[]"))
        except ValueError:
            return None
        if not ip.is_loopback:
            out.append(str(ip))
    return out


class MonitorOps:
    """The operations on the monitor host: Prometheus installed without starting itself, its
    configuration and keys, its unit (or process), started, and the configuration loaded."""

    def __init__(self, watch: Watch, found: Found):
        self.watch, self.found = watch, found
        self.config = self.rules = ""

    def __call__(self, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        systemd = choose_manager(host, "auto") == "systemd"
        state = process_state(prefix, PROMETHEUS_UNIT)
        creds = f"{state}/credentials"
        keys = sorted(self.found.keys)
        path_of = {ref: credential_path(ref) if systemd else f"{creds}/{credential_name(ref)}" for ref in keys}
        targets = [
            t if not t.credentials_file else _with_file(t, path_of[t.credentials_file]) for t in self.found.targets
        ]
        where = CONFIG_DIR if systemd else state
        self.rules = render_rules(self.found.servers, self.watch.interval_s)
        self.config = render_config(targets, self.watch.interval_s, [f"{where}/rules.yml"])
        listen = Listen(self.watch.bind, self.watch.port)
        addresses = [t.address.rsplit(":", 1)[0] for t in targets]
        ops: list[Operation] = [CheckSecret(f"{SECRETS_DIR}/{ref}") for ref in keys]
        ops += _monitor_dirs(host, prefix, sudo)
        ops.append(EnsurePackagesUnstarted(("prometheus",), "the monitor", stage_debs, f"{prefix}/monitor/debs"))
        if systemd:
            config = f"{CONFIG_DIR}/prometheus.yml"
            unit = render_prometheus_unit(
                listen, config, f"/var/lib/{PROMETHEUS_STATE}", [(r, f"{SECRETS_DIR}/{r}") for r in keys],
                _beyond_loopback(addresses),
            )  # fmt: skip
            ops += [
                EnsureUnitsMasked((DEBIAN_UNITS[PROMETHEUS_UNIT],)),
                EnsureDirectory(CONFIG_DIR, 0o755, sudo=True),
                EnsureServiceFile(ServiceFile(f"{CONFIG_DIR}/rules.yml", self.rules, 0o644, sudo=True)),
                EnsureServiceFile(ServiceFile(config, self.config, 0o644, sudo=True)),
                EnsureServiceFile(ServiceFile(f"{UNIT_DIR}/{PROMETHEUS_UNIT}", unit, 0o644, sudo=True)),
            ]
            manager: Manager = Systemd(PROMETHEUS_UNIT)
        else:
            config = f"{state}/prometheus.yml"
            unit = render_prometheus_unit(listen, config, f"{state}/data", [], _beyond_loopback(addresses))
            ops += [EnsureDirectory(f"{prefix}/deploy", 0o755), EnsureDirectory(state, 0o700)]
            ops += [EnsureCredentialCopy(f"{SECRETS_DIR}/{r}", path_of[r], host.user) for r in keys]
            ops.append(EnsureServiceFile(ServiceFile(f"{state}/rules.yml", self.rules, 0o600)))
            ops.append(EnsureServiceFile(ServiceFile(config, self.config, 0o600)))
            argv = parse_exec_start(unit)
            manager = ProcessRunner(state, argv[0], tuple(argv), make_dirs=(f"{state}/data",))
        probe = "127.0.0.1" if ipaddress.ip_address(listen.address).is_unspecified else listen.address
        ops += [
            EnsureUnitRunning(
                PROMETHEUS_UNIT, [unit], prefix, (probe, listen.port), sudo=sudo,
                what=f"Prometheus on {listen}", manager=manager,
            ),
            EnsureConfigLoaded(config, self.config, prefix, manager, f"http://{Listen(probe, listen.port)}/metrics",
                               sudo=sudo, rules=self.rules),
        ]  # fmt: skip
        return ops + self._slots_ops(systemd, prefix, sudo, keys, path_of)

    def _slots_ops(
        self, systemd: bool, prefix: str, sudo: bool, keys: list[str], prometheus_copy: dict[str, str]
    ) -> list[Operation]:
        """The slots exporter beside Prometheus (steps/monitor/slots_exporter.py): every server
        Prometheus scrapes but a set's models (their /slots is the router's), its keys its own
        credentials under systemd, Prometheus's 0600 copies for a process of the same user."""
        servers = [t for t in self.found.targets if t.job == "llama-server" and not t.params]
        key_file = {r: credential_path(r, SLOTS_UNIT) if systemd else prometheus_copy[r] for r in keys}
        listed = [
            {"url": f"{t.scheme}://{t.address}", **dict(t.labels),
             "key_file": key_file[t.credentials_file] if t.credentials_file else None}
            for t in servers
        ]  # fmt: skip
        for entry in listed:
            entry.pop("engine", None)  # the exporter's labels: host, model, service
        text = json.dumps(listed, indent=1, sort_keys=True) + "\n"
        program = f"{prefix}/monitor/slots_exporter.py"
        state = process_state(prefix, SLOTS_UNIT)
        servers_file = f"{CONFIG_DIR}/slots.json" if systemd else f"{state}/servers.json"
        listen = Listen("127.0.0.1", self.watch.slots_port)
        used = sorted({t.credentials_file for t in servers if t.credentials_file})
        unit = render_slots_unit(
            listen, program, servers_file, [(r, f"{SECRETS_DIR}/{r}") for r in used] if systemd else [],
            _beyond_loopback([t.address.rsplit(":", 1)[0] for t in servers]),
        )  # fmt: skip
        exporter = SLOTS_EXPORTER.read_text()
        ops: list[Operation] = [EnsureServiceFile(ServiceFile(program, exporter, 0o644))]
        if systemd:
            ops += [
                EnsureServiceFile(ServiceFile(servers_file, text, 0o644, sudo=True)),
                EnsureServiceFile(ServiceFile(f"{UNIT_DIR}/{SLOTS_UNIT}", unit, 0o644, sudo=True)),
            ]
            manager: Manager = Systemd(SLOTS_UNIT)
        else:
            ops += [EnsureDirectory(state, 0o700), EnsureServiceFile(ServiceFile(servers_file, text, 0o600))]
            argv = parse_exec_start(unit)
            manager = ProcessRunner(state, argv[0], tuple(argv))
        ops.append(
            EnsureUnitRunning(
                SLOTS_UNIT, [unit, exporter, text], prefix, (listen.address, listen.port), sudo=sudo,
                what=f"the slots exporter on {listen}", manager=manager,
            )
        )  # fmt: skip
        return ops


def _monitor_dirs(host: Host, prefix: str, sudo: bool) -> list[Operation]:
    """The prefix (the SSH user's, as the build step makes it) and its monitor/ directory: the
    exporter's program and the packages staged for a host with no package index."""
    return [
        EnsureDirectory(prefix, 0o755, owner=host.user if sudo else None, sudo=sudo),
        EnsureDirectory(f"{prefix}/monitor", 0o755),
    ]


def _with_file(t: Target, path: str) -> Target:
    return Target(t.job, t.address, t.labels, t.path, t.params, path, t.scheme, what=t.what)


class ExporterOps:
    """The operations on a host of the fleet: its node exporter and GPU exporter running."""

    def __init__(self, watch: Watch, spec: HostSpec, monitor: HostSpec):
        self.watch, self.spec, self.monitor = watch, spec, monitor

    def __call__(self, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        systemd = choose_manager(host, "auto") == "systemd"
        node = exporter_listen(self.spec, self.watch, self.watch.node_port)
        gpu = exporter_listen(self.spec, self.watch, self.watch.gpu_port)
        # who scrapes them: the monitor host, over loopback or at its inventory address
        peers = [] if same_host(self.spec, self.monitor) else (_beyond_loopback([self.monitor.host]) or [])
        program_dir = f"{prefix}/monitor"
        program = f"{program_dir}/gpu_exporter.py"
        exporter, probe, nvml = EXPORTER.read_text(), PROBE.read_text(), nvml_binding().read_text()
        devices = read_fact(host, "ls -1d /dev/nvidia[0-9] /dev/nvidia[0-9][0-9] 2>/dev/null || true").split()
        units = {NODE_UNIT: render_node_unit(node, peers), GPU_UNIT: render_gpu_unit(gpu, program, devices, peers)}
        ops: list[Operation] = [
            *_monitor_dirs(host, prefix, sudo),
            EnsurePackagesUnstarted(
                ("prometheus-node-exporter", "python3-prometheus-client"),
                "the monitor's exporters",
                stage_debs,
                f"{program_dir}/debs",
            ),
            EnsureServiceFile(ServiceFile(program, exporter, 0o644)),
            EnsureServiceFile(ServiceFile(f"{program_dir}/telemetry_probe.py", probe, 0o644)),
            EnsureServiceFile(ServiceFile(f"{program_dir}/pynvml.py", nvml, 0o644)),
        ]
        if systemd:
            ops.append(EnsureUnitsMasked((DEBIAN_UNITS[NODE_UNIT],)))
        for name, unit in units.items():
            listen = node if name == NODE_UNIT else gpu
            if systemd:
                ops.append(EnsureServiceFile(ServiceFile(f"{UNIT_DIR}/{name}", unit, 0o644, sudo=True)))
                manager: Manager = Systemd(name)
            else:
                state = process_state(prefix, name)
                ops += [EnsureDirectory(f"{prefix}/deploy", 0o755), EnsureDirectory(state, 0o700)]
                argv = parse_exec_start(unit)
                manager = ProcessRunner(state, argv[0], tuple(argv))
            texts = [unit, exporter, probe, nvml] if name == GPU_UNIT else [unit]
            ops.append(
                EnsureUnitRunning(
                    name, texts, prefix, (listen.address, listen.port), sudo=sudo,
                    what=f"the {'GPU' if name == GPU_UNIT else 'node'} exporter on {listen}", manager=manager,
                )
            )  # fmt: skip
        return ops


def unreachable(host: Host, targets: Sequence[Target]) -> list[Target]:
    """The targets whose port the monitor host cannot open (3 s each, all at once)."""
    checks = []
    for i, t in enumerate(targets):
        address, port = t.address.rsplit(":", 1)
        probe = f"exec 3<>/dev/tcp/{address.strip('[]')}/{port}"
        checks.append(f"(timeout 3 bash -c {shlex.quote(probe)} 2>/dev/null || echo {i}) &")
    out = read_fact(host, "bash -c " + shlex.quote(" ".join(checks) + " wait"))
    failed = {int(w) for w in out.split() if w.isdigit()}
    return [t for i, t in enumerate(targets) if i in failed]
