"""An EXL2 model over several cards: ExLlamaV2's placement, ported (plan/exl2_split.py).

What proves what:
- the port against ExLlamaV2 itself: the pinned exllamav2 0.3.2 runs its own set_device_map on
  generated checkpoints (tests/tools/exl2_device_map.py: its GPU kernels and CUDA streams
  absent, nothing else replaced), and every module's sizes, every module's card, each card's
  scratch and free allotment, and the cache map equal the port's. The checkpoints are FP16
  (ExLlamaV2's converter needs a GPU), so this holds the placement and the scratch formulas,
  not the EXL2 bytes per module (those are the bpw target, exl2_size.py);
- the planner's split against the planner's one-card plan (a one-card "split" holds what the
  one-card plan holds), which proves the split adds up its parts as the one-card plan does;
- the rendered config against the plan: what TabbyAPI is given is what was planned, and
  replaying the placement on those figures lands every module where the plan put it.
Nothing here has run on two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from playbooks.config.planning import plan_recipe, refuse_unfit
from playbooks.config.recipe import load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.modelgen.tinymodel import write_tiny_llama
from playbooks.plan.engine_exllamav2 import exl2_compute_bytes, plan_exl2_split
from playbooks.plan.evaluate import evaluate
from playbooks.plan.exl2_size import estimate_exl2, head_bits_per_weight
from playbooks.plan.exl2_split import (
    AllotmentTooSmall,
    Exl2Limits,
    exl2_modules,
    set_device_map,
)
from playbooks.plan.gpus import GIB, get_gpu
from playbooks.plan.kv_cache import exl2_cache_scratch_bytes
from playbooks.plan.model_config import shape_from_config
from playbooks.plan.serving import Serving
from playbooks.steps.serve.service_files import planned_service_files
from tests.pypi_wheels import exllamav2_python, exllamav2_source

TOOL = Path(__file__).parent / "tools" / "exl2_device_map.py"

# generated checkpoints: grouped-query attention with its own head; multi-head attention with a
# tied head and a vocabulary that is no multiple of 32 (ExLlamaV2 pads the head's rows)
CHECKPOINTS = {
    "gqa": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096,
            "tie_word_embeddings": False},
    "mha-tied": {"model_type": "llama", "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 6,
                 "num_attention_heads": 3, "num_key_value_heads": 3, "vocab_size": 2000,
                 "max_position_embeddings": 4096, "tie_word_embeddings": True},
}  # fmt: skip

# (checkpoint, max_seq_len, max_input_len, allocation in GB): a split across two cards, three
# cards with the middle one too small for anything, everything on one card, and too little
CASES = [
    ("gqa", 2048, 256, [0.006, 0.02]),
    ("gqa", 4096, 512, [0.012, 0.00001, 0.05]),
    ("gqa", 1024, 128, [1.0]),
    ("gqa", 2048, 256, [0.001, 0.002]),
    ("mha-tied", 2048, 256, [0.004, 0.004, 0.02]),
    ("mha-tied", 512, 128, [0.003, 0.02]),
    ("mha-tied", 2048, 256, [0.002]),
]


@pytest.fixture(scope="module")
def exllamav2_placements(tmp_path_factory):
    """ExLlamaV2's own set_device_map for every case, run once."""
    root = tmp_path_factory.mktemp("exl2-placement")
    dirs = {name: write_tiny_llama(root / name, config) for name, config in CHECKPOINTS.items()}
    request = [
        {"model_dir": str(dirs[name]), "max_seq_len": seq, "max_input_len": chunk, "allocation": alloc}
        for name, seq, chunk, alloc in CASES
    ]
    out = root / "placements.json"
    env = {**os.environ, "PYTHONPATH": str(exllamav2_source())}
    run = subprocess.run(
        [str(exllamav2_python()), str(TOOL), str(out)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _shape(name: str):
    return shape_from_config(CHECKPOINTS[name], where=name)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{len(c[3])}cards" for c in CASES])
def test_the_port_places_every_module_where_exllamav2_does(exllamav2_placements, i):
    name, seq, chunk, alloc = CASES[i]
    real = exllamav2_placements[i]
    shape = _shape(name)
    lim = Exl2Limits(max_seq_len=seq, max_input_len=chunk)
    modules = exl2_modules(shape, lim, 16, 16)  # the checkpoints are 16-bit
    if "error" in real:
        with pytest.raises(AllotmentTooSmall) as e:
            set_device_map(modules, alloc, shape, lim)
        assert real["error"] == "Insufficient space in device allocation"
        assert e.value.module.key == real["module"]
        assert e.value.module.kind == {"ExLlamaV2Attention": "attention", "ExLlamaV2MLP": "mlp"}[real["kind"]]
        return
    theirs = [m for m in real["modules"] if m["device"] != -1]  # the embedding: host RAM
    assert [m["kind"] for m in real["modules"]][0] == "ExLlamaV2Embedding" and real["modules"][0]["device"] == -1
    assert len(theirs) == len(modules)
    for ours, m in zip(modules, theirs, strict=True):
        assert ours.key == m["key"]
        sizes = (ours.footprint, ours.scratch, ours.scratch_fixed, ours.attention)
        assert sizes == (m["footprint"], m["scratch"], m["scratch_fixed"], m["attention"]), ours.key
    placed = set_device_map(modules, alloc, shape, lim)
    assert list(placed.device) == [m["device"] for m in theirs]
    assert list(placed.free_gib) == real["free"]  # the same float arithmetic, to the last bit
    assert list(placed.scratch_fixed) == real["fixed"]
    attention_cards = {
        str(m.layer): f"cuda:{d}" for m, d in zip(modules, placed.device, strict=True) if m.kind == "attention"
    }
    assert attention_cards == real["cache_map"]  # each layer's cache goes with its attention


def test_the_cases_exercise_a_split_an_empty_card_and_a_refusal(exllamav2_placements):
    """The cases are not all one card: the real placements spread modules over 2 and 3 cards,
    leave a card with nothing, and refuse an allotment too small."""
    spreads = [
        len({m["device"] for m in r["modules"] if m["device"] != -1}) for r in exllamav2_placements if "modules" in r
    ]
    assert max(spreads) >= 2 and 1 in spreads
    middle_empty = exllamav2_placements[1]
    assert {m["device"] for m in middle_empty["modules"]} == {-1, 0, 2}
    assert sum("error" in r for r in exllamav2_placements) == 2


# ---------------------------------------------------------------------------------------------
# the planner's split
# ---------------------------------------------------------------------------------------------

QWEN32 = load_recipe("qwen2.5-32b-exl2-v100-16gb")


def _serving(**kw) -> Serving:
    return replace(plan_recipe(QWEN32).serving, **kw)


def test_one_card_holds_what_the_one_card_plan_holds():
    """A split over one card adds up what the one-card plan adds up: the same compute (scratch,
    working set, RoPE, chunk, logits, a quantized cache's copy) and KV, and weights within the
    per-tensor rounding of the same bpw."""
    shape, gpu = QWEN32.shape, get_gpu("v100-32gb")
    s = _serving(gpu_count=1)
    one = plan_exl2_split(shape, "EXL2-3.3", gpu, s, 4096).shares
    assert len(one) == 1 and one[0].layers == tuple(range(shape.num_hidden_layers)) and one[0].output
    tokens = s.context * s.parallel
    assert one[0].compute_bytes == exl2_compute_bytes(shape, 4096, batch=1) + exl2_cache_scratch_bytes(
        shape, s.cache_k, tokens
    )
    single = evaluate(shape, "EXL2-3.3", gpu, s)
    assert one[0].kv_bytes == single.kv_bytes
    assert abs(one[0].weights_bytes - estimate_exl2(shape, 3.3, s.head_bits).gpu_weight_bytes) < 2**20


def test_two_cards_split_the_layers_and_the_head_goes_last():
    shape, gpu = QWEN32.shape, get_gpu(QWEN32.recipe.gpu)
    s = _serving(gpu_count=2)
    o = evaluate(shape, "EXL2-3.3", gpu, s)
    assert o.fits and o.backend == "exllamav2" and len(o.devices) == 2 and len(o.gpu_split) == 2
    first, last = o.devices
    assert first.layers + last.layers == tuple(range(shape.num_hidden_layers))
    assert not first.output and last.output
    # equal shares: the weights of the two cards within one layer of each other
    layer = (first.weights_bytes + last.weights_bytes) / shape.num_hidden_layers
    assert abs(first.weights_bytes - last.weights_bytes) < 2 * layer
    # the head's 1 GiB dequant buffer is the last card's scratch
    assert last.compute_bytes - first.compute_bytes > 0.4 * GIB
    # the rendered allotments, replayed, put every module where the plan did
    lim = Exl2Limits(max_seq_len=s.context)
    modules = exl2_modules(shape, lim, 3.3, head_bits_per_weight(s.head_bits))
    placed = set_device_map(modules, o.gpu_split, shape, lim)
    assert [m.layer for m, d in zip(modules, placed.device, strict=True) if d == 0 and m.kind == "attention"] == list(
        first.layers
    )


def test_a_70b_exl2_over_two_32gb_cards_fits_with_numbers_per_card():
    r = load_recipe("llama3.1-70b-2xv100-32gb")
    s = replace(plan_recipe(r).serving, backend="exllamav2", cache_k="Q8", cache_v="Q8")
    o = evaluate(r.shape, "EXL2-4.0", get_gpu("v100-32gb"), s)
    assert o.fits and o.max_ctx >= s.context
    assert all(d.total_bytes <= d.capacity_bytes for d in o.devices)
    assert sum(len(d.layers) for d in o.devices) == r.shape.num_hidden_layers == 80


def test_a_split_that_cannot_fit_names_the_card_and_the_overflow():
    r = load_recipe("llama3.1-70b-2xv100-32gb")
    s = replace(plan_recipe(r).serving, backend="exllamav2", cache_k="Q8", cache_v="Q8")
    o = evaluate(r.shape, "EXL2-8.0", get_gpu("v100-16gb"), s)
    assert not o.fits
    # the cards before the last are filled to what they hold; the rest lands on the last card
    *rest, last = o.devices
    assert all(d.headroom_bytes >= 0 for d in rest) and last.headroom_bytes < 0
    assert o.vram_bytes == last.total_bytes


def test_rpc_and_moe_exl2_splits_are_refused_in_one_line():
    shape, gpu = QWEN32.shape, get_gpu("v100-16gb")
    o = evaluate(shape, "EXL2-3.3", gpu, _serving(rpc_devices=1, gpu_count=1))
    assert o.unfit_reason.startswith("RPC workers are llama.cpp's")
    moe = load_recipe("qwen3-30b-a3b-v100-32gb")
    o = evaluate(moe.shape, "EXL2-4.0", gpu, replace(plan_recipe(moe).serving, gpu_count=2, n_cpu_moe=0))
    assert "mixture of experts" in o.unfit_reason


# ---------------------------------------------------------------------------------------------
# the recipe and what is rendered
# ---------------------------------------------------------------------------------------------


def _exl2_recipe(tmp_path: Path, gpu_count: int, bpw: float = 3.3, gpu: str = "v100-16gb", extra: str = ""):
    body = (Path("recipes") / "qwen2.5-32b-exl2-v100-16gb.yaml").read_text()
    body = body.replace("gpu: v100-16gb", f"gpu: {gpu}\ngpu_count: {gpu_count}{extra}")
    body = body.replace("quant: {bpw: 3.3, head_bits: 6}", f"quant: {{bpw: {bpw}, head_bits: 6}}")
    body = body.replace("config: models/", f"config: {Path('recipes/models').resolve()}/")
    (tmp_path / "qwen-exl2-split.yaml").write_text(body)
    return load_recipe("qwen-exl2-split", tmp_path)


def test_the_rendered_config_gives_tabbyapi_the_planned_gpu_split(tmp_path):
    loaded = _exl2_recipe(tmp_path, 2)
    planned = plan_recipe(loaded).chosen
    files = planned_service_files(loaded, gpu_indexes=(2, 3))
    unit, config = files[0], yaml.safe_load(files[1].text)
    assert config["model"]["gpu_split_auto"] is False
    assert config["model"]["gpu_split"] == list(planned.gpu_split)
    assert "CUDA_VISIBLE_DEVICES=2,3" in unit.text
    one = planned_service_files(load_recipe("qwen2.5-32b-exl2-v100-16gb"))
    assert yaml.safe_load(one[1].text)["model"]["gpu_split_auto"] is True  # one card: TabbyAPI's own


def test_render_refuses_an_exl2_split_that_does_not_fit(tmp_path):
    loaded = _exl2_recipe(tmp_path, 2, bpw=8.0)
    with pytest.raises(VoltaforgeError) as e:
        refuse_unfit(loaded)
    assert "does not fit 2 x v100-16gb" in str(e.value) and "GPU 1" in str(e.value)


def test_an_exl2_recipe_with_rpc_workers_is_refused_at_its_line(tmp_path):
    with pytest.raises(VoltaforgeError) as e:
        _exl2_recipe(tmp_path, 1, extra="\nrpc: [{endpoint: 127.0.0.1:50052, worker: local}]")
    assert "qwen-exl2-split.yaml:" in str(e.value) and "RPC workers are llama.cpp's" in str(e.value)
