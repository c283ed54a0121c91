"""A model set behind the edge for a minute (issue 55's real test): three generated members of
different sizes in one inventory set on this machine, under a CPU budget that allows two resident;
the set deployed by its deploy step as a managed process with an API key (every member's
``api_key_ref``, the key in /etc/voltaforge/secrets/ as an operator leaves it), the balancer's
fleet read from its deployment record (conduct/fleet.py, as `invoke lb` reads it: each member's
name routed to the router, the members' key the edge's), HAProxy run from the configuration
`invoke lb` renders with its own copy of the key as its credential, and requests with the key
alternating among the three through the edge for a minute.

Held: every request answered 200; never more than two children alive, counted from every child's
start and exit in strace's record of the router (attached before the first child, not sampled);
each child's memory, as `invoke status` reads it, within its plan (at most the plan's figure, at
least 80% of it without the margin); the edge lists all three, loaded or not, answers 404 for a
model of no set and 401 without the key; after an idle spell the children sleep and hold less
than 60% of what they held awake."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest
import yaml

from playbooks.conduct.fleet import deployed_fleet
from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.set_deploy import set_deploy_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.status import read_status
from playbooks.conduct.stop import stop_served
from playbooks.config.model_set import plan_set
from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.plan.gpus import GIB, MIB
from playbooks.steps.measure.set_gate import EnsureSetGate
from playbooks.steps.serve.balancer import Balancer, render_haproxy_config
from playbooks.steps.serve.lifecycle import EnsureServing
from tests.helpers import stage_served_model
from tests.model_set_members import WIDTHS, alive_most, three_members
from tests.test_balancer_real import haproxy, wait_for
from tests.testhosts import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("haproxy"), reason="needs haproxy (Debian package: ci/install-system-deps.sh)"),
]
#: how long the requests alternate
MINUTE_S = 60
#: a child idle this long sleeps (its weights and KV cache unloaded, its process kept)
SLEEP_S = 4


@pytest.mark.timeout(600)
def test_a_set_behind_the_edge_serves_three_on_demand_for_a_minute(tmp_path, api_secret):
    ref, key, _ = api_secret
    recipes, ggufs = three_members(tmp_path, {"api_key_ref": ref})
    names = list(WIDTHS)
    alone = plan_set(names, memory_gib=4.0, recipes_dir=recipes).residency
    held = {m.name: m.held for m in alone.members}
    budget = (alone.parent + held["large"] + held["mid"] + MIB) / GIB  # two resident, never three
    prefix, port, lb_port, stats_port = tmp_path / "opt", free_port(), free_port(), free_port()
    entry = {"set": "trio", "models": names, "port": port, "sleep_idle_s": SLEEP_S}
    host_entry = {"host": "127.0.0.1", "local": True, "prefix": str(prefix), "memory_budget_gib": budget}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local": host_entry | {"serve": [entry]}}}))
    settings = Settings(inventory=inventory, recipes_dir=recipes)
    [trio] = settings.targets("local", None)
    assert isinstance(trio, ServedSet) and trio.models_max == 2
    plan = {m.name: m for m in trio.plan.residency.members}

    with LocalHost() as host:
        for i, name in enumerate(names):
            stage_served_model(host, str(prefix), recipes / f"{name}.yaml", ggufs[name], tools=i == 0)
        # deployed, no member asked yet: no child runs before strace is attached
        done = run_ops(host, set_deploy_ops(trio, host, str(prefix), "process"))
        assert not [c for c in done if c.status == "failed"], done
    state = prefix / "deploy" / "voltaforge-set-trio"
    router = int((state / "server.pid").read_text())
    trace = tmp_path / "router.strace"
    # every child's start and exit: -f follows what the router's threads start from now on
    tracer = subprocess.Popen(
        ["strace", "-f", "-q", "-e", "trace=execve", "-e", "signal=none", "-o", str(trace), "-p", str(router)],
        stderr=subprocess.DEVNULL,
    )
    lb_proc = None
    try:
        wait_for(lambda: trace.exists(), 10)
        fleet = deployed_fleet(settings, settings.host_spec("local"), [settings.host_spec("local")], None, None)
        assert sorted(b.model for b in fleet.backends) == sorted(names)
        assert {b.port for b in fleet.backends} == {port}  # each member's name routed to the router
        assert fleet.key_ref == ref  # the members' one key is the edge's
        lb = Balancer(fleet.recipe, fleet.backends, port=lb_port, stats_port=stats_port)
        cfg = render_haproxy_config(lb)
        # the edge's own copy of the key, as its credential (the unit's LoadCredential)
        creds = tmp_path / "edge-credentials"
        creds.mkdir(mode=0o700)
        (creds / "api-key").write_text(key + "\n")
        assert key not in cfg
        lb_proc, lb_log = haproxy(cfg, tmp_path, env={**os.environ, "CREDENTIALS_DIRECTORY": str(creds)})
        edge = f"http://127.0.0.1:{lb_port}"
        auth = {"Authorization": f"Bearer {key}"}
        wait_for(lambda: httpx.get(f"{edge}/v1/models", headers=auth, timeout=5).status_code == 200, 30)
        assert httpx.get(f"{edge}/v1/models", timeout=5).status_code == 401  # no key: the edge says no
        listed = httpx.get(f"{edge}/v1/models", headers=auth, timeout=5).json()["data"]
        assert sorted(m["id"] for m in listed) == sorted(names)  # listed at the edge, none loaded
        unknown = httpx.post(
            f"{edge}/v1/completions", json={"model": "no-such", "prompt": "x"}, headers=auth, timeout=10
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        answered, seen = 0, {n: 0 for n in names}
        peak: dict[str, int] = {}
        t0, i = time.monotonic(), 0
        with httpx.Client(base_url=edge, headers=auth, timeout=120) as client:
            while time.monotonic() - t0 < MINUTE_S:
                name = names[i % len(names)]
                r = client.post("/v1/completions", json={"model": name, "prompt": "ka lo mi", "max_tokens": 8})
                assert r.status_code == 200 and r.json()["model"] == name, (name, r.status_code, r.text[:300])
                answered, i = answered + 1, i + 1
                seen[name] += 1
                # what each loaded child holds, as `invoke status` reads it (after every request:
                # read after every third, the same two members were always the loaded ones)
                [local] = read_status(settings, ["local"])
                for m in local["services"][0]["members"]:
                    if m["held_bytes"]:
                        peak[m["name"]] = max(peak.get(m["name"], 0), m["held_bytes"])
        # idle: each child sleeps, its model unloaded
        time.sleep(SLEEP_S + 3)
        [local] = read_status(settings, ["local"])
        members = {m["name"]: m for m in local["services"][0]["members"]}
        asleep = [n for n, m in members.items() if m["state"] == "sleeping"]
        assert len(asleep) == 2 and all(m["state"] in ("sleeping", "unloaded") for m in members.values()), members
        asleep_bytes = sum(members[n]["held_bytes"] or 0 for n in asleep)

        # the set's gate with its key (issue 56), as provision runs it on this deployment (no
        # restart): each member's swap and its own gate through the keyed router, its children
        # counted by strace with the rest
        with LocalHost() as host:
            ops = set_deploy_ops(trio, host, str(prefix), "process", gated=True)
            serving = next(op for op in ops if isinstance(op, EnsureServing))
            gate = EnsureSetGate(serving, trio.members, trio.models_max, str(prefix), out_dir=tmp_path / "gate")
            judged = run_ops(host, [*ops, gate])
        assert not [c for c in judged if c.status == "failed"], judged
        assert int((state / "server.pid").read_text()) == router  # the same router, gated
        verdict = json.loads((state / "deployed.json").read_text())["gate"]
        assert verdict["status"] == "passed", verdict
        assert [m["name"] for m in verdict["figures"]["per_member"] if m["passed"]] == names, verdict
    finally:
        stop_served(settings, "local")  # the router's children end with it; strace ends with them
        tracer.wait(timeout=60)
        if lb_proc is not None:
            lb_proc.send_signal(signal.SIGTERM)
            lb_proc.wait(timeout=30)
    most, starts, exits = alive_most(trace.read_text(), attached=True)
    print(f"set behind the edge: {answered} answered in {MINUTE_S} s ({seen}); children {starts} started, "
          f"{exits} gone, at most {most} alive; peak held {peak}; asleep {asleep_bytes}")  # fmt: skip
    assert most == 2 and starts == exits >= 3, (most, starts, exits)
    for name, got in peak.items():
        m = plan[name]
        without_margin = m.held - dict(m.parts)["margin"]
        assert 0.8 * without_margin <= got <= m.held, (name, got, m)
    assert len(peak) == 3, peak  # each member was seen loaded at least once
    assert asleep_bytes < 0.6 * sum(peak[n] for n in asleep), (asleep_bytes, peak)
