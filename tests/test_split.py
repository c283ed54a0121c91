"""One model over several cards (playbooks/plan/split.py): llama.cpp's layer assignment, each
card's share, the plan and the rendered unit of a split recipe, and the refusals.

What these prove: the assignment follows load_tensors' float32 arithmetic (the cases below are
worked by hand from src/llama-model.cpp at the pinned ref, including the ones where a split
point lands exactly on a layer boundary); the shares partition the whole model's weights and KV
cache (a consistency check: it proves nothing about whether the whole is right, which
tests/test_gguf_size.py and the load-log tests hold against real files and loads). Whether real
llama.cpp puts those bytes on those devices is tests/test_rpc_split_real.py: a generated model
served over two RPC servers, its load log held to the plan device by device.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from playbooks.cli.plan import run_plan
from playbooks.config.planning import plan_recipe, refuse_unfit, unfit_text
from playbooks.config.recipe import load_recipe
from playbooks.errors import RecipeError, UsageError, VoltaforgeError
from playbooks.facts.server_log import judge_split, parse_load_log
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gguf_size import estimate_gguf
from playbooks.plan.gpus import GIB, get_gpu
from playbooks.plan.kv_cache import llamacpp_kv_bytes
from playbooks.plan.model_config import load_config_file
from playbooks.plan.moe import expert_layout
from playbooks.plan.serving import Serving
from playbooks.plan.split import CUDA_ALIGNMENT, layer_devices, layer_kv_bytes, layer_weights, split_mode_refusal
from playbooks.steps.serve.service_files import render_service_files
from tests.helpers import ROOT, recipe_with

MODELS = ROOT / "recipes" / "models"
SPLIT = "llama3.1-70b-2xv100-32gb"


def counts(devices: list[int], n: int) -> list[int]:
    return [devices.count(i) for i in range(n)]


@pytest.mark.parametrize(
    "n_layer,shares,expected,output_on",
    [
        # 81 offloadable layers (80 + output), split points 0.5 and 1: il/81 < 0.5 up to il 40
        (80, (1, 1), [41, 40], 1),
        # 5 offloadable: 0/5, 1/5, 2/5 < 0.5; 3/5 is not
        (4, (1, 1), [3, 2], 1),
        # 0.75: il/81 < 0.75 up to il 60
        (80, (3, 1), [61, 20], 1),
        # 0.25, 0.5, 0.75, 1: 20/81 = 0.2469 < 0.25 -> 21 on the first
        (80, (1, 1, 1, 1), [21, 20, 20, 20], 3),
        # a zero share gets nothing: upper_bound skips a split point equal to il/act
        (8, (0, 1), [0, 9], 1),
        # 5 offloadable over points 0.25, 0.5, 0.75, 1: il/5 = 0, 0.2 | 0.4 | 0.6 | 0.8 (the output)
        (4, (1, 1, 1, 1), [2, 1, 1, 1], 3),
        # a boundary hit exactly: 3 layers + output = 4, shares 1,1: 2/4 = 0.5 is not < 0.5 -> card 1
        (3, (1, 1), [2, 2], 1),
    ],
)
def test_layers_go_where_load_tensors_puts_them(n_layer, shares, expected, output_on):
    d = layer_devices(n_layer, shares)
    assert len(d) == n_layer + 1
    assert counts(d, len(shares)) == expected
    assert d[-1] == output_on
    assert d == sorted(d)  # contiguous runs, in device order


def test_the_shares_partition_the_model():
    """Every weight byte and KV byte is on exactly one card (tensor sizes of a 70B are multiples
    of CUDA's 128-byte alignment, so padding adds nothing here)."""
    shape = load_config_file(MODELS / "llama-3.1-70b-instruct.config.json")
    s = Serving(context=8192, parallel=2, cache_k="q8_0", cache_v="q8_0", gpu_count=3, tensor_split=(2, 1, 1))
    o = evaluate(shape, "Q4_K_M", get_gpu("v100-32gb"), s)
    assert [len(d.layers) for d in o.devices] == [41, 20, 19]
    assert sum(d.weights_bytes for d in o.devices) == estimate_gguf(shape, "Q4_K_M", imatrix=True).gpu_weight_bytes
    assert sum(d.kv_bytes for d in o.devices) == llamacpp_kv_bytes(shape, 8192 * 2, "q8_0", "q8_0")
    per_layer, output = layer_weights(shape, "Q4_K_M", True, CUDA_ALIGNMENT)
    assert o.devices[2].weights_bytes == sum(per_layer[61:]) + output


def test_sliding_window_layers_keep_their_window_per_card():
    """Gemma 2: every even layer holds a window, so a card's KV depends on which layers it got."""
    shape = load_config_file(MODELS / "gemma-2-27b-it.config.json")
    kv = layer_kv_bytes(shape, 32768, "f16", "f16", 512)
    assert sum(kv) == llamacpp_kv_bytes(shape, 32768, "f16", "f16", 512)
    assert kv[0] < kv[1] and kv[2] == kv[0]  # layer 0 slides, layer 1 is full


def test_the_70b_recipe_fits_two_32gb_cards_and_not_one():
    loaded = load_recipe(SPLIT)
    two = plan_recipe(loaded).chosen
    assert two is not None and two.fits and len(two.devices) == 2
    assert [len(d.layers) for d in two.devices] == [41, 39] and two.devices[1].output
    for d in two.devices:
        assert d.total_bytes < 32 * GIB
    one = plan_recipe(loaded, gpu_count=1).chosen
    assert one is not None and not one.fits
    # cards run one after the other: the roofline is the whole model over one card's bandwidth
    assert two.roofline_tok_s == pytest.approx(900e9 / sum(d.streamed_bytes for d in two.devices))


def test_a_split_that_does_not_fit_names_the_card_and_by_how_much(tmp_path):
    path = recipe_with(tmp_path, SPLIT, "").read_text().replace("gpu: v100-32gb", "gpu: v100-16gb")
    (tmp_path / "small.yaml").write_text(path)
    loaded = load_recipe(tmp_path / "small.yaml")
    why = unfit_text(plan_recipe(loaded))
    assert (
        why is not None
        and why.startswith("device 0 of 2 (GPU 0, layers 0-40) needs ")
        and "of 16.00 GiB: over by" in why
    )
    with pytest.raises(VoltaforgeError, match="does not fit 2 x v100-16gb .* device 0 of 2"):
        refuse_unfit(loaded)


def test_plan_cli_shows_every_card_and_exits_1_when_one_overflows(capsys):
    args = dict(model_config=str(MODELS / "qwen2.5-72b-instruct.config.json"), gpu="v100-16gb", quant="Q4_K_M")
    assert run_plan(**args, gpu_count=2, as_json=True) == 1  # 72B Q4_K_M: ~22 GiB a card
    doc = json.loads(capsys.readouterr().out)
    assert doc["serving"]["gpu_count"] == 2 and doc["serving"]["tensor_split"] == [1.0, 1.0]
    cards = doc["chosen"]["devices"]
    assert [c["layer_count"] for c in cards] == [41, 39] and cards[1]["output"] is True
    assert doc["chosen"]["vram_bytes"] == max(c["total_bytes"] for c in cards)
    assert run_plan(**args, gpu_count=4) == 0
    out = capsys.readouterr().out
    assert "Per device" in out and "GPU 3" in out and "61-79 + output" in out
    with pytest.raises(UsageError, match="2 share"):
        run_plan(**args, gpu_count=3, tensor_split=(1.0, 1.0))
    with pytest.raises(UsageError, match="more than one device"):
        run_plan(**args, tensor_split=(1.0,))


def test_the_split_unit_passes_the_planned_split():
    r = load_recipe(SPLIT).recipe
    (unit,) = render_service_files(r)
    assert "--split-mode layer --tensor-split 1,1 " in unit.text
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in unit.text
    assert "DeviceAllow=/dev/nvidia0 rw" in unit.text and "DeviceAllow=/dev/nvidia1 rw" in unit.text
    (other,) = render_service_files(r, gpu_indexes=(2, 3))
    assert "CUDA_VISIBLE_DEVICES=2,3" in other.text
    with pytest.raises(VoltaforgeError, match="give 2 GPU indexes"):
        render_service_files(r, gpu_indexes=(0,))


def test_bad_splits_are_refused_at_the_recipe(tmp_path):
    for extra, match in (
        ("tensor_split: [1, 1, 1]\n", "3 share"),
        ("tensor_split: [0, 0]\n", "at least one above 0"),
    ):
        with pytest.raises(RecipeError, match=match):
            load_recipe(recipe_with(tmp_path, SPLIT, extra))
    moe = recipe_with(tmp_path, "qwen3-30b-a3b-v100-32gb", "gpu_count: 2\n", name="moe")
    # a MoE with n_cpu_moe 0 splits like a dense model (test_a_moe_split_keeps_every_expert_on_a_device)
    assert load_recipe(moe).recipe.split


def test_a_gpu_name_that_matches_several_cards_is_refused():
    with pytest.raises(VoltaforgeError, match="matches several cards: v100-16gb, v100-32gb, v100-pcie-16gb"):
        get_gpu("v100")
    cli = subprocess.run(
        [sys.executable, "-m", "invoke", "plan", "--recipe", "qwen2.5-14b-v100-16gb", "--gpu", "v100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and "matches several cards" in cli.stderr


RPC_LOG = ROOT / "tests" / "fixtures" / "thishost-llamacpp-0c1e570-llama-server-rpc-split-2-workers.log"


def assert_load_is_the_plan(log_path: Path, c) -> list[float]:
    """A real split load against the plan: every layer offloaded, each device's weights and KV
    cache equal to the plan's (to the log's 0.01 MiB), judge_split silent. Returns the real
    compute buffers, which the plan only estimates."""
    log = parse_load_log(log_path.read_text())
    planned = tuple((d.weights_bytes / 2**20, d.kv_bytes / 2**20) for d in c.devices)
    assert log.offloaded == (5, 5)
    assert [round(m, 2) for m, _ in planned] == [v for k, v in log.model_mib.items() if k.startswith("RPC")]
    assert [round(k, 2) for _, k in planned] == list(log.kv_mib.values())
    assert judge_split(log, planned) == []
    got = [v for k, v in log.compute_mib.items() if k.startswith("RPC")]
    print(f"\ncompute buffers: real {got} MiB, estimate {c.devices[0].compute_bytes / 2**20:.2f} MiB per device")
    return got


def test_a_real_rpc_split_load_equals_the_plan_device_by_device():
    """Held-out data: a real load of the pinned build over two RPC servers (the fixture's
    header has the command). Weights and KV cache per device equal the plan of the recipe that
    argv came from; the compute buffers are the plan's estimate, shown beside the real ones."""
    c = plan_recipe(load_recipe("tiny-rpc-cpu")).chosen
    assert c is not None and [len(d.layers) for d in c.devices] == [3, 1] and c.devices[1].output
    got = assert_load_is_the_plan(RPC_LOG, c)
    assert sum(got) <= sum(d.compute_bytes for d in c.devices) / 2**20 * 1.10  # the deploy check's margin


MOE_RPC_LOG = ROOT / "tests" / "fixtures" / "thishost-llamacpp-0c1e570-llama-server-rpc-split-moe-2-workers.log"


def moe_rpc_recipe(tmp_path: Path) -> Path:
    """tiny-moe-cpu with tiny-rpc-cpu's two workers and every expert on them (no n_cpu_moe)."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe-cpu.yaml").read_text())
    data.pop("n_cpu_moe")
    data["rpc"] = yaml.safe_load((ROOT / "recipes" / "tiny-rpc-cpu.yaml").read_text())["rpc"]
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / "tiny-moe-rpc-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_real_moe_split_load_equals_the_plan_device_by_device(tmp_path):
    """Held-out data: a mixture of experts split over two RPC servers by the pinned build
    (captured after the MoE split was planned; the header has the command). Each device's
    weights (its experts included) and KV cache equal the plan."""
    c = plan_recipe(load_recipe(moe_rpc_recipe(tmp_path))).chosen
    assert c is not None and c.quant == "Q4_K_M" and [len(d.layers) for d in c.devices] == [3, 1]
    assert_load_is_the_plan(MOE_RPC_LOG, c)
    # a token reads its active experts only, device by device: the sum is the one-card figure
    assert sum(d.streamed_bytes for d in c.devices) == c.streamed_bytes
    assert all(d.streamed_bytes < d.weights_bytes for d in c.devices)


def test_a_moe_split_keeps_every_expert_on_a_device(tmp_path):
    """Qwen3-30B-A3B over two 16 GB cards: no expert in host RAM, the roofline on active bytes;
    n_cpu_moe beside a split is refused at the recipe's line."""
    two = recipe_with(tmp_path, "qwen3-30b-a3b-v100-16gb", "gpu_count: 2\n", name="moe-two")
    text = two.read_text()
    two.write_text("\n".join(x for x in text.splitlines() if not x.startswith("n_cpu_moe:")) + "\n")
    c = plan_recipe(load_recipe(two)).chosen
    assert c is not None and c.fits and c.n_cpu_moe == 0 and len(c.devices) == 2
    # a token reads 8 of 128 experts: what the one-card MoE path counts (plan/moe.py per_token(0))
    lay = expert_layout(load_recipe(two).shape, c.quant, True)
    assert sum(d.streamed_bytes for d in c.devices) == c.streamed_bytes == sum(lay.per_token(0))
    assert c.streamed_bytes < sum(d.weights_bytes for d in c.devices) / 4
    keyed = recipe_with(tmp_path, "qwen3-30b-a3b-v100-16gb", "gpu_count: 2\n", name="moe-offload")
    with pytest.raises(RecipeError, match=r"n_cpu_moe: .* beside a split is not planned"):
        load_recipe(keyed)


def test_judge_split_names_the_device_whose_share_moved():
    log = parse_load_log(RPC_LOG.read_text())
    moved = judge_split(log, ((0.9, 1.5), (1.33, 0.5)))
    assert moved[0].startswith("device 0 (RPC0[127.0.0.1:28152]) holds 1.33 MiB of weights, the plan 0.90 MiB")
    (fewer,) = [r for r in judge_split(log, ((0.7, 1.0),) * 3) if "weights on 2" in r]
    assert "splits the model over 3 devices" in fewer


def test_each_rpc_worker_adds_its_round_trip_to_every_token(tmp_path):
    """planner.rpc_rtt_ms (or preflight's measured connect time) per worker per token."""
    base = plan_recipe(load_recipe("tiny-rpc-cpu")).chosen
    slow = plan_recipe(load_recipe(recipe_with(tmp_path, "tiny-rpc-cpu", "planner:\n  rpc_rtt_ms: 0.5\n"))).chosen
    assert base is not None and slow is not None
    assert 1 / slow.roofline_tok_s == pytest.approx(1 / base.roofline_tok_s + 2 * 0.5e-3)
    measured = plan_recipe(load_recipe("tiny-rpc-cpu"), rpc_rtt_ms=2.0)
    assert 1 / measured.chosen.roofline_tok_s == pytest.approx(1 / base.roofline_tok_s + 2 * 2.0e-3)
    assert any("2 x 2 ms of network per token" in n and "measured" in n for n in measured.notes)


@pytest.mark.parametrize("mode", ["row", "tensor", "none", "diagonal"])
def test_only_the_layer_split_is_planned_and_the_others_say_why(tmp_path, mode):
    """A recipe's split_mode and `invoke plan --split-mode`: one rule (plan/split.py)."""
    why = split_mode_refusal(mode)
    assert why and (mode in why) and ("use layer" in why or "unknown" in why)
    path = recipe_with(tmp_path, "llama3.1-70b-2xv100-32gb", f"split_mode: {mode}\n", name="split-mode")
    with pytest.raises(RecipeError, match=r"split_mode: "):
        load_recipe(path)
    assert split_mode_refusal("layer") is None
    with pytest.raises(UsageError, match=f"split mode '?{mode}'?|--split-mode {mode} is not planned"):
        run_plan(recipe="llama3.1-70b-2xv100-32gb", split_mode=mode, out=io.StringIO())


@pytest.mark.slow
def test_row_split_is_gone_from_the_pinned_cuda_backend():
    """What the row refusal says, held to the pinned source (the llama-cpp-python sdist's tree):
    llama.cpp asks a device's backend for ggml_backend_split_buffer_type and throws when it is
    absent; ggml-cuda no longer exports it (SYCL still does)."""
    from tests.llamacpp_tools import llamacpp_tree

    tree = llamacpp_tree()
    model = (tree / "src" / "llama-model.cpp").read_text()
    assert '"ggml_backend_split_buffer_type"' in model and "does not support split buffers" in model
    cuda = "\n".join(p.read_text(errors="replace") for p in (tree / "ggml" / "src" / "ggml-cuda").glob("*.cu"))
    assert "ggml_backend_split_buffer_type" not in cuda
    assert '"ggml_backend_get_features"' in cuda  # the proc-address table is there, without it
    sycl = (tree / "ggml" / "src" / "ggml-sycl" / "ggml-sycl.cpp").read_text(errors="replace")
    assert "ggml_backend_split_buffer_type" in sycl


def _numpy_layer_devices(n_layer, weights):
    """The float32 arithmetic as numpy does it (the code before the planner dropped numpy's
    import): the reference the pure-Python rounding must match exactly."""
    import numpy as np

    splits = np.cumsum(np.array(weights, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32)
    act = np.float32(n_layer + 1)
    return [int(np.searchsorted(splits, np.float32(np.float32(il) / act), side="right")) for il in range(n_layer + 1)]


def test_layer_devices_rounds_as_float32_does():
    """Shares whose split points land on or beside a layer boundary (1/3, 0.1, awkward
    decimals), many layer counts: the pure-Python float32 gives numpy's devices every time."""
    import random

    from playbooks.plan.split import layer_devices

    rng = random.Random(7)
    cases = [[1, 1], [3, 1], [1, 2], [0.1, 0.2, 0.7], [1, 1, 1], [2, 3, 5, 7]]
    cases += [
        [round(rng.uniform(0.01, 10), rng.choice([1, 2, 3, 7])) for _ in range(rng.randint(2, 8))] for _ in range(300)
    ]
    for weights in cases:
        for n_layer in (1, 7, 23, 24, 27, 31, 47, 63, 79, 95):
            assert layer_devices(n_layer, weights) == _numpy_layer_devices(n_layer, weights), (n_layer, weights)
