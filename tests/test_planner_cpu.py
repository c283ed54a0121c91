"""A CPU target never fits an EXL2 quant: ExLlamaV2 has no CPU path (planner.EXL2_NEEDS_CUDA).

Before this, `invoke plan --recipe tiny-cpu` listed every EXL2 row as fitting "cpu" (the
memory budget was all the planner looked at) and explained their absence from the
recommendation with the pre-Ampere batching note, which is about V100s."""

import json
import subprocess
import sys

import pytest

from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import load_recipe
from playbooks.plan.engine_exllamav2 import EXL2_NEEDS_CUDA
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gpus import get_gpu
from playbooks.plan.model_config import load_config_file
from playbooks.plan.objective import Objective
from playbooks.plan.planner import make_plan
from playbooks.plan.serving import Serving
from tests.helpers import ROOT

LLAMA8B = "recipes/models/llama-3.1-8b.config.json"


@pytest.fixture(scope="module")
def tiny_plan():
    return plan_recipe(load_recipe("tiny-cpu"))


def test_every_exl2_row_on_a_cpu_says_it_needs_a_cuda_gpu(tiny_plan):
    exl2 = [o for o in tiny_plan.options if o.backend == "exllamav2"]
    assert exl2, "the fit table lists the EXL2 ladder"
    for o in exl2:
        # the memory alone would fit (a 4-layer model in a 4 GiB budget): the backend is what cannot run
        assert o.vram_bytes <= o.gpu_bytes
        assert not o.fits and o.unfit_reason == EXL2_NEEDS_CUDA == "needs a CUDA GPU" and o.max_ctx == 0
    gguf = [o for o in tiny_plan.options if o.backend == "llamacpp"]
    assert all(o.fits and o.unfit_reason == "" for o in gguf)


def test_a_cpu_plan_never_recommends_exl2_and_says_why(tiny_plan):
    assert tiny_plan.recommendation is not None and tiny_plan.recommendation.backend == "llamacpp"
    # nor without a speed floor, where the fastest fitting quant wins (EXL2's would be fastest)
    shape = load_recipe("tiny-cpu").shape
    fastest = make_plan(shape, get_gpu("cpu"), Serving(context=512), objective=Objective(min_tok_s=None))
    assert fastest.recommendation is not None and fastest.recommendation.backend == "llamacpp"
    assert fastest.recommendation_kind == "fastest"
    assert any("EXL2 is left out: ExLlamaV2 needs a CUDA GPU" in n for n in tiny_plan.notes)
    # the V100 batching note is not the reason on a CPU
    assert not any("Ampere" in n for n in tiny_plan.notes)


def test_even_one_slot_and_every_bpw_on_a_cpu_is_refused():
    """No slot count or bit rate makes EXL2 run on a CPU (the old filter only caught parallel > 1)."""
    shape = load_recipe("tiny-cpu").shape
    plan = make_plan(shape, get_gpu("cpu"), Serving(context=512, parallel=1), objective=Objective(min_bpw=2.0))
    assert plan.recommendation is not None and plan.recommendation.backend == "llamacpp"
    chosen = make_plan(shape, get_gpu("cpu"), Serving(backend="exllamav2", cache_k="FP16"), quant="EXL2-4.0").chosen
    assert chosen is not None and not chosen.fits and chosen.unfit_reason == EXL2_NEEDS_CUDA


def test_exl2_on_a_gpu_is_judged_on_memory_as_before():
    shape = load_config_file(ROOT / LLAMA8B)
    o = evaluate(shape, "EXL2-4.0", get_gpu("v100-16gb"), Serving(backend="exllamav2", cache_k="FP16"))
    assert o.unfit_reason == "" and o.fits and o.max_ctx > 0


def _invoke(*args):
    return subprocess.run(
        [sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_invoke_plan_tiny_cpu_table_and_json():
    r = _invoke("plan", "--recipe", "tiny-cpu")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ EXL2-")]
    assert rows and all("no, needs a CUDA GPU" in line for line in rows), r.stdout
    assert "(recommended)" not in "".join(rows)
    data = json.loads(_invoke("plan", "--recipe", "tiny-cpu", "--json").stdout)
    for q in data["quants"]:
        if q["backend"] == "exllamav2":
            assert q["fits"] is False and q["unfit_reason"] == "needs a CUDA GPU"
        else:
            assert q["unfit_reason"] is None
    assert not data["recommendation"].startswith("EXL2")


def test_invoke_plan_an_exl2_quant_on_a_cpu_fails_and_says_why():
    r = _invoke("plan", "--model-config", LLAMA8B, "--gpu", "cpu", "--quant", "EXL2-4.0")
    assert r.returncode == 1
    assert "does not fit: needs a CUDA GPU" in r.stdout
