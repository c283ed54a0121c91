"""One endpoint in front of every llama-server of a recipe: HAProxy, from Debian's package, as
a hardened systemd unit (`invoke lb`).

Why HAProxy and not nginx: its health checks are active (it asks each server's /health every
couple of seconds, so a dead or still-loading server leaves the rotation before a user's
request finds it, and comes back on its own), open source nginx checks passively only (a
server is marked down after requests to it failed). HAProxy relays a streamed response event by
event with `option http-no-delay` (without it, measured: bursts; scripts/bench_lb_stream.py),
and it retries a connection a server refused
on another server (`retries` + `option redispatch`), which is what a restarting llama-server
does. Its stats page (loopback only) gives each server's state and request count, which
`invoke status` reads.

The API key, when the recipe has one, is checked at the edge from a systemd credential (never
in the configuration), and passed on to the servers, which check it again.
"""

from __future__ import annotations

import csv
import ipaddress
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from playbooks.config.recipe import SERVED_NAME_RE, Recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.units import ServerLayout, render_template

UNIT_NAME = "voltaforge-lb.service"
#: each served model is one HAProxy backend, named this and the model's name
BACKEND_PREFIX = "model_"
CONFIG_PATH = "/etc/voltaforge/lb/haproxy.cfg"
#: HAProxy's runtime API under systemd (the unit's RuntimeDirectory=, owned by its dynamic
#: user, mode 600: root reaches it through sudo); a managed process keeps it in its state dir
ADMIN_SOCKET = "/run/voltaforge-lb/admin.sock"
#: what HAProxy takes for a Unix socket's path: sun_path's 108 bytes, less the NUL and the
#: ".<pid>.tmp" it binds first and renames (measured, HAProxy 2.6: 97 parses, 98 is "too long")
SOCKET_PATH_MAX = 97
#: the edge's certificate and key (one PEM, root, 0600), loaded as a credential
TLS_PATH = "/etc/voltaforge/lb/tls.pem"
#: where the loopback-only stats page listens (per-server state and counters)
STATS_PORT = 8404
CHECK_INTERVAL_MS = 2000
#: a request waits this long in the balancer's queue when every server is busy (then: 503)
QUEUE_TIMEOUT_S = 60
#: what the 503 after the queue tells a client to wait before trying again
RETRY_AFTER_S = 10
#: JSON bytes per token of a request body, as the edge sizes its buffer (issue 32: about 4)
BODY_BYTES_PER_TOKEN = 4
#: what a request's headers (and HAProxy's rewrites) may take of the buffer besides the body
HEADER_ROOM = 16384
_SERVER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# an IPv4 address or a DNS name HAProxy resolves at start (IPv6 backends are not rendered)
_ADDRESS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Backend:
    """One llama-server the balancer sends requests to."""

    name: str  # inventory host, with the instance: "gpu-01" or "gpu-01-gpu1"
    address: str  # an IPv4 address or host name the balancer reaches it at
    port: int
    #: requests it runs at once (its slots, llama-server --parallel): HAProxy's maxconn, so the
    #: next request waits in the balancer's queue for any server of the model, not in this one
    slots: int = 1
    #: the model it serves, by its served name ("": the balancer recipe's); requests are routed
    #: by the `model` their JSON names
    model: str = ""
    #: the tokens one slot takes (the recipe's context): sizes the request bodies the edge reads
    context: int = 0

    def __post_init__(self) -> None:
        if not _SERVER_NAME.match(self.name):
            raise VoltaforgeError(f"backend name {self.name!r}: letters, digits and . _ - only")
        if not _ADDRESS.match(self.address):
            raise VoltaforgeError(f"backend {self.name}: {self.address!r} is not an IPv4 address or a host name")
        if not 1 <= self.port <= 65535:
            raise VoltaforgeError(f"backend {self.name}: port {self.port} out of range")
        if not 1 <= self.slots <= 4096:
            raise VoltaforgeError(f"backend {self.name}: {self.slots} slots: want 1 to 4096")
        if self.model and not SERVED_NAME_RE.fullmatch(self.model):
            raise VoltaforgeError(f"backend {self.name}: model name {self.model!r} cannot be routed")


@dataclass(frozen=True)
class Balancer:
    """Where the balancer listens, and for whom."""

    recipe: Recipe
    backends: tuple[Backend, ...]
    bind: str = "127.0.0.1"
    port: int = 8000
    stats_port: int = STATS_PORT
    config_path: str = CONFIG_PATH
    #: how long a request may wait at the edge for a free slot before a 503 with Retry-After
    queue_timeout_s: int = QUEUE_TIMEOUT_S
    #: HTTPS at the edge (the pair from steps/serve/tls.py); plain HTTP beyond loopback only
    #: when the operator says so (``invoke lb --no-tls``)
    tls: bool = False
    #: HAProxy's runtime API (drain a server, put it back: conduct/roll.py), owner-only; None:
    #: none (a balancer that no rolling change drives: the benchmarks' and demos')
    admin_socket: str | None = None

    def __post_init__(self) -> None:
        if not self.backends:
            raise VoltaforgeError("a balancer needs at least one backend (--hosts)")
        names = [(self.model_of(b), b.name) for b in self.backends]
        if len(set(names)) != len(names):
            twice = sorted({n for m, n in names if names.count((m, n)) > 1})
            raise VoltaforgeError(f"backends named twice: {', '.join(twice)}")
        ip = ipaddress.ip_address(self.bind)
        if not ip.is_loopback and not self.recipe.service.api_key_ref:
            raise VoltaforgeError(
                f"a balancer on {self.bind} (not loopback) needs an API key (its backends' service.api_key_ref): "
                "the key is checked at the edge"
            )
        if self.admin_socket and len(self.admin_socket.encode()) > SOCKET_PATH_MAX:
            raise VoltaforgeError(
                f"the balancer's runtime API socket {self.admin_socket} is {len(self.admin_socket.encode())} bytes "
                f"long, past the {SOCKET_PATH_MAX} a Unix socket's path holds: give its host a shorter prefix"
            )
        if self.port == self.stats_port:
            raise VoltaforgeError(f"port {self.port} is the stats page's; give the balancer another (--port)")

    def model_of(self, backend: Backend) -> str:
        return backend.model or self.recipe.served_name

    @property
    def models(self) -> dict[str, tuple[Backend, ...]]:
        """The served model names, each with its servers (in the order given)."""
        return by_model(self.backends, self.recipe.served_name)

    @property
    def body_limit(self) -> int:
        """The largest request body the edge reads for its `model`: about 4 bytes of JSON per
        token of the largest context served (a full prompt), never under 16 KiB. Beyond it: 413."""
        tokens = max(b.context or self.recipe.context for b in self.backends)
        return max(BODY_BYTES_PER_TOKEN * tokens, 16384)

    @property
    def bufsize(self) -> int:
        """HAProxy's tune.bufsize: the body limit and room for the headers, in 4 KiB steps."""
        return -(-(self.body_limit + HEADER_ROOM) // 4096) * 4096

    @property
    def api_key_file(self) -> str | None:
        return ServerLayout().api_key_file(self.recipe)

    @property
    def probe_address(self) -> str:
        """Where a check on its own host reaches it: its address, or loopback when it binds all."""
        ip = ipaddress.ip_address(self.bind)
        if ip.is_unspecified:
            return "::1" if ip.version == 6 else "127.0.0.1"
        return self.bind

    @property
    def loopback_only(self) -> bool:
        return ipaddress.ip_address(self.bind).is_loopback

    @property
    def peers(self) -> list[str]:
        """The backends' addresses a loopback-only balancer must still reach."""
        return sorted({b.address for b in self.backends if b.address != "127.0.0.1"})


def by_model(backends: Sequence[Backend], default: str = "") -> dict[str, tuple[Backend, ...]]:
    """The backends grouped by the model each serves (``default``: a backend that names none),
    models and servers in the order given."""
    out: dict[str, list[Backend]] = {}
    for b in backends:
        out.setdefault(b.model or default, []).append(b)
    return {m: tuple(bs) for m, bs in out.items()}


def backends_for(recipe: Recipe, hosts: Sequence[tuple[str, str, bool, Sequence[int]]]) -> tuple[Backend, ...]:
    """One backend per server: each host (inventory name, address, whether it is the balancer's
    own host, the ports its instances of the recipe listen on: one, or one per GPU) gives one
    per port, named ``host`` or ``host-port``. The balancer's own host is reached on loopback; another
    host at its inventory address, which needs the server to listen beyond loopback (and so
    an API key: the recipe schema asks for one)."""
    bind = ipaddress.ip_address(recipe.service.bind)
    out = []
    for name, address, same_host, ports in hosts:
        if same_host:
            target = "127.0.0.1" if bind.is_loopback or bind.is_unspecified else str(bind)
        elif bind.is_loopback:
            raise VoltaforgeError(
                f"{name}: recipe {recipe.name} serves on {recipe.service.bind} only, which a balancer on another "
                "host cannot reach; give it service.bind 0.0.0.0 (or the host's address) and service.api_key_ref"
            )
        else:
            target = address
        out += [
            Backend(
                name if len(ports) == 1 else f"{name}-{port}", target, port, recipe.parallel,
                recipe.served_name, recipe.context,
            )
            for port in ports
        ]  # fmt: skip
    return tuple(out)


def render_haproxy_config(lb: Balancer) -> str:
    return render_template(
        "haproxy.cfg.j2",
        name=lb.config_path,
        bind=lb.bind,
        port=lb.port,
        api_key=bool(lb.api_key_file),
        tls=lb.tls,
        check_interval_ms=CHECK_INTERVAL_MS,
        queue_timeout_s=lb.queue_timeout_s,
        retry_after_s=RETRY_AFTER_S,
        models=lb.models,
        models_json=_models_json(lb),
        body_limit=lb.body_limit,
        bufsize=lb.bufsize,
        stats_port=lb.stats_port,
        admin_socket=lb.admin_socket,
    )


def _models_json(lb: Balancer) -> str:
    """GET /v1/models as the edge answers it (OpenAI's list shape), escaped for HAProxy's
    double-quoted string."""
    body = json.dumps(
        {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "voltaforge"} for m in lb.models]},
        separators=(",", ":"),
    )
    return body.replace("\\", "\\\\").replace('"', '\\"')


def render_lb_unit(lb: Balancer) -> str:
    return render_template(
        "haproxy-lb.service.j2",
        unit_name=UNIT_NAME,
        recipe=lb.recipe.name,
        config=lb.config_path,
        api_key_file=lb.api_key_file,
        tls_file=TLS_PATH if lb.tls else None,
        loopback_only=lb.loopback_only,
        peers=lb.peers,
        runtime_dir=lb.admin_socket == ADMIN_SOCKET,
    )


# ------------------------------------------------------------------------------------------
# its stats page, read back
# ------------------------------------------------------------------------------------------


def stats_command(stats_port: int = STATS_PORT) -> str:
    return f"curl -sf -m 5 'http://127.0.0.1:{stats_port}/stats;csv' 2>/dev/null || true"


@dataclass(frozen=True)
class ServerStat:
    name: str
    status: str  # UP, DOWN, "UP 1/2" (going down), MAINT, no check
    requests: int  # HTTP requests it answered (hrsp_* summed) or sessions when absent
    check: str  # the last health check's result, e.g. L7OK, L4CON
    model: str = ""  # the served model name whose backend it is in
    in_flight: int = 0  # requests it runs now and those queued for it (scur + qcur)

    @property
    def up(self) -> bool:
        return self.status.startswith("UP")


def parse_stats(output: str, model: str | None = None) -> list[ServerStat]:
    """The servers of every model's backend (``model``: of that one) from HAProxy's CSV stats
    (garbage: none, never an exception)."""
    text = output.lstrip("# ")
    servers = []
    for row in csv.DictReader(text.splitlines()):
        px = row.get("pxname") or ""
        # "llama": the one backend of a balancer rendered before models were routed (still
        # running on hosts until `invoke lb` runs again)
        if not (px.startswith(BACKEND_PREFIX) or px == "llama") or row.get("svname") in ("FRONTEND", "BACKEND", None):
            continue
        if model is not None and px != BACKEND_PREFIX + model:
            continue
        total = row.get("stot") or "0"
        now = [row.get(k) or "0" for k in ("scur", "qcur")]
        servers.append(
            ServerStat(
                name=row.get("svname") or "",
                status=row.get("status") or "",
                requests=int(total) if total.isdigit() else 0,
                check=row.get("check_status") or "",
                model=px.removeprefix(BACKEND_PREFIX),
                in_flight=sum(int(n) for n in now if n.isdigit()),
            )
        )
    return servers
