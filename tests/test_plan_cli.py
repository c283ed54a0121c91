"""`invoke plan` as a user runs it: a real subprocess, real output, real exit codes."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, docs_text

INVOKE = [sys.executable, "-m", "invoke"]
QWEN32 = "recipes/models/qwen2.5-32b-instruct.config.json"


def invoke(*args):
    return subprocess.run([*INVOKE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_plan_recipe_table():
    r = invoke("plan", "--recipe", "qwen2.5-14b-v100-16gb")
    assert r.returncode == 0, r.stderr
    assert "Planned quant Q4_K_M" in r.stdout and "fits with" in r.stdout
    assert "Fit table" in r.stdout and "Recommendation:" in r.stdout


def test_32b_q4_k_m_does_not_fit_16gb_and_says_what_does():
    r = invoke("plan", "--model-config", QWEN32, "--gpu", "v100-16gb", "--quant", "Q4_K_M")
    assert r.returncode == 1  # the planned configuration does not fit
    assert re.search(r"Planned quant Q4_K_M: weights 19\.85 GB on disk", r.stdout)
    assert "does not fit by" in r.stdout
    m = re.search(r"Recommendation: (\S+) \((\w+)\) is the best quality", r.stdout)
    assert m, r.stdout
    data = json.loads(invoke("plan", "--model-config", QWEN32, "--gpu", "v100-16gb", "--json").stdout)
    by = {q["quant"]: q for q in data["quants"]}
    assert by["Q4_K_M"]["fits"] is False and by[m.group(1)]["fits"] is True


def test_model_config_json_interface():
    r = invoke("plan", "--model-config", QWEN32, "--gpu", "v100-32gb", "--ctx", "8192", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * 2
    assert data["gpu"]["key"] == "v100-sxm2-32gb" and "v100-32gb" in data["gpu"]["aliases"]
    for q in data["quants"]:
        for key in ("quant", "weights_bytes", "vram_bytes", "fits", "max_ctx", "roofline_tok_s"):
            assert key in q
    names = [q["quant"] for q in data["quants"]]
    assert "Q4_K_M" in names and "EXL2-3.3" in names
    q4 = next(q for q in data["quants"] if q["quant"] == "Q4_K_M")
    assert q4["fits"] and q4["max_ctx"] >= 8192 and abs(q4["weights_bytes"] - 19_851_336_576) / 19_851_336_576 < 0.01


def test_every_shipped_recipe_through_the_cli():
    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "defaults"):
        r = invoke("plan", "--recipe", recipe, "--json")
        assert r.returncode == 0, (recipe, r.stderr)
        assert json.loads(r.stdout)["chosen"]["fits"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--model-config", QWEN32, "--gpu", "v100-64gb"], "unknown GPU 'v100-64gb'"),
        (["--model-config", QWEN32, "--ctx", "0"], "--ctx must be a positive"),
        (["--model-config", QWEN32, "--ctx", "65536"], "above the model's maximum"),
        (["--model-config", QWEN32, "--quant", "Q9_K"], "--quant 'Q9_K' is not a known quant"),
        (["--model-config", "no/such/config.json"], "cannot read model config"),
        ([], "give either --recipe"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = invoke("plan", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_exl2_quant_spellings():
    r = invoke("plan", "--model-config", QWEN32, "--gpu", "v100-32gb", "--quant", "exl2-4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["chosen"]["quant"] == "EXL2-4.0"
    r = invoke("plan", "--model-config", QWEN32, "--quant", "EXL2-9.5")
    assert r.returncode == 2 and "between 2.0 and 8.0" in r.stderr


def plan_json(*args):
    r = invoke("plan", *args, "--json")
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_the_recommendation_is_the_best_quality_that_reaches_the_speed_floor():
    """Qwen2.5-14B on a 32 GB card: Q8_0 fits with 11 GiB to spare at 61 tok/s; the old
    objective (the fastest of at least 3.3 bits/weight) said Q3_K_S."""
    data = plan_json("--recipe", "qwen2.5-14b-v100-32gb")
    rec = data["recommended"]
    assert data["recommendation"] == "Q8_0" and data["recommendation_kind"] == "quality"
    assert rec["headroom_bytes"] > 11 * 2**30 and rec["roofline_tok_s"] >= data["objective"]["min_tok_s"] == 30
    assert rec["kld"] == 0.001355 and rec["kld_source"] == "published"
    # nothing that fits and reaches the floor diverges less
    better = [q for q in data["quants"] if q["fits"] and q["kld"] < rec["kld"] and q["roofline_tok_s"] >= 30]
    assert better == []
    r = invoke("plan", "--recipe", "qwen2.5-14b-v100-32gb")
    assert re.search(
        r"Recommendation: Q8_0 \(llamacpp\) is the best quality \(KL divergence 0\.0014, published\)", r.stdout
    )
    assert "Best quality that fits" not in r.stdout  # one objective, one sentence


def test_experts_in_host_ram_do_not_buy_quality_below_the_speed_floor():
    """Qwen3-30B-A3B on 16 GB: F16 fits with the experts of 38 layers in host RAM at a 16 tok/s
    ceiling; it was shown as "best quality that fits". Below the 30 tok/s floor it loses."""
    cfg = "recipes/models/qwen3-30b-a3b.config.json"
    data = plan_json("--model-config", cfg, "--gpu", "v100-16gb")
    f16 = next(q for q in data["quants"] if q["quant"] == "F16")
    assert f16["fits"] and f16["n_cpu_moe"] > 0 and f16["roofline_tok_s"] < 30
    rec = data["recommended"]
    assert data["recommendation"] != "F16" and rec["roofline_tok_s"] >= 30 and data["recommendation_kind"] == "quality"
    # the floor is the lever: below F16's ceiling F16 wins; without a floor the fastest does
    assert plan_json("--model-config", cfg, "--gpu", "v100-16gb", "--min-tok-s", "10")["recommendation"] == "F16"
    fastest = plan_json("--model-config", cfg, "--gpu", "v100-16gb", "--min-tok-s", "none")
    fitting = [q for q in fastest["quants"] if q["fits"] and q["bits_per_weight"] >= 3.3]
    assert fastest["recommendation_kind"] == "fastest"
    assert fastest["recommended"]["roofline_tok_s"] == max(q["roofline_tok_s"] for q in fitting)


def test_mxfp4_moe_is_left_out_of_a_dense_fit_table():
    dense = plan_json("--model-config", QWEN32, "--gpu", "v100-32gb")
    assert "MXFP4_MOE" not in [q["quant"] for q in dense["quants"]]
    assert "MXFP4_MOE" not in invoke("plan", "--recipe", "qwen2.5-32b-v100-16gb").stdout
    moe = plan_json("--model-config", "recipes/models/qwen3-30b-a3b.config.json")
    assert "MXFP4_MOE" in [q["quant"] for q in moe["quants"]]


def test_the_quality_floor_is_one_number_everywhere():
    """3.3 bits/weight: recipes/defaults.yaml, the recipe schema's default, the objective's, the
    README's, and what a --model-config plan uses (it was 3.0 there)."""
    import yaml

    from playbooks.config.recipe import PlannerSettings
    from playbooks.plan.objective import MIN_BPW
    from playbooks.plan.planner import make_plan

    shipped = yaml.safe_load((ROOT / "recipes/defaults.yaml").read_text())["planner"]["min_bpw"]
    readme = re.search(r"\(`planner\.min_bpw`, ([\d.]+) bits/weight by default\)", docs_text())
    assert readme, "the docs state the default quality floor"
    assert shipped == PlannerSettings().min_bpw == MIN_BPW == float(readme.group(1)) == 3.3
    assert make_plan.__defaults__ is None or 3.0 not in make_plan.__defaults__
    data = plan_json("--model-config", QWEN32, "--gpu", "v100-16gb", "--min-tok-s", "none")
    assert data["objective"]["min_bpw"] == 3.3
    # the fastest of at least 3.3: no longer Q2_K (3.01 bits/weight, the fastest of at least 3.0)
    assert data["recommended"]["bits_per_weight"] >= 3.3 and data["recommendation"] != "Q2_K"


def test_model_config_plans_take_llama_servers_cache_types():
    """--cache-type-k/-v as llama-server's -ctk/-ctv: a model-config plan comparable with the
    shipped recipes' q8_0 cache."""
    f16 = plan_json("--model-config", QWEN32, "--gpu", "v100-32gb", "--ctx", "8192")
    q8 = plan_json(
        "--model-config",
        QWEN32,
        "--gpu",
        "v100-32gb",
        "--ctx",
        "8192",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q8_0",
    )
    assert (q8["serving"]["cache_k"], q8["serving"]["cache_v"], q8["serving"]["flash_attn"]) == ("q8_0", "q8_0", True)
    assert f16["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * 2
    assert q8["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * 34 // 32
    # a 16 GB card: Q3_K_S holds about twice the context with q8_0 (the cache is most of what grows)
    small = ("--model-config", QWEN32, "--gpu", "v100-16gb", "--quant", "Q3_K_S")
    f16_16, q8_16 = plan_json(*small), plan_json(*small, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0")
    assert q8_16["chosen"]["max_ctx"] > 1.8 * f16_16["chosen"]["max_ctx"] > 0
    # the same numbers as the shipped recipe with that model, card, context and cache
    recipe = plan_json("--recipe", "qwen2.5-32b-v100-32gb")
    q8_2 = plan_json(
        "--model-config",
        QWEN32,
        "--gpu",
        "v100-32gb",
        "--ctx",
        "8192",
        "--parallel",
        "2",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q8_0",
    )
    assert q8_2["chosen"]["vram_bytes"] == recipe["chosen"]["vram_bytes"]
    # EXL2 rows get ExLlamaV2's matching cache mode (Q8)
    exl2 = next(q for q in q8["quants"] if q["quant"] == "EXL2-4.0")
    assert exl2["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * (1 + 2 / 32)
    # a K/V pair without a compiled flash-attention kernel is named
    big = ("--model-config", QWEN32, "--gpu", "v100-32gb")
    mixed = invoke("plan", *big, "--cache-type-k", "q8_0", "--cache-type-v", "q4_0")
    assert mixed.returncode == 0 and "GGML_CUDA_FA_QUANTS" in mixed.stdout, mixed.stderr
    assert "GGML_CUDA_FA_QUANTS" not in invoke("plan", *big, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0").stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model-config", QWEN32, "--cache-type-k", "q9_0"], "--cache-type-k 'q9_0': want one of f16, bf16"),
        (["--model-config", QWEN32, "--cache-type-v", "Q8"], "--cache-type-v 'Q8': want one of"),
        (["--recipe", "qwen2.5-32b-exl2-v100-16gb", "--cache-type-k", "q8_0"], "--cache-type-k is llama-server's"),
        (["--recipe", "qwen2.5-32b-v100-16gb", "--quant", "EXL2-3.3"], "is a llama.cpp recipe; give a GGUF type"),
        (["--recipe", "qwen2.5-32b-exl2-v100-16gb", "--quant", "Q4_K_M"], "is an ExLlamaV2 recipe; give an EXL2"),
        (["--model-config", QWEN32, "--min-tok-s", "0"], "--min-tok-s must be a positive number of tok/s"),
        (["--model-config", QWEN32, "--min-tok-s", "fast"], "--min-tok-s 'fast': want a decode speed"),
    ],
)
def test_bad_cache_types_and_speed_floors_are_one_line_and_exit_2(args, message):
    r = invoke("plan", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_what_if_on_a_recipe_is_the_recipe_file_edited(tmp_path):
    """`plan --recipe R --parallel 4 --quant Q5_K_M --cache-type-k f16` plans what editing R's
    file to those values plans (was: refused, "--parallel goes with --model-config"), says what
    was overridden, and prints the aggregate ceiling at the slots from plan/aggregate.py."""
    import yaml

    from playbooks.config.recipe import RECIPES_DIR
    from playbooks.plan.aggregate import aggregate_tok_s

    flags = ["--parallel", "4", "--quant", "q5_k_m", "--cache-type-k", "f16", "--json"]
    what_if = json.loads(invoke("plan", "--recipe", "qwen2.5-14b-v100-16gb", *flags).stdout)
    data = yaml.safe_load((RECIPES_DIR / "qwen2.5-14b-v100-16gb.yaml").read_text())
    data |= {"parallel": 4, "quant": "Q5_K_M", "cache": {"k": "f16", "v": data["cache"]["v"]}}
    (tmp_path / "defaults.yaml").write_text((RECIPES_DIR / "defaults.yaml").read_text())
    (tmp_path / "qwen2.5-14b-v100-16gb.yaml").write_text(yaml.safe_dump(data))
    edited = json.loads(invoke("plan", "--recipe", str(tmp_path / "qwen2.5-14b-v100-16gb.yaml"), "--json").stdout)
    for key in ("chosen", "serving", "quants", "recommendation", "aggregate"):
        assert what_if[key] == edited[key], key
    assert what_if["notes"][0] == (
        "a what-if, not the recipe as written: parallel 4 (the recipe: 2); quant Q5_K_M (the recipe: Q4_K_M); "
        "cache K f16 (the recipe: q8_0)"
    )
    c, agg = what_if["chosen"], what_if["aggregate"]
    ctx = what_if["serving"]["context"]
    assert agg["slots"] == 4
    # (the JSON's roofline is rounded to 2 places: within that)
    near = pytest.approx(aggregate_tok_s(c["roofline_tok_s"], 900, c["kv_bytes_per_token"], 4, 0), abs=0.05)
    assert agg["tok_s"] == near
    full = aggregate_tok_s(c["roofline_tok_s"], 900, c["kv_bytes_per_token"], 4, ctx)
    assert agg["full_ctx_tok_s"] == pytest.approx(full, abs=0.05)
    assert (
        3.9 * c["roofline_tok_s"] < agg["tok_s"] <= 4 * c["roofline_tok_s"] + 0.01
        and agg["full_ctx_tok_s"] < agg["tok_s"]
    )
    text = invoke("plan", "--recipe", "qwen2.5-14b-v100-16gb", *flags[:-1]).stdout
    assert f"Aggregate at 4 slots: {agg['tok_s']:.0f} tok/s with empty caches" in " ".join(text.split())
    # one slot: no aggregate; a value equal to the recipe's is no override
    one = json.loads(invoke("plan", "--recipe", "qwen2.5-32b-v100-16gb", "--parallel", "1", "--json").stdout)
    assert one["aggregate"] is None and not one["notes"][0].startswith("a what-if")


def test_the_readmes_plan_output_is_the_real_one():
    """docs/plan.md, "What `invoke plan` prints": the whole output of the command it names, as it prints now."""
    readme = docs_text()
    m = re.search(r"A real run \(`invoke plan --recipe (\S+)`\), whole:\n\n```text\n(.*?)```\n", readme, re.S)
    assert m, "the README shows a whole plan"
    shown = [line.rstrip() for line in m.group(2).splitlines()]
    real = invoke("plan", "--recipe", m.group(1))
    assert real.returncode == 0, real.stderr
    assert shown == [line.rstrip() for line in real.stdout.splitlines()]


def test_the_readmes_plan_excerpts_are_in_the_real_output():
    """Every README block `$ invoke plan ...  # (excerpt)`: each line it shows is in what that
    command prints now (whitespace aside: the README joins lines the terminal wrapped)."""
    readme = docs_text()
    blocks = re.findall(r"```\n\$ invoke plan (.*?)\s+# \(excerpt\)\n(.*?)```\n", readme, re.S)
    assert len(blocks) >= 2, "the README's plan excerpts (the 70B split, the EXL2 split)"
    for args, body in blocks:
        real = subprocess.run(
            [*INVOKE, "plan", *args.split()],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert real.returncode == 0, real.stderr
        printed = " ".join(real.stdout.split())
        for line in body.splitlines():
            assert " ".join(line.split()) in printed, f"invoke plan {args}: {line!r} is not printed"
