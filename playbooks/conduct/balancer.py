"""`invoke lb`: HAProxy in front of a fleet's servers (conduct/fleet.py) on several hosts
(steps/serve/balancer.py): Debian's package, the rendered configuration and hardened unit,
started and listening; its settings the inventory's ``lb:`` entry with flags winning (Edge).

Under systemd the unit runs it (the API key a credential, its network filter systemd's). Where
systemd does not run, the unit's own command line runs as a managed process of the SSH user
(deploy's runner: steps/serve/service_manager.py), its files under ``<prefix>/deploy/
voltaforge-lb/`` and the key a private 0600 copy there, named to HAProxy by the same
``$CREDENTIALS_DIRECTORY`` the unit would set: the same configuration, not hardened by a unit."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.fleet import Fleet
from playbooks.conduct.placements import Served
from playbooks.config.inventory import HostSpec, LbSpec
from playbooks.errors import UsageError, VoltaforgeError
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.build.llamacpp_source import source_cache_dir
from playbooks.steps.build.toolchain import EnsureSystemPackages
from playbooks.steps.serve.balancer import (
    ADMIN_SOCKET,
    CONFIG_PATH,
    SOCKET_PATH_MAX,
    TLS_PATH,
    UNIT_NAME,
    Balancer,
    render_haproxy_config,
    render_lb_unit,
)
from playbooks.steps.serve.runtime_api import RuntimeApi
from playbooks.steps.serve.secrets import CheckSecret, EnsureCredentialCopy, EnsureSecretFile
from playbooks.steps.serve.service_file import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.tls import TlsPair, given_pair, kept_pair
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, parse_exec_start


@dataclass(frozen=True)
class Edge:
    """A balancer's settings: the inventory's ``lb:`` entry, each flag given winning."""

    host: str
    hosts: tuple[str, ...]
    bind: str = "127.0.0.1"
    port: int = 8000
    key_ref: str | None = None
    tls: bool | None = None
    cert: str | None = None
    key: str | None = None


def edge_settings(
    entry: LbSpec,
    host: str | None = None,
    hosts: Sequence[str] | None = None,
    bind: str | None = None,
    port: int | None = None,
    tls: bool | None = None,
    cert: str | None = None,
    key: str | None = None,
    default_host: str | None = None,
) -> Edge:
    """The flags over the ``lb:`` entry; one line when neither names the balancer's host or
    its hosts. The host: the flag's, else the entry's, else ``default_host`` (invoke.yaml's).
    A certificate given by flag replaces the entry's pair; ``--tls off`` drops it."""
    lb_host = host or entry.host or default_host
    if not lb_host:
        raise UsageError("which host runs the balancer: pass --host, or give the inventory an lb: entry with host:")
    backends = tuple(hosts or entry.hosts)
    if not backends:
        raise UsageError("which hosts it balances: pass --hosts, or give the inventory's lb: entry hosts:")
    if len(set(backends)) != len(backends):
        raise UsageError(f"--hosts {','.join(backends)}: a host is named twice")
    if cert is None and key is None and tls is not False:
        cert, key = entry.cert, entry.key
    return Edge(
        lb_host,
        backends,
        bind or entry.bind or "127.0.0.1",
        port or entry.port or 8000,
        entry.api_key_ref,
        tls if tls is not None else entry.tls,
        cert,
        key,
    )


class BalancerOps:
    """The operations of `invoke lb` on the balancer's host, for converge() (a MakeOps): every
    server of the fleet (conduct/fleet.py), grouped by model name, behind the fleet's one key;
    ``tls``: the pair HAProxy presents (edge_tls), None for plain HTTP. What the balancer's host
    serves itself does not matter: it may serve nothing. Once called, ``api`` is where its
    runtime API listens there (the backends' records name it: conduct/fronted.py)."""

    def __init__(self, edge: Edge, fleet: Fleet, tls: TlsPair | None = None):
        self.edge, self.fleet, self.tls = edge, fleet, tls
        self.api: RuntimeApi | None = None

    def __call__(self, served: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        edge, fleet, tls = self.edge, self.fleet, self.tls
        systemd = choose_manager(host, "auto") == "systemd"
        state = f"{prefix}/deploy/{UNIT_NAME.removesuffix('.service')}"
        # under systemd root reaches the socket (sudo); a managed process's is the SSH user's
        socket = ADMIN_SOCKET if systemd else f"{state}/admin.sock"
        if len(socket.encode()) <= SOCKET_PATH_MAX:
            self.api = RuntimeApi(socket, sudo=systemd)
        else:
            # the balancer still runs; only a rolling change needs the socket
            host.printer.line(
                host.name,
                f"note: no runtime API: its socket {socket} would be {len(socket.encode())} bytes, past the "
                f"{SOCKET_PATH_MAX} HAProxy takes; provision changes these servers in place (a shorter prefix "
                "on this host enables rolling changes)",
            )
        lb = Balancer(
            fleet.recipe,
            fleet.backends,
            bind=edge.bind,
            port=edge.port,
            config_path=CONFIG_PATH if systemd else f"{state}/haproxy.cfg",
            tls=tls is not None,
            admin_socket=self.api.socket if self.api else None,
        )
        config, unit = render_haproxy_config(lb), render_lb_unit(lb)
        secret = lb.api_key_file
        ops: list[Operation] = [CheckSecret(secret)] if secret else []
        ops.append(EnsureSystemPackages(("haproxy",), "the load balancer"))
        if systemd:
            ops += [
                EnsureDirectory("/etc/voltaforge/lb", 0o755, sudo=True),
                *([EnsureSecretFile(TLS_PATH, tls.pem, sudo=True)] if tls else []),
                EnsureServiceFile(ServiceFile(CONFIG_PATH, config, 0o644, sudo=True)),
                EnsureServiceFile(ServiceFile(f"{UNIT_DIR}/{UNIT_NAME}", unit, 0o644, sudo=True)),
            ]
            manager: Manager = Systemd(UNIT_NAME)
        else:
            ops += [EnsureDirectory(f"{prefix}/deploy", 0o755), EnsureDirectory(state, 0o700)]
            env: tuple[tuple[str, str], ...] = ()
            creds = f"{state}/credentials"
            if secret:
                ops.append(EnsureCredentialCopy(secret, f"{creds}/api-key", host.user))
            if tls:
                ops += [EnsureDirectory(creds, 0o700), EnsureSecretFile(f"{creds}/tls.pem", tls.pem, sudo=False)]
            if secret or tls:
                env = (("CREDENTIALS_DIRECTORY", creds),)
            ops.append(EnsureServiceFile(ServiceFile(lb.config_path, config, 0o600)))
            argv = parse_exec_start(unit)
            manager = ProcessRunner(state, argv[0], tuple(argv), env)
        ops.append(
            EnsureUnitRunning(
                UNIT_NAME,
                # a new certificate restarts it too (HAProxy reads the pair at start)
                [config, unit, tls.fingerprint if tls else ""],
                prefix,
                (lb.probe_address, edge.port),
                sudo=sudo,
                what=f"the load balancer on {edge.bind}:{edge.port}",
                manager=manager,
            )
        )
        return ops


def tls_dir(lb_host: str) -> Path:
    """Where the controller keeps a balancer's self-signed pair (beside its other caches)."""
    return source_cache_dir().parent / "lb" / lb_host


def edge_tls(lb_spec: HostSpec, bind: str, tls: bool | None, cert: str | None, key: str | None) -> TlsPair | None:
    """The pair the balancer presents, decided on the controller before any host is touched:
    the operator's (``cert`` and ``key``, checked), else a self-signed one kept for this balancer
    host; none for plain HTTP, which a bind beyond loopback gets only when asked (``tls=False``).
    ``tls`` None: TLS beyond loopback, plain on it."""
    if (cert is None) != (key is None):
        raise VoltaforgeError("--cert and --key go together: the certificate and its private key")
    use = tls if tls is not None else (cert is not None or not ipaddress.ip_address(bind).is_loopback)
    if not use:
        if cert:
            raise VoltaforgeError("--cert/--key with --no-tls: plain HTTP presents no certificate")
        return None
    if cert and key:
        return given_pair(Path(cert), Path(key))
    names = [lb_spec.host or lb_spec.name, lb_spec.name, "localhost", "127.0.0.1"]
    if not ipaddress.ip_address(bind).is_unspecified:
        names.append(bind)
    return kept_pair(tls_dir(lb_spec.name), names)


def remember_edge(lb_host: str, pair: TlsPair | None, hosts: Sequence[str] = ()) -> None:
    """What a client of this balancer needs to know (kept beside its pair on the controller):
    whether it speaks TLS, and the CA to verify it with (its self-signed certificate; an
    operator's certificate: the system's trust store); and the backend hosts it fronts, where
    its records are (its next run, `--stop` and `--remove` clear those it no longer fronts)."""
    where = tls_dir(lb_host)
    where.mkdir(parents=True, exist_ok=True)
    ca = str(where / "cert.pem") if pair and pair.origin.startswith("self-signed") else None
    (where / "edge.json").write_text(json.dumps({"tls": pair is not None, "ca": ca, "hosts": list(hosts)}) + "\n")


def _seen(lb_host: str) -> dict:
    try:
        seen = json.loads((tls_dir(lb_host) / "edge.json").read_text())
    except (OSError, ValueError):
        return {}
    return seen if isinstance(seen, dict) else {}


def fronted_hosts(lb_host: str) -> list[str]:
    """The backend hosts this balancer fronted at its last run from this controller."""
    hosts = _seen(lb_host).get("hosts")
    return [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []


def forget_edge(lb_host: str) -> None:
    """The balancer is gone: nothing to reach, no hosts fronted (its self-signed pair stays)."""
    (tls_dir(lb_host) / "edge.json").unlink(missing_ok=True)


def edge_client(lb_host: str) -> str | bool | None:
    """How to reach this balancer (remember_edge): None for plain HTTP, else what to verify its
    certificate with (a CA file, or True: the system's trust store)."""
    seen = _seen(lb_host)
    if not seen.get("tls"):
        return None
    return str(seen["ca"]) if seen.get("ca") else True
