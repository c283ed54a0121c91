"""A change to a model set behind the balancer, under load, for real (issue 56), on this machine
without systemd. The host's layout: a set ``pair`` serving ``small`` and ``mid`` through one
router, and beside it a server of each of those names on its own (a lab's hot models served
apart too), all managed processes; HAProxy in front (`invoke lb`: each name a backend holding
the router and its own server, and the record it leaves on the host); a steady load through
the edge asking for the two names in turn while one member's recipe (``mid``'s context) changes:

- a dry run shows the router's turn in both its members' lanes;
- the router is drained in both backends, restarted once (its one deploy operation changed, a
  new process), judged by the set's gate (each member's own) and put back: no request fails,
  and HAProxy sent the router no request while it was out (the roll's own readings of its
  counters; its log says it entered drain in both backends). The two single servers are not
  touched.

Why not two sets: one CPU host holds one set (its ``memory_budget_gib`` is the host's, and a
second set planned against the same budget would count the memory twice: the inventory refuses
it).

The roll is driven as provision drives it (conduct/roll.py: Roll.deploy with the set's deploy
operations and its gate, conduct/set_deploy.py and steps/measure/set_gate.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from playbooks.cli.balancer import run_lb
from playbooks.cli.deploy import run_deploy
from playbooks.conduct.roll import Roll, rolled_line
from playbooks.conduct.set_deploy import set_deploy_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.stop import stop_served
from playbooks.host import connect
from playbooks.host.base import Printer
from playbooks.host.ops import run_ops
from playbooks.steps.measure.set_gate import EnsureSetGate
from playbooks.steps.serve.lifecycle import EnsureServing
from tests import llamacpp_tools
from tests.helpers import ROOT, stage_served_model
from tests.test_roll_real import TINY, Load

pytestmark = pytest.mark.slow
PORT = 18431  # the set's router
SINGLE = {"small": 18432, "mid": 18433}  # each name's own server
LB_PORT = 18440
NAMES = ("small", "mid")


def write_member(where: Path, recipe: str, served: str, context: int, port: int = PORT) -> None:
    data = json.loads(json.dumps(TINY))
    data |= {"name": recipe, "parallel": 2, "context": context, "threads": 1}
    data["service"] = {"model_name": served, "port": port}
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 8, "min_tok_s": 1}
    (where / f"{recipe}.yaml").write_text(yaml.safe_dump(data))


def roll_sets(settings: Settings, roll: Roll, prefix: str, dry_run: bool = False) -> list:
    """Each set of the layout in turn, as provision's deploy and gate steps run it."""
    changes = []
    for s in settings.sets("local", None):
        with connect(settings.host_spec("local")) as host:
            ops = set_deploy_ops(s, host, prefix, "auto", gated=True)
            gates = [EnsureSetGate(op, s.members, s.models_max, prefix) for op in ops if isinstance(op, EnsureServing)]
            rolled = roll.deploy(host, prefix, s.name, Printer(), ops, gates, dry_run=dry_run)
            assert rolled is not None, "no balancer record: invoke lb left none"
            changes += rolled.deploy + rolled.gate
    return changes


def record(prefix: str, service: str) -> dict:
    return json.loads((Path(prefix) / "deploy" / service / "deployed.json").read_text())


def pid(prefix: str, service: str) -> int:
    return int((Path(prefix) / "deploy" / service / "server.pid").read_text())


@pytest.mark.timeout(900)
def test_a_sets_change_rolls_under_load_and_loses_no_request(tmp_path, tmp_path_factory, monkeypatch, capsys):
    work = tmp_path / "w"
    q4 = llamacpp_tools.quantize(llamacpp_tools.tiny_f16(work, TINY["model"]["config"]), work / "t.gguf", "Q4_K_M")
    prefix = str(tmp_path_factory.mktemp("vf"))  # short: the runtime API's socket lives under it
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    for served in NAMES:
        write_member(recipes, f"{served}-set", served, 1024)
        write_member(recipes, f"{served}-own", served, 1024, SINGLE[served])
    layout = [{"set": "pair", "models": [f"{n}-set" for n in NAMES], "port": PORT}]
    layout += [{"recipe": f"{n}-own"} for n in NAMES]
    inv = tmp_path / "inventory.yaml"
    # room for both members at once (4 GiB): the load asks for both without a swap
    host_entry = {"prefix": prefix, "memory_budget_gib": 4.0, "serve": layout}
    inv.write_text(yaml.safe_dump({"hosts": {"local": host_entry}, "lb": {"hosts": ["local"], "port": LB_PORT}}))
    settings = Settings(inventory=inv, recipes_dir=recipes)
    url = f"http://127.0.0.1:{LB_PORT}/v1/completions"
    router, own = "voltaforge-set-pair", [f"voltaforge-{n}-own" for n in NAMES]
    with connect(settings.host_spec("local")) as here:
        for i, p in enumerate(sorted(recipes.glob("*-*.yaml"))):
            stage_served_model(here, prefix, p, q4, "Q4_K_M", tools=i == 0)
        for s in settings.sets("local", None):
            ops = set_deploy_ops(s, here, prefix, "auto", gated=True)
            serving = next(op for op in ops if isinstance(op, EnsureServing))
            gate = EnsureSetGate(serving, s.members, s.models_max, prefix, out_dir=tmp_path / "gate")
            done = run_ops(here, [*ops, gate])
            assert not [c for c in done if c.status == "failed"], done
    # the bench reports and the balancer's TLS pair in a cache of the test's own (after the
    # tools were staged from the shared one)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    try:
        assert run_deploy("local", None, settings=settings) == 0, capsys.readouterr().out[-3000:]
        assert run_lb("local", settings=settings) == 0, capsys.readouterr().out[-4000:]
        fronted = json.loads((Path(prefix) / "deploy" / "balancers" / "local.json").read_text())
        servers = sorted((s["port"], s["model"], s["server"], s["peers"]) for s in fronted["servers"])
        want = [(PORT, n, f"local-{PORT}", 2) for n in NAMES] + [(p, n, f"local-{p}", 2) for n, p in SINGLE.items()]
        assert servers == sorted(want), fronted  # the router in both its members' backends
        before = {u: (record(prefix, u)["fingerprint"], pid(prefix, u)) for u in (router, *own)}

        # one member of the set changes (mid's context): a dry run shows the router's turn in
        # both its members' lanes
        write_member(recipes, "mid-set", "mid", 768)
        planned = Roll(settings)
        roll_sets(settings, planned, prefix, dry_run=True)
        assert planned.planned == {("local", "mid"): [f"local-{PORT}"], ("local", "small"): [f"local-{PORT}"]}

        roll = Roll(settings)
        with Load(url, NAMES) as load:
            changes = roll_sets(settings, roll, prefix)
        assert not [c for c in changes if c.status == "failed"], changes
        print(f"a set's rolling change: {len(load.results)} requests, {len(load.failed)} failed")
        for r in roll.rolled:
            print(rolled_line(r))
        assert load.steady and not load.failed, (load.failed[:5], len(load.results))
        assert sorted((r.server, r.model, r.result, r.while_out, r.cut) for r in roll.rolled) == [
            (f"local-{PORT}", n, "changed", 0, 0) for n in sorted(NAMES)
        ], roll.rolled
        # the router restarted once: its one deploy operation changed, and it is a new process;
        # the single servers are the same processes
        restarted = [c for c in changes if c.status == "changed" and c.step.startswith("Ensure a managed process")]
        assert len(restarted) == 1, [(c.step, c.status) for c in changes]
        rec = record(prefix, router)
        assert rec["fingerprint"] != before[router][0] and pid(prefix, router) != before[router][1], rec
        assert rec["gate"]["status"] == "passed" and len(rec["gate"]["figures"]["per_member"]) == 2, rec
        for u in own:
            assert (record(prefix, u)["fingerprint"], pid(prefix, u)) == before[u]
        log = (Path(prefix) / "deploy" / "voltaforge-lb" / "server.log").read_text()
        for n in NAMES:
            assert f"Server model_{n}/local-{PORT} enters drain state" in log, log[-3000:]
            assert f"Server model_{n}/local-{SINGLE[n]} enters drain state" not in log, log[-3000:]
    finally:
        stop_served(settings, "local")
        lb_pid = Path(prefix) / "deploy" / "voltaforge-lb" / "server.pid"
        if lb_pid.exists():
            try:
                os.kill(int(lb_pid.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
