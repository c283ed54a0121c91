"""A model set's residency plan (issue 55, part 1: the plan): plan/residency.py's arithmetic on
sizes worked by hand, config/model_set.py's refusals (one line each) and `invoke plan --models`
on generated CPU recipes and shipped V100 recipes.

What this proves: the count the plan gives keeps the largest members within the memory it is
given, and the set's bad input is refused before anything runs. What it does not: that a member
holds what its plan says (the member's own plan, tested against real load logs elsewhere:
tests/test_planner_cpu.py), or that the router evicts by the count (part 2's real test)."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import yaml

from playbooks.cli.plan_set import run_plan_set
from playbooks.config.model_set import plan_set
from playbooks.errors import VoltaforgeError
from playbooks.plan.gpus import GIB, MIB
from playbooks.plan.residency import Member, Residency, refusal
from tests.helpers import ROOT


def _m(name: str, gib: float) -> Member:
    held = int(gib * GIB)
    return Member(name, f"{name}-recipe", "Q4_K_M", held, (("weights", held - GIB // 2), ("KV cache", GIB // 2)))


def test_the_count_is_the_largest_k_whose_k_largest_fit():
    # 16 GiB card, the router's 0.5 GiB: 15.5 GiB shared; 10 + 6 = 16 do not fit together,
    # so one at a time, although 6 + 3 + 2 = 11 would
    r = Residency((_m("small", 2), _m("big", 10), _m("mid", 6), _m("tiny", 3)), 16 * GIB, GIB // 2)
    assert r.room == int(15.5 * GIB) and not r.too_large
    assert [m.name for m in r.largest_first] == ["big", "mid", "tiny", "small"]
    assert (r.models_max, r.most_together, r.peak) == (1, 3, int(10.5 * GIB))
    assert r.grouping() == (
        "--models-max 1 is set by the largest; up to 3 of the smallest fit together: with big served apart "
        "(a set of its own on other cards), the other 3 are all resident at once"
    )
    assert refusal(r, "the card") is None


def test_where_every_member_fits_together_the_count_is_the_set_and_nothing_is_wasted():
    r = Residency((_m("a", 4), _m("b", 5), _m("c", 6)), 16 * GIB, GIB // 2)
    assert (r.models_max, r.most_together, r.grouping()) == (3, 3, None)
    # one byte less room than the three need: two (the two largest, 11 GiB, fit)
    tight = Residency(r.members, 15 * GIB + GIB // 2 - 1, GIB // 2)
    assert (tight.models_max, tight.most_together) == (2, 2) and tight.grouping() is None


def test_a_member_that_does_not_fit_alone_refuses_the_set_naming_it_and_its_parts():
    r = Residency((_m("a", 4), _m("huge", 15.6)), 16 * GIB, GIB // 2)
    assert [m.name for m in r.too_large] == ["huge"] and r.models_max == 0 and r.grouping() is None
    line = refusal(r, "Tesla V100-SXM2-16GB (the card's memory)")
    assert line == (
        "huge (huge-recipe, Q4_K_M) holds 15.60 GiB alone (weights 15.10 GiB, KV cache 0.50 GiB): more than "
        "the 15.50 GiB the set's children share on Tesla V100-SXM2-16GB (the card's memory) (beside the "
        "router's 0.50 GiB)"
    )


def _recipes(tmp_path: Path, sizes: dict[str, int], **extra) -> Path:
    """Generated CPU recipes (tiny-cpu's model at ``hidden`` width) under ``tmp_path``."""
    base = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    for name, hidden in sizes.items():
        data = yaml.safe_load(yaml.safe_dump(base))
        data["model"]["config"] |= {"hidden_size": hidden, "intermediate_size": hidden * 3}
        data["service"]["model_name"] = name
        data |= extra.get(name, {})
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return tmp_path


def test_a_cpu_set_under_a_memory_budget_through_the_command(tmp_path):
    where = _recipes(tmp_path, {"small": 256, "mid": 512, "large": 1024})
    sp = plan_set(["small", "mid", "large"], memory_gib=1.0, recipes_dir=where)
    held = {m.name: m.held for m in sp.residency.members}
    assert held["small"] < held["mid"] < held["large"], held
    # the budget, the router's measured share (plan/engine_llamacpp.py), no CUDA context on a CPU
    assert (sp.residency.capacity, sp.residency.parent) == (GIB, 16 * MIB)
    assert all(dict(m.parts)["margin"] == 64 * MIB for m in sp.residency.members)  # tiny-cpu's margin_mib
    # a budget sized between two and three of them: the two largest together, the count 2
    two = (held["large"] + held["mid"] + 16 * MIB) / GIB
    out = StringIO()
    three = ["small", "mid", "large"]
    assert run_plan_set(three, memory_gib=two + 0.001, as_json=True, out=out, recipes_dir=where) == 0
    got = json.loads(out.getvalue())
    assert (got["models_max"], got["most_together"], got["refusal"]) == (2, 2, None)
    assert got["capacity_source"] == f"a {two + 0.001:g} GiB budget"
    out = StringIO()
    assert run_plan_set(three, memory_gib=two + 0.001, out=out, recipes_dir=where) == 0
    text = " ".join(out.getvalue().split())
    assert "resident together: any 2 of 3" in text and "serve with --models-max 2" in text, text
    # a budget below the largest alone: refused, exit 1, the line names it
    out = StringIO()
    assert run_plan_set(["small", "large"], memory_gib=(held["large"] / GIB) * 0.9, out=out, recipes_dir=where) == 1
    text = " ".join(out.getvalue().split())
    assert "refused: large (large, Q4_K_M) holds" in text and "(does not fit)" in text, text


def test_shipped_v100_recipes_as_one_set_on_a_32gb_card():
    names = ["qwen2.5-14b-v100-32gb", "qwen2.5-32b-v100-32gb", "qwen3-30b-a3b-v100-32gb"]
    sp = plan_set(names, gpu="v100-32gb")
    r = sp.residency
    # the router's CUDA context is the recipes' planner.cuda_context_mib (defaults.yaml: 400)
    assert r.parent == 400 * MIB and r.capacity == 32 * GIB
    # each of these is sized to fill a 32 GB card alone: one at a time
    assert r.models_max == 1 and not r.too_large and sp.refusal is None
    for m in r.members:
        assert sum(b for _, b in m.parts) == m.held and dict(m.parts)["context + margin"] > 400 * MIB


@pytest.mark.parametrize(
    ("models", "gpu", "budget", "said"),
    [
        (["tiny-cpu"], None, None, "a set names 2 or more recipes, got 1: one model is a plain server"),
        (["tiny-cpu", "tiny-cpu"], None, None, "a recipe is named twice in the set: tiny-cpu, tiny-cpu"),
        (
            ["qwen2.5-14b-v100-16gb", "qwen2.5-32b-exl2-v100-16gb"],
            None,
            None,
            "qwen2.5-32b-exl2-v100-16gb is an ExLlamaV2 recipe: TabbyAPI serves one model per server",
        ),
        (["tiny-cpu", "tiny-rpc-cpu"], None, None, "tiny-rpc-cpu splits over RPC workers"),
        (
            ["qwen2.5-14b-v100-32gb", "qwen2.5-32b-spec-v100-32gb"],
            None,
            None,
            "qwen2.5-32b-spec-v100-32gb has a draft model: a set serves its members without speculation",
        ),
        (["qwen2.5-14b-v100-16gb", "qwen2.5-32b-v100-16gb"], None, 8.0, "(--memory-budget) is for a CPU target"),
        (["tiny-cpu", "no-such-recipe"], None, None, "no-such-recipe"),
    ],
)
def test_a_set_that_cannot_be_planned_gets_one_line(models, gpu, budget, said):
    with pytest.raises(VoltaforgeError) as err:
        plan_set(models, gpu, budget)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_two_members_serving_one_name_are_refused(tmp_path):
    where = _recipes(tmp_path, {"a": 256, "b": 512})
    data = yaml.safe_load((where / "b.yaml").read_text())
    data["service"]["model_name"] = "a"
    (where / "b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(VoltaforgeError, match=r"a and b both serve 'a': the router routes by the served name"):
        plan_set(["a", "b"], recipes_dir=where)


def test_invoke_plan_models_as_a_user_runs_it():
    def invoke(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "invoke", "plan", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    r = invoke("--models", "qwen2.5-14b-v100-16gb,qwen2.5-32b-v100-16gb", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["gpu"] == "v100-sxm2-16gb" and got["models_max"] == 1 and len(got["members"]) == 2
    r = invoke("--models", "tiny-cpu,,tiny-moe-cpu")
    assert r.returncode != 0 and "--models 'tiny-cpu,,tiny-moe-cpu': give two or more recipe names" in r.stderr
    # a single recipe's flags beside a set would be ignored: refused, each named, one line
    r = invoke("--models", "tiny-cpu,tiny-moe-cpu", "--recipe", "tiny-cpu", "--ctx", "4096")
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "--recipe, --ctx: --models plans each recipe of the set as it is written" in err[0]
    r = invoke("--recipe", "tiny-cpu", "--memory-budget", "4")
    assert r.returncode == 2 and "--memory-budget goes with --models" in r.stderr, r.stderr


def test_invoke_plan_host_plans_the_sets_of_its_inventory_entry(tmp_path):
    """`invoke plan --host H`: each set of the host's serve: layout on the host's own GPU, or on
    a CPU host within its memory_budget_gib; a host without a set, one line."""
    small = []
    for name in ("tiny-a", "tiny-b"):  # two CPU recipes under names of their own
        data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
        data.setdefault("service", {})["model_name"] = name
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        small.append(str(tmp_path / f"{name}.yaml"))
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "hosts:\n"
        "  lab-01:\n    host: 10.0.0.31\n    gpu: v100-sxm2-16gb\n    serve:\n"
        "      - set: chat\n        models: [qwen2.5-14b-v100-16gb, qwen2.5-32b-v100-16gb]\n"
        "  box:\n    host: 10.0.0.32\n    memory_budget_gib: 3\n    serve:\n"
        f"      - set: small\n        models: [{small[0]}, {small[1]}]\n"
        "  plain:\n    host: 10.0.0.33\n    recipe: tiny-cpu\n"
    )

    def invoke(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "invoke", "plan", "--inventory", str(inv), *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    r = invoke("--host", "lab-01", "--json")
    assert r.returncode == 0, r.stderr
    (chat,) = json.loads(r.stdout)
    direct = json.loads(invoke_plain("--models", "qwen2.5-14b-v100-16gb,qwen2.5-32b-v100-16gb", "--json"))
    assert chat == {"set": "chat"} | direct  # the same plan as --models on the host's GPU
    r = invoke("--host", "box", "--json")
    assert r.returncode == 0, r.stderr
    (small,) = json.loads(r.stdout)
    assert small["capacity_bytes"] == 3 * 2**30 and "a 3 GiB budget" in small["capacity_source"]
    r = invoke("--host", "box")
    assert r.returncode == 0 and "box: set small" in r.stdout and "resident together" in r.stdout, r.stdout
    r = invoke("--host", "plain")
    assert r.returncode == 2 and "--host plain: its inventory entry serves no model set" in r.stderr, r.stderr
    r = invoke("--host", "box", "--ctx", "512")
    assert r.returncode == 2 and "--ctx: --host plans the model sets its inventory entry names" in r.stderr


def invoke_plain(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "invoke", "plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout
