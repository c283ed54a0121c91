"""A change behind the balancer, one server at a time, under load, for real (issue 33), on this
machine without systemd: two servers of one model (a ``serve:`` layout of two recipes, each a
managed process), HAProxy in front (`invoke lb`, which leaves its record on the host), and a
steady load through the balancer (8 requests a second, well below what one server takes, so the
edge's queue never waits long) while provision's deploy step changes both servers' context:

1. each server is drained on the balancer (HAProxy's runtime API), restarted with the change,
   gated and put back, one after the other: no request fails, both run the new recipe, and
   HAProxy sent neither a request while it was out (the roll's own readings of its counters;
   its log says each entered drain);
2. a change whose gate cannot pass: the first server is drained, changed, fails its gate, is
   rolled back and put back; the roll stops, the second server is not touched; nothing fails.

The roll is driven as provision drives it (conduct/roll.py: Roll.deploy with the deploy step's
operations and gates); provision's own steps around it, and the systemd path of the runtime
API through the CLI, run in the booted container (tests/test_layout_real.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.cli.balancer import run_lb
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.conduct.deploy import deploy_ops
from playbooks.conduct.roll import Roll, rolled_line
from playbooks.conduct.settings import Settings
from playbooks.host import connect
from playbooks.host.base import Printer
from playbooks.steps.measure.gate import EnsureGate
from playbooks.steps.serve.lifecycle import EnsureServing
from tests import llamacpp_tools
from tests.helpers import ROOT, stage_served_model

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
PORTS = {"tiny-a": 18411, "tiny-b": 18412}
LB_PORT = 18420
TOKENS = 8  # each request's reply: long enough that a restart in place cuts some
RATE = 8.0  # requests a second through the balancer


def write_recipe(where: Path, name: str, context: int, min_tok_s: float = 1) -> Path:
    data = json.loads(json.dumps(TINY))
    data |= {"name": name, "parallel": 2, "context": context}
    data["service"] = {"port": PORTS[name]}
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 8, "min_tok_s": min_tok_s}
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Load:
    """A steady load through the balancer until stopped: every reply's status, kept, and when
    each request was sent. The ``with`` block is the change: a second of load before it and one
    after, and ``window`` the change's own span."""

    def __init__(self, url: str, models: tuple[str, ...] = ("tiny-llama",)):
        self.url, self.models, self.stop = url, models, threading.Event()
        self.results: list[str] = []
        self.sent: list[float] = []  # time.monotonic() of each request's send
        self.window = (0.0, 0.0)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, client: httpx.Client, i: int) -> str:
        model = self.models[i % len(self.models)]  # several: each asked in turn
        body = {"model": model, "prompt": f"Count {i}", "max_tokens": TOKENS, "ignore_eos": True}
        try:
            reply = client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            return f"error {type(exc).__name__}: {exc}"
        if reply.status_code != 200:
            return f"{reply.status_code} {reply.text[:200]}"
        return "ok" if reply.json()["usage"]["completion_tokens"] == TOKENS else f"short {reply.text[:200]}"

    def _run(self) -> None:
        with httpx.Client(timeout=90) as client, ThreadPoolExecutor(8) as pool:
            futures = []
            t0, i = time.monotonic(), 0
            while not self.stop.is_set():
                self.sent.append(time.monotonic())
                futures.append(pool.submit(self._one, client, i))
                i += 1
                time.sleep(max(0.0, t0 + i / RATE - time.monotonic()))
            self.results = [f.result() for f in futures]

    def __enter__(self) -> Load:
        self.thread.start()
        time.sleep(1)  # a few requests before the change starts
        self.window = (time.monotonic(), 0.0)
        return self

    def __exit__(self, *exc) -> None:
        self.window = (self.window[0], time.monotonic())
        time.sleep(1)
        self.stop.set()
        self.thread.join(timeout=120)

    @property
    def failed(self) -> list[str]:
        return [r for r in self.results if r != "ok"]

    @property
    def steady(self) -> bool:
        """Whether the change ran under the load: requests sent within its span, at no less than
        80% of RATE over it, and at least one. A count, not the gaps: the sender catches up after
        a stall, so a stall that ends inside the span is not seen. How many there are follows from
        how long the change took (a set's roll, about 2.9 s in cold run 88, gave 39 where a fixed
        count of 40 was asked)."""
        start, end = self.window
        during = sum(start <= t <= end for t in self.sent)
        return during >= max(1, int(0.8 * RATE * (end - start)))


def change(settings: Settings, roll: Roll, prefix: str) -> list:
    """Each recipe of the layout in turn, as provision's deploy and gate steps run it."""
    changes = []
    for served in settings.serves("local", None):
        with connect(settings.host_spec("local")) as host:
            ops = deploy_ops(served.loaded, host, prefix, "auto", served.gpus, gated=True, server=served.layout(prefix))
            gates = [EnsureGate(op, served.loaded, prefix) for op in ops if isinstance(op, EnsureServing)]
            rolled = roll.deploy(host, prefix, served.name, Printer(), ops, gates, dry_run=False)
            assert rolled is not None, "no balancer record: invoke lb left none"
            changes += rolled.deploy + rolled.gate
    return changes


def record(prefix: str, name: str) -> dict:
    return json.loads((Path(prefix) / "deploy" / f"voltaforge-{name}" / "deployed.json").read_text())


@pytest.mark.timeout(900)
def test_a_rolling_change_under_load_loses_no_request(tmp_path, tmp_path_factory, monkeypatch, capsys):
    work = tmp_path / "w"
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    q4 = llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")
    prefix = str(tmp_path_factory.mktemp("vf"))  # short: the runtime API's socket lives under it
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    paths = {n: write_recipe(recipes, n, 1024) for n in PORTS}
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        yaml.safe_dump(
            {
                "hosts": {"local": {"prefix": prefix, "serve": [{"recipe": str(p)} for p in paths.values()]}},
                "lb": {"hosts": ["local"], "port": LB_PORT},
            }
        )
    )
    settings = Settings(inventory=inv)
    with connect(settings.host_spec("local")) as here:
        for p in paths.values():
            stage_served_model(here, prefix, p, q4, "Q4_K_M")
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{LB_PORT}/v1/completions"
    try:
        assert run_deploy("local", None, settings=settings) == 0, capsys.readouterr().out[-3000:]
        assert run_lb("local", settings=settings) == 0, capsys.readouterr().out[-4000:]
        fronted = json.loads((Path(prefix) / "deploy" / "balancers" / "local.json").read_text())
        assert [(s["port"], s["server"], s["peers"]) for s in fronted["servers"]] == [
            (18411, "local-18411", 2), (18412, "local-18412", 2),
        ], fronted  # fmt: skip
        before = {n: record(prefix, n)["fingerprint"] for n in PORTS}

        # 1. a new context on both servers, under load
        for n in PORTS:
            write_recipe(recipes, n, 768)
        roll = Roll(settings)
        with Load(url) as load:
            changes = change(settings, roll, prefix)
        assert not [c for c in changes if c.status == "failed"], changes
        print(f"rolling change: {len(load.results)} requests, {len(load.failed)} failed")
        for r in roll.rolled:
            print(rolled_line(r))
        assert load.steady and not load.failed, (load.failed[:5], len(load.results))
        assert [(r.server, r.result, r.while_out, r.cut) for r in roll.rolled] == [
            ("local-18411", "changed", 0, 0), ("local-18412", "changed", 0, 0),
        ], roll.rolled  # fmt: skip
        for n in PORTS:
            rec = record(prefix, n)
            assert rec["fingerprint"] != before[n] and rec["gate"]["status"] == "passed", rec
        log = (Path(prefix) / "deploy" / "voltaforge-lb" / "server.log").read_text()
        for server in ("local-18411", "local-18412"):
            assert f"Server model_tiny-llama/{server} enters drain state" in log, log[-3000:]
            # back in rotation: UP as it leaves the drain, or (its health checks still failing
            # from the restart, seen on a loaded machine) DOWN as it leaves and UP once they pass
            name = f"Server model_tiny-llama/{server}"
            left = log.rsplit(f"{name} enters drain state", 1)[1]
            assert f"{name} is UP (leaving forced drain)" in left or (
                f"{name} is DOWN (leaving forced drain)" in left
                and f"{name} is UP, reason: Layer7 check passed"
                in left.split(f"{name} is DOWN (leaving forced drain)", 1)[1]
            ), log[-3000:]

        # 2. a change whose gate cannot pass: the roll stops at the first server, nothing is lost
        changed = {n: record(prefix, n)["fingerprint"] for n in PORTS}
        for n in PORTS:
            write_recipe(recipes, n, 1024, min_tok_s=1e6)
        roll = Roll(settings)
        with Load(url) as load:
            changes = change(settings, roll, prefix)
        print(f"failing change: {len(load.results)} requests, {len(load.failed)} failed")
        assert not load.failed and load.steady, (load.failed[:5], len(load.results))
        whys = [c.why for c in changes if c.status == "failed"]
        assert any("the gate failed" in w and "rolled back" in w for w in whys), whys
        assert any(w.startswith("not changed: the roll stopped at local-18411") for w in whys), whys
        assert [(r.server, r.result) for r in roll.rolled] == [("local-18411", "rolled back")], roll.rolled
        assert {n: record(prefix, n)["fingerprint"] for n in PORTS} == changed
    finally:
        run_stop("local", None, settings=settings)
        pid_file = Path(prefix) / "deploy" / "voltaforge-lb" / "server.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
