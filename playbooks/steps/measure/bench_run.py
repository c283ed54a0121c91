"""The measurement behind `invoke bench` and provision's gate: the deployed server measured
against its physical ceiling, judged, written as reports, and added to the history.

Where things run: the client runs here, on the controller, and reaches the server through an
SSH port forward (the service listens on the host's loopback only), so latencies include the
forward (sub-millisecond on a LAN; the report says where the client ran). Telemetry runs on
the host. The ceilings the server is judged against, and their probes there (memory bandwidth,
llama.cpp's own ``llama-bench`` for the side-by-side decode figure), are bench_ceilings.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import math
import shlex
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.config.recipe import Gate, LoadedRecipe
from playbooks.facts import builds as build_facts
from playbooks.facts import read_fact, system
from playbooks.facts import telemetry as telem
from playbooks.facts.service import health_command, parse_health
from playbooks.host import Host
from playbooks.host.local import LocalHost
from playbooks.plan.engines import engine
from playbooks.plan.gpus import get_gpu
from playbooks.resources import resource_dir
from playbooks.steps.build.llamacpp_source import source_cache_dir
from playbooks.steps.measure import bench, bench_ceilings, bench_client, roofline
from playbooks.steps.measure.bench_history import append_history, read_history
from playbooks.steps.measure.bench_noise import host_noise
from playbooks.steps.measure.bench_render import write_reports
from playbooks.steps.measure.bench_stats import MIN_ROUNDS, estimate, settled
from playbooks.steps.serve.deploy_record import DeployLayout, read_record
from playbooks.steps.serve.secrets import api_key_for

#: per request: generous for a slow host, short enough that a hung server fails the run
REQUEST_TIMEOUT_S = 300.0


def bench_dir() -> Path:
    """Reports and history live on the controller, beside the other caches."""
    return source_cache_dir().parent / "bench"


def bench_health(host: Host, port: int, tls: bool = False) -> int:
    return parse_health(read_fact(host, health_command(port, tls=tls)))


def round_bounds(g: Gate, concurrency: int) -> tuple[int, int]:
    """The fewest and the most rounds a level runs (a round: one request per stream, all at
    once; the unit of replication, bench_stats). The gate's request counts are rounded up to
    whole rounds, and never fewer than MIN_ROUNDS: with fewer the t quantile alone makes the
    interval several times the spread (12.7 at 2 rounds, 3.18 at 4)."""
    least_req = g.requests_per_level or max(2 * concurrency, 4)
    most_req = g.max_requests_per_level or max(8 * concurrency, 16)
    least = max(MIN_ROUNDS, math.ceil(least_req / concurrency))
    return least, max(least, math.ceil(most_req / concurrency))


def request_bounds(g: Gate, concurrency: int) -> tuple[int, int]:
    """The fewest and the most requests a level runs (:func:`round_bounds` in requests)."""
    least, most = round_bounds(g, concurrency)
    return least * concurrency, most * concurrency


def sweep_level(
    url: str,
    text: bench.Corpus,
    words: int,
    c: int,
    g: Gate,
    kind: str,
    api_key: str | None = None,
    verify: str | bool = True,
    sent: bench_client.Sent | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """One concurrency level: a warm-up round (every stream once, left out), then rounds of one
    request per stream until the judged per-stream decode's 95% half-width (over rounds) is
    within the gate's ``ci_target`` of its mean, or the cap (:func:`round_bounds`); a level that
    stopped at the cap short of the target says so (``capped``). Returns the level's summary
    (with the client's own CPU time: on the served host it competes with the server) and its
    samples. ``sent``: every request of the level counted in it, the warm-up's too."""
    least, most = round_bounds(g, c)
    warm = bench.prompts_for(text, words, c, seed=100_000 + c)
    warmed, _ = asyncio.run(
        bench_client.run_level(url, warm, c, g.max_tokens, 100_000, kind, REQUEST_TIMEOUT_S, api_key, verify)
    )
    if sent is not None:
        sent.add(warmed)
    rounds: list[bench.Round] = []
    cpu0 = time.process_time()
    while True:
        prompts = bench.prompts_for(text, words, c, seed=1000 * c + len(rounds))
        got, took = asyncio.run(
            bench_client.run_level(
                url, prompts, c, g.max_tokens, 1 + len(rounds) * c, kind, REQUEST_TIMEOUT_S, api_key, verify
            )
        )
        rounds.append((got, took))
        if sent is not None:
            sent.add(got)
        if all(s.error for s in got):
            break
        values, _ = bench.judged_rounds(rounds)
        if len(rounds) >= most or settled(estimate(values), least, most, g.ci_target):
            break
    samples = [s for got, _ in rounds for s in got]
    summary = bench.level_summary(c, samples, sum(t for _, t in rounds), warmup=len(warm), rounds=rounds)
    decode = summary.get("decode")
    if decode is not None:
        rel = decode.get("rel_halfwidth")
        decode["capped"] = len(rounds) >= most and (rel is None or rel > g.ci_target)
    summary["client_cpu_s"] = round(time.process_time() - cpu0, 3)
    return summary, samples


def workload_text(workload: str = "chat") -> bench.Corpus:
    """What the prompts of a workload kind are cut from (bench.WORKLOADS): the shipped texts
    under recipes/calibration (general.txt: prose, dialogue, code, data; code.txt: source)."""
    name, layout = bench.WORKLOADS[workload]
    text = (resource_dir("recipes") / "calibration" / name).read_text(encoding="utf-8")
    return bench.Corpus.of(text, layout)


def prompt_words(
    url: str,
    text: bench.Corpus,
    kind: str,
    prompt_tokens: int,
    api_key: str | None = None,
    verify: str | bool = True,
    sent: bench_client.Sent | None = None,
) -> tuple[int, str | None]:
    """Words per prompt for about ``prompt_tokens`` tokens, from one probe request's own token
    count; or why the server does not serve completions. ``sent``: the probe counted in it."""
    probe_words = 64
    first = bench_client.probe_prompt_tokens(url, text.cut(0, probe_words), kind, 60, api_key, verify)
    if sent is not None:
        sent.add([first])
    if first.error:
        return 0, first.error
    return bench.words_for(prompt_tokens, probe_words, first.prompt_tokens or probe_words), None


def measure_level(
    host: Host,
    port: int,
    kind: str,
    concurrency: int,
    g: Gate,
    api_key: str | None = None,
    tls: str | bool | None = None,
) -> dict[str, Any]:
    """One concurrency level against a server on ``host``'s loopback ``port`` (tune's scratch
    server, a balancer): the level's summary (:func:`sweep_level`), or ``{"error": ...}``.
    ``api_key``: a keyed server's key (steps/serve/secrets.py api_key_for); ``tls``: HTTPS,
    verified against this CA file (True: the system's trust store); None: plain HTTP."""
    verify: str | bool = True if tls is None else tls
    if bench_health(host, port, tls is not None) == 0:
        return {"error": f"the server on {host.name}:{port} does not answer: nothing listens there"}
    text = workload_text(g.workload)
    with host.forward(port) as local_port:
        url = f"{'http' if tls is None else 'https'}://127.0.0.1:{local_port}"
        words, why = prompt_words(url, text, kind, g.prompt_tokens, api_key, verify)
        if why:
            return {"error": f"the server on {host.name}:{port} does not serve completions: {why}"}
        summary, samples = sweep_level(url, text, words, concurrency, g, kind, api_key, verify)
    if all(s.error for s in samples):
        summary["error"] = f"every request failed at concurrency {concurrency}: {samples[0].error}"
    return summary


def client_on_served_host(host: Host) -> bool:
    """Whether the client shares the served host's CPUs: this machine, or an SSH host reached
    over loopback."""
    if isinstance(host, LocalHost):
        return True
    address = str(getattr(getattr(host, "spec", None), "host", "") or "")
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def measure(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    layout: DeployLayout,
    levels: list[int] | None = None,
    remeasure: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run on one host: the result dict (the report's schema) and what was seen."""
    r = loaded.recipe
    g = r.gate
    levels = levels or list(g.levels)
    record = read_record(host, layout) or {}
    result: dict[str, Any] = {
        "version": 1,
        "complete": False,
        "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host.name,
        "recipe": r.name,
        "recipe_sha256": hashlib.sha256(loaded.path.read_bytes()).hexdigest(),
        "client": "this machine" if isinstance(host, LocalHost) else "the controller, through an SSH port forward",
        "client_on_served_host": client_on_served_host(host),
        "workload": {
            "kind": g.workload,
            "prompt_tokens": g.prompt_tokens,
            "max_tokens": g.max_tokens,
            "seed": 1,
            "levels": levels,
            "requests_per_level": {str(c): list(request_bounds(g, c)) for c in levels},
            "rounds_per_level": {str(c): list(round_bounds(g, c)) for c in levels},
            "ci_target": g.ci_target,
            # what --compare counts between two runs: the gate's figure where the recipe gives
            # one, else the host's own (``host_noise``, bench_noise)
            "run_noise": g.run_noise,
            "warmup": "one round per level (a request per stream), left out",
        },
        "levels": [],
        "telemetry": None,
        "llama_bench": None,
    }
    seen: dict[str, Any] = {}
    buffers = record.get("buffers") or {}
    gpu = get_gpu(r.gpu)
    # a CPU recipe's log says 0/N layers "offloaded to GPU" by design: nothing crossed PCIe
    seen["offloaded"] = None if gpu.is_cpu else buffers.get("offloaded")
    nproc = system.parse_nproc(read_fact(host, system.NPROC_COMMAND))
    mem = system.parse_meminfo(read_fact(host, system.MEMINFO_COMMAND))
    total = mem.mem_total_bytes
    result["facts"] = {"cpus": nproc, "memory_gb": round(total / 1e9, 1) if total else None, "gpu": r.gpu}
    if not record:
        result["error"] = (
            f"{layout.service} was never deployed on {host.name}: run `invoke deploy --host {host.name}` first"
        )
        return result, seen
    port = int(record.get("port") or r.service.port)
    model = str((record.get("artifact") or {}).get("path") or "")
    build = None
    e = engine(r.backend)
    if e.serves_llamacpp_build:
        current = build_facts.parse_readlink(
            read_fact(host, build_facts.readlink_command(f"{prefix}/llama.cpp/current"))
        )
        build = current.rstrip("/").rsplit("/", 1)[-1] if current else None
    result["server"] = {
        "port": port,
        "kind": e.server,
        # the name clients ask for (llama-server --alias, TabbyAPI's model directory), and the file
        "model": r.served_name,
        "model_file": model,
        "deployed_at": record.get("at"),
        "build": build or ("not recorded" if e.serves_llamacpp_build else f"{e.server_label} (no llama.cpp build)"),
        "url": f"http://127.0.0.1:{port}/v1 on {host.name}",
        "service": layout.service,
    }
    python = bench_ceilings.host_python(host, prefix)
    membw = None
    n_cpu_moe = bench_ceilings.served_n_cpu_moe(loaded)
    # the host's copy rate, kept as a host fact: the roofline of a CPU, and the host side of a
    # MoE with experts in host RAM
    if gpu.is_cpu or n_cpu_moe:
        result["membw"] = bench_ceilings.host_membw(host, prefix, python, remeasure)
        membw = result["membw"]["gb_s"]
    llc = None
    if gpu.is_cpu:  # the CPU's roofline is a DRAM rate: it bounds only what the cache cannot hold
        llc = system.parse_llc(read_fact(host, system.LLC_COMMAND))
        result["facts"]["last_level_cache"] = llc.model_dump(exclude_none=True)
    result |= bench_ceilings.ceilings(loaded, membw, llc.size_bytes if llc else None)
    result["membw_gb_s"] = membw
    text = workload_text(g.workload)
    kind = result["server"]["kind"]
    # is anything there? (through the forward a refused port only looks like a broken read)
    if bench_health(host, port) == 0:
        result["error"] = f"the server on {host.name}:{port} does not answer: nothing listens there (is it stopped?)"
        return result, seen
    # a keyed server: its key from the host's secret, as the server gets it (held in memory)
    api_key = api_key_for(host, r)
    with host.forward(port) as local_port:
        url = f"http://127.0.0.1:{local_port}"
        # what the server is sent from here on, and when: Prometheus's view of the run reads the
        # server's counters over this window (conduct/bench_view.py)
        sent, sent_from = bench_client.Sent(), time.time()
        words, why = prompt_words(url, text, kind, g.prompt_tokens, api_key, sent=sent)
        if why:
            result["error"] = f"the server on {host.name}:{port} does not serve completions: {why}"
            return result, seen
        tel_pid = None
        tel_out = f"{prefix}/bench/telemetry.jsonl"
        if not gpu.is_cpu:
            tprobe = bench_ceilings.push_probe(host, prefix, telem.TELEMETRY_PROBE_PATH)
            # in the background, into a file: the sweep's own requests are never waiting on it
            tel_pid = host.run(
                telem.background_telemetry_command(python, tprobe, tel_out, 0.5, 3600), stream=False
            ).stdout.strip()
        t0 = time.monotonic()
        samples_all = []
        try:
            for c in levels:
                summary, samples = sweep_level(url, text, words, c, g, kind, api_key, sent=sent)
                samples_all += samples
                result["levels"].append(summary)
                if all(s.error for s in samples):
                    result["error"] = f"every request failed at concurrency {c}: {samples[0].error}"
                    break
        finally:
            if tel_pid and tel_pid.isdigit():
                host.run(telem.stop_telemetry_command(tel_pid), check=False, stream=False)
                t = telem.parse_telemetry(read_fact(host, f"cat -- {shlex.quote(tel_out)} 2>/dev/null || true"))
                result["telemetry"] = {"source": t.source, "error": t.error, "summary": telem.throttle_summary(t)}
        result["sweep_s"] = round(time.monotonic() - t0, 2)
        result["sent"] = {
            "from": round(sent_from, 3),
            "to": round(time.time(), 3),
            "requests": sent.requests,
            "completion_tokens": sent.completion_tokens,
        }
    cpu_s = sum(lv.get("client_cpu_s") or 0 for lv in result["levels"])
    walls = sum(lv.get("wall_s") or 0 for lv in result["levels"])
    result["client_cpu"] = {
        "on_served_host": result["client_on_served_host"],
        "cpu_s": round(cpu_s, 2),
        # CPU seconds per second of measured wall time (warm-ups aside: a slight over-estimate)
        "cores": round(cpu_s / walls, 3) if walls else None,
        "host_cpus": nproc,
    }
    random_weights = bool(r.model.generate)
    result["sanity"] = bench.sanity(samples_all, random_weights)
    result["knee"] = bench.find_knee(result["levels"])
    result["scaling"] = bench.scaling(result["levels"], r.backend, gpu.compute_capability == (7, 0))
    single = bench.decode_figure(result["levels"][0]) if result["levels"] else None
    roof = result.get("roofline_tok_s")
    # None where no roofline binds (cache-resident); above 1 it is kept, and said to be no
    # utilisation but a ceiling or measurement error (roofline.mbu_note)
    result["mbu"] = round(single / roof, 4) if single and roof else None
    result["mbu_note"] = roofline.mbu_note(result)
    if e.serves_llamacpp_build and model and "error" not in result:
        crowded = bench_ceilings.no_room_for_llama_bench(loaded)
        if crowded:
            result["llama_bench"] = {"error": crowded}
        else:
            extra = bench_ceilings.llama_bench_args(loaded, n_cpu_moe)
            result["llama_bench"] = bench_ceilings.llama_bench(
                host, prefix, model, g.prompt_tokens, g.max_tokens, extra
            )
    result["complete"] = "error" not in result
    return result, seen


def thresholds(loaded: LoadedRecipe) -> dict[str, float]:
    g = loaded.recipe.gate
    return {
        "min_tok_s": g.min_tok_s,
        "min_roofline_fraction": g.min_roofline_fraction,
        "min_aggregate_tok_s": g.min_aggregate_tok_s,
        "at_concurrency": g.at_concurrency,
        "max_ttft_ms": g.max_ttft_ms,
        # a CPU server shares the cores with everything else on its host (on `local`, with the
        # client itself): there the client's per-token timing is reported beside the server's,
        # not gated (measured: 8% apart at 11 ms per token on two busy cores, within 5% idle)
        "crosscheck_gates": 0 if get_gpu(loaded.recipe.gpu).is_cpu else 1,
    }


def gate_run(
    loaded: LoadedRecipe,
    host: Host,
    prefix: str,
    layout: DeployLayout,
    out_dir: Path | None = None,
    remeasure: bool = False,
) -> tuple[dict[str, Any], dict[str, Path], list[dict[str, Any]]]:
    """Measure, judge, write the reports (``out_dir``, else under bench_dir()) and add a
    complete run to the history. Returns the result, the report files and the earlier runs
    of this host and recipe (for a comparison). ``remeasure``: the host's memory bandwidth
    afresh instead of its stored figure."""
    result, seen = measure(loaded, host, prefix, layout, remeasure=remeasure)
    result["gate"] = bench.judge(result, thresholds(loaded), seen)
    history = bench_dir() / "history.jsonl"
    # the host's own run-to-run noise, from its runs before this one (every recipe's)
    noise = host_noise(read_history(history, host.name))
    result["host_noise"] = noise.as_dict() if noise else None
    where = out_dir or bench_dir() / host.name / loaded.recipe.name / result["at"].replace(":", "")
    files = write_reports(result, where)
    earlier = read_history(history, host.name, loaded.recipe.name)
    if result["complete"]:
        append_history(result, history)  # an incomplete run never enters the history
    return result, files, earlier
