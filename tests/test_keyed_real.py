"""A keyed, networked server for real, where there is no systemd (issue 31): the tiny CPU recipe
bound to 0.0.0.0 with an API key, on a private sshd in its own network namespace (a managed
process), reached from this namespace through the veth as a colleague would reach it.

- A key file others can read, then a missing one: one line each naming the file, nothing made.
- `invoke provision` through the CLI, on a host `invoke toolchain` and `invoke build` prepared
  (the compile from the run's shared ccache), to a passing gate: the process reads its 0600
  copy of the key (``--api-key-file``); over the network ``/v1/models`` is 401 without the key
  and 200 with it, the model listed by its name (the official ``openai`` client too), never by
  its path; the gate measured it with the key.
- `invoke tune` measures it with the key and does not fail on 401.
- `invoke lb` puts HAProxy in front of it as a managed process (no systemd), TLS at the edge (a
  self-signed pair kept on the controller, its fingerprint printed; the official client given
  that CA lists the model, a client without it is refused), the key checked at the edge from
  the balancer's own 0600 copy; `bench --lb` speaks TLS and sends the key; a second run is `ok`.
- A hung server (SIGSTOP) is not ``ok`` in `invoke provision`'s no-op: it is restarted and
  answers again.
- Throughout, strace records every exec of this process's children (the CLI runs among them)
  and of the sshd's (every command the host runs): the key is in no argv, and neither is it in
  a log, a report or the deployment's files (the credential copy aside). The trace's positive
  control: the check deploy ran before issue 31, run over SSH as it was, caught 20 of 20.
  The host's preparation comes first, untraced: `invoke toolchain` (the venv, torch from the
  wheelhouse), `invoke build` (the llama.cpp compile) and `invoke quantize` (the converter's torch
  and the quantize), which never read the key. A traced
  sshd stops its children at every system call (sudo rules out strace's seccomp filter), which
  made them minutes of the suite's critical path; strace then attaches to the sshd, and the
  provision it watches finds all three in place (their steps ``ok``).
(The booted container, where the key reaches the unit as a systemd credential, is provisioned
keyed from the CLI in tests/test_provision_real.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from playbooks.conduct.balancer import tls_dir
from playbooks.host import connect
from playbooks.steps.build.llamacpp_source import source_cache_dir
from playbooks.steps.serve.tls import TlsPair
from tests.exec_trace import ExecTrace
from tests.helpers import ROOT, inventory_for, shared_ccache, spec_for
from tests.wheelhouse import ensure_wheelhouse

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
PORT = 18181  # the namespace has a port space of its own
LB_PORT = 18200


@pytest.fixture
def offline_pip(tmp_path) -> Iterator[tuple[Path, Path]]:
    """The host is in its own network namespace: its pip reaches no index. The suite's
    wheelhouse (tests/wheelhouse.py, what toolchain, build and quantize install for a CPU
    recipe) hard-linked where the host's user can read it, and a pip.conf that uses only it
    (every SSH session gets PIP_CONFIG_FILE, as an air-gapped lab configures its hosts)."""
    built = ensure_wheelhouse()
    share = Path(tempfile.mkdtemp(prefix="vf-keyed-wheels-", dir="/tmp"))
    wheels = share / "wheels"
    subprocess.run(["cp", "-al", str(built), str(wheels)], check=True)
    conf = share / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
    for p in (share, wheels):
        p.chmod(0o755)
    conf.chmod(0o644)
    yield wheels, conf
    shutil.rmtree(share, ignore_errors=True)


def keyed_recipe(where: Path, ref: str, wheels: Path | None = None, **over) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(TINY))
    if wheels is not None:  # torch from the host's wheelhouse, as in the container
        data["toolchain"] |= {"torch_index": "https://pypi.org/simple", "torch_find_links": str(wheels)}
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


@pytest.mark.timeout(1500)
# all of it alone with the CPU (helpers.cpu_alone): its compile, and then the gate, tune's search
# and `bench --lb`, which load both cores for minutes beside a neighbour's measurement
@pytest.mark.usefixtures("cpu_alone")
def test_a_keyed_networked_server_without_systemd(make_sshd_host, api_secret, offline_pip, tmp_path, monkeypatch):
    ref, key, secret = api_secret
    wheels, pip_conf = offline_pip
    pip = {"PIP_CONFIG_FILE": str(pip_conf)}
    host = make_sshd_host(sudo="nopasswd", netns=True, env=pip)
    prefix = str(host.prefix / "vf")
    recipe = keyed_recipe(tmp_path / "r", ref, wheels)
    inv = inventory_for(tmp_path, "box", host, prefix=prefix)
    shared_ccache(Path(prefix), host.user)
    # the controller's cache of its own (the fleet cache gets this prefix's build), the pinned
    # source from the run's usual cache (fetched once from PyPI)
    cache = tmp_path / "cache"
    cache.mkdir()
    source_cache_dir().mkdir(parents=True, exist_ok=True)
    (cache / "sources").symlink_to(source_cache_dir(), target_is_directory=True)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(cache))
    monkeypatch.setenv("VOLTAFORGE_LOG_DIR", str(tmp_path / "logs"))
    # the recipes' directory: `invoke lb` finds each backend's recipe by its name there, and
    # `invoke tune` writes its winner there
    monkeypatch.setenv("INVOKE_VOLTAFORGE_RECIPES_DIR", str(recipe.parent))
    url = f"http://{host.hostname}:{PORT}"
    state = Path(prefix) / "deploy" / "voltaforge-llama-server"
    on_box = ("--host", "box", "--inventory", str(inv))

    def cli(*args: str, timeout: float = 900, traced: bool = True) -> subprocess.CompletedProcess:
        """The CLI as a user types it, under strace unless ``traced`` is false."""
        argv = [sys.executable, "-m", "invoke", "-r", str(ROOT), *args]
        argv = trace.wrap(argv) if traced else argv
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)

    def invoke(*args: str, timeout: float = 900) -> tuple[int, str]:
        r = cli(*args, timeout=timeout)
        return r.returncode, r.stdout + r.stderr

    def as_json(*args: str) -> Any:
        r = cli(*args, "--json")
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return json.loads(r.stdout)

    def said(out: str) -> str:
        return " ".join(out.split())

    def provision() -> tuple[int, dict[str, dict], str]:
        summary = tmp_path / "summary.json"
        code, out = invoke("provision", *on_box, "--recipe", str(recipe), "--json", str(summary), timeout=1400)
        [done] = json.loads(summary.read_text())
        return code, {s["step"]: s for s in done["steps"]}, out

    # 0. the host's preparation, untraced (the docstring says why), the compile from the run's
    # shared ccache, the quantize on the host
    for task in ("toolchain", "build", "quantize"):
        done = cli(task, *on_box, "--recipe", str(recipe), timeout=1200, traced=False)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # from here on every command the host runs: strace attached to the sshd, and to each CLI run
    with ExecTrace(tmp_path / "trace", pids=[host.pid]) as trace:
        try:
            # 1. a key others can read, then none: one line naming the file, nothing made
            secret.chmod(0o644)
            code, out = invoke("deploy", *on_box, "--recipe", str(recipe))
            assert code == 1 and f"the API key file {secret} is mode 0644: others can read the key" in said(out), out
            assert not state.exists()
            secret.chmod(0o600)
            missing = keyed_recipe(tmp_path / "m", ref + "-none")
            code, out = invoke("deploy", *on_box, "--recipe", str(missing))
            assert code == 1 and f"the API key file {secret}-none does not exist on the host" in said(out), out
            assert not state.exists()

            # 2. provisioned as a managed process, keyed, on the network, gated (the gate's floor
            # is 1 tok/s); the toolchain, the build and the quant made before are kept
            code, steps, out = provision()
            assert code == 0 and steps["gate"]["status"] == "changed", out[-4000:]
            assert steps["build"]["status"] == steps["toolchain"]["status"] == steps["quantize"]["status"] == "ok", out[
                -4000:
            ]
            assert "a managed process" in said(out), out[-4000:]
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

            # 3. status and tune see it and measure it with the key
            [seen] = as_json("status", *on_box)
            assert [s["model_name"] for s in seen["services"]] == ["tiny-llama"], seen
            tune = ("--objective", "single", "--quants", "Q4_K_M", "--cache", "f16", "--slots", "1", "--ubatch", "512")
            tuned = as_json("tune", *on_box, "--recipe", str(recipe), *tune, "--spec", "none", "--budget", "10m",
                            "--rungs", "1")  # fmt: skip
            assert tuned["candidates"] and all(c["error"] is None for c in tuned["candidates"]), tuned["candidates"]

            # 3b. the balancer in front of it, as a managed process too: the key checked at the
            # edge from its own private copy, and `bench --lb` sends it
            lb = ("lb", *on_box, "--hosts", "box", "--recipe", str(recipe), "--bind", "0.0.0.0", "--port", str(LB_PORT))
            code, out = invoke(*lb)
            assert code == 0, out[-4000:]
            # beyond loopback: TLS, a self-signed pair kept on the controller, its fingerprint shown
            ca = tls_dir("box") / "cert.pem"
            fingerprint = TlsPair(ca.read_bytes(), b"", "").fingerprint
            assert f"TLS at the edge: self-signed, kept in {ca.parent}; certificate {fingerprint}" in said(out), out
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
            via = as_json("bench", *on_box, "--lb", str(LB_PORT), "--recipe", str(recipe))
            assert (
                all(not lv.get("error") for lv in via["levels"]) and via["levels"][0]["backends"]["box"]["requests"] > 0
            )
            code, out = invoke(*lb)
            assert code == 0 and "box: 0 changed" in out, out[-2000:]

            # 4. a hung server is not `ok`: provision's no-op asks /health and restarts it
            code, steps, out = provision()
            assert code == 0 and {s["status"] for s in steps.values()} == {"ok"}, out[-4000:]
            pid = int((state / "server.pid").read_text())
            os.kill(pid, signal.SIGSTOP)
            code, steps, out = provision()
            assert code == 0 and steps["deploy"]["status"] == "changed", out[-4000:]
            why = said(f"{steps['deploy']['why']} {out}")
            assert "/health on 127.0.0.1:18181 does not answer within 5 s" in why, why[-3000:]
            assert int((state / "server.pid").read_text()) != pid
            with httpx.Client(trust_env=False, timeout=30) as web:
                assert web.get(f"{url}/health").status_code == 200

            # the trace's positive control: the check deploy ran before issue 31, as it ran, over
            # SSH to the same sshd, 20 times (a grep that lives a millisecond)
            old = f'key=$(sudo head -n1 {secret}); printf x | grep -qxF "api_key: \\"$key\\"" - || true'
            with connect(spec_for(host)) as h:
                for _ in range(20):
                    h.run(old, stream=False)
            assert len(trace.holding(key, program="grep")) == 20, trace.execs()[-5:]
            ran = {Path(p).name for p in trace.programs()}
            assert {Path(sys.executable).name, "sshd", "llama-server", "haproxy"} <= ran, sorted(ran)
            assert [ln for ln in trace.holding(key) if '"grep"' not in ln] == [], trace.holding(key)[:3]
            # no log, report, record or rendered file holds it (the credential copies are the key)
            roots = [cache, tmp_path / "logs", Path(prefix), recipe.parent]
            assert files_holding(roots, key, skip=("api-key",)) == []
            assert "tiny-llama" in (state / "deployed.json").read_text()
        finally:
            cli("stop", *on_box, "--recipe", str(recipe), timeout=300, traced=False)
            pid_file = Path(prefix) / "deploy" / "voltaforge-lb" / "server.pid"
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
