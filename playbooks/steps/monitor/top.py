"""What `invoke top` shows, made from Prometheus's answers: pure, so the same answers give the
same view (tests/test_top.py feeds it what a real exporter and a real Prometheus said).

Per server (a llama-server target of the monitor): its state (its scrape ``up``), the tokens/s
it serves and one stream's decode rate while it generates (the recording rules of
steps/monitor/rules.py), its slots busy against the slots its recipe gives it, requests it
deferred, requests waiting at the edge for its model, and the share of its planned KV cache its
slots hold (the slots exporter's reading of its /slots). Per GPU (the GPU exporter): name, SM
clock, temperature, power against its limit, utilization, memory, and each power or thermal
reason holding its clocks down (the alert's, rules.HELD). A host whose exporter sees no GPU is
one line, with NVML's own word for why.

Where a server sits on a host's GPUs is not in Prometheus's labels (a host's servers share its
exporter), so GPUs are their own rows under their host rather than columns of a server.
A set's models show no KV use (their /slots is the router's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from playbooks.steps.monitor.rules import HELD

#: what `invoke top` asks Prometheus, each an instant query (its name -> PromQL)
QUERIES: dict[str, str] = {
    "up": 'up{job="llama-server"}',
    "tok_s": "voltaforge:decode_tok_s:server",
    "stream": "voltaforge:decode_tok_s:stream",
    "busy": 'llamacpp:requests_processing{job="llama-server"}',
    "deferred": 'llamacpp:requests_deferred{job="llama-server"}',
    "slots": "voltaforge:slots",
    "kv": "voltaforge:kv_use",
    "edge": "voltaforge:waiting:edge",
    "gpus": "voltaforge_gpus",
    "nvml": "voltaforge_nvml_error == 1",
    "info": "voltaforge_gpu_info",
    "sm": "voltaforge_gpu_sm_clock_hertz",
    "temp": "voltaforge_gpu_temperature_celsius",
    "power": "voltaforge_gpu_power_watts",
    "limit": "voltaforge_gpu_power_limit_watts",
    "util": "voltaforge_gpu_utilization_ratio",
    "used": "voltaforge_gpu_memory_used_bytes",
    "total": "voltaforge_gpu_memory_total_bytes",
    "held": "voltaforge_gpu_clocks_event_reason == 1",
}

#: one answer: a series' labels and its value
Sample = tuple[Mapping[str, str], float]


@dataclass(frozen=True)
class ServerRow:
    host: str
    model: str
    service: str
    up: bool
    tok_s: float | None
    stream_tok_s: float | None
    busy: int | None
    slots: int | None
    deferred: int | None
    edge_waiting: int | None
    #: the share of the KV cache its plan gives it that its slots hold
    kv_use: float | None = None


@dataclass(frozen=True)
class GpuRow:
    host: str
    gpu: str
    name: str
    sm_mhz: float | None
    temp_c: float | None
    power_w: float | None
    limit_w: float | None
    util: float | None
    used_bytes: float | None
    total_bytes: float | None
    held: tuple[str, ...] = ()


@dataclass
class View:
    servers: list[ServerRow] = field(default_factory=list)
    gpus: list[GpuRow] = field(default_factory=list)
    #: a host whose GPU exporter sees no GPU, and why
    no_gpu: list[str] = field(default_factory=list)


def parse_answer(payload: Mapping) -> list[Sample]:
    """Prometheus's /api/v1/query answer (an instant vector) as samples."""
    if payload.get("status") != "success":
        raise ValueError(f"Prometheus answered {payload.get('errorType', '')}: {payload.get('error', payload)}")
    data = payload["data"]
    if data.get("resultType") != "vector":
        raise ValueError(f"not an instant vector: {data.get('resultType')}")
    return [(r["metric"], float(r["value"][1])) for r in data["result"]]


def _by(samples: Sequence[Sample], *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(labels.get(k, "") for k in keys): value for labels, value in samples}


def _num(value: float | None) -> int | None:
    return None if value is None or value != value else int(round(value))


def fleet_view(answers: Mapping[str, Sequence[Sample]]) -> View:
    """The rows, sorted by host then model (servers) or host then GPU index (GPUs)."""
    key = ("host", "service", "model")
    tok, stream = _by(answers.get("tok_s", ()), *key), _by(answers.get("stream", ()), *key)
    busy, deferred = _by(answers.get("busy", ()), *key), _by(answers.get("deferred", ()), *key)
    slots, kv = _by(answers.get("slots", ()), *key), _by(answers.get("kv", ()), *key)
    edge = {p.removeprefix("model_"): v for (p,), v in _by(answers.get("edge", ()), "proxy").items()}
    view = View()
    for labels, up in answers.get("up", ()):
        k = tuple(labels.get(n, "") for n in key)
        view.servers.append(
            ServerRow(
                k[0], k[2], k[1], up == 1.0, tok.get(k), stream.get(k), _num(busy.get(k)), _num(slots.get(k)),
                _num(deferred.get(k)), _num(edge.get(k[2])), kv.get(k),
            )
        )  # fmt: skip
    view.servers.sort(key=lambda r: (r.host, r.model, r.service))

    gk = ("host", "gpu")
    metric = {n: _by(answers.get(n, ()), *gk) for n in ("sm", "temp", "power", "limit", "util", "used", "total")}
    held: dict[tuple[str, ...], list[str]] = {}
    for labels, _ in answers.get("held", ()):
        if labels.get("reason", "") in HELD:  # power or heat; not idle, not application clocks
            held.setdefault((labels.get("host", ""), labels.get("gpu", "")), []).append(labels.get("reason", ""))
    for labels, _ in answers.get("info", ()):
        k = (labels.get("host", ""), labels.get("gpu", ""))
        sm = metric["sm"].get(k)
        view.gpus.append(
            GpuRow(
                k[0], k[1], labels.get("name", ""), None if sm is None else sm / 1e6, metric["temp"].get(k),
                metric["power"].get(k), metric["limit"].get(k), metric["util"].get(k), metric["used"].get(k),
                metric["total"].get(k), tuple(sorted(held.get(k, []))),
            )
        )  # fmt: skip
    view.gpus.sort(key=lambda r: (r.host, int(r.gpu) if r.gpu.isdigit() else 0, r.gpu))

    why = {labels.get("host", ""): f"{labels.get('kind', '')}: {labels.get('message', '')}"
           for labels, _ in answers.get("nvml", ())}  # fmt: skip
    for labels, n in sorted(answers.get("gpus", ()), key=lambda s: s[0].get("host", "")):
        if n == 0:
            host = labels.get("host", "")
            view.no_gpu.append(f"{host}: no GPU seen" + (f" (NVML {why[host]})" if host in why else ""))
    return view
