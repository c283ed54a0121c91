"""The frictions a lab engineer met planning V100 boxes with host-free commands (issue 36, item
3), each fixed and held here: BF16 on a card without it, an EXL2 split in a layout, the render
hint that works, a user recipes folder beside the shipped one, a copied recipe's model config,
a token file in the SSH user's home, nvidia-smi's card names, EXL2's default cache."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from playbooks.conduct.deploy import served_instances
from playbooks.conduct.placements import host_serves
from playbooks.config.inventory import load_inventory
from playbooks.config.planning import plan_recipe, refuse_unfit
from playbooks.config.recipe import RECIPES_DIR, load_recipe
from playbooks.errors import RecipeError, VoltaforgeError
from playbooks.facts.files import parse_stat, stat_command
from playbooks.plan.gpus import GPUS, get_gpu
from playbooks.steps.measure.tune_space import Candidate, rule_out
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.units import default_gpu_indexes


def _unit_and_instances(served, prefix):
    """The recipe's rendered unit (its placement's GPUs) and the instances it runs."""
    r = served.loaded.recipe
    gpus = default_gpu_indexes(r) if served.gpus is None else served.gpus
    return planned_service_files(served.loaded, served.layout(prefix), gpus)[0], served_instances(served, prefix)[1]


def _copy(tmp_path, shipped: str, name: str, **changes) -> str:
    """A shipped recipe copied into a folder of the user's (with the shipped defaults beside it)
    and changed: its path."""
    data = yaml.safe_load((RECIPES_DIR / f"{shipped}.yaml").read_text())
    data.update(changes)
    (tmp_path / "defaults.yaml").write_text((RECIPES_DIR / "defaults.yaml").read_text())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_bf16_weights_or_cache_on_a_card_without_bf16_are_refused_with_the_reason(tmp_path):
    """Was: `cache: {k: bf16, v: bf16}` on a V100 planned "fits" and rendered --cache-type-k bf16."""
    plan = plan_recipe(load_recipe("qwen2.5-14b-v100-16gb"))
    bf16 = next(o for o in plan.options if o.quant == "BF16")
    assert not bf16.fits and bf16.unfit_reason == "sm_70 has no BF16"
    cache = load_recipe(_copy(tmp_path, "qwen2.5-14b-v100-16gb", "bf16-cache", cache={"k": "bf16", "v": "bf16"}))
    with pytest.raises(VoltaforgeError, match=r"sm_70 has no BF16 for a bf16 cache \(cache: f16\)"):
        refuse_unfit(cache)
    weights = load_recipe(_copy(tmp_path, "qwen2.5-14b-v100-16gb", "bf16-weights", quant="BF16"))
    with pytest.raises(VoltaforgeError, match=r"sm_70 has no BF16 for BF16 weights \(quant: F16\)"):
        refuse_unfit(weights)
    # tune prunes it by the same words; a card with BF16 and a CPU build keep it
    c = Candidate("Q4_K_M", "bf16", "bf16", True, 1, 512)
    assert rule_out(c, "v100-16gb", "llamacpp", None, None) == "sm_70 has no BF16"
    assert all(
        o.unfit_reason != "sm_70 has no BF16" for o in plan_recipe(load_recipe("tiny-cpu")).options if o.quant == "BF16"
    )
    a100 = plan_recipe(load_recipe("qwen2.5-14b-v100-16gb"), gpu="a100-80gb")
    assert next(o for o in a100.options if o.quant == "BF16").unfit_reason == ""


def test_an_exl2_split_is_placed_in_a_layout(tmp_path):
    """Was: "TabbyAPI serves one instance per host; give it one GPU" for a recipe split over two."""
    split = _copy(tmp_path, "qwen2.5-32b-exl2-v100-16gb", "exl2-split", gpu_count=2)
    inv = tmp_path / "inventory.yaml"
    box = {"host": "10.0.0.9", "gpu": "v100-16gb", "serve": [{"recipe": split, "gpus": [2, 3]}]}
    inv.write_text(yaml.safe_dump({"hosts": {"box": box}}))
    (spec,) = load_inventory(inv).values()
    (served,) = host_serves(spec, None, load_recipe)
    unit, instances = _unit_and_instances(served, "/opt/voltaforge")
    assert "Environment=CUDA_VISIBLE_DEVICES=2,3" in unit.text and len(instances) == 1
    # one card's recipe on two GPUs is still refused, saying how to split
    inv.write_text(inv.read_text().replace(split, "qwen2.5-32b-exl2-v100-16gb"))
    (spec,) = load_inventory(inv).values()
    with pytest.raises(VoltaforgeError, match=r"give it one GPU, or split the model over 2 \(gpu_count: 2"):
        host_serves(spec, None, load_recipe)


def test_the_render_hint_names_a_recipe_the_way_plan_takes_it(tmp_path):
    """Was: `render --recipe lab/bad/nofit.yaml` said `invoke plan --recipe nofit`: unknown."""
    nofit = _copy(tmp_path, "qwen2.5-32b-v100-16gb", "nofit", quant="Q8_0")
    with pytest.raises(VoltaforgeError) as err:
        refuse_unfit(load_recipe(nofit))
    hint = str(err.value).rsplit("(invoke plan --recipe ", 1)[1].rstrip(")")
    assert hint == nofit and load_recipe(hint).recipe.name == "nofit"
    shipped = load_recipe("qwen2.5-32b-v100-16gb")
    shipped.recipe.__dict__["quant"] = "Q8_0"  # the shipped one, made not to fit: named by its name
    with pytest.raises(VoltaforgeError, match=r"\(invoke plan --recipe qwen2.5-32b-v100-16gb\)$"):
        refuse_unfit(shipped)


def test_a_users_recipes_folder_sits_beside_the_shipped_recipes(tmp_path):
    """Was: recipes_dir hid the shipped recipes and listed the user's as "shipped recipes"."""
    mine = tmp_path / "mine"
    mine.mkdir()
    _copy(mine, "tiny-cpu", "lab-tiny")
    assert load_recipe("lab-tiny", mine).recipe.name == "lab-tiny"
    assert load_recipe("qwen2.5-14b-v100-16gb", mine).path == RECIPES_DIR / "qwen2.5-14b-v100-16gb.yaml"
    # a recipe of a shipped name in the user's folder wins, and the plan says so
    _copy(mine, "tiny-cpu", "tiny-cpu", context=256)
    own = load_recipe("tiny-cpu", mine)
    assert own.path == mine / "tiny-cpu.yaml" and own.recipe.context == 256
    assert any("not the shipped recipe of the same name" in n for n in plan_recipe(own).notes)
    with pytest.raises(RecipeError, match=rf"recipes in {mine}: lab-tiny, tiny-cpu; shipped recipes: .*tiny-cpu"):
        load_recipe("no-such", mine)


def test_a_copied_shipped_recipe_keeps_its_model_config(tmp_path):
    """Was: a shipped recipe copied elsewhere broke on its relative `models/...` config."""
    copied = load_recipe(_copy(tmp_path, "qwen2.5-14b-v100-16gb", "lab-14b"))
    assert copied.shape.num_hidden_layers == load_recipe("qwen2.5-14b-v100-16gb").shape.num_hidden_layers
    # a config next to the recipe of that name wins over the shipped one
    (tmp_path / "models").mkdir()
    own = json.loads((RECIPES_DIR / "models" / "qwen2.5-14b-instruct.config.json").read_text())
    (tmp_path / "models" / "qwen2.5-14b-instruct.config.json").write_text(json.dumps({**own, "num_hidden_layers": 40}))
    assert load_recipe(str(tmp_path / "lab-14b.yaml")).shape.num_hidden_layers == 40
    data = yaml.safe_load((tmp_path / "lab-14b.yaml").read_text())
    data["model"]["config"] = "models/none.config.json"
    (tmp_path / "lab-14b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(
        RecipeError, match=r"model.config: file 'models/none.config.json' not found \(looked at .* and "
    ):
        load_recipe(str(tmp_path / "lab-14b.yaml"))


def test_a_token_file_in_the_ssh_users_home(tmp_path):
    """Was: `token_file: ~/...` refused. Expanded on the host, never on the controller: the stat
    command run by bash with another HOME finds the file there."""
    model = yaml.safe_load((RECIPES_DIR / "qwen2.5-14b-v100-16gb.yaml").read_text())["model"]
    path = _copy(tmp_path, "qwen2.5-14b-v100-16gb", "tok", model={**model, "token_file": "~/.cache/hf-token"})
    assert load_recipe(path).recipe.model.token_file == "~/.cache/hf-token"
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "hf-token").write_text("x")
    (home / ".cache" / "hf-token").chmod(0o600)
    out = subprocess.run(
        ["bash", "-c", stat_command("~/.cache/hf-token")], env={"HOME": str(home)}, capture_output=True, text=True
    )
    stat = parse_stat(out.stdout)
    assert stat is not None and stat.mode == 0o600
    for bad in ("~root/x", "relative/x", "~/a b"):
        with pytest.raises(RecipeError, match="token_file"):
            load_recipe(_copy(tmp_path, "qwen2.5-14b-v100-16gb", "tok", model={**model, "token_file": bad}))


@pytest.mark.parametrize(
    "name,key",
    [
        ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
        ("V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("tesla v100-sxm2-32gb", "v100-sxm2-32gb"),
        ("NVIDIA H200", "h200"),
        ("v100-32gb", "v100-sxm2-32gb"),
    ],
)
def test_nvidia_smis_card_names_are_accepted(name, key):
    """Was: `Tesla V100-PCIE-32GB`, nvidia-smi's own name, was an unknown GPU."""
    assert get_gpu(name) is GPUS[key]


def test_an_exl2_recipe_without_a_cache_gets_exllamav2s_default(tmp_path):
    """Was: the defaults' llama.cpp cache (f16) failed an EXL2 recipe with no line number."""
    data = yaml.safe_load((RECIPES_DIR / "qwen2.5-32b-exl2-v100-16gb.yaml").read_text())
    del data["cache"]
    shutil.copy(RECIPES_DIR / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "exl2.yaml").write_text(yaml.safe_dump(data))
    cache = load_recipe(str(tmp_path / "exl2.yaml")).recipe.cache
    assert (cache.k, cache.v) == ("FP16", "FP16")
    data["cache"] = {"k": "f16", "v": "f16"}  # a llama.cpp type named: the line that says so
    (tmp_path / "exl2.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"exl2.yaml:\d+: cache: ExLlamaV2 has one cache mode"):
        load_recipe(str(tmp_path / "exl2.yaml"))
