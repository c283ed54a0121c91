"""Everything voltaforge starts can be stopped and removed (issue 52), for real on this machine
without systemd (managed processes; the systemd path runs in the booted container:
tests/test_layout_real.py), through the CLI as a user types it:

1. a keyed recipe deployed and stopped, then two unkeyed servers of a layout deployed: `invoke lb`
   leaves the stopped one out, in one line, and its key does not block the others (before: "the
   backends take different keys"); `invoke status` shows it stopped;
2. the balancer's HAProxy dies, its record stays on the host: a change of a server it fronted
   (provision's deploy step, driven as provision drives it) fails before anything is written,
   naming the balancer, the record and the commands that settle it; with --in-place the server
   changes in place, and no line says it was drained or put back in rotation;
3. `invoke lb --stop` and `--remove`: the balancer stopped, then taken off, its record leaving
   the backend host each time;
4. `invoke remove`: --dry-run lists and changes nothing; --recipe takes one recipe's server off
   and leaves the others serving; without it every deployment goes; a second run is ``ok``; the
   weights and the build stay.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from playbooks.conduct.deploy import deploy_ops
from playbooks.conduct.roll import Roll
from playbooks.conduct.settings import Settings
from playbooks.errors import HostError
from playbooks.host import connect
from playbooks.host.base import Printer
from playbooks.steps.measure.gate import EnsureGate
from playbooks.steps.serve.lifecycle import EnsureServing
from tests import llamacpp_tools
from tests.helpers import ROOT, exited, stage_served_model

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
PORTS = {"tiny-a": 18511, "tiny-b": 18512, "tiny-k": 18513}
LB_PORT = 18520
KEYED = "voltaforge-llama-server"  # the keyed recipe deployed alone: the default unit's name


def write_recipe(where: Path, name: str, context: int = 1024, key_ref: str | None = None) -> Path:
    data = json.loads(json.dumps(TINY))
    data |= {"name": name, "parallel": 1, "context": context}
    data["service"] = {"port": PORTS[name], **({"api_key_ref": key_ref} if key_ref else {})}
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 8, "min_tok_s": 1}
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def api_key():
    """A key in /etc/voltaforge/secrets/ (root's, 0600, as an operator leaves it); removed after."""
    ref = f"vf-life-{os.getpid()}"
    path = Path("/etc/voltaforge/secrets") / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, (secrets.token_urlsafe(24) + "\n").encode())
    os.close(fd)
    yield ref
    path.unlink(missing_ok=True)


def said(out: str) -> str:
    return " ".join(out.split())


def record(prefix: str, name: str) -> dict:
    return json.loads((Path(prefix) / "deploy" / f"voltaforge-{name}" / "deployed.json").read_text())


def change_one(settings: Settings, roll: Roll, prefix: str, name: str) -> list:
    """One recipe of the layout changed as provision's deploy and gate steps run it."""
    [served] = [s for s in settings.serves("local", None) if s.name == name]
    with connect(settings.host_spec("local")) as host:
        ops = deploy_ops(served.loaded, host, prefix, "auto", served.gpus, gated=True, server=served.layout(prefix))
        gates = [EnsureGate(op, served.loaded, prefix) for op in ops if isinstance(op, EnsureServing)]
        rolled = roll.deploy(host, prefix, served.name, Printer(), ops, gates, dry_run=False)
        assert rolled is not None, "no balancer record"
        return rolled.deploy + rolled.gate


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(900)
def test_stopped_stale_and_removed(tmp_path, tmp_path_factory, monkeypatch, api_key):
    work = tmp_path / "w"
    q4 = llamacpp_tools.quantize(llamacpp_tools.tiny_f16(work, TINY["model"]["config"]), work / "q4.gguf", "Q4_K_M")
    prefix = str(tmp_path_factory.mktemp("vf"))  # short: the runtime API's socket lives under it
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    layout = {n: write_recipe(recipes, n) for n in ("tiny-a", "tiny-b")}
    keyed = write_recipe(recipes, "tiny-k", key_ref=api_key)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        yaml.safe_dump(
            {
                "hosts": {"local": {"prefix": prefix, "serve": [{"recipe": str(p)} for p in layout.values()]}},
                "lb": {"hosts": ["local"], "port": LB_PORT},
            }
        )
    )
    # the keyed recipe deployed beside the layout from an inventory of its own (a layout host
    # takes no other recipe), at the same prefix
    inv_k = tmp_path / "keyed.yaml"
    inv_k.write_text(yaml.safe_dump({"hosts": {"local": {"prefix": prefix, "recipe": str(keyed)}}}))
    settings = Settings(inventory=inv)
    with connect(settings.host_spec("local")) as here:
        for p in (*layout.values(), keyed):
            gguf = stage_served_model(here, prefix, p, q4, "Q4_K_M")
    cache = tmp_path / "cache"
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(cache))
    env = {**os.environ, "VOLTAFORGE_CACHE": str(cache), "VOLTAFORGE_LOG_DIR": str(tmp_path / "logs"), "COLUMNS": "200"}
    lb_pid = Path(prefix) / "deploy" / "voltaforge-lb" / "server.pid"
    lb_record = Path(prefix) / "deploy" / "balancers" / "local.json"

    def invoke(*args: str, inventory: Path = inv) -> tuple[int, str]:
        argv = [sys.executable, "-m", "invoke", "-r", str(ROOT), args[0], "--inventory", str(inventory), *args[1:]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        return r.returncode, r.stdout + r.stderr

    try:
        # 1. a keyed server deployed, then stopped; the layout's two unkeyed servers deployed
        for args, where in ((("deploy",), inv_k), (("stop",), inv_k), (("deploy",), inv)):
            code, out = invoke(*args, "--host", "local", inventory=where)
            assert code == 0, out[-3000:]
        code, out = invoke("lb", "--host", "local")
        assert code == 0, out[-3000:]
        assert f"local: {KEYED} (tiny-k) is stopped: left out of the balancer" in said(out), out[-3000:]
        assert "model tiny-llama: local-18511 127.0.0.1:18511, local-18512 127.0.0.1:18512" in said(out), out
        reply = httpx.post(f"http://127.0.0.1:{LB_PORT}/v1/completions", trust_env=False, timeout=60,
                           json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        assert reply.status_code == 200, reply.text
        code, out = invoke("status", "--host", "local", "--json")
        [seen] = json.loads(out[out.index("[") :])
        running = {s["service"]: s["running"] for s in seen["services"]}
        assert running == {"voltaforge-tiny-a": True, "voltaforge-tiny-b": True, KEYED: False}, seen

        # 2. HAProxy dies, its record stays: a change behind it fails before anything is written
        os.kill(int(lb_pid.read_text()), signal.SIGTERM)
        for _ in range(50):
            if not Path(f"/proc/{lb_pid.read_text().strip()}").exists():
                break
            time.sleep(0.1)
        assert lb_record.exists()
        before = record(prefix, "tiny-a")["fingerprint"]
        write_recipe(recipes, "tiny-a", context=768)
        with pytest.raises(HostError) as stale:
            change_one(settings, Roll(settings), prefix, "tiny-a")
        text = said(str(stale.value))
        assert (
            f"local-18511 is fronted by the balancer on local (its record {lb_record} on local), whose runtime "
            "API does not answer: HAProxy's runtime API at" in text
        ), text
        for fix in (
            "`invoke lb --host local`",
            "`invoke lb --host local --remove`",
            "--in-place",
            "nothing was changed",
        ):
            assert fix in text, text
        assert record(prefix, "tiny-a")["fingerprint"] == before
        # ...and with --in-place it changes in place: no drain, no "back in rotation"
        roll = Roll(replace(settings, in_place=True))
        changes = change_one(settings, roll, prefix, "tiny-a")
        assert not [c for c in changes if c.status == "failed"], changes
        assert roll.rolled == [], roll.rolled
        assert any(n.startswith("local-18511: the balancer on local does not answer (") and
                   n.endswith("): --in-place: changed in place") for n in roll.notes), roll.notes  # fmt: skip
        assert record(prefix, "tiny-a")["fingerprint"] != before and answers(18511)

        # 3. the balancer stopped (already down: ok), its record leaves the backend; then started
        # again and taken off: its files, state and record gone
        code, out = invoke("lb", "--host", "local", "--stop")
        assert code == 0 and not lb_record.exists(), out[-3000:]
        assert "Remove the record of the balancer on local" in said(out), out[-3000:]
        code, out = invoke("lb", "--host", "local")
        assert code == 0 and lb_record.exists(), out[-3000:]
        pid = int(lb_pid.read_text())
        code, out = invoke("lb", "--host", "local", "--remove")
        assert code == 0, out[-3000:]
        assert not lb_record.exists() and not lb_pid.parent.exists() and exited(pid)
        code, out = invoke("lb", "--host", "local", "--remove")
        assert code == 0 and "local: 0 changed" in said(out), out[-3000:]

        # 4. invoke remove: listed, then one recipe, then the rest; again: nothing to do
        code, out = invoke("remove", "--host", "local", "--dry-run")
        assert code == 0 and f"Remove {KEYED}: its files and state" in said(out), out[-3000:]
        assert all((Path(prefix) / "deploy" / s).exists() for s in ("voltaforge-tiny-a", "voltaforge-tiny-b", KEYED))
        code, out = invoke("remove", "--host", "local", "--recipe", str(keyed))
        assert code == 0, out[-3000:]
        assert not (Path(prefix) / "deploy" / KEYED).exists() and not (Path(prefix) / "serve" / KEYED).exists()
        assert answers(18511) and answers(18512)
        code, out = invoke("remove", "--host", "local")
        assert code == 0, out[-3000:]
        assert sorted(p.name for p in (Path(prefix) / "deploy").iterdir()) == []
        assert sorted(p.name for p in (Path(prefix) / "serve").iterdir()) == []
        assert not answers(18511) and not answers(18512)
        assert Path(gguf).is_file() and (Path(prefix) / "llama.cpp" / "current" / "bin" / "llama-server").is_file()
        code, out = invoke("remove", "--host", "local")
        assert code == 0 and "nothing is deployed under" in out and "local: 0 changed, 1 ok" in out, out[-3000:]
        code, out = invoke("status", "--host", "local", "--json")
        assert json.loads(out[out.index("[") :])[0]["services"] == []
    finally:
        invoke("remove", "--host", "local")
        if lb_pid.exists():
            try:
                os.kill(int(lb_pid.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
