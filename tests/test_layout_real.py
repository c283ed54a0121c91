"""Two recipes on one host through its inventory `serve:` layout, for real, in a booted Debian 12
container (systemd-nspawn, its own network namespace, no internet) over SSH, through the CLI:

1. `invoke provision --host box --dry-run` shows both recipes and changes nothing; then
   `invoke provision --host box` provisions each recipe of the layout in turn: `tiny-cpu` as two
   instances started from the llama-server instance template (`voltaforge-tiny-cpu@0` and `@1`,
   ports 18100 and 18101 from their environment files), and `tiny-b` (the same model under
   another name) as its own unit on 18080. Every server runs unprivileged and answers; each
   instance passed its own gate. A second run changes nothing, nor does `invoke deploy`.
2. `invoke lb` in front of every server the deployment records list (no `--recipe`): the two
   instances and tiny-b, one model by name, TLS at the edge; requests over HTTPS (curl given the
   controller's CA) reach all three (HAProxy's counters).
2b. A rolling change under load: tiny-cpu's context changes; `invoke provision --dry-run` shows
   the order, then provision drains each instance on the balancer, changes, gates and puts it
   back, one after the other, while a steady load through the edge (from inside the container)
   loses no request; HAProxy's journal says each was drained.
3. `invoke status` lists the three servers and the balancer; `invoke stop` stops every server of
   the layout, and nothing listens on their ports after.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from playbooks.conduct.balancer import tls_dir
from playbooks.config.model_set import plan_set
from playbooks.plan.gpus import GIB, MIB
from tests.helpers import ROOT
from tests.test_provision_real import answers, inventory, provision, recipe, seeded_ccache, statuses  # noqa: F401
from tests.test_rpc_split_real import LB, active, lb, status

pytestmark = pytest.mark.slow
INSTANCES = ("voltaforge-tiny-cpu@0.service", "voltaforge-tiny-cpu@1.service")
SINGLE = "voltaforge-tiny-b.service"
#: the model set's members (served names) and its router's unit and port
DUO = ("duo-a", "duo-b")
ROUTER = "voltaforge-set-duo.service"
SET_PORT = 18200
#: how long requests alternate between the set's two members through the edge
ALTERNATE_S = 30


def layout_inventory(tmp_path: Path, host) -> Path:
    """box serves tiny-cpu twice (ports 18100, 18101), tiny-b once (its own port, 18080) and a
    model set ``duo`` (issue 56) of two recipes of the same model under their own names, duo-a
    and duo-b, through one router on 18200, with a budget that holds one of them at a time."""
    # one gate level: three servers are gated one after the other, and the gate itself is
    # tested elsewhere (tests/test_provision_real.py)
    tiny = recipe(tmp_path, host, "a", gate={"levels": [1]})
    b = tiny.parent / "tiny-b.yaml"
    b.write_text(tiny.read_text())
    members = []
    for name in DUO:
        data = yaml.safe_load(tiny.read_text())
        data["name"] = name
        data["service"] = {**data.get("service", {}), "model_name": name}
        members.append(tiny.parent / f"{name}.yaml")
        members[-1].write_text(yaml.safe_dump(data))
    one = plan_set([str(m) for m in members], memory_gib=4.0).residency
    inv = inventory(tmp_path, {"box": (host, tiny)})
    data = yaml.safe_load(inv.read_text())
    entry = data["hosts"]["box"]
    del entry["recipe"]
    entry["serve"] = [
        {"recipe": str(tiny), "instances": 2, "port": 18100},
        {"recipe": str(b)},
        {"set": "duo", "models": [str(m) for m in members], "port": SET_PORT},
    ]
    # room for the router and one member's child, not two: each member's gate evicts the other
    entry["memory_budget_gib"] = (one.parent + max(m.held for m in one.members) + MIB) / GIB
    inv.write_text(yaml.safe_dump(data))
    return inv


def write_recipe_context(inv: Path, recipe_name: str, context: int) -> None:
    """The layout's recipe of that name with another context (a flag of its servers)."""
    for entry in yaml.safe_load(inv.read_text())["hosts"]["box"]["serve"]:
        path = Path(entry["recipe"])
        data = yaml.safe_load(path.read_text())
        if data.get("name", path.stem) == recipe_name:
            path.write_text(yaml.safe_dump({**data, "context": context}))
            return
    raise AssertionError(f"no recipe {recipe_name} in the layout")


# a steady load through the edge from inside the container, until /root/load.stop appears
LOAD_SCRIPT = """
import json, os, ssl, threading, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
ctx = ssl.create_default_context(cafile="/root/edge-ca.pem")
def one(i):
    body = json.dumps({"model": "tiny-llama", "prompt": f"Count {i}", "max_tokens": 8, "ignore_eos": True}).encode()
    req = urllib.request.Request("https://localhost:18000/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=90) as r:
            return "ok" if json.load(r)["usage"]["completion_tokens"] == 8 else "short"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
futures, t0, i = [], time.monotonic(), 0
with ThreadPoolExecutor(8) as pool:
    while not os.path.exists("/root/load.stop"):
        futures.append(pool.submit(one, i))
        i += 1
        time.sleep(max(0.0, t0 + i / 8 - time.monotonic()))
    results = [f.result() for f in futures]
failed = [r for r in results if r != "ok"]
json.dump({"sent": len(results), "failed": failed[:10]}, open("/root/load.json", "w"))
"""


# requests alternating between the set's two members through the edge, one at a time, for
# ALTERNATE_S seconds: each answer's status and the model it names, in order
ALTERNATE_SCRIPT = """
import json, ssl, sys, time, urllib.error, urllib.request
ctx = ssl.create_default_context(cafile="/root/edge-ca.pem")
seen, end, i = [], time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    model = ("duo-a", "duo-b")[i % 2]
    body = json.dumps({"model": model, "prompt": f"Count {i}", "max_tokens": 8, "ignore_eos": True}).encode()
    req = urllib.request.Request("https://localhost:18000/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=90) as r:
            seen.append([model, r.status, json.load(r).get("model")])
    except urllib.error.HTTPError as exc:
        seen.append([model, exc.code, exc.read()[:200].decode("utf-8", "replace")])
    except Exception as exc:
        seen.append([model, 0, f"{type(exc).__name__}: {exc}"])
    i += 1
print(json.dumps(seen))
"""


def set_children(host) -> tuple[int, set[int], dict[int, str]]:
    """(the router's main pid, its children's pids, each one's control group as the kernel
    says it: /proc/PID/cgroup, its unified-hierarchy line)."""
    main = int(host.run_inside(f"systemctl show -p MainPID --value {ROUTER}").stdout.strip())
    kids = {int(k) for k in host.run_inside(f"pgrep -P {main} || true").stdout.split()}
    groups = {}
    for pid in kids | {main}:
        lines = host.run_inside(f"cat /proc/{pid}/cgroup").stdout.splitlines()
        groups[pid] = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
    return main, kids, groups


@contextlib.contextmanager
def container_load(host):
    """The load running while the block runs; its tally (requests sent, failures) yielded."""
    (host.rootfs / "root" / "load.py").write_text(LOAD_SCRIPT)
    for name in ("load.stop", "load.json"):
        (host.rootfs / "root" / name).unlink(missing_ok=True)
    proc = subprocess.Popen(
        host.ssh_command("python3 /root/load.py", user="root"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    tally: dict = {}
    try:
        time.sleep(1)
        yield tally
    finally:
        time.sleep(1)
        (host.rootfs / "root" / "load.stop").write_text("")
        said = proc.communicate(timeout=180)[0]
        done = host.rootfs / "root" / "load.json"
        tally.update(json.loads(done.read_text()) if done.exists() else {"sent": 0, "failed": [said.decode()[-2000:]]})


def invoke(inv: Path, *args: str) -> subprocess.CompletedProcess:
    # a wide table (rich reads COLUMNS when piped): each operation's name on one line
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), *args, "--inventory", str(inv)],
        cwd=inv.parent, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip


@pytest.mark.timeout(3600)
@pytest.mark.usefixtures("cpu_alone")  # tests/helpers.cpu_alone
def test_two_recipes_and_two_instances_on_one_host(seeded_ccache, provisionable_nspawn_host, tmp_path):  # noqa: F811
    host = provisionable_nspawn_host
    inv = layout_inventory(tmp_path, host)

    # 1. a dry run of the layout shows both recipes and starts or writes nothing
    code, summary, out, _ = provision(inv, "box", "--dry-run")
    assert code == 0 and [s["recipe"] for s in summary] == ["tiny-cpu", "tiny-b", "duo"], out[-4000:]
    assert all(statuses(s)["deploy"] in ("would change", "not reached") for s in summary), summary
    assert not any(active(host, u) for u in (*INSTANCES, SINGLE, ROUTER))
    assert host.run_inside(f"ls {host.prefix}/deploy 2>/dev/null || true").stdout.strip() == ""

    # each recipe of the layout, in turn, from nothing
    code, summary, out, _ = provision(inv, "box")
    assert code == 0, out[-6000:]
    assert [s["recipe"] for s in summary] == ["tiny-cpu", "tiny-b", "duo"], summary
    first, second, duo = summary
    assert statuses(first)["deploy"] == "changed" and statuses(first)["gate"] == "changed", first
    # the second and the set share the first's build and weights: only their own servers are new
    for later in (second, duo):
        assert statuses(later)["build"] == "ok" and statuses(later)["quantize"] == "ok", later
        assert statuses(later)["deploy"] == "changed" and statuses(later)["gate"] == "changed", later
    assert "3 of 3 recipes provisioned" in out, out[-3000:]
    # the set's router under systemd, gated per member: each one's first token after a swap (the
    # budget holds one: the other evicted) and its own recipe's gate
    verdict = json.loads(host.run_inside(f"cat {host.prefix}/deploy/voltaforge-set-duo/deployed.json").stdout)["gate"]
    each = verdict["figures"]["per_member"]
    assert verdict["status"] == "passed" and [m["name"] for m in each] == list(DUO), verdict
    assert [m["swap"]["evicted"] for m in each] == ["duo-b", "duo-a"] and all(m["passed"] for m in each), each
    for unit in (*INSTANCES, SINGLE, ROUTER):
        assert active(host, unit), host.run_inside(f"journalctl -u {unit} -o cat | tail -20", check=False).stdout
        assert host.run_inside(f"systemctl show -p User --value {unit}").stdout.strip() != "root"
    listening = host.run_inside("ss -Hltn").stdout
    for port in (18100, 18101, 18080):
        assert f"127.0.0.1:{port}" in listening, listening
        assert answers(host, port)["choices"][0]["message"]["content"]
    # each instance was gated on its own port
    for i, port in enumerate((18100, 18101)):
        rec = json.loads(host.run_inside(f"cat {host.prefix}/deploy/voltaforge-tiny-cpu@{i}/deployed.json").stdout)
        assert rec["port"] == port and rec["gate"]["status"] == "passed", rec
    # a second run changes nothing, for either recipe; nor does `invoke deploy` of the layout
    # (both recipes' operations in one converge, the shared ones once)
    code, summary, out, _ = provision(inv, "box")
    assert code == 0 and [set(statuses(s).values()) for s in summary] == [{"ok"}] * 3, out[-4000:]
    again = invoke(inv, "deploy", "--host", "box")
    assert again.returncode == 0 and ": 0 changed," in again.stdout, again.stdout[-4000:] + again.stderr[-2000:]
    for unit in (*INSTANCES, SINGLE):
        assert unit in again.stdout, again.stdout[-4000:]
    # what `invoke render --host box` writes from the inventory alone, without connecting, is
    # exactly what the host got: every file, byte for byte, with its mode (issue 36, item 2),
    # and nothing the host got that render did not write (issue 51, item 3)
    out_dir = tmp_path / "rendered"
    shown = invoke(inv, "render", "--host", "box", "--out", str(out_dir))
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr[-2000:]
    rendered = [p for p in out_dir.rglob("*") if p.is_file()]
    # three units (one a template), two instance env files, the set's preset
    assert len(rendered) >= 6, rendered
    assert (out_dir / "etc/systemd/system" / ROUTER).is_file(), rendered
    for p in rendered:
        installed = host.rootfs / p.relative_to(out_dir)
        assert installed.read_text() == p.read_text(), p
        assert installed.stat().st_mode & 0o777 == p.stat().st_mode & 0o777, p
    # ...and the other way: every file deploy installed (units with any drop-in, environment
    # files, configurations, under /etc/systemd/system and /etc/voltaforge) is one render wrote.
    # Not rendered, so not counted: the operator's secrets (/etc/voltaforge/secrets) and the
    # state deploy keeps under <prefix>/deploy/ (the deployment records; the balancers' records
    # under deploy/balancers/ are `invoke lb`'s, made after this point)
    find = "find /etc/systemd/system /etc/voltaforge -path /etc/voltaforge/secrets -prune -o -type f -print"

    def on_host() -> set[str]:
        return {p for p in host.run_inside(f"{find} 2>/dev/null || true").stdout.split() if "voltaforge" in p}

    wrote = {"/" + str(p.relative_to(out_dir)) for p in rendered}
    wrote = {p for p in wrote if p.startswith(("/etc/systemd/", "/etc/voltaforge/"))}  # the preset is the prefix's
    assert on_host() == wrote, on_host()
    # the control: that comparison sees a file render did not write (a drop-in left on the unit)
    stray = f"/etc/systemd/system/{SINGLE}.d/stray.conf"
    host.run_inside(f"mkdir -p {Path(stray).parent} && printf '[Service]\\n' > {stray}")
    assert on_host() - wrote == {stray}
    host.run_inside(f"rm -r {Path(stray).parent}")

    # 2. a balancer in front of every server of the layout, as the deployment records list
    # them (no --recipe): one model (tiny-b is tiny-cpu's model under another recipe name),
    # three backends, TLS at the edge (the controller's self-signed pair; curl given its CA)
    run = lb(inv, "--tls", "on")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    said = " ".join(run.stdout.split())
    assert "model tiny-llama: box-18080 127.0.0.1:18080, box-18100 127.0.0.1:18100, box-18101" in said, said
    for name in DUO:  # each member's name routed to the set's router
        assert f"model {name}: box-{SET_PORT} 127.0.0.1:{SET_PORT}" in said, said
    assert active(host, LB)
    (host.rootfs / "root" / "edge-ca.pem").write_bytes((tls_dir("box") / "cert.pem").read_bytes())
    body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2})
    for _ in range(9):
        host.run_inside(
            "curl -sf -m 30 --cacert /root/edge-ca.pem https://localhost:18000/v1/completions "
            f"-H 'Content-Type: application/json' -d '{body}'"
        )

    # 2a. the set under systemd (issue 56): requests alternating between its two members through
    # the edge for ALTERNATE_S seconds, each a swap (one member resident at a time), all
    # answered by the member asked for; the router's children are in its unit's control group
    (host.rootfs / "root" / "alternate.py").write_text(ALTERNATE_SCRIPT)
    seen = json.loads(host.run_inside(f"python3 /root/alternate.py {ALTERNATE_S}", timeout=ALTERNATE_S + 120).stdout)
    assert len(seen) >= 10 and all(status == 200 and got == model for model, status, got in seen), seen[:10]
    main, kids, groups = set_children(host)
    unit_group = host.run_inside(f"systemctl show -p ControlGroup --value {ROUTER}").stdout.strip()
    assert len(kids) == 1 and set(groups.values()) == {unit_group}, (main, kids, groups, unit_group)
    assert unit_group.endswith(f"/{ROUTER}"), unit_group
    [child] = kids
    assert "llama-server" in host.run_inside(f"cat /proc/{child}/cmdline").stdout
    print(f"set under systemd: {len(seen)} alternating requests in {ALTERNATE_S} s, all answered")

    # 2b. a rolling change under load (issue 33): tiny-cpu's context changes, so both of its
    # instances restart; each is drained on the balancer (the runtime API, through sudo: the
    # unit's dynamic user owns the socket), changed, gated and put back, one after the other,
    # while a steady load through the edge loses nothing (tiny-b keeps serving throughout)
    write_recipe_context(inv, "tiny-cpu", 1024)
    code, _, out, _ = provision(inv, "box", "--dry-run")
    said = " ".join(out.split())
    assert (
        code == 0
        and ("rolling model tiny-llama behind the balancer on box, one server at a time: box-18100, then box-18101")
        in said
    ), out[-4000:]
    with container_load(host) as load:
        code, summary, out, _ = provision(inv, "box")
    assert code == 0, out[-6000:]
    assert statuses(summary[0])["deploy"] == "changed", summary
    assert set(statuses(summary[1]).values()) == set(statuses(summary[2]).values()) == {"ok"}, summary
    assert [(r["server"], r["result"], r["while_out"]) for r in summary[0]["rolled"]] == [
        ("box-18100", "changed", 0), ("box-18101", "changed", 0),
    ], summary[0]  # fmt: skip
    assert load["sent"] >= 40 and not load["failed"], load
    journal = host.run_inside(f"journalctl -u {LB} -o cat", check=False).stdout
    for server in ("box-18100", "box-18101"):
        assert f"Server model_tiny-llama/{server} enters drain state" in journal, journal[-3000:]
        assert f"Server model_tiny-llama/{server} is UP (leaving forced drain)" in journal, journal[-3000:]
    assert "model_tiny-llama/box-18080 enters drain state" not in journal, journal[-3000:]

    # 3. everything in `invoke status`; `invoke stop` stops every server of the layout
    listed = status(inv)
    assert sorted(s["service"] for s in listed["services"]) == [
        "voltaforge-set-duo",
        "voltaforge-tiny-b",
        "voltaforge-tiny-cpu@0",
        "voltaforge-tiny-cpu@1",
    ], listed
    backends = {u["unit"]: u for u in listed["units"]}[LB]["backends"]
    assert sorted((b["name"], b["up"]) for b in backends) == [
        ("box-18080", True), ("box-18100", True), ("box-18101", True),
        (f"box-{SET_PORT}", True), (f"box-{SET_PORT}", True),
    ], backends  # fmt: skip
    assert all(b["requests"] >= 1 for b in backends), backends
    main, kids, _ = set_children(host)
    stopped = invoke(inv, "stop", "--host", "box")
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-2000:]
    assert not any(active(host, u) for u in (*INSTANCES, SINGLE, ROUTER))
    listening = host.run_inside("ss -Hltn").stdout
    assert not any(f"127.0.0.1:{p}" in listening for p in (18100, 18101, 18080, SET_PORT)), listening
    # the router's stop stopped its children with it (its unit's control group, killed whole)
    assert kids and not host.run_inside(f"ps -o pid= -p {','.join(map(str, kids | {main}))} || true").stdout.strip()
    assert host.run_inside("pgrep llama-server || true").stdout.strip() == "", "a llama-server is left running"

    # 4. taken off (issue 52): `invoke remove` disables and removes every server's unit, its
    # environment files and its state (the record, good/, the model's links), then `invoke lb
    # --remove` the balancer's unit, configuration, TLS pair and its record on the host; a
    # second run changes nothing. Left: the operator's secrets, the weights and the build.
    removed = invoke(inv, "remove", "--host", "box")
    assert removed.returncode == 0, removed.stdout[-3000:] + removed.stderr[-2000:]
    gone = invoke(inv, "lb", "--host", "box", "--remove")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-2000:]
    assert [p for p in host.run_inside(f"{find} 2>/dev/null; true").stdout.split() if "voltaforge" in p] == []
    left = host.run_inside(f"ls -A {host.prefix}/deploy; ls -A {host.prefix}/serve; true").stdout.split()
    assert left == [], left
    units = host.run_inside("systemctl list-units --all --plain --no-legend 'voltaforge*'", check=False).stdout
    assert units.strip() == "" and not active(host, LB), units
    for again in (invoke(inv, "remove", "--host", "box"), invoke(inv, "lb", "--host", "box", "--remove")):
        assert again.returncode == 0 and "box: 0 changed" in again.stdout, again.stdout[-3000:]
    kept = f"{host.prefix}/models/*/gguf/*.gguf {host.prefix}/llama.cpp/current/bin/llama-server"
    assert host.run_inside(f"ls {kept}").stdout
