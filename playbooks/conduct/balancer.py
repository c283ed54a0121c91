"""`invoke lb`: HAProxy in front of a recipe's servers on several hosts (steps/serve/balancer.py):
Debian's package, the rendered configuration and hardened unit, started and listening.

Under systemd the unit runs it (the API key a credential, its network filter systemd's). Where
systemd does not run, the unit's own command line runs as a managed process of the SSH user
(deploy's runner: steps/serve/service_manager.py), its files under ``<prefix>/deploy/
voltaforge-lb/`` and the key a private 0600 copy there, named to HAProxy by the same
``$CREDENTIALS_DIRECTORY`` the unit would set: the same configuration, not hardened by a unit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from playbooks.conduct.converge import MakeOps
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.placements import Served, host_serves
from playbooks.config.inventory import HostSpec
from playbooks.config.recipe import LoadedRecipe
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.build.toolchain import EnsureSystemPackages
from playbooks.steps.serve.balancer import (
    CONFIG_PATH,
    UNIT_NAME,
    Balancer,
    backends_for,
    render_haproxy_config,
    render_lb_unit,
)
from playbooks.steps.serve.deploy import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.secrets import CheckSecret, EnsureCredentialCopy
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, parse_exec_start


def same_host(a: HostSpec, b: HostSpec) -> bool:
    return a.name == b.name or a.host == b.host or (a.local and b.local)


def balancer_ops_maker(
    lb_spec: HostSpec, backend_specs: Sequence[HostSpec], bind: str, port: int, load: Callable[[str], LoadedRecipe]
) -> MakeOps:
    """The operations of `invoke lb` on the balancer's host, for converge(). Each backend host
    serves the recipe as it places it (conduct/placements.py): on its layout's port, and once
    per instance where it runs one per GPU."""

    def make(served: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        loaded = served.loaded
        hosts = []
        for s in backend_specs:
            [there] = host_serves(s, loaded.recipe.name, load, loaded.recipe.name)
            hosts.append((s.name, s.host, same_host(s, lb_spec), there.ports()))
        backends = backends_for(loaded.recipe, hosts)
        systemd = choose_manager(host, "auto") == "systemd"
        state = f"{prefix}/deploy/{UNIT_NAME.removesuffix('.service')}"
        lb = Balancer(
            loaded.recipe,
            backends,
            bind=bind,
            port=port,
            config_path=CONFIG_PATH if systemd else f"{state}/haproxy.cfg",
        )
        config, unit = render_haproxy_config(lb), render_lb_unit(lb)
        secret = lb.api_key_file
        ops: list[Operation] = [CheckSecret(secret)] if secret else []
        ops.append(EnsureSystemPackages(("haproxy",), "the load balancer"))
        if systemd:
            ops += [
                EnsureDirectory("/etc/voltaforge/lb", 0o755, sudo=True),
                EnsureServiceFile(ServiceFile(CONFIG_PATH, config, 0o644, sudo=True)),
                EnsureServiceFile(ServiceFile(f"{UNIT_DIR}/{UNIT_NAME}", unit, 0o644, sudo=True)),
            ]
            manager: Manager = Systemd(UNIT_NAME)
        else:
            ops += [EnsureDirectory(f"{prefix}/deploy", 0o755), EnsureDirectory(state, 0o700)]
            env: tuple[tuple[str, str], ...] = ()
            if secret:
                ops.append(EnsureCredentialCopy(secret, f"{state}/credentials/api-key", host.user))
                env = (("CREDENTIALS_DIRECTORY", f"{state}/credentials"),)
            ops.append(EnsureServiceFile(ServiceFile(lb.config_path, config, 0o600)))
            argv = parse_exec_start(unit)
            manager = ProcessRunner(state, argv[0], tuple(argv), env)
        ops.append(
            EnsureUnitRunning(
                UNIT_NAME,
                [config, unit],
                prefix,
                (lb.probe_address, port),
                sudo=sudo,
                what=f"the load balancer on {bind}:{port}",
                manager=manager,
            )
        )
        return ops

    return make
