"""A host's `serve:` layout (config/inventory.py Placement, conduct/placements.py): several
recipes on disjoint GPU sets, each with its own units and ports; every refusal one line that
names the host and the recipe, before anything connects."""

from __future__ import annotations

import pytest

from playbooks.conduct.deploy import served_instances
from playbooks.conduct.placements import Served, host_serves
from playbooks.conduct.settings import Settings
from playbooks.config import planning
from playbooks.config.inventory import load_inventory
from playbooks.config.recipe import list_recipes, load_recipe
from playbooks.errors import RecipeError, VoltaforgeError
from playbooks.facts.deployments import Deployment
from playbooks.steps.serve import service_files
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.units import default_gpu_indexes
from tests.helpers import recipe_with

DGX = """\
hosts:
  dgx-01:
    host: 10.0.0.31
    gpu: v100-sxm2-32gb
    serve:
      - recipe: llama3.1-70b-2xv100-32gb
        gpus: [0, 1]
      - recipe: qwen3-30b-a3b-v100-32gb
        gpus: [2]
        port: 8090
      - recipe: qwen2.5-14b-v100-32gb
        gpus: [3, 4]
        port: 8100
"""


def _unit_and_instances(served, prefix):
    """The recipe's rendered unit (its placement's GPUs) and the instances it runs."""
    r = served.loaded.recipe
    gpus = default_gpu_indexes(r) if served.gpus is None else served.gpus
    return planned_service_files(served.loaded, served.layout(prefix), gpus)[0], served_instances(served, prefix)[1]


def served(tmp_path, text: str, recipe: str | None = None):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(text)
    (spec,) = load_inventory(inv).values()
    return host_serves(spec, recipe, load_recipe)


def test_a_layout_places_each_recipe_on_its_gpus_with_its_own_units_and_ports(tmp_path):
    split, moe, replicas = served(tmp_path, DGX)
    # the 70B split: one plain unit over GPUs 0 and 1, on the recipe's own port
    unit, instances = _unit_and_instances(split, "/opt/voltaforge")
    assert unit.path == "/etc/systemd/system/voltaforge-llama3.1-70b-2xv100-32gb.service"
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in unit.text
    assert [(n, p) for n, _, p in instances] == [
        ("voltaforge-llama3.1-70b-2xv100-32gb.service", load_recipe("llama3.1-70b-2xv100-32gb").recipe.service.port)
    ]
    # the MoE on GPU 2 alone, on the layout's port
    unit, instances = _unit_and_instances(moe, "/opt/voltaforge")
    assert "Environment=CUDA_VISIBLE_DEVICES=2" in unit.text and "DeviceAllow=/dev/nvidia2 rw" in unit.text
    assert [p for _, _, p in instances] == [8090] == moe.ports()
    assert "--port 8090" in unit.text
    # a one-card recipe on two GPUs: the instance template, one instance per GPU (port + index)
    unit, instances = _unit_and_instances(replicas, "/opt/voltaforge")
    assert unit.path == "/etc/systemd/system/voltaforge-qwen2.5-14b-v100-32gb@.service"
    assert [(n, s.state_dir, p) for n, s, p in instances] == [
        (
            "voltaforge-qwen2.5-14b-v100-32gb@3.service",
            "/opt/voltaforge/deploy/voltaforge-qwen2.5-14b-v100-32gb@3",
            8103,
        ),
        (
            "voltaforge-qwen2.5-14b-v100-32gb@4.service",
            "/opt/voltaforge/deploy/voltaforge-qwen2.5-14b-v100-32gb@4",
            8104,
        ),
    ]
    # every recipe its own model link
    assert {s.layout("/p").serve_dir for s in (split, moe, replicas)} == {
        "/p/serve/voltaforge-llama3.1-70b-2xv100-32gb",
        "/p/serve/voltaforge-qwen3-30b-a3b-v100-32gb",
        "/p/serve/voltaforge-qwen2.5-14b-v100-32gb",
    }


def test_recipe_picks_one_placement_and_a_recipe_outside_the_layout_is_refused(tmp_path):
    (moe,) = served(tmp_path, DGX, "qwen3-30b-a3b-v100-32gb")
    assert moe.gpus == (2,) and moe.ports() == [8090]
    with pytest.raises(VoltaforgeError, match=r"dgx-01: --recipe tiny-cpu is not in its serve: layout \(llama3.1"):
        served(tmp_path, DGX, "tiny-cpu")


def test_a_host_without_a_layout_serves_its_one_recipe_as_before(tmp_path):
    text = "hosts:\n  v100-01:\n    host: 10.0.0.21\n    recipe: tiny-cpu\n"
    (one,) = served(tmp_path, text)
    assert one.unit_name is None and one.gpus is None and one.ports() == [18080]
    unit, _ = _unit_and_instances(one, "/opt/voltaforge")
    assert unit.path == "/etc/systemd/system/voltaforge-llama-server.service"


@pytest.mark.parametrize(
    "serve,message",
    [
        # the schema's own checks, with the file's line
        ("      - {recipe: tiny-cpu, gpus: [0]}\n      - {recipe: tiny-moe-cpu, gpus: [0]}\n",
         r"GPU 0 is placed twice in serve: tiny-cpu and tiny-moe-cpu"),
        ("      - {recipe: tiny-cpu}\n      - {recipe: tiny-cpu, port: 9000}\n", r"a recipe is placed twice"),
        ("      - {recipe: tiny-cpu, gpus: [0], instances: 2}\n", r"not both"),
        ("      - {recipe: tiny-cpu, gpus: [0, 0]}\n", r"distinct GPU indexes"),
        ("      - {recipe: tiny-cpu, colour: red}\n", r"unknown key 'hosts.h.serve.0.colour'"),
    ],
)  # fmt: skip
def test_a_bad_layout_is_refused_with_its_line(tmp_path, serve, message):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  h:\n    host: 10.0.0.21\n    serve:\n" + serve)
    with pytest.raises(RecipeError, match=message):
        load_inventory(inv)
    inv.write_text("hosts:\n  h:\n    host: 10.0.0.21\n    recipe: tiny-cpu\n    serve:\n      - {recipe: tiny-cpu}\n")
    with pytest.raises(RecipeError, match="inventory.yaml.*give recipe \\(one\\) or serve"):
        load_inventory(inv)


@pytest.mark.parametrize(
    "serve,message",
    [
        ("      - {recipe: llama3.1-70b-2xv100-32gb, gpus: [0]}\n",
         r"h: serve: llama3.1-70b-2xv100-32gb: the recipe splits one server over 2 GPUs; the layout gives 1: \[0\]"),
        ("      - {recipe: tiny-cpu, gpus: [1]}\n", r"h: serve: tiny-cpu: a CPU recipe takes instances, not gpus"),
        ("      - {recipe: qwen2.5-14b-v100-16gb, instances: 2}\n", r"a GPU recipe runs one instance per GPU"),
        ("      - {recipe: qwen2.5-32b-exl2-v100-16gb, gpus: [0, 1]}\n", r"TabbyAPI serves one instance per host"),
        ("      - {recipe: seed-exl2-3.3-v100-16gb, gpus: [0]}\n"
         "      - {recipe: seed-exl2-4.0-v100-16gb, gpus: [1], port: 8081}\n",
         r"h: serve: seed-exl2-3.3-v100-16gb, seed-exl2-4.0-v100-16gb are EXL2 recipes; TabbyAPI has one unit"),
        # tiny-cpu's two instances listen on 18080 and 18081, tiny-moe-cpu's port
        ("      - {recipe: tiny-cpu, instances: 2}\n      - {recipe: tiny-moe-cpu}\n",
         r"h: serve: tiny-cpu and tiny-moe-cpu both listen on port 18081: give one of them another port"),
        ("      - {recipe: tiny-cpu, instances: 3, port: 65534}\n", r"would listen on port 65536, above 65535"),
    ],
)  # fmt: skip
def test_what_only_the_recipes_can_tell_is_refused_before_connecting(tmp_path, serve, message):
    with pytest.raises(VoltaforgeError, match=message):
        served(tmp_path, "hosts:\n  h:\n    host: 10.0.0.21\n    serve:\n" + serve)


def test_a_recipe_path_in_a_layout_and_the_other_commands(tmp_path):
    """The placement may name a recipe by path; --recipe then matches its path or its name.
    A command that needs one recipe (quantize, tune) says which are there."""
    path = recipe_with(tmp_path, "tiny-cpu", "", name="tiny-b")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        f"hosts:\n  h:\n    host: 10.0.0.21\n    serve:\n      - {{recipe: {path}, port: 18300}}\n"
        "      - {recipe: tiny-cpu, instances: 2}\n"
    )
    settings = Settings(inventory=inv)
    assert [s.name for s in settings.serves("h", None)] == ["tiny-b", "tiny-cpu"]
    assert [s.ports() for s in settings.serves("h", "tiny-b")] == [[18300]]
    assert [s.ports() for s in settings.serves("h", str(path))] == [[18300]]
    with pytest.raises(VoltaforgeError, match=r"h serves several recipes \(.*tiny-b.yaml, tiny-cpu\): pass --recipe"):
        settings.recipe_for("h", None)
    # the recipe as served there: the file's, on the layout's port
    (b,) = settings.serves("h", "tiny-b")
    assert b.loaded.recipe.service.port == 18300 and load_recipe(path).recipe.service.port == 18080


def test_the_example_inventory_s_layout_is_the_one_tested_here(tmp_path):
    """inventory.example.yaml shows a layout in comments: uncommented, it loads and places as above."""
    from tests.helpers import ROOT

    lines = (ROOT / "inventory.example.yaml").read_text().splitlines()
    start = lines.index("  # dgx-01:")
    block = [line.replace("  # ", "  ", 1).split("   #")[0].rstrip() for line in lines[start:]]
    split, moe, replicas = served(tmp_path, "hosts:\n" + "\n".join(block) + "\n")
    assert (split.gpus, moe.gpus, replicas.gpus) == ((0, 1), (2,), (3, 4))
    assert replicas.ports() == [8103, 8104] and moe.ports() == [8090]


def test_bench_lb_refuses_a_layout_of_several_before_connecting(tmp_path):
    """`invoke bench --lb` measures one recipe's workload: a layout of two without --recipe is
    one line, and nothing is reached (the host's address would not answer). (`invoke lb`
    balances the whole layout: tests/test_balancer.py.)"""
    from playbooks.cli.bench import run_bench_lb

    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "hosts:\n  h:\n    host: 192.0.2.1\n    serve:\n      - {recipe: tiny-cpu, instances: 2, port: 18300}\n"
        "      - {recipe: tiny-moe-cpu}\n"
    )
    settings = Settings(inventory=inv, connect_timeout=0.5)
    with pytest.raises(VoltaforgeError, match=r"^h serves several recipes \(tiny-cpu, tiny-moe-cpu\): pass --recipe$"):
        run_bench_lb("h", 8000, settings=settings)
    assert settings.one_recipe("h", "tiny-moe-cpu").ports() == [18081]


def test_render_host_writes_what_the_inventory_gives_each_host(tmp_path):
    """`invoke render --inventory I --host H` without connecting: the layout host's every
    recipe (units, the instance template and one env file per instance) and, on a worker host,
    the RPC worker units another host's recipe places there (issue 36, item 2; that these are
    the installed bytes is held by tests/test_layout_real.py in the booted container)."""
    import subprocess
    import sys

    from playbooks.conduct.host_files import host_files
    from playbooks.conduct.settings import Settings
    from tests.helpers import ROOT

    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        DGX
        + "  edge:\n    host: 10.0.0.32\n    recipe: tiny-rpc-cpu\n"
        + "  local:\n    host: 127.0.0.1\n    local: true\n"
    )
    settings = Settings(inventory=inv)
    paths = [f.path for f in host_files(settings, "dgx-01")]
    assert paths[0] == "/etc/systemd/system/voltaforge-llama3.1-70b-2xv100-32gb.service"
    assert "/etc/systemd/system/voltaforge-qwen2.5-14b-v100-32gb@.service" in paths
    assert sum(p.endswith(".env") for p in paths) == 2, paths  # GPUs 3 and 4, one instance each
    # tiny-rpc-cpu (served by edge) places both its workers on `local`
    workers = [f for f in host_files(settings, "local")]
    assert [f.path for f in workers] == [
        "/etc/systemd/system/voltaforge-rpc-18152.service",
        "/etc/systemd/system/voltaforge-rpc-18153.service",
    ]
    assert "ggml-rpc-server --host 127.0.0.1 --port 18152" in workers[0].text
    # the task writes them at their host paths; a host with nothing to install is one line
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "render", "--host", "dgx-01", "--inventory", str(inv),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        p.lstrip("/") for p in paths
    )
    with pytest.raises(VoltaforgeError, match="nothing would be installed"):
        host_files(Settings(inventory=inv), "ghost")


@pytest.mark.parametrize("path", list_recipes(), ids=lambda p: p.stem)
@pytest.mark.parametrize("slots", ["default", "two"])
def test_the_engine_names_the_unit_it_renders_without_planning(path, slots, monkeypatch):
    """served_instances takes a recipe's unit name from its engine (ServerEngine.unit_name), not
    from rendering the unit, which plans the recipe: the name is the one render_files writes
    first, for every shipped recipe on its own GPUs and a one-card recipe on two (the template)."""
    loaded = load_recipe(path)
    r = loaded.recipe
    gpus = default_gpu_indexes(r) if slots == "default" or r.gpu_count > 1 else (3, 4)
    one = Served(loaded, gpus, None)
    rendered = planned_service_files(loaded, one.layout("/opt/vf"), gpus)[0].path.rsplit("/", 1)[1]

    def no_plan(*_a, **_k):
        raise AssertionError("served_instances planned the recipe")

    # rendering plans through these two (steps/serve/service_files.py); nothing else may plan
    monkeypatch.setattr(service_files, "resolve_n_cpu_moe", no_plan)
    monkeypatch.setattr(service_files, "resolve_gpu_split", no_plan)
    monkeypatch.setattr(planning, "plan_recipe", no_plan)
    unit, instances = served_instances(one, "/opt/vf")
    assert unit == rendered
    port = r.service.port
    assert [i.port for i in instances] == ([port + i for i in gpus] if unit.endswith("@.service") else [port])


def test_an_instance_listens_where_its_record_says(tmp_path):
    """The host's records give each instance its port (what runs), the recipe the rest."""
    (replicas,) = served(tmp_path, DGX, "qwen2.5-14b-v100-32gb")
    name = "voltaforge-qwen2.5-14b-v100-32gb"
    records = [
        Deployment(f"{name}@3", {"port": 9103}),
        Deployment(f"{name}@4", {"port": "8104"}),  # not a port: the recipe's
        Deployment("voltaforge-other", {"port": 8103}),
    ]
    _, instances = served_instances(replicas, "/opt/voltaforge", records)
    assert [(i.unit, i.port) for i in instances] == [(f"{name}@3.service", 9103), (f"{name}@4.service", 8104)]
