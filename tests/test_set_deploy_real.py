"""A model set deployed for real on this machine (issue 55): three generated members of different
sizes in one inventory set under a CPU budget for two, their quantized GGUFs staged where
`invoke quantize` leaves them, then the set's deploy step (conduct/set_deploy.py) and its gate
(steps/measure/set_gate.py) run as provision runs them: a dry run first (it changes nothing),
then for real (the router started as a managed process, every member listed and answering
through it), a second run (nothing changes), `invoke status`'s reading of the members (each one's
state, child, memory and when it was last used), then stop and remove.

What this proves: the set's files as its engine renders them serve each member through one
port with the plan's count, and the lifecycle around it (record, status, stop, remove) reads that
router back. What it does not: the edge in front of it, or the one-minute load with its children
counted (tests/test_set_edge_real.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.conduct.model_sets import ServedSet
from playbooks.conduct.remove import remove_deployed
from playbooks.conduct.set_deploy import set_deploy_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.status import read_status
from playbooks.conduct.stop import stop_served
from playbooks.config.model_set import plan_set
from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.plan.gpus import GIB, MIB
from playbooks.steps.measure.set_gate import EnsureSetGate
from playbooks.steps.serve.lifecycle import EnsureServing
from tests.helpers import stage_served_model
from tests.model_set_members import WIDTHS, three_members
from tests.testhosts import free_port

pytestmark = pytest.mark.slow


def _ops(trio: ServedSet, host: LocalHost, prefix: str) -> list:
    ops = set_deploy_ops(trio, host, prefix, "process", gated=True)
    serving = next(op for op in ops if isinstance(op, EnsureServing))
    return [*ops, EnsureSetGate(serving, trio.members, trio.models_max, prefix, out_dir=Path(prefix) / "gate")]


def test_a_set_deployed_answers_for_each_member_and_is_shown_stopped_and_removed(tmp_path):
    recipes, ggufs = three_members(tmp_path)
    names = list(WIDTHS)
    alone = plan_set(names, memory_gib=4.0, recipes_dir=recipes).residency
    held = {m.name: m.held for m in alone.members}
    budget = (alone.parent + held["large"] + held["mid"] + MIB) / GIB  # two resident, never three
    prefix, port = tmp_path / "opt", free_port()
    inventory = tmp_path / "inventory.yaml"
    entry = {"set": "trio", "models": names, "port": port, "sleep_idle_s": 600}
    host_entry = {"host": "127.0.0.1", "local": True, "prefix": str(prefix), "memory_budget_gib": budget}
    inventory.write_text(yaml.safe_dump({"hosts": {"local": host_entry | {"serve": [entry]}}}))
    settings = Settings(inventory=inventory, recipes_dir=recipes)
    [trio] = settings.targets("local", None)
    assert isinstance(trio, ServedSet) and trio.models_max == 2 and trio.port == port

    with LocalHost() as host:
        for i, name in enumerate(names):
            stage_served_model(host, str(prefix), recipes / f"{name}.yaml", ggufs[name], tools=i == 0)
        state = prefix / "deploy" / "voltaforge-set-trio"
        # a dry run shows what it would do and changes nothing
        planned = run_ops(host, _ops(trio, host, str(prefix)), dry_run=True)
        assert not [c for c in planned if c.status == "failed"], planned
        assert not state.exists() and not (prefix / "serve" / "voltaforge-set-trio").exists()
        try:
            began = time.monotonic()
            done = run_ops(host, _ops(trio, host, str(prefix)))
            failed = [c for c in done if c.status == "failed"]
            assert not failed, (failed, (state / "server.log").read_text()[-3000:] if state.exists() else "")
            # the router's own cache (its unit's CacheDirectory=, here under its state directory):
            # the hub models it lists beside the preset's are none
            router_pid = (state / "server.pid").read_text().strip()
            environ = (Path("/proc") / router_pid / "environ").read_bytes().split(b"\0")
            assert f"LLAMA_CACHE={state}/cache/voltaforge-set-trio".encode() in environ, environ
            preset = (prefix / "serve" / "voltaforge-set-trio" / "models.ini").read_text()
            assert [line for line in preset.splitlines() if line.startswith("[")] == [f"[{n}]" for n in names]
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                listed = client.get("/v1/models").json()["data"]
                assert sorted(m["id"] for m in listed) == sorted(names)
                # the gate asked each in turn: two children at most, the two it asked last
                states = {m["id"]: m["status"]["value"] for m in listed}
                assert states == {"small": "unloaded", "mid": "loaded", "large": "loaded"}, states
            # the gate judged each member by its own recipe's gate (issue 56): its first token
            # after a swap (the set full without it: the router stopped the least recently used
            # child and loaded it), then its warm decode against its own roofline
            verdict = json.loads((state / "deployed.json").read_text())["gate"]
            each = verdict["figures"]["per_member"]
            assert verdict["status"] == "passed" and [m["name"] for m in each] == names, verdict
            evicted = {"small": "mid", "mid": "large", "large": "small"}
            for name, m in zip(names, each, strict=True):
                assert m["passed"] and m["reasons"] == [], m
                assert m["swap"]["evicted"] == evicted[name] and m["swap"]["first_token_s"] > 0, m
                assert m["single_tok_s"] >= m["gate"]["min_tok_s"] and m["single_halfwidth"] is not None, m
                assert m["roofline_tok_s"] or m["cache_resident"], m
            report = (Path(prefix) / "gate" / "set-gate.md").read_text()
            assert all(f"| {name} | " in report for name in names), report
            # a second run: nothing to do
            again = run_ops(host, _ops(trio, host, str(prefix)))
            assert {c.status for c in again} == {"ok"}, [(c.step, c.status, c.why) for c in again]
            # one member's own gate out of reach: the set fails, naming that member and no other
            data = yaml.safe_load((recipes / "mid.yaml").read_text())
            (recipes / "mid.yaml").write_text(yaml.safe_dump({**data, "gate": {**data["gate"], "min_tok_s": 1e6}}))
            [strict] = settings.targets("local", None)
            judged = run_ops(host, _ops(strict, host, str(prefix)))
            [failed] = [c for c in judged if c.status == "failed"]
            assert failed.why.startswith("the gate failed: mid: single-stream decode"), failed.why
            assert "small:" not in failed.why and "large:" not in failed.why, failed.why
            (recipes / "mid.yaml").write_text(yaml.safe_dump(data))

            # `invoke status`: the router's service and each member as it lists them, with what
            # each loaded member's child holds
            [local] = read_status(settings, ["local"])
            [service] = local["services"]
            assert service["service"] == "voltaforge-set-trio" and service["health"] == 200
            assert service["recipe"] == "set: small, mid, large" and service["note"] is None
            members = {m["name"]: m for m in service["members"]}
            assert [m["recipe"] for m in service["members"]] == names
            assert members["small"]["state"] == "unloaded" and members["small"]["child_pid"] is None
            for name in ("mid", "large"):
                m = members[name]
                assert m["state"] == "loaded" and m["child_pid"], m
                # its own memory and its mapped weights, within the plan's figure for it
                assert 0 < m["held_bytes"] <= held[name], (m, held[name])
            # each was last used by the gate, after the router started (its log's stamps)
            since = time.monotonic() - began + 1
            for name in names:
                assert members[name]["used"] is True and 0 <= members[name]["idle_s"] <= since, members[name]
        finally:
            stopped = stop_served(settings, "local")
        assert [c.status for c in stopped] == ["changed"], stopped
        [local] = read_status(settings, ["local"])
        [service] = local["services"]
        assert service["running"] is False and {m["state"] for m in service["members"]} == {"router down"}
        removed = remove_deployed(settings, "local", "trio", dry_run=False)
        assert not [c for c in removed if c.status == "failed"], removed
        assert not state.exists() and not (prefix / "serve" / "voltaforge-set-trio").exists()
