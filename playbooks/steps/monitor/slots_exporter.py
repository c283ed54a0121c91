#!/usr/bin/env python3
"""voltaforge slots exporter: the KV cache each llama-server holds, read from its /slots at each
scrape, as Prometheus metrics.

    python3 slots_exporter.py --listen 127.0.0.1:9836 --servers servers.json

Why: llama-server at voltaforge's pin publishes no KV cache metric on /metrics; its /slots
(enabled by default) says, per slot, the tokens its cache holds (``n_prompt_tokens``: the
prompt kept and every token generated after it). This process, beside Prometheus on the monitor
host, asks each server's /slots when Prometheus scrapes it (all at once, 3 s each) and exports

- ``voltaforge_kv_tokens{host,model,service}``: the tokens the server's slots hold in all;
- ``voltaforge_slots_read_error{host,model,service,kind}``: 1 where /slots could not be read
  (``http-401``, ``http-501``: the server runs with --no-slots, ``unreachable``, ``bad-answer``).

Its share of the cache is a recording rule (steps/monitor/rules.py): these tokens over the
context the plan gives the server (its recipe's context x slots), not over /slots' own n_ctx,
which a unified cache reports per slot as the whole.

``servers.json``: ``[{"url": "http://127.0.0.1:18080", "host": ..., "model": ..., "service": ...,
"key_file": path or null}]``, written by `invoke monitor`; a keyed server's key is read from its
file at each scrape (a credential under systemd), never from the command line. Runs on the host's
python3 (3.8 or later) with Debian's python3-prometheus-client."""

import argparse
import json
import signal
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

# Debian's python3-prometheus-client on the host (the controller's venv has it too, for the tests)
from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, GaugeMetricFamily

LABELS = ["host", "model", "service"]
TIMEOUT_S = 3


def read_slots(server):
    """(tokens held, None) or (None, why) for one server."""
    request = urllib.request.Request(server["url"].rstrip("/") + "/slots")
    if server.get("key_file"):
        with open(server["key_file"]) as f:
            request.add_header("Authorization", "Bearer " + f.read().strip())
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            slots = json.loads(r.read().decode())
    except urllib.error.HTTPError as exc:
        return None, f"http-{exc.code}"
    except (OSError, ValueError):
        return None, "unreachable"
    if not isinstance(slots, list):
        return None, "bad-answer"
    try:
        return sum(int(s.get("n_prompt_tokens", 0)) for s in slots), None
    except (AttributeError, TypeError, ValueError):
        return None, "bad-answer"


class SlotsCollector:
    def __init__(self, servers):
        self.servers = servers

    def collect(self):
        tokens = GaugeMetricFamily(
            "voltaforge_kv_tokens", "tokens held in the server's KV cache (its /slots)", labels=LABELS
        )
        error = GaugeMetricFamily(
            "voltaforge_slots_read_error",
            "1 while the server's /slots cannot be read, by why",
            labels=LABELS + ["kind"],
        )
        with ThreadPoolExecutor(max(1, min(16, len(self.servers)))) as pool:
            answers = list(pool.map(read_slots, self.servers))
        for i, server in enumerate(self.servers):  # (zip's strict= is not in Python 3.8)
            held, why = answers[i]
            labels = [server[k] for k in LABELS]
            if why is None:
                tokens.add_metric(labels, held)
            else:
                error.add_metric([*labels, why], 1)
        yield tokens
        yield error


def main(argv=None):
    parser = argparse.ArgumentParser(prog="slots_exporter.py")
    parser.add_argument("--listen", required=True, help="ADDRESS:PORT (loopback)")
    parser.add_argument("--servers", required=True, help="the servers' JSON list, written by invoke monitor")
    args = parser.parse_args(argv)
    address, _, port = args.listen.rpartition(":")
    with open(args.servers) as f:
        servers = json.load(f)
    REGISTRY.register(SlotsCollector(servers))
    start_http_server(int(port), addr=address.strip("[]"))
    print(f"voltaforge slots exporter listening on {args.listen}, {len(servers)} servers", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
