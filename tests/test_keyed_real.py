"""A keyed, networked server for real, where there is no systemd (issue 31): the tiny CPU recipe
bound to 0.0.0.0 with an API key, on a private sshd in its own network namespace (a managed
process), reached from this namespace through the veth as a colleague would reach it.

- A key file others can read, then a missing one: one line each naming the file, nothing made.
- Deployed: the process reads its 0600 copy of the key (``--api-key-file``); over the network
  ``/v1/models`` is 401 without the key and 200 with it, the model listed by its name (the
  official ``openai`` client too), never by its path.
- The gate (`invoke bench`) and `invoke tune` measure it with the key; neither fails on 401.
- `invoke lb` puts HAProxy in front of it as a managed process (no systemd), TLS at the edge (a
  self-signed pair kept on the controller, its fingerprint printed; the official client given
  that CA lists the model, a client without it is refused), the key checked at the edge from
  the balancer's own 0600 copy; `bench --lb` speaks TLS and sends the key; a second run is `ok`.
- A hung server (SIGSTOP) is not ``ok`` in the no-op: it is restarted and answers again.
- Throughout, every process's argv on this machine (controller and host alike) is sampled:
  the key is never in one, and neither is it in a log, a report or the deployment's files
  (the credential copy aside). The sampler's positive control: a ``grep`` with the key in its
  argv, which it must find.
(The booted container, where the key reaches the unit as a systemd credential, is provisioned
keyed from the CLI in tests/test_provision_real.py.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import stat
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from playbooks.cli.balancer import run_lb
from playbooks.cli.bench import run_bench, run_bench_lb
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.cli.status import run_status
from playbooks.cli.tune import options, run_tune
from playbooks.conduct.balancer import tls_dir
from playbooks.conduct.settings import Settings
from playbooks.host import connect
from playbooks.steps.serve.tls import TlsPair
from tests import llamacpp_tools
from tests.argv_sampler import ArgvSampler, hold_in_argv
from tests.helpers import ROOT, inventory_for, spec_for, stage_served_model

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
PORT = 18181  # the namespace has a port space of its own
LB_PORT = 18200


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("keyed")
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


@pytest.fixture
def api_secret():
    """A key in /etc/voltaforge/secrets/ (the host shares this machine's filesystem), root's,
    0600, as an operator leaves it; removed afterwards."""
    ref = f"vf-test-{os.getpid()}"
    path = Path("/etc/voltaforge/secrets") / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, (key + "\n").encode())
    os.close(fd)
    yield ref, key, path
    path.unlink(missing_ok=True)


def keyed_recipe(where: Path, ref: str, **over) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(TINY))
    data["service"] = {"bind": "0.0.0.0", "port": PORT, "api_key_ref": ref}
    data |= {"parallel": 1, "context": 1024}
    data["gate"] = {"levels": [1, 2], "prompt_tokens": 16, "max_tokens": 16, "min_tok_s": 1}
    data |= over
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / "tiny-keyed.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def files_holding(roots: list[Path], needle: str, skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink() and p.name not in skip and needle.encode() in p.read_bytes():
                found.append(str(p))
    return found


@pytest.mark.timeout(900)
def test_a_keyed_networked_server_without_systemd(make_sshd_host, tiny_q4, api_secret, tmp_path, monkeypatch, capsys):
    ref, key, secret = api_secret
    host = make_sshd_host(sudo="nopasswd", netns=True)
    prefix = str(host.prefix / "vf")
    recipe = keyed_recipe(tmp_path / "r", ref)
    # the recipes' directory: `invoke lb` finds each backend's recipe by its name there
    settings = Settings(inventory=inventory_for(tmp_path, "box", host, prefix=prefix), recipes_dir=recipe.parent)
    with connect(spec_for(host)) as h:
        stage_served_model(h, prefix, recipe, tiny_q4)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    url = f"http://{host.hostname}:{PORT}"
    state = Path(prefix) / "deploy" / "voltaforge-llama-server"
    try:
        with ArgvSampler(key) as sampler:
            # 1. a key others can read, then none: one line naming the file, nothing made
            secret.chmod(0o644)
            assert run_deploy("box", str(recipe), settings=settings) == 1
            out = capsys.readouterr().out
            assert f"the API key file {secret} is mode 0644: others can read the key" in out, out[-2000:]
            assert not state.exists()
            secret.chmod(0o600)
            missing = keyed_recipe(tmp_path / "m", ref + "-none")
            assert run_deploy("box", str(missing), settings=settings) == 1
            assert f"the API key file {secret}-none does not exist on the host" in capsys.readouterr().out
            assert not state.exists()

            # 2. deployed as a managed process, keyed, on the network
            assert run_deploy("box", str(recipe), settings=settings) == 0, capsys.readouterr().out[-3000:]
            assert "a managed process" in capsys.readouterr().out
            copy = state / "credentials" / "api-key"
            assert stat.S_IMODE(copy.stat().st_mode) == 0o600 and copy.owner() == host.user
            assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700
            with httpx.Client(trust_env=False, timeout=30) as web:
                assert web.get(f"{url}/v1/models").status_code == 401
                assert web.get(f"{url}/v1/models", headers={"Authorization": "Bearer not-the-key"}).status_code == 401
                listed = web.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["tiny-llama"]
            client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
            assert [m.id for m in client.models.list()] == ["tiny-llama"]
            reply = client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
            assert reply.model == "tiny-llama" and reply.usage.completion_tokens == 4

            # 3. the gate and tune measure it with the key
            assert run_bench("box", str(recipe), as_json=True, settings=settings) == 0
            result = json.loads(capsys.readouterr().out)
            assert result["gate"]["passed"] and all(lv["errors"] == 0 for lv in result["levels"]), result["gate"]
            assert result["server"]["model"] == "tiny-llama" and result["server"]["model_file"].endswith(".gguf")
            assert run_status("box", as_json=True, settings=settings) == 0
            [seen] = json.loads(capsys.readouterr().out)
            assert [s["model_name"] for s in seen["services"]] == ["tiny-llama"], seen
            opts = options("single", "Q4_K_M", "f16", None, 1, "512", "none", None, None, "10m", 1, False, None)
            opts = type(opts)(**{**opts.__dict__, "recipes_dir": tmp_path / "tuned"})
            assert run_tune("box", str(recipe), opts, as_json=True, settings=settings) == 0
            tuned = json.loads(capsys.readouterr().out)
            assert tuned["candidates"] and all(c["error"] is None for c in tuned["candidates"]), tuned["candidates"]

            # 3b. the balancer in front of it, as a managed process too: the key checked at the
            # edge from its own private copy, and `bench --lb` sends it
            assert run_lb("box", ["box"], str(recipe), "0.0.0.0", LB_PORT, settings=settings) == 0
            out = capsys.readouterr().out
            # beyond loopback: TLS, a self-signed pair kept on the controller, its fingerprint shown
            ca = tls_dir("box") / "cert.pem"
            fingerprint = TlsPair(ca.read_bytes(), b"", "").fingerprint
            said = " ".join(out.split())  # (the console wraps long lines)
            assert f"TLS at the edge: self-signed, kept in {ca.parent}; certificate {fingerprint}" in said, out
            lb_state = Path(prefix) / "deploy" / "voltaforge-lb"
            for secret_file in ("api-key", "tls.pem"):
                assert stat.S_IMODE((lb_state / "credentials" / secret_file).stat().st_mode) == 0o600
            edge = f"https://{host.hostname}:{LB_PORT}"
            trusted = ssl.create_default_context(cafile=str(ca))
            with httpx.Client(trust_env=False, timeout=30, verify=trusted) as web:
                assert web.get(f"{edge}/v1/models").status_code == 401
                through = web.get(f"{edge}/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert through.status_code == 200 and through.json()["data"][0]["id"] == "tiny-llama"
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(f"{edge}/v1/models", timeout=10)  # not trusted without the CA
            tls_client = OpenAI(
                base_url=f"{edge}/v1", api_key=key, max_retries=0, http_client=httpx.Client(verify=trusted)
            )
            assert [m.id for m in tls_client.models.list()] == ["tiny-llama"]
            assert run_bench_lb("box", LB_PORT, str(recipe), as_json=True, settings=settings) == 0
            via = json.loads(capsys.readouterr().out)
            assert (
                all(not lv.get("error") for lv in via["levels"]) and via["levels"][0]["backends"]["box"]["requests"] > 0
            )
            assert run_lb("box", ["box"], str(recipe), "0.0.0.0", LB_PORT, settings=settings) == 0
            again = capsys.readouterr().out
            assert "box: 0 changed" in again, again[-2000:]

            # 4. a hung server is not `ok`: the no-op asks /health and restarts it
            assert run_deploy("box", str(recipe), settings=settings) == 0
            assert "running, unchanged" in capsys.readouterr().out
            pid = int((state / "server.pid").read_text())
            os.kill(pid, signal.SIGSTOP)
            assert run_deploy("box", str(recipe), settings=settings) == 0
            out = capsys.readouterr().out
            assert "but /health on 127.0.0.1:18181 does not answer within 5 s" in out, out[-3000:]
            assert int((state / "server.pid").read_text()) != pid
            with httpx.Client(trust_env=False, timeout=30) as web:
                assert web.get(f"{url}/health").status_code == 200
        assert sampler.rounds >= 20 and sampler.hits == [], sampler.hits
        # the sampler finds what it looks for (the positive control)
        with ArgvSampler(key) as control:
            hold_in_argv(f"grep -qxF {key} -")
        assert any(cmd.startswith("grep") for _, cmd in control.hits), control.rounds
        # no log, report, record or rendered file holds it (the credential copy is the key)
        roots = [tmp_path / "cache", Path(prefix), tmp_path / "tuned"]
        assert files_holding(roots, key, skip=("api-key",)) == []
        assert "tiny-llama" in (state / "deployed.json").read_text()
    finally:
        run_stop("box", str(recipe), settings=settings)
        pid_file = Path(prefix) / "deploy" / "voltaforge-lb" / "server.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
