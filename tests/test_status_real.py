"""The host knows what it serves, for real: the tiny model (Q4_K_M, made by the real
llama-quantize) deployed over a private sshd as a managed process from a temporary recipe,
with an inventory entry that names no recipe. Then the temporary recipe is deleted, and bare
`invoke bench` (a gate that passes), `invoke status` (the API and the Invoke task in a
subprocess) and `invoke stop` work from the host's deployment record alone; status shows the
service down after. A record written before recipes were recorded is refused in one line,
and deploying with --recipe once records it without a restart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from playbooks.cli.bench import run_bench
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.cli.status import run_status
from playbooks.conduct.settings import Settings
from playbooks.errors import VoltaforgeError
from playbooks.host import connect
from tests import llamacpp_tools
from tests.helpers import ROOT, inventory_for, spec_for, stage_served_model
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
SERVICE = "voltaforge-llama-server"


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("status")
    f16 = llamacpp_tools.tiny_f16(work, TINY["model"]["config"])
    return llamacpp_tools.quantize(f16, work / "tiny-Q4_K_M.gguf", "Q4_K_M")


def _recipe(where: Path, port: int) -> Path:
    """tiny-cpu on a port of its own with a short gate that passes, in a temporary directory."""
    where.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(TINY))
    data["service"] = {"port": port}
    # the model's whole context per slot: with the tiny vocabulary some passages of the shipped
    # text take far more tokens per word than the probe's (seen: a 735-token prompt for 16 asked)
    data["context"] = 2048
    data["gate"] = {"levels": [1], "prompt_tokens": 16, "max_tokens": 16, "min_tok_s": 1}
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / "tiny-status.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _status(settings: Settings, capsys) -> dict:
    assert run_status("box", as_json=True, settings=settings) == 0
    [host] = json.loads(capsys.readouterr().out)
    assert host["host"] == "box" and host["error"] is None
    [service] = host["services"]
    return service


@pytest.mark.timeout(1200)
def test_bare_bench_status_and_stop_use_what_the_host_serves(sshd_host, tiny_q4, tmp_path, monkeypatch, capsys):
    port = free_port()
    prefix = str(sshd_host.prefix / "vf")
    inventory = inventory_for(tmp_path, "box", sshd_host, prefix=prefix)  # no recipe in it
    settings = Settings(inventory=inventory)
    recipe = _recipe(tmp_path / "recipe", port)
    with connect(spec_for(sshd_host)) as host:
        gguf = stage_served_model(host, prefix, recipe, tiny_q4)
    # reports, history and recorded recipes in the test's own cache (after staging: the tools live in the real one)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(VoltaforgeError) as nothing:
        run_bench("box", settings=settings)
    assert str(nothing.value) == f"nothing deployed on box under {prefix}: pass --recipe or run invoke provision"

    assert run_deploy("box", str(recipe), settings=settings) == 0, capsys.readouterr().out[-3000:]
    capsys.readouterr()
    pid_file = Path(prefix) / "deploy" / SERVICE / "server.pid"
    pid = int(pid_file.read_text())
    record_file = Path(prefix) / "deploy" / SERVICE / "deployed.json"
    assert record_file.parent.stat().st_mode & 0o077 == 0  # the record, the recipe's text in it: the user's only
    shutil.rmtree(recipe.parent)  # the temporary recipe is gone: the host's record still holds it
    try:
        # bare bench: the recipe the host serves, its gate passes
        assert run_bench("box", as_json=True, settings=settings) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["gate"]["passed"] and [lv["concurrency"] for lv in result["levels"]] == [1]
        assert (tmp_path / "cache" / "bench" / "box" / "tiny-status").is_dir()
        assert next((tmp_path / "cache" / "deployed-recipes").glob("*/tiny-status.yaml"))
        assert result["membw"]["source"].startswith("measured ")  # the first run on this host measures
        # again, bare, with --remeasure: the host's memory bandwidth measured afresh, not the stored figure
        assert run_bench("box", as_json=True, settings=settings, remeasure=True) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["membw"]["source"].startswith("measured ") and "(--remeasure)" in result["membw"]["source"]

        s = _status(settings, capsys)
        assert s["service"] == SERVICE and s["recipe"] == "tiny-status" and s["recipe_path"] == str(recipe.resolve())
        assert s["port"] == port and s["health"] == 200 and s["health_text"] == "200 ready" and s["model"] == gguf
        assert s["manager"] == "process" and s["running"] is True and s["pid"] == pid
        assert s["uptime_basis"] == "process" and 0 <= s["uptime_s"] < 3600
        assert s["gate"]["status"] == "not run"  # `invoke deploy` has no gate; provision's writes one

        # the Invoke task, as a user runs it
        env = {k: v for k, v in os.environ.items() if not k.startswith("INVOKE_")}
        r = subprocess.run(
            [sys.executable, "-m", "invoke", "status", "--host", "box", "--inventory", str(inventory)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr, r.stdout[-2000:])
        assert "200 ready" in r.stdout and "tiny-status" in r.stdout and f"pid {pid}" in r.stdout, r.stdout

        # a record from before recipes were recorded: one line; deploying with --recipe once records it
        record = json.loads(record_file.read_text())
        del record["recipe"]
        record_file.write_text(json.dumps(record, indent=2))
        with pytest.raises(VoltaforgeError) as old:
            run_stop("box", settings=settings)
        assert str(old.value) == (
            f"box: {SERVICE} was deployed before voltaforge recorded its recipe: pass --recipe once "
            "(`invoke deploy --host box --recipe RECIPE` records it, without a restart)"
        )
        assert int(pid_file.read_text()) == pid  # nothing was stopped
        again = _recipe(tmp_path / "recipe", port)  # the same text at the same path
        assert run_deploy("box", str(again), settings=settings) == 0
        out = capsys.readouterr().out
        assert "the record does not name its recipe yet" in out and int(pid_file.read_text()) == pid
        assert json.loads(record_file.read_text())["recipe"]["name"] == "tiny-status"
        assert run_stop("box", settings=settings) == 0  # bare: the recipe from the record
    finally:
        if pid_file.exists():  # a failure above: stop it all the same
            run_stop("box", str(_recipe(tmp_path / "recipe", port)), settings=settings)
    capsys.readouterr()
    assert not pid_file.exists()
    s = _status(settings, capsys)
    assert s["running"] is False and s["health"] == 0 and s["health_text"] == "nothing listens"
    assert s["pid"] is None and s["uptime_s"] is None and s["recipe"] == "tiny-status"
