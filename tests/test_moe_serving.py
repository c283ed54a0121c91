"""A MoE recipe's serving: the planner's --n-cpu-moe reaches llama-server's command line, and
deploy's load check holds a real GPU load to exactly the planned experts in host RAM.

The loads are real: llama-server of the pinned llama.cpp built for sm_90 by the build step on
a lent H200 (scripts/device_check.py), serving shaped GGUFs (the planner's tensors and types,
zero data) of Qwen3-30B-A3B with --n-cpu-moe 24 and of the dense Qwen2.5-14B.

What the "GPU weights = plan" comparisons prove, and what they do not. The GGUFs were written
from the planner's own tensor list (playbooks/modelgen/shaped_gguf.py), so every tensor's size in
them IS the planner's size: that the GPU model buffer equals the planned GPU weights does not
check the sizes (a wrong size would be in the file and in the plan alike). It checks PLACEMENT:
which tensors llama.cpp puts on the GPU and which it keeps in host RAM (token_embd, the experts of
the first N layers under --n-cpu-moe N) is what the planner assumes. The sizes are proven
elsewhere, against published files (tests/test_gguf_size.py) and the real converter and
quantizer (tests/test_gguf_real.py, tests/test_gguf_moe_real.py). The KV cache and compute
buffer are llama.cpp's own arithmetic from the shape, checked against the planner's."""

from dataclasses import replace

import pytest

from playbooks.config.planning import plan_recipe, resolve_n_cpu_moe
from playbooks.config.recipe import load_recipe
from playbooks.facts.server_log import judge_load, parse_load_log
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gpus import get_gpu
from playbooks.plan.model_config import load_config_file
from playbooks.plan.serving import Serving
from playbooks.steps.serve.engine_llamacpp import llama_server_argv
from playbooks.steps.serve.service_files import render_service_files
from playbooks.steps.serve.units import ServerLayout
from tests.helpers import ROOT, fixture_body

MOE_LOG = "llamacpp-load-h200-qwen3-30b-a3b-q4km-n-cpu-moe-24.log"
DENSE_LOG = "llamacpp-load-h200-qwen2.5-14b-q4km-full-offload.log"
QWEN3 = load_config_file(ROOT / "recipes/models/qwen3-30b-a3b.config.json")
# what the captured server ran: -c 4096, one slot, q8_0 cache, FA on, ub 512 (its argv)
AS_RUN = Serving(context=4096, parallel=1, cache_k="q8_0", cache_v="q8_0", cuda_context_mib=400, margin_mib=256)


def _exec_args(recipe: str) -> list[str]:
    (unit,) = render_service_files(load_recipe(recipe).recipe, n_cpu_moe=resolve_n_cpu_moe(load_recipe(recipe)))
    line = next(x for x in unit.text.splitlines() if x.startswith("ExecStart="))
    return line.split()


def test_the_16gb_recipe_serves_with_the_planned_experts_in_host_ram():
    loaded = load_recipe("qwen3-30b-a3b-v100-16gb")
    n = resolve_n_cpu_moe(loaded)
    chosen = plan_recipe(loaded).chosen
    assert chosen is not None and chosen.fits and n == chosen.n_cpu_moe > 0
    args = _exec_args("qwen3-30b-a3b-v100-16gb")
    assert args[args.index("--n-cpu-moe") + 1] == str(n)
    assert args[args.index("--fit") + 1] == "off"  # llama-server moves nothing else on its own


@pytest.mark.parametrize(
    "recipe", ["qwen3-30b-a3b-v100-32gb", "gpt-oss-20b-v100-16gb", "qwen2.5-14b-v100-16gb", "tiny-cpu"]
)
def test_recipes_that_fit_whole_get_no_expert_flag(recipe):
    assert resolve_n_cpu_moe(load_recipe(recipe)) == 0
    assert "--n-cpu-moe" not in _exec_args(recipe)


def test_argv_writes_the_flag_only_for_n_above_zero():
    r = load_recipe("tiny-moe-cpu").recipe
    assert "--n-cpu-moe" not in llama_server_argv(r, ServerLayout(), n_cpu_moe=0)[0]
    argv = llama_server_argv(r, ServerLayout(), n_cpu_moe=3)[0]
    assert argv[argv.index("--n-cpu-moe") + 1] == "3"


def _planned(n: int):
    return evaluate(QWEN3, "Q4_K_M", get_gpu("h200"), replace(AS_RUN, n_cpu_moe=n))


def test_h200_shaped_moe_load_places_the_planned_tensors_with_24_layers_of_experts_in_host_ram():
    """llama.cpp on the H200 put exactly the tensors the plan puts on the GPU there (its model
    buffer = the planned GPU weights, to 0.02 MiB) and kept the rest in host RAM; the file's
    tensors are the planner's own, so this is placement, not size (module docstring). KV cache
    and compute buffer: llama.cpp's arithmetic equals the planner's."""
    log = parse_load_log(fixture_body(MOE_LOG))
    option = _planned(24)
    assert log.offloaded == (49, 49)  # the layer count cannot tell: every layer is "on the GPU"
    assert (
        judge_load(
            log,
            expect_layers=QWEN3.num_hidden_layers + 1,
            planned_kv_mib=option.kv_bytes / 2**20,
            planned_compute_mib=option.compute_bytes / 2**20,
            planned_device_model_mib=option.gpu_weights_bytes / 2**20,
        )
        == []
    )
    # placement: the planner's tensors llama.cpp kept on the GPU sum to the planner's GPU share;
    # the KV cache and CUDA compute buffer exactly
    assert log.model_device_mib == pytest.approx(option.gpu_weights_bytes / 2**20, abs=0.02)
    assert log.kv_mib == {"CUDA0": pytest.approx(option.kv_bytes / 2**20, abs=0.005)}
    assert log.compute_mib["CUDA0"] == pytest.approx(option.compute_bytes / 2**20, abs=0.005)


@pytest.mark.parametrize(
    ("planned_n", "why"),
    [(23, "more than the planned experts stayed in host memory"), (25, "fewer experts stayed in host memory")],
)
def test_one_layer_of_experts_more_or_less_in_host_ram_fails_the_load(planned_n, why):
    """The placement check can fail: a plan one layer of experts off is caught by the judge."""
    log = parse_load_log(fixture_body(MOE_LOG))
    option = _planned(planned_n)
    reasons = judge_load(
        log,
        expect_layers=QWEN3.num_hidden_layers + 1,
        planned_kv_mib=None,
        planned_compute_mib=None,
        planned_device_model_mib=option.gpu_weights_bytes / 2**20,
    )
    assert len(reasons) == 1 and why in reasons[0] and "9154.43 MiB" in reasons[0]


def test_h200_shaped_dense_load_places_every_planned_tensor_on_the_gpu_and_kv_compute_are_the_plan():
    """Dense Qwen2.5-14B, full offload: the GPU model buffer equals the planned GPU weights (the
    file is the planner's tensor list, so this proves placement, token_embd kept in host RAM, not
    sizes); KV cache to the byte and compute buffer to 0.005 MiB are llama.cpp's own arithmetic."""
    loaded = load_recipe("qwen2.5-14b-v100-16gb")
    option = evaluate(loaded.shape, "Q4_K_M", get_gpu("h200"), plan_recipe(loaded).serving)
    log = parse_load_log(fixture_body(DENSE_LOG))
    assert log.offloaded == (49, 49) and not log.problems
    assert log.kv_mib == {"CUDA0": option.kv_bytes / 2**20}
    assert log.compute_mib["CUDA0"] == pytest.approx(option.compute_bytes / 2**20, abs=0.005)
    assert log.model_device_mib == pytest.approx(option.gpu_weights_bytes / 2**20, abs=0.02)
