"""`invoke deploy` for real: the tiny CPU recipe served by the CPU llama-server build
and the generated tiny model quantized to Q4_K_M by the real llama-quantize.

- On a booted Debian 12 container (systemd-nspawn) over SSH: a unit, started, answering the
  official `openai` client with a streamed chat completion; deployed again: `ok`, the same
  process; one flag changed: exactly one restart; a config that cannot start: rolled back,
  and the old one answers again; a port someone else holds, a model that was never made:
  one line each, the old service still answering.
- On a host without systemd (a private sshd on this machine): the same rendered command line
  as a managed process, the same checks; `invoke stop`.

The model reaches the host as `invoke quantize` leaves it (the file and its manifest under
models/<id>/gguf/); quantize's own run of it is tested in test_quantize_real.py, and
`invoke provision` chains the two.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.conduct.quantize import recipe_weights
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.host import connect
from playbooks.steps.weights.model_layout import ModelLayout, manifest_path
from tests import llamacpp_tools
from tests.helpers import ROOT, exited, inventory_for, spec_for, stage_served_model
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("deploy")
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


def _recipe(tmp_path: Path, name: str, port: int, **over) -> Path:
    """tiny-cpu on another port, some keys replaced; each variant in a directory of its own
    (the recipe's name, which the unit shows, stays the same)."""
    tmp_path = tmp_path / hashlib.sha256(repr((port, over)).encode()).hexdigest()[:8]
    tmp_path.mkdir(exist_ok=True)
    data = json.loads(json.dumps(TINY))
    data["service"] = {**data["service"], "port": port}
    for key, value in over.items():
        data[key] = value if not isinstance(value, dict) else {**data.get(key, {}), **value}
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


CHAT = textwrap.dedent(
    """
    import sys
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello!\\nWho are you?"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True}, seed=1, extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    print(repr(text), usage.completion_tokens)
    """
)


def _chat(port: int, netns: str | None = None) -> tuple[str, int]:
    """A streamed chat completion through the official client, from the server's own network
    namespace when it has one (the service listens on loopback only)."""
    cmd = [sys.executable, "-c", CHAT, str(port)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text, tokens = r.stdout.strip().rsplit(" ", 1)
    return eval(text), int(tokens)  # noqa: S307 - our own script's repr()


def test_deploy_under_systemd_no_op_one_restart_rollback_and_bad_input(nspawn_host, tiny_q4, tmp_path, capsys):
    port = 18090
    recipe = _recipe(tmp_path, "tiny-deploy", port)
    inv = inventory_for(tmp_path, "box", nspawn_host, prefix=str(nspawn_host.prefix))
    settings = Settings(inventory=inv)
    unit = "voltaforge-llama-server.service"
    with connect(spec_for(nspawn_host)) as host:
        stage_served_model(host, str(nspawn_host.prefix), recipe, tiny_q4)
        # the container is the session's: another test's unit of the same name may have logged
        # before this one, so the journal is read from here on
        cursor = host.sudo("journalctl -n 0 --show-cursor", stream=False).stdout.split("cursor: ", 1)[1].strip()

        def show(prop: str) -> str:
            return host.run(f"systemctl show -p {prop} --value {unit}", stream=False).stdout.strip()

        try:
            # a dry run: the unit shown, nothing installed or started
            assert run_deploy("box", str(recipe), dry_run=True, settings=settings) == 0
            out = capsys.readouterr().out
            assert "+++ /etc/systemd/system/voltaforge-llama-server.service (rendered)" in out, out[-3000:]
            assert "+ExecStart=" in out and "--fit off" in out
            assert host.run(f"test -e /etc/systemd/system/{unit}", check=False, stream=False).exited == 1

            # deploy: installed, started, healthy, checked against the plan, answering
            assert run_deploy("box", str(recipe), settings=settings) == 0, capsys.readouterr().out[-3000:]
            out = capsys.readouterr().out
            assert "systemd unit voltaforge-llama-server.service" in out
            assert host.run(f"systemctl is-active {unit}", stream=False).stdout.strip() == "active"
            text, tokens = _chat(port, nspawn_host.netns)
            assert tokens == 12 and text, text
            record = json.loads(host.run(f"cat {nspawn_host.prefix}/deploy/voltaforge-llama-server/deployed.json",
                                         stream=False).stdout)  # fmt: skip
            # the real buffers beside the plan's
            assert record["buffers"]["kv_mib"] and record["buffers"]["planned"]["kv_mib"] > 0
            pid, since = show("MainPID"), show("ActiveEnterTimestampMonotonic")

            # again: nothing to do, the same process
            assert run_deploy("box", str(recipe), settings=settings) == 0
            out = capsys.readouterr().out
            assert "running, unchanged" in out and "0 changed" in out, out[-2000:]
            assert (show("MainPID"), show("ActiveEnterTimestampMonotonic")) == (pid, since)

            # one flag changed: the diff in a dry run, then exactly one restart
            smaller = _recipe(tmp_path, "tiny-deploy", port, context=256)
            assert run_deploy("box", str(smaller), dry_run=True, settings=settings) == 0
            out = capsys.readouterr().out
            assert "-ExecStart=" in out and "+ExecStart=" in out and "--ctx-size 512" in out
            invocation = show("InvocationID")
            assert run_deploy("box", str(smaller), settings=settings) == 0
            out = capsys.readouterr().out
            assert "voltaforge-llama-server.service changed" in out
            new_invocation = show("InvocationID")
            assert new_invocation != invocation and show("NRestarts") == "0"
            journal = host.sudo(
                f"journalctl -u {unit} -o cat --no-pager --after-cursor={shlex.quote(cursor)}", stream=False
            ).stdout
            assert journal.count("llama_server: listening on") == 2  # the first start and the one restart
            _chat(port, nspawn_host.netns)

            # a config that cannot start (a port below 1024: the unprivileged service may not bind
            # it): rolled back to the one that worked, which answers again
            broken = _recipe(tmp_path, "tiny-deploy", 81, context=256)
            assert run_deploy("box", str(broken), settings=settings) == 1
            out = capsys.readouterr().out
            failed = [line for line in out.splitlines() if "failed:" in line]
            assert len(failed) == 1 and "rolled back to the deployment of" in failed[0], out[-3000:]
            assert "which answers again" in failed[0]
            assert f"--port {port}" in host.run(f"cat /etc/systemd/system/{unit}", stream=False).stdout
            _chat(port, nspawn_host.netns)
            assert run_deploy("box", str(smaller), settings=settings) == 0  # the good one is what runs
            assert "running, unchanged" in capsys.readouterr().out

            # the port held by someone else: one line, before anything changes
            other = 18091
            server = f"python3 -m http.server {other} --bind 127.0.0.1"
            host.run(f"setsid {server} >/dev/null 2>&1 </dev/null & echo $! >/tmp/h.pid", stream=False)
            try:
                busy = _recipe(tmp_path, "tiny-deploy", other)
                assert run_deploy("box", str(busy), settings=settings) == 1
                out = capsys.readouterr().out
                failed = [line for line in out.splitlines() if "failed:" in line]
                assert len(failed) == 1 and f"port {other} is in use by python3" in failed[0], out[-2000:]
            finally:
                host.run("kill $(cat /tmp/h.pid)", check=False, stream=False)
            _chat(port, nspawn_host.netns)

            # a model that was never made
            q8 = _recipe(tmp_path, "tiny-deploy", port, quant="Q8_0")
            assert run_deploy("box", str(q8), settings=settings) == 1
            out = capsys.readouterr().out
            failed = [line for line in out.splitlines() if "failed:" in line]
            assert len(failed) == 1 and "model file missing" in failed[0] and "invoke quantize" in failed[0]
            _chat(port, nspawn_host.netns)
        finally:
            host.sudo(
                f"systemctl disable --now {unit}; rm -f /etc/systemd/system/{unit}; systemctl daemon-reload; "
                f"rm -rf {nspawn_host.prefix}/deploy {nspawn_host.prefix}/serve {nspawn_host.prefix}/models",
                check=False,
                stream=False,
            )


def test_deploy_as_a_process_where_there_is_no_systemd(sshd_host, tiny_q4, tmp_path, capsys):
    port = free_port()
    recipe = _recipe(tmp_path, "tiny-process", port)
    prefix = str(sshd_host.prefix / "vf")
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=prefix))
    with connect(spec_for(sshd_host)) as host:
        stage_served_model(host, prefix, recipe, tiny_q4)
    # a unit asked for where systemd does not run: one line, nothing touched
    with pytest.raises(VoltaforgeError, match=r"^box: systemd is not running there .*--manager process"):
        run_deploy("box", str(recipe), manager="systemd", settings=settings)
    assert not (Path(prefix) / "deploy").exists()
    try:
        assert run_deploy("box", str(recipe), settings=settings) == 0, capsys.readouterr().out[-3000:]
        out = capsys.readouterr().out
        assert "a managed process (no systemd on this host" in out
        pid_file = Path(prefix) / "deploy" / "voltaforge-llama-server" / "server.pid"
        pid = pid_file.read_text().strip()
        # the unit's own ExecStart, parsed back: the same flags
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        unit_text = (
            Path(prefix) / "deploy" / "voltaforge-llama-server" / "voltaforge-llama-server.service"
        ).read_text()
        assert b"--fit" in cmdline and shlex.join(a.decode() for a in cmdline[1:4]) in unit_text
        text, tokens = _chat(port)
        assert tokens == 12
        # the device check's streamed chat (scripts/device_exl2.py, what it asks TabbyAPI on a
        # GPU) against this real server: the same client, the same stream, content chunks counted
        spec = importlib.util.spec_from_file_location("device_exl2", ROOT / "scripts" / "device_exl2.py")
        assert spec and spec.loader
        device_exl2 = importlib.util.module_from_spec(spec)
        sys.modules["device_exl2"] = device_exl2  # its dataclass looks its module up there
        spec.loader.exec_module(device_exl2)
        chat = device_exl2.streamed_chat(port, "tiny", max_tokens=12)
        assert chat["completion_tokens"] == 12 and chat["chunks"] >= 1 and 0 < chat["ttft_s"] <= chat["wall_s"]
        # again: ok, the same process
        assert run_deploy("box", str(recipe), settings=settings) == 0
        assert "running, unchanged" in capsys.readouterr().out and pid_file.read_text().strip() == pid
        # one change: one restart, a new process
        assert run_deploy("box", str(_recipe(tmp_path, "tiny-process", port, context=256)), settings=settings) == 0
        new_pid = pid_file.read_text().strip()
        assert new_pid != pid and exited(int(pid))
        _chat(port)
    finally:
        assert run_stop("box", str(recipe), settings=settings) == 0
    assert not pid_file.exists()


def test_one_instance_per_gpu_is_planned_from_the_template(nspawn_host, tmp_path, capsys):
    """A V100 recipe with --gpus 0,1 on the systemd host, as a dry run (no GPU here to start
    it): the instance template and one env file per GPU are shown, and each instance gets its
    own port check and its own serving step (port + i)."""
    recipe = load_recipe("qwen2.5-14b-v100-16gb")
    prefix = str(nspawn_host.prefix)
    gguf = ModelLayout(prefix, recipe_weights(recipe).model_id).gguf(recipe.recipe.quant_name)
    with connect(spec_for(nspawn_host)) as host:
        host.run(f"mkdir -p {shlex.quote(gguf.rsplit('/', 1)[0])}", stream=False)
        host.put(json.dumps({"sha256": "ab" * 32, "bytes": 9 * 10**9}).encode(), manifest_path(gguf))
        try:
            settings = Settings(inventory=inventory_for(tmp_path, "box", nspawn_host, prefix=prefix))
            assert run_deploy("box", "qwen2.5-14b-v100-16gb", dry_run=True, gpus=(0, 1), settings=settings) == 0
            out = capsys.readouterr().out
            port = recipe.recipe.service.port
            for i in (0, 1):
                assert f"+++ /etc/voltaforge/voltaforge-llama-server@{i}.env (rendered)" in out
                assert f"+VOLTAFORGE_PORT={port + i}" in out and f"+CUDA_VISIBLE_DEVICES={i}" in out
                assert f"Ensure systemd unit voltaforge-llama-server@{i}.service serves on 127.0.0.1:{port + i}" in out
            assert "+++ /etc/systemd/system/voltaforge-llama-server@.service (rendered)" in out
            assert host.run("test -e /etc/voltaforge", check=False, stream=False).exited == 1  # nothing written
        finally:
            host.run(f"rm -rf {shlex.quote(prefix)}/models {shlex.quote(prefix)}/deploy", check=False, stream=False)
