"""A model split across two llama.cpp RPC workers, for real, in a booted Debian 12 container
(systemd-nspawn, its own network namespace, no internet) over SSH, through the real CLI:

1. `invoke rpc-worker`: a dry run starts nothing; the run builds llama.cpp (GGML_RPC=ON) and
   starts two hardened ggml-rpc-server units, each listening on its one loopback address, as
   an unprivileged user; a second run changes nothing.
2. `invoke provision` of the recipe whose server dials them: its deploy holds the load log to
   the plan device by device (layers, weights, KV cache) and fails otherwise, then the gate
   runs. The record's buffers equal the plan here too, and a chat completion answers.
3. `invoke lb` puts HAProxy in front of that server, as a systemd unit (DynamicUser, the
   hardened unit as rendered), answering through it; a second run changes nothing.
4. `invoke status` lists both workers and the balancer with its backend up and its requests
   beside the server; a worker stopped: status says so, and
   provision's preflight refuses in one line, naming the endpoint, before anything changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import load_recipe
from tests.helpers import ROOT
from tests.test_provision_real import answers, inventory, provision, record, seeded_ccache, statuses  # noqa: F401

pytestmark = pytest.mark.slow
UNITS = ("voltaforge-rpc-18152.service", "voltaforge-rpc-18153.service")
LB = "voltaforge-lb.service"


def rpc_recipe(tmp_path: Path, host) -> Path:
    """tiny-rpc-cpu, its workers on the container ("box"), torch from the container's wheelhouse."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-rpc-cpu.yaml").read_text())
    data["toolchain"] = {**data["toolchain"], "torch_index": "https://pypi.org/simple",
                         "torch_find_links": str(host.wheelhouse)}  # fmt: skip
    data["rpc"] = [{**w, "worker": "box"} for w in data["rpc"]]
    d = tmp_path / "recipes"
    d.mkdir(exist_ok=True)
    (d / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = d / "tiny-rpc-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def rpc_worker(inv: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "rpc-worker", "--host", "box", "--inventory", str(inv),
         *extra],
        cwd=inv.parent, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip


def lb(inv: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "lb", "--host", "box", "--hosts", "box", "--port", "18000",
         "--inventory", str(inv), *extra],
        cwd=inv.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def status(inv: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "status", "--host", "box", "--inventory", str(inv), "--json"],
        cwd=inv.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    (found,) = json.loads(r.stdout)
    return found


def active(host, unit: str) -> bool:
    return host.run_inside(f"systemctl is-active --quiet {unit}", check=False).returncode == 0


@pytest.mark.timeout(3600)
@pytest.mark.usefixtures("cpu_alone")  # tests/helpers.cpu_alone
def test_a_model_split_across_two_rpc_workers(seeded_ccache, provisionable_nspawn_host, tmp_path):  # noqa: F811
    host = provisionable_nspawn_host
    path = rpc_recipe(tmp_path, host)
    inv = inventory(tmp_path, {"box": (host, path)})

    # 1. the workers
    dry = rpc_worker(inv, "--dry-run")
    assert dry.returncode == 0, dry.stdout[-4000:] + dry.stderr[-2000:]
    assert not any(active(host, u) for u in UNITS)
    run = rpc_worker(inv)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    for unit in UNITS:
        assert active(host, unit), host.run_inside(f"journalctl -u {unit} -o cat | tail -20", check=False).stdout
        assert host.run_inside(f"systemctl show -p User --value {unit}").stdout.strip() != "root"
    listening = host.run_inside("ss -Hltn").stdout
    assert "127.0.0.1:18152" in listening and "127.0.0.1:18153" in listening
    assert "0.0.0.0:1815" not in listening and "*:1815" not in listening
    again = rpc_worker(inv)
    assert again.returncode == 0 and ": 0 changed," in again.stdout, again.stdout[-4000:]

    # 2. the server over both workers: deploy holds the load log to the plan device by device
    code, [s], out, _ = provision(inv, "box")
    assert code == 0, out[-6000:]
    assert statuses(s)["deploy"] == "changed" and statuses(s)["gate"] == "changed", s
    buffers = record(host)["buffers"]
    plan = plan_recipe(load_recipe(path)).chosen
    assert plan is not None
    workers = [k for k in buffers["model_mib"] if k.startswith("RPC")]
    assert workers == ["RPC0[127.0.0.1:18152]", "RPC0[127.0.0.1:18153]"], buffers
    assert [buffers["model_mib"][k] for k in workers] == [round(d.weights_bytes / 2**20, 2) for d in plan.devices]
    assert [buffers["kv_mib"][k] for k in workers] == [round(d.kv_bytes / 2**20, 2) for d in plan.devices]
    print(
        f"\ncompute buffers: {json.dumps(buffers['compute_mib'])}; planned {plan.devices[0].compute_bytes / 2**20:.2f}"
    )
    reply = answers(host, 18090)
    assert reply["choices"][0]["message"]["content"]

    # the balancer in front of it, under systemd: a dry run installs nothing; then HAProxy runs
    # as a DynamicUser unit and answers; a second run changes nothing
    dry = lb(inv, "--dry-run")
    assert dry.returncode == 0 and not active(host, LB), dry.stdout[-3000:] + dry.stderr[-2000:]
    run = lb(inv)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert active(host, LB) and host.run_inside(f"systemctl show -p User --value {LB}").stdout.strip() != "root"
    body = json.dumps({"prompt": "Hello", "max_tokens": 4})
    through = host.run_inside(
        f"curl -sf -m 30 http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    ).stdout
    assert json.loads(through)["choices"][0]["text"] is not None
    again = lb(inv)
    assert again.returncode == 0 and ": 0 changed," in again.stdout, again.stdout[-4000:]

    # the workers and the balancer in `invoke status`, beside the server
    listed = status(inv)
    units = {u["unit"]: u for u in listed["units"]}
    assert [(u, units[u]["running"]) for u in UNITS] == [(u, True) for u in UNITS], listed
    assert [s["service"] for s in listed["services"]] == ["voltaforge-llama-server"]
    (backend,) = units[LB]["backends"]
    assert backend["name"] == "box" and backend["up"] and backend["requests"] >= 1, units[LB]
    assert backend["model"] == "tiny-llama"  # the served name its backend is routed by

    # 4. a worker gone: preflight refuses in one line before anything changes; the unit stays
    unit_file = host.run_inside("cat /etc/systemd/system/voltaforge-llama-server.service").stdout
    host.run_inside(f"systemctl stop {UNITS[1]}")
    stopped = {u["unit"]: u for u in status(inv)["units"]}
    assert stopped[UNITS[1]]["running"] is False and stopped[UNITS[1]]["state"] == "inactive (dead)", stopped
    code, [s], out, _ = provision(inv, "box")
    assert code == 1 and statuses(s)["preflight"] == "failed", out[-4000:]
    assert set(statuses(s).values()) == {"failed", "not reached"}, s
    why = s["steps"][0]["why"]
    # only the stopped one: the other is busy with the running server (one client at a time)
    assert why == "rpc-worker: the RPC worker 127.0.0.1:18153 refuses connections from box: nothing listens there"
    assert host.run_inside("cat /etc/systemd/system/voltaforge-llama-server.service").stdout == unit_file
    host.run_inside(f"systemctl start {UNITS[1]}")

    # 5. taken off (issue 52): `invoke remove` stops, disables and removes the server's unit and
    # both workers' units (every voltaforge-rpc-* unit without --recipe); the balancer is its own
    removed = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "remove", "--host", "box", "--inventory", str(inv)],
        cwd=inv.parent, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    assert removed.returncode == 0, removed.stdout[-3000:] + removed.stderr[-2000:]
    for unit in (*UNITS, "voltaforge-llama-server.service"):
        assert f"Stop the RPC worker {unit}" in removed.stdout or unit.startswith("voltaforge-llama"), removed.stdout
        assert not host.run_inside(f"ls /etc/systemd/system/{unit} 2>/dev/null; true").stdout.strip()
    left = host.run_inside("systemctl list-units --all --plain --no-legend 'voltaforge*'", check=False).stdout
    assert [line.split()[0] for line in left.splitlines() if line.strip()] == [LB], left
