"""One TLS endpoint over a mixed fleet, for real, on this machine without systemd (issue 32): the
shape of two boxes with different cards, in small.

- `local` (this machine, an inventory entry named ``local``) serves a ``serve:`` layout of two
  recipes of one model, Q8_0 and Q4_K_M, each a managed process on its own port;
- ``box`` (a private sshd in its own network namespace, reached through its veth as another
  machine would be) serves a third recipe of that model, bound to 0.0.0.0;
- all three take one key (the inventory's ``lb: api_key_ref``), and `invoke lb --host local`
  reads what to balance from the hosts' deployment records (no ``--recipe``), with TLS at the
  edge (a self-signed pair kept on the controller) and the settings from the ``lb:`` entry.

Through the edge, with the official ``openai`` client given that CA: the model is listed once by
its name and streams; a few dozen requests reach every one of the three servers (HAProxy's
counters); an unknown model is a 404 JSON; ``model`` after a long ``messages`` routes, and a body
past the edge's limit is a 413 JSON; one backend killed, the next requests all succeed; a second
`invoke lb` changes nothing. (Queueing at the edge and HAProxy's retry of a refused connection are
measured in tests/test_balancer_real.py; a layout behind the balancer in the booted container, with
systemd, in tests/test_layout_real.py.)
"""

from __future__ import annotations

import json
import os
import signal
import ssl
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from playbooks.cli.balancer import run_lb
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.conduct.balancer import tls_dir
from playbooks.conduct.settings import Settings
from playbooks.host import connect
from playbooks.steps.serve.balancer import parse_stats, stats_command
from tests import llamacpp_tools
from tests.helpers import ROOT, host_entry, spec_for, stage_served_model

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
LOCAL_PORTS = (18311, 18312)
BOX_PORT = 18181  # the namespace has a port space of its own
LB_PORT = 18320
NO_EOS = {"ignore_eos": True}  # a random model may end a reply at any token: count on the length asked


@pytest.fixture(scope="module")
def quants(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("fleet")
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    return {q: llamacpp_tools.quantize(f16, work / f"tiny-{q}.gguf", q) for q in ("Q8_0", "Q4_K_M")}


def fleet_recipe(where: Path, name: str, ref: str, quant: str, bind: str, port: int) -> Path:
    """tiny-cpu under another name and quant: one model, served as tiny-llama, one key."""
    data = json.loads(json.dumps(TINY))
    data |= {"name": name, "quant": quant, "parallel": 2, "context": 1024}
    data["service"] = {"bind": bind, "port": port, "api_key_ref": ref}
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 8, "min_tok_s": 1}
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def served_by(counters: str) -> dict[str, int]:
    return {s.name: s.requests for s in parse_stats(counters, "tiny-llama")}


@pytest.mark.timeout(900)
def test_one_tls_endpoint_over_a_mixed_fleet_without_systemd(
    make_sshd_host,
    quants,
    api_secret,
    tmp_path,
    tmp_path_factory,
    monkeypatch,
    capsys,
):
    ref, key, _ = api_secret
    box = make_sshd_host(sudo="nopasswd", netns=True)
    # (a short prefix: HAProxy's runtime API socket lives under it, in at most 97 bytes)
    local_prefix, box_prefix = str(tmp_path_factory.mktemp("vf") / "local"), str(box.prefix / "vf")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    q8 = fleet_recipe(recipes, "tiny-q8", ref, "Q8_0", "127.0.0.1", LOCAL_PORTS[0])
    q4 = fleet_recipe(recipes, "tiny-q4", ref, "Q4_K_M", "127.0.0.1", LOCAL_PORTS[1])
    remote = fleet_recipe(recipes, "tiny-box", ref, "Q4_K_M", "0.0.0.0", BOX_PORT)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        yaml.safe_dump(
            {
                "hosts": {
                    "local": {"prefix": local_prefix, "serve": [{"recipe": str(q8)}, {"recipe": str(q4)}]},
                    "box": {**host_entry(box), "prefix": box_prefix, "recipe": str(remote)},
                },
                "lb": {"hosts": ["local", "box"], "port": LB_PORT, "api_key_ref": ref, "tls": True},
            }
        )
    )
    settings = Settings(inventory=inv)
    with connect(settings.host_spec("local")) as here:
        stage_served_model(here, local_prefix, q8, quants["Q8_0"], "Q8_0")
        stage_served_model(here, local_prefix, q4, quants["Q4_K_M"], "Q4_K_M")
    with connect(spec_for(box)) as there:
        stage_served_model(there, box_prefix, remote, quants["Q4_K_M"], "Q4_K_M")
    # (after staging: the test tools' build stays in the shared cache)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    edge = f"https://127.0.0.1:{LB_PORT}"
    try:
        assert run_deploy("local", None, settings=settings) == 0, capsys.readouterr().out[-3000:]
        assert run_deploy("box", None, settings=settings) == 0, capsys.readouterr().out[-3000:]
        capsys.readouterr()

        # the balancer: its settings from lb:, its servers from the hosts' deployment records
        assert run_lb("local", settings=settings) == 0, capsys.readouterr().out[-4000:]
        said = " ".join(capsys.readouterr().out.split())  # (the console wraps long lines)
        ca = tls_dir("local") / "cert.pem"
        assert "TLS at the edge: self-signed" in said, said
        # (in the records' order: by service name)
        assert (
            f"model tiny-llama: local-{LOCAL_PORTS[1]} 127.0.0.1:{LOCAL_PORTS[1]}, "
            f"local-{LOCAL_PORTS[0]} 127.0.0.1:{LOCAL_PORTS[0]}, box {box.hostname}:{BOX_PORT}"
        ) in said, said
        trusted = ssl.create_default_context(cafile=str(ca))
        client = OpenAI(
            base_url=f"{edge}/v1", api_key=key, max_retries=0, http_client=httpx.Client(verify=trusted, timeout=60)
        )
        assert [m.id for m in client.models.list()] == ["tiny-llama"]
        stream = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)  # (the tokens counted, not their text: a random model's may decode to nothing)
        usage = next(c.usage for c in reversed(chunks) if c.usage)
        assert usage.completion_tokens == 6 and sum(1 for c in chunks if c.choices) >= 2, chunks

        # every server of the model serves (HAProxy's counters), each taking its slots
        with connect(settings.host_spec("local")) as here:
            before = served_by(here.run(stats_command(), stream=False).stdout)
            for i in range(24):
                reply = client.completions.create(
                    model="tiny-llama", prompt=f"Count {i}", max_tokens=2, extra_body=NO_EOS
                )
                assert reply.usage.completion_tokens == 2
            after = served_by(here.run(stats_command(), stream=False).stdout)
        moved = {name: after[name] - before.get(name, 0) for name in after}
        assert set(moved) == {f"local-{LOCAL_PORTS[0]}", f"local-{LOCAL_PORTS[1]}", "box"}, after
        assert all(n >= 1 for n in moved.values()), moved

        with httpx.Client(verify=trusted, timeout=60, headers={"Authorization": f"Bearer {key}"}) as web:
            # an unknown model: OpenAI's 404 shape, from the edge
            miss = web.post(f"{edge}/v1/chat/completions", json={"model": "gpt-9", "messages": []})
            assert miss.status_code == 404 and miss.json()["error"]["code"] == "model_not_found", miss.text
            # `model` after a long `messages` (the official client's order) routes...
            # (12 KB: past one server's context, so the server itself answers, not the edge)
            long = {"messages": [{"role": "user", "content": "word " * 2400}], "model": "tiny-llama", "max_tokens": 1}
            routed = web.post(f"{edge}/v1/chat/completions", json=long)
            assert routed.status_code == 400 and "context" in routed.json()["error"]["message"], routed.text
            # ...and a body past the edge's limit is a 413 JSON, never a server's problem
            huge = {"messages": [{"role": "user", "content": "word " * 20000}], "model": "tiny-llama"}
            too_big = web.post(f"{edge}/v1/chat/completions", json=huge)
            assert too_big.status_code == 413 and too_big.json()["error"]["type"], too_big.text

        # one backend killed: the next requests all succeed on the others
        pid_file = Path(local_prefix) / "deploy" / "voltaforge-tiny-q8" / "server.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        for i in range(8):
            reply = client.completions.create(model="tiny-llama", prompt=f"Again {i}", max_tokens=2, extra_body=NO_EOS)
            assert reply.usage.completion_tokens == 2

        # a second `invoke lb` changes nothing
        assert run_lb("local", settings=settings) == 0
        again = capsys.readouterr().out
        assert "local: 0 changed" in again, again[-2000:]

        # the balancer re-run without box (issue 52): box's record goes, local's is rewritten
        box_record = Path(box_prefix) / "deploy" / "balancers" / "local.json"
        assert box_record.exists()
        assert run_lb("local", backends=["local"], settings=settings) == 0
        dropped = capsys.readouterr().out
        assert not box_record.exists() and not box_record.parent.exists(), dropped[-2000:]
        assert "Remove the record of the balancer on local" in dropped, dropped[-2000:]
        assert (Path(local_prefix) / "deploy" / "balancers" / "local.json").exists()
    finally:
        run_stop("local", None, settings=settings)
        run_stop("box", None, settings=settings)
        pid_file = Path(local_prefix) / "deploy" / "voltaforge-lb" / "server.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
