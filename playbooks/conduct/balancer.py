"""`invoke lb`: HAProxy in front of a recipe's servers on several hosts (steps/serve/balancer.py):
Debian's package, the rendered configuration and hardened unit, started and listening.

Under systemd the unit runs it (the API key a credential, its network filter systemd's). Where
systemd does not run, the unit's own command line runs as a managed process of the SSH user
(deploy's runner: steps/serve/service_manager.py), its files under ``<prefix>/deploy/
voltaforge-lb/`` and the key a private 0600 copy there, named to HAProxy by the same
``$CREDENTIALS_DIRECTORY`` the unit would set: the same configuration, not hardened by a unit."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from playbooks.conduct.converge import MakeOps
from playbooks.conduct.deploy import choose_manager
from playbooks.conduct.placements import Served, host_serves
from playbooks.conduct.quantize import recipe_weights
from playbooks.config.inventory import HostSpec
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.host import Host
from playbooks.host.ops import EnsureDirectory, Operation
from playbooks.steps.build.llamacpp_source import source_cache_dir
from playbooks.steps.build.toolchain import EnsureSystemPackages
from playbooks.steps.serve.balancer import (
    CONFIG_PATH,
    TLS_PATH,
    UNIT_NAME,
    Backend,
    Balancer,
    backends_for,
    render_haproxy_config,
    render_lb_unit,
)
from playbooks.steps.serve.deploy import EnsureServiceFile, ServiceFile
from playbooks.steps.serve.secrets import CheckSecret, EnsureCredentialCopy, EnsureSecretFile
from playbooks.steps.serve.service_manager import Manager, ProcessRunner, Systemd
from playbooks.steps.serve.tls import TlsPair, given_pair, kept_pair
from playbooks.steps.serve.unit_running import EnsureUnitRunning
from playbooks.steps.serve.units import UNIT_DIR, parse_exec_start


def same_host(a: HostSpec, b: HostSpec) -> bool:
    return a.name == b.name or a.host == b.host or (a.local and b.local)


def fleet_backends(
    lb_spec: HostSpec,
    backend_specs: Sequence[HostSpec],
    load: Callable[[str], LoadedRecipe],
    recipe: str | None,
    key_ref: str | None,
    default: str | None = None,
) -> tuple[Backend, ...]:
    """Every server the backend hosts serve, as the inventory places them (conduct/placements.py:
    a layout's every recipe, or the host's one recipe): each on its port, once per instance,
    under its served model name. ``recipe``: only that recipe's servers (on every host);
    ``default``: what a host that names no recipe serves (the balancer host's own).

    Refused in one line: a host that serves nothing; one model name from two different base
    models (two quants of one model share a name, two models must not); a backend whose key
    is not the balancer's (``key_ref``: the edge checks one key and forwards it)."""
    backends: list[Backend] = []
    weights: dict[str, set[str]] = {}
    for s in backend_specs:
        theirs = host_serves(s, recipe, load, default)
        if not theirs:
            raise VoltaforgeError(f"{s.name}: serves no recipe (give it one in the inventory, or pass --recipe)")
        for there in theirs:
            r = there.loaded.recipe
            if r.service.api_key_ref != key_ref:
                raise VoltaforgeError(
                    f"{s.name}: {r.name} takes the key {r.service.api_key_ref or '(none)'}, the balancer's edge "
                    f"checks {key_ref or '(none)'}: every backend must accept the balancer's key (one api_key_ref)"
                )
            weights.setdefault(r.served_name, set()).add(recipe_weights(there.loaded).model_id)
            backends += backends_for(r, [(s.name, s.host, same_host(s, lb_spec), there.ports())])
    for name, ids in weights.items():
        if len(ids) > 1:
            raise VoltaforgeError(
                f"model name {name} is served from {len(ids)} different base models ({', '.join(sorted(ids))}): "
                "give each its own service.model_name"
            )
    return tuple(backends)


def balancer_ops_maker(
    lb_spec: HostSpec,
    backend_specs: Sequence[HostSpec],
    bind: str,
    port: int,
    load: Callable[[str], LoadedRecipe],
    recipe: str | None = None,
    tls: TlsPair | None = None,
) -> MakeOps:
    """The operations of `invoke lb` on the balancer's host, for converge(): every server the
    backend hosts serve (fleet_backends), grouped by model name; ``recipe``: that recipe's only.
    The balancer host's own recipe gives the edge its key; ``tls``: the pair HAProxy presents
    (edge_tls), None for plain HTTP."""

    def make(served: Served, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        loaded = served.loaded
        key = loaded.recipe.service.api_key_ref
        backends = fleet_backends(lb_spec, backend_specs, load, recipe, key, str(loaded.path))
        systemd = choose_manager(host, "auto") == "systemd"
        state = f"{prefix}/deploy/{UNIT_NAME.removesuffix('.service')}"
        lb = Balancer(
            loaded.recipe,
            backends,
            bind=bind,
            port=port,
            config_path=CONFIG_PATH if systemd else f"{state}/haproxy.cfg",
            tls=tls is not None,
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
                (lb.probe_address, port),
                sudo=sudo,
                what=f"the load balancer on {bind}:{port}",
                manager=manager,
            )
        )
        return ops

    return make


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


def remember_edge(lb_host: str, pair: TlsPair | None) -> None:
    """What a client of this balancer needs to know (kept beside its pair on the controller):
    whether it speaks TLS, and the CA to verify it with (its self-signed certificate; an
    operator's certificate: the system's trust store)."""
    where = tls_dir(lb_host)
    where.mkdir(parents=True, exist_ok=True)
    ca = str(where / "cert.pem") if pair and pair.origin.startswith("self-signed") else None
    (where / "edge.json").write_text(json.dumps({"tls": pair is not None, "ca": ca}) + "\n")


def edge_client(lb_host: str) -> str | bool | None:
    """How to reach this balancer (remember_edge): None for plain HTTP, else what to verify its
    certificate with (a CA file, or True: the system's trust store)."""
    try:
        seen = json.loads((tls_dir(lb_host) / "edge.json").read_text())
    except (OSError, ValueError):
        return None
    if not seen.get("tls"):
        return None
    return str(seen["ca"]) if seen.get("ca") else True
