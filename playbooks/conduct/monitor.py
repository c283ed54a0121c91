"""`invoke monitor`: one Prometheus for the fleet (steps/monitor/), its targets found the way the
balancer finds its backends (the hosts' deployment records, conduct/fleet.py's source):

- every host of the fleet: its node exporter and GPU exporter (Debian's packages; ours on its
  python3), as hardened units, or managed processes where systemd does not run;
- every running server: a llama-server under its model name, engine and service (a keyed one
  scraped with its key from a 0600 credential; each model of a router-mode set asked with
  ``autoload=false``, so no scrape ever loads one); an engine that publishes no metrics
  (TabbyAPI) named in a line, the edge's per-backend counters and the GPU exporter covering it;
- the edge: HAProxy's own exporter on its loopback stats port (templates/haproxy.cfg.j2), on
  the balancer's host, which the monitor reaches when it runs there.

Compute first: the targets and every file are decided before a host changes; a second run
changes nothing; a server added or removed changes the configuration, which Prometheus reloads
(steps/monitor/reload.py). After the run, the monitor host tries each target's port and names,
in one line each, those it cannot reach, with the address tried; Prometheus runs for the rest."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.deployed import read_deployments, recipe_file, stopped
from playbooks.conduct.fleet import same_host
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec, load_inventory
from playbooks.config.monitor_spec import MonitorSpec
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import HostError, UsageError, VoltaforgeError
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.plan.gpus import get_gpu
from playbooks.steps.monitor.edge import parse_edge_metrics
from playbooks.steps.monitor.packages import EnsurePackagesUnstarted
from playbooks.steps.monitor.reload import EnsureConfigLoaded
from playbooks.steps.monitor.rules import ServerFacts, render_rules
from playbooks.steps.monitor.scrape import Target, render_config
from playbooks.steps.monitor.staged_debs import stage_debs
from playbooks.steps.monitor.units import (
    CONFIG_DIR,
    DEBIAN_UNITS,
    GPU_UNIT,
    NODE_UNIT,
    PROMETHEUS_STATE,
    PROMETHEUS_UNIT,
    Listen,
    credential_name,
    credential_path,
    render_gpu_unit,
    render_node_unit,
    render_prometheus_unit,
)
from playbooks.steps.monitor.units_masked import EnsureUnitsMasked
from playbooks.steps.serve.balancer import CONFIG_PATH, UNIT_NAME
from playbooks.steps.serve.deploy import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.engines import server_engine
from playbooks.steps.serve.secrets import SECRETS_DIR, CheckSecret, EnsureCredentialCopy
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, parse_exec_start

#: the telemetry probe the GPU exporter imports its reason table from, shipped beside it
PROBE = Path(__file__).resolve().parents[1] / "facts" / "probes" / "telemetry_probe.py"
#: the exporter program (run on the host's python3; never imported here)
EXPORTER = Path(__file__).resolve().parents[1] / "steps" / "monitor" / "gpu_exporter.py"


def nvml_binding() -> Path:
    """NVIDIA's pynvml.py (PyPI nvidia-ml-py, a dependency of voltaforge), shipped beside the
    exporter: found through the package's own file list, never a stand-in earlier on sys.path."""
    files = importlib.metadata.files("nvidia-ml-py") or []
    found = [Path(str(f.locate())) for f in files if str(f).endswith("pynvml.py")]
    if not found:
        raise VoltaforgeError("nvidia-ml-py has no pynvml.py here: reinstall voltaforge (pip install -e .)")
    return found[0]


@dataclass(frozen=True)
class Watch:
    """`invoke monitor`'s settings: the inventory's ``monitor:`` entry, each flag given winning."""

    host: str
    hosts: tuple[str, ...]
    bind: str = "127.0.0.1"
    port: int = 9090
    exporters: str = "loopback"
    node_port: int = 9100
    gpu_port: int = 9835
    interval_s: int = 15


def watch_settings(
    entry: MonitorSpec,
    inventory: Sequence[str],
    host: str | None = None,
    hosts: Sequence[str] | None = None,
    bind: str | None = None,
    port: int | None = None,
    default_host: str | None = None,
) -> Watch:
    """The flags over the entry. The fleet: the flag's hosts, else the entry's, else every
    inventory host; the monitor's own host is always among them (its exporters too)."""
    mon = host or entry.host or default_host
    if not mon:
        raise UsageError("which host runs Prometheus: pass --host, or give the inventory a monitor: entry with host:")
    fleet = tuple(dict.fromkeys([*(hosts or entry.hosts or inventory), mon]))
    if bind is not None:
        try:
            ipaddress.ip_address(bind)
        except ValueError:
            raise UsageError(f"--bind {bind!r}: an IP address, e.g. 127.0.0.1") from None
    return Watch(
        mon,
        fleet,
        bind or entry.bind,
        port or entry.port,
        entry.exporters,
        entry.node_exporter_port,
        entry.gpu_exporter_port,
        entry.scrape_interval_s,
    )


def inventory_hosts(settings: Settings) -> list[str]:
    return list(load_inventory(settings.inventory))


@dataclass
class Found:
    """What the monitor will scrape, and what it says of what it will not."""

    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the API keys the scrapes need (api_key_ref), each a file on the monitor host
    keys: set[str] = field(default_factory=set)
    #: each server's facts for its rules (steps/monitor/rules.py)
    servers: list[ServerFacts] = field(default_factory=list)
    #: hosts that could not be reached over SSH: left out of this run, each with a note
    skipped: set[str] = field(default_factory=set)


def _reach(spec: HostSpec, mon: HostSpec, bind: str) -> str:
    """The address the monitor host reaches a part of ``spec`` at that listens on ``bind``."""
    ip = ipaddress.ip_address(bind)
    if same_host(spec, mon):
        return "127.0.0.1" if ip.is_loopback or ip.is_unspecified else bind
    return spec.host if ip.is_loopback or ip.is_unspecified else bind


def exporter_listen(spec: HostSpec, watch: Watch, port: int) -> Listen:
    """Where a host's exporter listens: loopback, or its inventory address (``exporters: address``)."""
    if watch.exporters == "loopback" or spec.local:
        return Listen("127.0.0.1", port)
    try:
        ipaddress.ip_address(spec.host)
    except ValueError:
        raise VoltaforgeError(
            f"{spec.name}: monitor exporters: address needs its inventory address to be an IP, not {spec.host!r}"
        ) from None
    return Listen(spec.host, port)


def server_facts(loaded: LoadedRecipe, host: str, service: str, in_set: bool) -> ServerFacts:
    """What a server's rules take from its recipe's gate and its plan: the single-stream decode
    floor, the plan's roofline, and what the plan puts on its GPUs (the worst card's figure for
    each card of a split: an upper bound)."""
    r = loaded.recipe
    option = next((o for o in plan_recipe(loaded).options if o.quant == r.quant_name), None)
    cpu = get_gpu(r.gpu).is_cpu
    return ServerFacts(
        host, service, r.served_name, r.gate.min_tok_s,
        option.roofline_tok_s if option and option.roofline_tok_s else None,
        0 if cpu or option is None else option.vram_bytes * max(1, r.gpu_count), in_set,
    )  # fmt: skip


def _server_target(
    spec: HostSpec, mon: HostSpec, loaded: LoadedRecipe, port: int, service: str, found: Found, model: str | None = None
) -> None:
    r = loaded.recipe
    engine = server_engine(r.backend)
    what = f"{spec.name}: {engine.engine.server_label} {r.served_name} ({service})"
    if not engine.engine.metrics_path:
        found.notes.append(
            f"{what} publishes no metrics: the edge's counters for {r.served_name} and the GPU exporter cover it"
        )
        return
    ref = r.service.api_key_ref
    if ref:
        found.keys.add(ref)
    found.servers.append(server_facts(loaded, spec.name, service, model is not None))
    found.targets.append(
        Target(
            engine.engine.server,
            f"{_reach(spec, mon, r.service.bind)}:{port}",
            (("engine", engine.engine.name), ("host", spec.name), ("model", r.served_name), ("service", service)),
            engine.engine.metrics_path,
            (("model", model), ("autoload", "false")) if model else (),
            ref,  # the file's path on the monitor host is filled in by MonitorOps
            what=what,
        )
    )


def find_targets(settings: Settings, watch: Watch) -> Found:
    """Every part of the fleet the monitor scrapes, from the hosts' deployment records (one
    connection each) and the inventory; a stopped server is left out with a line."""
    mon = settings.host_spec(watch.host)
    found = Found()
    found.targets.append(Target("prometheus", f"{_reach(mon, mon, watch.bind)}:{watch.port}", what="Prometheus"))
    for name in watch.hosts:
        spec = settings.host_spec(name)
        try:
            with settings.connect(spec) as host:
                records = [d for d in read_deployments(host, spec.prefix) if d.port is not None]
                down = {d.service for d in records if stopped(host, spec.prefix, d)}
        except HostError as exc:
            if spec.name == mon.name:
                raise
            found.skipped.add(spec.name)
            found.notes.append(f"{spec.name}: left out of this run, cannot be reached: {exc}")
            continue
        for job, port in (("node", watch.node_port), ("gpu", watch.gpu_port)):
            listen = exporter_listen(spec, watch, port)
            found.targets.append(
                Target(job, f"{_reach(spec, mon, listen.address)}:{port}", (("host", spec.name),),
                       what=f"{spec.name}: the {job} exporter")
            )  # fmt: skip
        for d in records:
            assert d.port is not None
            if d.service in down:
                found.notes.append(f"{spec.name}: {d.service} is stopped: not scraped")
            elif d.members:
                for recorded, served in zip(d.members, d.member_names, strict=True):
                    loaded = settings.load_recipe(recipe_file(recorded, spec.name))
                    _server_target(spec, mon, loaded, d.port, d.service, found, model=served)
            elif d.recipe is not None:
                loaded = settings.load_recipe(recipe_file(d.recipe, spec.name))
                _server_target(spec, mon, loaded, d.port, d.service, found)
    edge_target(settings, mon, found)
    return found


def edge_target(settings: Settings, mon: HostSpec, found: Found) -> None:
    """The edge's exporter, where the inventory's ``lb:`` entry names its host: its stats port
    read from the configuration `invoke lb` left there (loopback only: the monitor reaches it
    when it runs on the same host)."""
    lb = settings.lb()
    if not lb.host or lb.host in found.skipped:
        return
    spec = settings.host_spec(lb.host)
    with settings.connect(spec) as host:
        systemd = choose_manager(host, "auto") == "systemd"
        path = CONFIG_PATH if systemd else f"{spec.prefix}/deploy/{UNIT_NAME.removesuffix('.service')}/haproxy.cfg"
        run = host.sudo if systemd else host.run
        text = run(f"cat -- {shlex.quote(path)} 2>/dev/null || true", check=False, stream=False).stdout
    edge = parse_edge_metrics(text)
    if edge is None:
        found.notes.append(f"{spec.name}: no edge configuration at {path} (`invoke lb` deploys it): not scraped")
    elif not edge.exporter:
        found.notes.append(
            f"{spec.name}: the edge was rendered before its exporter: run `invoke lb` again to scrape it"
        )
    else:
        found.targets.append(
            Target("edge", f"{_reach(spec, mon, edge.address)}:{edge.port}", (("host", spec.name),),
                   what=f"{spec.name}: the edge (HAProxy's exporter, loopback only)")
        )  # fmt: skip


def _peers(addresses: Sequence[str]) -> list[str] | None:
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
        state = f"{prefix}/deploy/{PROMETHEUS_UNIT.removesuffix('.service')}"
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
                _peers(addresses),
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
            unit = render_prometheus_unit(listen, config, f"{state}/data", [], _peers(addresses))
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
        peers = [] if same_host(self.spec, self.monitor) else (_peers([self.monitor.host]) or [])
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
                state = f"{prefix}/deploy/{name.removesuffix('.service')}"
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
