"""The host knows what it serves: the deployment record keeps its recipe (name, path, sha256,
merged text), one command lists a host's records, bare `invoke bench`/`stop` take the recipe
from there, and `invoke status` shows each service. Here on this machine's shell (LocalHost,
a prefix under tmp_path) and a port where nothing listens; the sshd run with a real server is
tests/test_status_real.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from playbooks.cli.status import run_status
from playbooks.conduct.deployed import deployed_recipe, read_deployments
from playbooks.conduct.settings import Settings
from playbooks.conduct.stop import stop_served
from playbooks.config.planning import resolve_n_cpu_moe
from playbooks.config.recipe import RECIPES_DIR, load_recipe
from playbooks.config.recorded import recipe_record
from playbooks.errors import VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.deployments import deployments_command, parse_deployments
from playbooks.host.local import LocalHost
from playbooks.host.ops import Record, Shell, run_command
from playbooks.steps.serve.deploy_record import DeployLayout, read_record, write_record
from playbooks.steps.serve.lifecycle import EnsureServing, Expectations, ServingFacts
from playbooks.steps.serve.service_file import ServiceFile
from playbooks.steps.serve.service_files import render_service_files
from playbooks.steps.serve.service_manager import Running, Systemd, make_manager
from playbooks.steps.serve.units import ServerLayout
from tests.helpers import ROOT
from tests.testhosts import free_port

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if p.name != "defaults.yaml")
SERVICE = "voltaforge-llama-server"


def _copy_of_tiny(where: Path, **over) -> Path:
    """tiny-cpu as a temporary recipe file beside its own defaults.yaml (as the tests deploy it)."""
    where.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text()) | over
    (where / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    path = where / "tiny-tmp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _record(path: Path | None, port: int = 1, manager: str = "process", **extra) -> dict:
    """A record as EnsureServing writes it (the keys status reads), with or without its recipe."""
    rec = {
        "version": 3,
        "fingerprint": "f" * 16,
        "run": "",
        "at": "2026-01-02T03:04:05Z",
        "manager": manager,
        "files": {},
        "artifact": {"path": "/p/models/m/gguf/m-Q4_K_M.gguf", "sha256": "ab" * 32, "bytes": 1},
        "port": port,
        "gate": {"status": "not run"},
    } | extra
    if path is not None:
        rec["recipe"] = recipe_record(load_recipe(path))
    return rec


def _write(host: LocalHost, layout: DeployLayout, record: dict) -> None:
    """The record where deploy keeps it: its state directory (mode 0700, as deploy makes it)."""
    Path(layout.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    write_record(host, layout, record)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_recorded_recipe_loads_back_as_the_same_recipe_and_unit(name, tmp_path):
    """The merged text alone (no defaults.yaml beside it, no model config file) is the recipe:
    every field but the config's form, the model's shape, the rendered files, and its own
    record's sha256."""
    loaded = load_recipe(name)
    rec = recipe_record(loaded)
    assert rec["name"] == loaded.recipe.name and rec["path"] == str(loaded.path.resolve())
    copy = tmp_path / "elsewhere" / "copy.yaml"
    copy.parent.mkdir()
    copy.write_text(rec["yaml"])
    again = load_recipe(copy)
    a, b = loaded.recipe.model_dump(mode="json"), again.recipe.model_dump(mode="json")
    assert isinstance(b["model"]["config"], dict)  # inlined: no file beside it is needed
    a["model"].pop("config"), b["model"].pop("config")
    if a.get("draft"):  # a draft's config is inlined the same way
        assert isinstance(b["draft"]["model"]["config"], dict)
        a["draft"]["model"].pop("config"), b["draft"]["model"].pop("config")
    assert a == b and again.shape == loaded.shape and again.draft_shape == loaded.draft_shape
    layout = ServerLayout(prefix="/srv/vf")
    assert [
        (f.path, f.text) for f in render_service_files(again.recipe, layout, n_cpu_moe=resolve_n_cpu_moe(again))
    ] == [(f.path, f.text) for f in render_service_files(loaded.recipe, layout, n_cpu_moe=resolve_n_cpu_moe(loaded))]
    assert recipe_record(again)["sha256"] == rec["sha256"]


def test_paths_relative_to_the_recipe_are_recorded_absolute(tmp_path):
    src = tmp_path / "r"
    src.mkdir()
    (src / "cfg.json").write_text(
        json.dumps(yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"])
    )
    path = _copy_of_tiny(src, model={"path": "weights", "config": "cfg.json", "calibration": "calib.txt"})
    text = recipe_record(load_recipe(path))["yaml"]
    model = yaml.safe_load(text)["model"]
    assert model["path"] == str(src / "weights") and model["calibration"] == str(src / "calib.txt")
    assert model["config"]["hidden_size"] == 256


def test_one_command_lists_every_record_and_the_parser_tells_old_corrupt_and_edited_ones(tmp_path):
    prefix = str(tmp_path / "a prefix")  # a space: the command quotes it
    recipe = _copy_of_tiny(tmp_path / "r")
    with LocalHost() as host:
        assert parse_deployments(read_fact(host, deployments_command(prefix))) == []  # no deploy/ at all
        _write(host, DeployLayout(prefix, "svc-new"), _record(recipe))
        _write(host, DeployLayout(prefix, "svc-old"), _record(None))
        edited = _record(recipe)
        edited["recipe"]["yaml"] += "context: 64\n"  # its sha256 no longer matches: not trusted
        _write(host, DeployLayout(prefix, "svc-edited"), edited)
        (Path(prefix) / "deploy" / "svc-corrupt").mkdir()
        (Path(prefix) / "deploy" / "svc-corrupt" / "deployed.json").write_text('{"port": 1,\n')
        (Path(prefix) / "deploy" / "svc-none").mkdir()  # a state directory without a record
        (Path(prefix) / "deploy" / "svc-new" / "good").mkdir()  # a rollback copy is no deployment
        found = read_deployments(host, prefix)
    assert [d.service for d in found] == ["svc-corrupt", "svc-edited", "svc-new", "svc-old"]
    corrupt, edited_d, new, old = found
    assert corrupt.record is None and corrupt.recipe is None
    assert edited_d.record is not None and edited_d.recipe is None
    assert new.recipe is not None and new.recipe.name == "tiny-tmp" and new.recipe.path == str(recipe.resolve())
    assert yaml.safe_load(new.recipe.yaml)["service"]["port"] == 18080
    assert new.port == 1 and new.manager == "process" and new.model == "/p/models/m/gguf/m-Q4_K_M.gguf"
    assert old.record is not None and old.recipe is None and old.at == "2026-01-02T03:04:05Z"
    assert parse_deployments("garbage\n\tno service\nsvc\t[1, 2]\n") == [parse_deployments("svc\t")[0]]


def test_a_sets_record_names_its_members_and_one_edited_by_hand_is_left_out(tmp_path):
    """A model set's router keeps its members in its record (conduct/set_deploy.py): each as a
    recipe is kept, with its served name; an entry whose text does not match its sha256 is not
    trusted, and the router's own ``recipe`` is none."""
    first = recipe_record(load_recipe(str(_copy_of_tiny(tmp_path / "a"))))
    second = recipe_record(load_recipe(str(_copy_of_tiny(tmp_path / "b", context=256))))
    edited = {**second, "yaml": second["yaml"] + "parallel: 1\n"}
    members = [first | {"served_name": "small"}, second | {"served_name": "mid"}, edited | {"served_name": "big"}]
    with LocalHost() as host:
        _write(host, DeployLayout(str(tmp_path / "p"), "voltaforge-set-trio"), _record(None, members=members))
        (d,) = read_deployments(host, str(tmp_path / "p"))
    assert d.recipe is None and [r.sha256 for r in d.members] == [first["sha256"], second["sha256"]]
    assert d.member_names == ("small", "mid")
    assert parse_deployments("svc\t" + json.dumps({"members": "garbage"}))[0].members == ()


def test_bare_commands_take_the_recipe_the_host_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    prefix = str(tmp_path / "vf")
    settings = Settings(inventory=tmp_path / "none.yaml", prefix=prefix)
    recipe = _copy_of_tiny(tmp_path / "r")
    with LocalHost() as host:
        with pytest.raises(VoltaforgeError, match="^local: no recipe: pass --recipe or set one in inventory.yaml$"):
            settings.recipe_for("local", None)  # no host to ask: as before
        with pytest.raises(VoltaforgeError) as nothing:
            settings.recipe_for("local", None, host)
        assert str(nothing.value) == f"nothing deployed on local under {prefix}: pass --recipe or run invoke provision"

        layout = DeployLayout(prefix, SERVICE)
        _write(host, layout, _record(None))
        with pytest.raises(VoltaforgeError) as old:
            deployed_recipe(host, prefix)
        assert str(old.value) == (
            f"local: {SERVICE} was deployed before voltaforge recorded its recipe: pass --recipe once "
            "(`invoke deploy --host local --recipe RECIPE` records it, without a restart)"
        )
        assert settings.recipe_for("local", "tiny-cpu", host) == "tiny-cpu"  # a named recipe wins

        _write(host, layout, _record(recipe))
        assert settings.recipe_for("local", None, host) == str(recipe.resolve())  # the file still holds it
        # the file gone (a temporary path): the recorded text, under the local cache, loads the same recipe
        shutil.rmtree(recipe.parent)
        copy = settings.recipe_for("local", None, host)
        assert copy.startswith(str(tmp_path / "cache" / "deployed-recipes")) and copy.endswith("/tiny-tmp.yaml")
        served = load_recipe(copy)
        assert served.recipe.name == "tiny-tmp" and served.recipe.service.port == 18080
        assert deployed_recipe(host, prefix) == copy  # again: the same file

        # two instances of one recipe (one per GPU): that recipe; two recipes: one line naming both
        _write(host, DeployLayout(prefix, f"{SERVICE}@1"), read_record(host, layout) or {})
        assert deployed_recipe(host, prefix) == copy
        other = _copy_of_tiny(tmp_path / "r2", context=256)
        _write(host, DeployLayout(prefix, "voltaforge-tabbyapi"), _record(other))
        with pytest.raises(VoltaforgeError) as several:
            deployed_recipe(host, prefix)
        assert str(several.value) == (
            f"local serves 3 deployments under {prefix}: {SERVICE} (tiny-tmp), {SERVICE}@1 (tiny-tmp), "
            "voltaforge-tabbyapi (tiny-tmp): pass --recipe to choose one"
        )


def _serving(tmp_path: Path, recipe: dict | None) -> EnsureServing:
    unit = ServiceFile("/etc/systemd/system/x.service", "[Service]\nExecStart=/bin/x\n", 0o644, True)
    return EnsureServing(
        Systemd("x.service"), DeployLayout(str(tmp_path), "x"), [unit], "/l", "/m", "ab" * 32, 1, 1,
        Expectations(None, None, None), recipe=recipe,
    )  # fmt: skip


def test_a_deployment_unchanged_but_for_its_recipe_only_has_its_record_updated(tmp_path):
    """Deploying the same service again from a recipe whose text differs (a gate threshold, or a
    record older than recipes in records) writes the recipe into the record; nothing restarts."""
    recipe = recipe_record(load_recipe(_copy_of_tiny(tmp_path / "r")))
    op = _serving(tmp_path, recipe)
    up = Running(True, "inv1", 42, "active (running), pid 42")
    old = {"fingerprint": op.want, "run": "inv1", "at": "T", "port": 1}
    d = op.decide(ServingFacts(up, old))
    assert d.reason.endswith("; the record does not name its recipe yet") and d.reason.startswith("running, unchanged")
    assert [type(c) for c in d.commands] == [Record]
    assert op.decide(ServingFacts(up, old | {"recipe": recipe})).commands == ()
    other = old | {"recipe": {**recipe, "sha256": "0" * 64}}
    assert op.decide(ServingFacts(up, other)).reason.endswith("; the record names another recipe text")
    # not running: a restart as before, which records the recipe with the rest
    assert any(isinstance(c, Shell) for c in op.decide(ServingFacts(Running(False, "", 0, ""), old)).commands)
    with LocalHost() as host:
        good = {"fingerprint": op.want, "at": "T", "copies": {}}
        _write(host, op.layout, old | {"good": good})
        op.apply(host, d)  # the record only: a restart would need systemctl, which is not here
        rec = read_record(host, op.layout) or {}
    assert rec["recipe"] == recipe and rec["good"]["recipe"] == recipe and rec["run"] == "inv1"


def test_status_shows_each_service_and_a_host_it_cannot_reach(tmp_path, capsys):
    prefix = str(tmp_path / "vf")
    port, dead = free_port(), free_port()
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"gone": {"host": "127.0.0.1", "port": dead}}}))
    settings = Settings(inventory=inventory, prefix=prefix, connect_timeout=5)
    with LocalHost() as host:
        assert run_status("local", as_json=True, settings=settings) == 0
        assert json.loads(capsys.readouterr().out) == [
            {"host": "local", "prefix": prefix, "error": None, "services": [], "units": []}
        ]
        recipe = _copy_of_tiny(tmp_path / "r")
        gate = {"status": "passed", "at": "2026-01-02T03:05:00Z", "figures": {"single_tok_s": 61.5, "peak_at": 2,
                "peak_aggregate_tok_s": 90.0}, "reasons": [], "report": "/x/bench.md"}  # fmt: skip
        _write(host, DeployLayout(prefix, SERVICE), _record(recipe, port, gate=gate))
        _write(host, DeployLayout(prefix, "voltaforge-old"), _record(None, port, manager="systemd"))
    assert run_status(["local", "gone"], as_json=True, settings=settings) == 1
    here, gone = json.loads(capsys.readouterr().out)
    assert gone["host"] == "gone" and gone["services"] == [] and gone["error"] and "\n" not in gone["error"]
    new, old = here["services"]
    # nothing listens on the port, and the managed process's unit file is not there to read its state
    assert new["service"] == SERVICE and new["recipe"] == "tiny-tmp" and new["recipe_path"] == str(recipe.resolve())
    assert new["health"] == 0 and new["health_text"] == "nothing listens" and new["running"] is None
    assert new["port"] == port and new["model"] == "/p/models/m/gguf/m-Q4_K_M.gguf" and new["uptime_s"] is None
    assert new["gate"]["status"] == "passed" and new["gate"]["figures"]["single_tok_s"] == 61.5
    assert old["recipe"] is None and old["note"] == "deployed before voltaforge recorded its recipe"
    assert old["manager"] == "systemd" and old["running"] is False  # no systemd here: not active
    assert run_status(["local", "gone"], settings=settings) == 1
    table = capsys.readouterr().out
    assert "nothing listens" in table and "tiny-tmp" in table and "passed" in table and "61.5 tok/s single" in table
    assert "unreachable:" in table and "1 of 2 hosts read; unreachable: gone" in table
    with pytest.raises(VoltaforgeError, match="a host is named twice"):
        run_status(["local", "local"], settings=settings)


def test_stop_stops_what_the_record_names_and_a_server_never_deployed_is_ok(tmp_path, monkeypatch):
    """`invoke stop` asks each instance's deployment record who runs it (its manager, and for a
    process the unit file kept in its state directory), not this host's systemd: no record is
    ``ok (never deployed here)`` with nothing run; a recorded process is stopped for real."""
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    prefix = str(tmp_path / "vf")
    settings = Settings(inventory=tmp_path / "none.yaml", prefix=prefix)
    recipe = _copy_of_tiny(tmp_path / "r")
    [never] = stop_served(settings, "local", str(recipe))
    assert (never.status, never.why, never.commands) == ("ok", "never deployed here", ())

    layout = DeployLayout(prefix, SERVICE)
    unit = f"{layout.state_dir}/{SERVICE}.service"
    text = f"[Service]\nExecStart={shutil.which('sleep')} 300\n"
    with LocalHost() as host:
        _write(host, layout, _record(recipe, files={unit: "x"}))
        Path(unit).write_text(text)
        mgr = make_manager("process", layout, f"{SERVICE}.service", text)
        run_command(host, mgr.restart())
        assert mgr.running(host.run(mgr.state_command(), stream=False).stdout).up
        [stopped] = stop_served(settings, "local", str(recipe))
        assert (stopped.status, stopped.step) == ("changed", f"Stop {mgr.describe()}")
        assert not mgr.running(host.run(mgr.state_command(), stream=False).stdout).up
