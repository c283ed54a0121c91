"""`invoke plan` as a user runs it: a real subprocess, real output, real exit codes."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

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
    m = re.search(r"Recommendation: (\S+) \((\w+)\) is the fastest", r.stdout)
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
