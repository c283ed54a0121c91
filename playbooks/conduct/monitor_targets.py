"""What `invoke monitor` scrapes, found the way the balancer finds its backends (the hosts'
deployment records, conduct/fleet.py's source), before any host changes:

- every host of the fleet: its node exporter and GPU exporter;
- every running server: a llama-server under its model name, engine and service (a keyed one
  scraped with its key from a 0600 credential; each model of a router-mode set asked with
  ``autoload=false``, so no scrape ever loads one); an engine that publishes no metrics
  (TabbyAPI) named in a line, the edge's per-backend counters and the GPU exporter covering it;
  each with the facts its rules take from its recipe's gate and plan (steps/monitor/rules.py);
- the edge: HAProxy's own exporter on its loopback stats port (templates/haproxy.cfg.j2), on
  the balancer's host, which the monitor reaches when it runs there.

A stopped server is left out with a line; a fleet host that cannot be reached over SSH too, the
rest monitored."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.deployed import read_deployments, recipe_file, stopped
from playbooks.conduct.settings import Settings
from playbooks.conduct.watch import Watch, exporter_listen, reach
from playbooks.config.inventory import HostSpec
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import HostError
from playbooks.plan.gpus import get_gpu
from playbooks.steps.monitor.edge import parse_edge_metrics
from playbooks.steps.monitor.rules import ServerFacts
from playbooks.steps.monitor.scrape import Target
from playbooks.steps.serve.balancer import CONFIG_PATH, UNIT_NAME
from playbooks.steps.serve.engines import server_engine


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
        0 if cpu or option is None else option.vram_bytes * max(1, r.gpu_count), in_set, r.parallel,
        r.context * r.parallel,
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
            f"{reach(spec, mon, r.service.bind)}:{port}",
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
    found.targets.append(Target("prometheus", f"{reach(mon, mon, watch.bind)}:{watch.port}", what="Prometheus"))
    found.targets.append(
        Target("slots", f"127.0.0.1:{watch.slots_port}", what=f"{mon.name}: the slots exporter (loopback only)")
    )
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
                Target(job, f"{reach(spec, mon, listen.address)}:{port}", (("host", spec.name),),
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
            Target("edge", f"{reach(spec, mon, edge.address)}:{edge.port}", (("host", spec.name),),
                   what=f"{spec.name}: the edge (HAProxy's exporter, loopback only)")
        )  # fmt: skip
