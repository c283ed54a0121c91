"""RPC workers (steps/serve/rpc_worker.py, the recipe's rpc: entries): the worker's unit and the
server's flags, the refusals, and the operation's decision table. The real thing, workers
started by systemd and a server split across them, is tests/test_rpc_split_real.py."""

from __future__ import annotations

import shutil

import pytest

from playbooks.config.recipe import load_recipe
from playbooks.errors import RecipeError, VoltaforgeError
from playbooks.steps.serve.engine_llamacpp import render_llama_server_unit
from playbooks.steps.serve.rpc_worker import RpcLayout, render_rpc_unit, rpc_worker_op, workers_on
from playbooks.steps.serve.unit_running import UnitFacts
from playbooks.steps.serve.units import parse_exec_start
from tests.helpers import recipe_with
from tests.test_units import exposure

needs_systemd = pytest.mark.skipif(
    not shutil.which("systemd-analyze"),
    reason="needs systemd-analyze (Debian package systemd: ci/install-system-deps.sh)",
)
REMOTE = """rpc:
  - {endpoint: "10.0.0.2:50052", worker: gpu-02, allow_from: [10.0.0.1], gpu: 1}
  - {endpoint: "10.0.0.3:50052", worker: gpu-03, allow_from: [10.0.0.1]}
tensor_split: [1, 1, 2]
"""


@needs_systemd
def test_the_worker_unit_listens_on_one_address_and_scores_at_most_2(tmp_path):
    r = load_recipe("tiny-rpc-cpu").recipe
    (w, _) = r.rpc
    layout = RpcLayout("/opt/voltaforge", w.port)
    text = render_rpc_unit(r, w, layout)
    assert parse_exec_start(text) == [
        "/opt/voltaforge/llama.cpp/current/bin/ggml-rpc-server", "--host", "127.0.0.1", "--port", "18152",
    ]  # fmt: skip
    assert "IPAddressDeny=any\nIPAddressAllow=localhost\n" in text and "DynamicUser=yes" in text
    assert exposure(text, tmp_path, layout.unit_name) <= 2.0


@needs_systemd
def test_a_gpu_worker_on_the_network_lets_in_the_server_only(tmp_path):
    r = load_recipe(recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", REMOTE)).recipe
    w = workers_on(r, "gpu-02")[0]
    text = render_rpc_unit(r, w, RpcLayout("/opt/voltaforge", w.port))
    assert "--host 10.0.0.2 --port 50052" in text
    assert "IPAddressAllow=10.0.0.1" in text and "CUDA_VISIBLE_DEVICES=1" in text
    assert "DeviceAllow=/dev/nvidia1 rw" in text and "PrivateDevices" not in text
    assert exposure(text, tmp_path, "voltaforge-rpc-50052.service") <= 2.0
    # the server dials both, RPC devices first, and its loopback-only filter lets it reach them
    server = render_llama_server_unit(r).text
    assert "--rpc 10.0.0.2:50052,10.0.0.3:50052 --split-mode layer --tensor-split 1,1,2" in server
    assert "IPAddressAllow=10.0.0.2\n" in server and "IPAddressAllow=10.0.0.3\n" in server
    assert exposure(server, tmp_path) <= 2.0


@pytest.mark.parametrize(
    "entry,match",
    [
        ('{endpoint: "0.0.0.0:50052"}', "not 0.0.0.0"),
        ('{endpoint: "10.0.0.2:50052"}', "needs allow_from"),
        ('{endpoint: "127.0.0.1:80"}', "port from 1024"),
        ('{endpoint: "gpu-02:50052"}', "must be IP:PORT"),
        ('{endpoint: "127.0.0.1:50052", allow_from: [everyone]}', "not an IP address"),
        ('{endpoint: "127.0.0.1:50052", worker: "a b"}', "inventory host name"),
    ],
)
def test_bad_workers_are_refused_with_the_key(tmp_path, entry, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe_with(tmp_path, "tiny-cpu", f"rpc:\n  - {entry}\n"))


def test_a_split_needs_one_share_per_device(tmp_path):
    with pytest.raises(RecipeError, match="2 share.*3 device"):
        load_recipe(recipe_with(tmp_path, "qwen2.5-14b-v100-16gb", REMOTE.replace("[1, 1, 2]", "[1, 1]")))


def test_a_host_the_recipe_does_not_name_is_refused():
    with pytest.raises(VoltaforgeError, match="names no RPC worker on gpu-09.*127.0.0.1:18152 \\(local\\)"):
        workers_on(load_recipe("tiny-rpc-cpu").recipe, "gpu-09")


def test_the_worker_runs_what_was_rendered_on_the_current_build():
    r = load_recipe("tiny-rpc-cpu").recipe
    w = r.rpc[0]
    layout = RpcLayout("/opt/voltaforge", w.port)
    op = rpc_worker_op(w, layout, render_rpc_unit(r, w, layout))
    build = "/opt/voltaforge/llama.cpp/builds/0c1e570-cpu-abc"
    same = op.fingerprint(build)
    assert op.decide(UnitFacts(True, "active (running), pid 7", build, same)).commands == ()
    for facts, why in (
        (UnitFacts(False, "inactive (dead)", build, ""), "not running"),
        (UnitFacts(True, "active (running), pid 7", build + "x", same), "its unit, configuration or build changed"),
        (UnitFacts(True, "active (running), pid 7", build, ""), "running, but not started by voltaforge"),
    ):
        d = op.decide(facts)
        assert d.commands and d.reason.startswith(why)
        shown = d.shown()
        assert shown[0].startswith("systemctl daemon-reload") and "/dev/tcp/127.0.0.1/18152" in shown[1]
        assert op.fingerprint(facts.extra) in shown[2]  # the record names what it started from
    assert "readlink -f -- /opt/voltaforge/llama.cpp/current" in (op.extra_command or "")


def test_preflight_refuses_a_worker_it_cannot_reach():
    from playbooks.facts.rpc import parse_reach_timed, reach_command
    from playbooks.steps.preflight import judge
    from tests.test_preflight_judge import facts

    loaded = load_recipe("tiny-rpc-cpu")
    cmd = reach_command([w.endpoint for w in loaded.recipe.rpc])
    assert "/dev/tcp/127.0.0.1/18152" in cmd and cmd.count("timeout 3 bash -c") == 2
    timed = parse_reach_timed("127.0.0.1:18152 open 210\n127.0.0.1:18153 refused 90\ngarbage\n")
    assert timed == {"127.0.0.1:18152": ("open", 0.21), "127.0.0.1:18153": ("refused", 0.09)}
    seen = {e: state for e, (state, _) in timed.items()}
    v = judge(facts(rpc=seen), loaded, "/opt/voltaforge/models", "/opt/voltaforge")
    checks = [c for c in v.checks if c.name == "rpc-worker"]
    assert [c.status for c in checks] == ["pass", "fail"] and not v.ok
    assert checks[1].detail.startswith("the RPC worker 127.0.0.1:18153 refuses connections from v100-01")
    assert "invoke rpc-worker --host local --recipe tiny-rpc-cpu" in checks[1].fix
    # busy (a running server holds the worker) or filtered: said, not blocking
    busy = judge(facts(rpc={"127.0.0.1:18152": "timeout", "127.0.0.1:18153": "open"}), loaded, "/m", "/opt/vf")
    assert [c.status for c in busy.checks if c.name == "rpc-worker"] == ["warn", "pass"]


def test_the_probe_tells_refused_from_open_for_real():
    """The command itself, on this machine: a listening port, and a closed one."""
    import socket
    import subprocess

    from playbooks.facts.rpc import parse_reach_timed, reach_command

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: the kernel refuses
        a, b = (f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, closed))
        out = subprocess.run(["bash", "-c", reach_command([a, b])], capture_output=True, text=True, timeout=30)
    found = parse_reach_timed(out.stdout)
    assert {e: state for e, (state, _) in found.items()} == {a: "open", b: "refused"}
    state, ms = found[a]
    assert state == "open" and ms is not None and 0 < ms < 3000  # the connect time, for the plan's network hop
