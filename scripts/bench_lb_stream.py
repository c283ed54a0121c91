"""Streaming through the load balancer, side by side in one run; asserts nothing.

One llama-server (the pinned static CPU build, one thread, a generated model large enough that
a token takes 10-20 ms, by the CPU) streams a 64-token completion three ways: directly, through HAProxy with
the configuration `invoke lb` renders, and through the same configuration without its
`option http-no-delay`. For each: the gaps between consecutive events as the client receives
them (median and largest), how many events arrive together (gap under 1 ms after another), and
the time to the first event. Each way RUNS times, the figures of the median run by total time.

Usage: .venv/bin/python scripts/bench_lb_stream.py [--runs 3]
Writes reports/local/lb-stream.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playbooks.config.recipe import load_recipe  # noqa: E402
from playbooks.results import write_result  # noqa: E402
from playbooks.steps.serve.balancer import Backend, Balancer, render_haproxy_config  # noqa: E402
from tests import llamacpp_tools, sparse_gguf  # noqa: E402

#: what the file measures (results.py, ``measures``): the gaps come from the HAProxy configuration
#: `invoke lb` renders, so a change to its renderer or template re-makes it
MEASURES = ["playbooks/steps/serve/balancer.py", "templates/haproxy.cfg.j2"]
MODEL = "llama-E1024-F2816-L8-H8-K2-D128-V2048.gguf"
TOKENS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} never answered")


def stream(base: str) -> dict[str, float]:
    body = {"prompt": "Hello", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    arrivals = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
    gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "events": len(arrivals),
        "first_ms": (arrivals[0] - t0) * 1000,
        "total_ms": (arrivals[-1] - t0) * 1000,
        "median_gap_ms": statistics.median(gaps),
        "max_gap_ms": max(gaps),
        "together": sum(1 for g in gaps if g < 1.0),
    }


def haproxy(cfg: str, work: Path, name: str) -> subprocess.Popen:
    path = work / f"{name}.cfg"
    path.write_text(cfg)
    return subprocess.Popen(["haproxy", "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vf-lb-stream-"))
    model = sparse_gguf.write(work, sparse_gguf.shape_of(MODEL))
    port = free_port()
    server = subprocess.Popen(
        [str(llamacpp_tools.llama_server()), "-m", str(model), "-c", "1024", "-np", "2", "-t", "1",
         "--host", "127.0.0.1", "--port", str(port), "--fit", "off", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    procs = []
    try:
        wait(f"http://127.0.0.1:{port}/health")
        recipe = load_recipe("tiny-cpu").recipe
        ways = {"direct": f"http://127.0.0.1:{port}"}
        for name, keep in (("haproxy", True), ("haproxy_without_no_delay", False)):
            lb_port, stats_port = free_port(), free_port()
            cfg = render_haproxy_config(Balancer(recipe, (Backend("a", "127.0.0.1", port),), port=lb_port,
                                                 stats_port=stats_port))  # fmt: skip
            if not keep:
                assert "    option http-no-delay\n" in cfg
                cfg = cfg.replace("    option http-no-delay\n", "")
            procs.append(haproxy(cfg, work, name))
            wait(f"http://127.0.0.1:{stats_port}/stats")
            ways[name] = f"http://127.0.0.1:{lb_port}"
        time.sleep(5)  # both checks pass (rise 2 at 2 s)
        results = {}
        for name, base in ways.items():
            runs = sorted((stream(base) for _ in range(args.runs)), key=lambda r: r["total_ms"])
            results[name] = runs[len(runs) // 2]
        print(f"{'way':28} {'events':>6} {'first ms':>9} {'median gap':>11} {'max gap':>8} {'together':>9}")
        for name, r in results.items():
            print(f"{name:28} {r['events']:6} {r['first_ms']:9.1f} {r['median_gap_ms']:11.1f} "
                  f"{r['max_gap_ms']:8.1f} {r['together']:9}")  # fmt: skip
    finally:
        for p in [server, *procs]:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
    figures, units = {}, {}
    for name, r in results.items():
        for key in ("median_gap_ms", "max_gap_ms", "first_ms"):
            figures[f"{name}_{key}"] = round(r[key], 1)
            units[f"{name}_{key}"] = "ms"
        figures[f"{name}_together"] = r["together"]
        units[f"{name}_together"] = "events"
    figures["events"] = results["direct"]["events"]
    units["events"] = "events"
    write_result(
        ROOT / "reports" / "local" / "lb-stream.json",
        "scripts/bench_lb_stream.py: a 64-token stream directly, through HAProxy as invoke lb renders it, "
        "and without its option http-no-delay",
        figures,
        units,
        f".venv/bin/python scripts/bench_lb_stream.py --runs {args.runs}",
        notes="one llama-server (pinned static CPU build, -t 1, a generated 8-layer model, 10-20 ms a token), "
        "HAProxy 2.6 from Debian; the median run of each way by total time; 'together': events that arrived "
        "under 1 ms after the one before",
        measures=MEASURES,
    )


if __name__ == "__main__":
    main()
