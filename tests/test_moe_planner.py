"""Planning a mixture-of-experts model on a small GPU (issue 13).

A token reads only its routed experts, and llama-server's --n-cpu-moe N keeps the expert
tensors of the first N layers in host RAM (playbooks/plan/moe.py says what moves). The plan
gets the two-sided roofline, the smallest N that fits, the host's share, the recipe key, the
flags and the JSON; the MoE compute buffer's walk is held to real CPU-only loads.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from playbooks.cli.plan import run_plan
from playbooks.config.planning import host_from_recipe, plan_recipe, resolve_n_cpu_moe
from playbooks.config.recipe import load_recipe
from playbooks.errors import RecipeError, VoltaforgeError
from playbooks.plan.compute_buffer import replay, worst_case_graph
from playbooks.plan.evaluate import evaluate
from playbooks.plan.gguf_size import assign_types, estimate_gguf, quant_refusal, tensor_bytes
from playbooks.plan.gpus import GIB, MIB, get_gpu
from playbooks.plan.model_config import load_config_file, shape_from_config
from playbooks.plan.moe import HOST_MEMBW_DEFAULT_GB_S, HostMemory, expert_layout, two_sided_tok_s
from playbooks.plan.moe_offload import smallest_n_cpu_moe
from playbooks.plan.planner import make_plan
from playbooks.plan.serving import Serving
from playbooks.steps.measure.bench_ceilings import ceilings
from tests.helpers import ROOT

QWEN3 = "recipes/models/qwen3-30b-a3b.config.json"
QWEN14 = "recipes/models/qwen2.5-14b-instruct.config.json"
V100_16 = get_gpu("v100-16gb")


@pytest.fixture(scope="module")
def qwen3():
    return load_config_file(ROOT / QWEN3)


# ------------------------------------------------------------------------------------------
# bytes and the two-sided roofline
# ------------------------------------------------------------------------------------------

TINY = {  # a Qwen3-MoE small enough to count by hand
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def test_the_two_sided_ceiling_of_a_shape_counted_by_hand():
    shape = shape_from_config(TINY)
    # F16: every matrix at 2 bytes an element, norms F32. The router's type is the size model's
    # (the converter writes it F32): read it, do not assume it.
    router = next(tensor_bytes(t.ne, ty) for t, ty in assign_types(shape, "F16") if t.name.endswith("gate_inp.weight"))
    experts = 3 * 256 * 128 * 8 * 2  # gate, up, down: 256 x 128 x 8 experts, per layer
    active = experts * 2 // 8  # 2 of 8 experts per token
    layer = (
        256 * 256 * 2  # attn_q (4 heads x 64)
        + 2 * 256 * 128 * 2  # attn_k, attn_v (2 KV heads x 64)
        + 256 * 256 * 2  # attn_output
        + router
        + (256 + 256 + 64 + 64) * 4  # attn_norm, ffn_norm, q_norm, k_norm
    )
    resident = 4 * layer + 256 * 4 + 256 * 1024 * 2  # + output_norm, output (token_embd stays on the host)
    lay = expert_layout(shape, "F16")
    assert lay.expert_bytes == (experts,) * 4
    assert lay.per_token(0) == (resident + 4 * active, 0)
    assert lay.per_token(1) == (resident + 3 * active, active)
    assert lay.host_expert_bytes(1) == experts
    # 1 / (GPU bytes / GPU bandwidth + host bytes / host bandwidth)
    by_hand = 1 / ((resident + 3 * active) / 900e9 + active / 50e9)
    o = evaluate(shape, "F16", V100_16, Serving(context=1024, n_cpu_moe=1), host=HostMemory(membw_gb_s=50))
    assert o.n_cpu_moe == 1 and o.roofline_tok_s == pytest.approx(by_hand, rel=1e-12)
    assert (o.host_bytes_per_token, o.gpu_bytes_per_token) == (active, resident + 3 * active)
    assert o.host_membw_gb_s == 50 and o.host_membw_source == "default"
    assert o.gpu_weights_bytes == estimate_gguf(shape, "F16").gpu_weight_bytes - experts
    assert two_sided_tok_s(resident, 900, 0, 50) == pytest.approx(900e9 / resident)


def test_a_dense_model_reads_everything_and_offloads_nothing():
    shape = load_config_file(ROOT / QWEN14)
    o = evaluate(shape, "Q4_K_M", V100_16, Serving(context=4096))
    assert (o.n_cpu_moe, o.host_bytes_per_token, o.host_membw_gb_s) == (0, 0, None)
    assert o.active_bytes_per_token == o.streamed_bytes == estimate_gguf(shape, "Q4_K_M").streamed_bytes_per_token
    with pytest.raises(ValueError, match="dense"):
        expert_layout(shape, "Q4_K_M")


def test_a_moe_token_reads_its_active_experts_only(qwen3):
    o = evaluate(qwen3, "Q4_K_M", get_gpu("v100-32gb"), Serving(context=4096, n_cpu_moe="auto"))
    assert o.n_cpu_moe == 0 and o.fits  # a 32 GB card holds it whole
    # 3.35B of 30.5B parameters are active: a token reads about a ninth of the file
    assert 0.09 < o.active_bytes_per_token / o.weights_bytes < 0.11
    assert o.roofline_tok_s == pytest.approx(900e9 / o.active_bytes_per_token)


# ------------------------------------------------------------------------------------------
# the fit search
# ------------------------------------------------------------------------------------------


def test_auto_finds_the_smallest_n_and_one_less_does_not_fit(qwen3):
    s = Serving(context=4096, n_cpu_moe="auto")
    auto = evaluate(qwen3, "Q4_K_M", V100_16, s)
    n = auto.n_cpu_moe
    assert auto.fits and 0 < n < qwen3.num_hidden_layers
    assert smallest_n_cpu_moe(qwen3, "Q4_K_M", V100_16, s) == n
    pinned = evaluate(qwen3, "Q4_K_M", V100_16, Serving(context=4096, n_cpu_moe=n))
    assert pinned == auto
    fewer = evaluate(qwen3, "Q4_K_M", V100_16, Serving(context=4096, n_cpu_moe=n - 1))
    assert not fewer.fits and fewer.vram_bytes > V100_16.memory_bytes >= auto.vram_bytes
    # more offload, less VRAM, a lower ceiling
    more = evaluate(qwen3, "Q4_K_M", V100_16, Serving(context=4096, n_cpu_moe=n + 4))
    assert more.vram_bytes < auto.vram_bytes and more.roofline_tok_s < auto.roofline_tok_s
    # without offload (the recipe default) it does not fit, and the plan says what would
    plan = make_plan(qwen3, V100_16, Serving(context=4096), quant="Q4_K_M")
    assert plan.chosen is not None and not plan.chosen.fits and plan.chosen.n_cpu_moe == 0
    assert any(f"fits with the experts of {n} layer(s) in host RAM" in note for note in plan.notes)


def test_each_offloaded_layer_takes_its_experts_off_the_gpu(qwen3):
    lay = expert_layout(qwen3, "Q4_K_M", True)
    vram = [evaluate(qwen3, "Q4_K_M", V100_16, Serving(context=4096, n_cpu_moe=n)).gpu_weights_bytes for n in range(12)]
    assert [a - b for a, b in zip(vram, vram[1:], strict=False)] == list(lay.expert_bytes[:11])


def test_an_unfittable_quant_says_so_with_every_layer_offloaded():
    shape = shape_from_config(TINY | {"num_hidden_layers": 2, "vocab_size": 200000})
    tiny_gpu = get_gpu("v100-16gb").model_copy(update={"memory_gib": 0.5})
    o = evaluate(shape, "F16", tiny_gpu, Serving(context=512, n_cpu_moe="auto", cuda_context_mib=400))
    assert not o.fits and o.n_cpu_moe == 2


def test_host_ram_is_checked_when_known(qwen3):
    s = Serving(context=4096, n_cpu_moe="auto")
    small = evaluate(qwen3, "Q4_K_M", V100_16, s, host=HostMemory(ram_bytes=2 * GIB, ram_source="given"))
    assert not small.fits and small.unfit_reason.startswith("host RAM: token_embd + the experts of 7 layer(s) need")
    assert "the host has 2.0 GiB (given)" in small.unfit_reason
    enough = evaluate(qwen3, "Q4_K_M", V100_16, s, host=HostMemory(ram_bytes=64 * GIB, ram_source="measured"))
    assert enough.fits and enough.host_resident_bytes < 64 * GIB


def test_exl2_rows_of_a_moe():
    gpt_oss = load_config_file(ROOT / "recipes/models/gpt-oss-20b.config.json")
    plan = make_plan(gpt_oss, V100_16, Serving(context=4096))
    for o in plan.options:
        if o.backend == "exllamav2":
            assert not o.fits and o.unfit_reason == "ExLlamaV2 0.3.2 has no GptOssForCausalLM"
    qwen3 = load_config_file(ROOT / QWEN3)
    o = evaluate(qwen3, "EXL2-4.0", get_gpu("v100-32gb"), Serving(backend="exllamav2", cache_k="FP16", cache_v="FP16"))
    assert o.fits and o.streamed_bytes < o.gpu_weights_bytes / 5  # the active experts only


# ------------------------------------------------------------------------------------------
# the compute buffer of a MoE graph
# ------------------------------------------------------------------------------------------

# Two layers at the real widths (what the buffer depends on), written by weights/shaped_gguf.py
# (Q4_0; gpt-oss MXFP4_MOE) and loaded by the pinned CPU llama-server (0c1e570, `--fit off -t 1`), 2026-12-01:
# "CPU compute buffer size" in MiB. test_pinned_llama_server_reserves_what_the_moe_walk_says
# measures them again.
MOE_SHAPES = {
    "qwen3moe": TINY
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
    },
    "qwen2moe": {  # with a shared expert
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
    },
    "gptoss": {  # biases, no renormalisation, sliding window on every other layer
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 2,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
    },
}
# (shape, -c, -ub, -fa, -np, cache type) -> MiB
MOE_CPU_LOADS = {
    ("qwen3moe", 4096, 512, "on", 1, "f16"): 92.01,
    ("qwen3moe", 4096, 512, "off", 1, "f16"): 294.01,
    ("qwen3moe", 8192, 512, "on", 2, "f16"): 92.01,
    ("qwen3moe", 2048, 256, "on", 1, "f16"): 45.01,
    ("qwen3moe", 4096, 512, "on", 1, "q8_0"): 92.09,
    ("qwen3moe", 1024, 16, "on", 1, "f16"): 2.78,
    ("qwen3moe", 16384, 1024, "on", 4, "f16"): 184.02,
    ("mixtral", 4096, 512, "on", 1, "f16"): 204.01,
    ("mixtral", 4096, 512, "off", 1, "f16"): 308.01,
    ("mixtral", 8192, 512, "on", 2, "f16"): 204.01,
    ("mixtral", 2048, 256, "on", 1, "f16"): 101.01,
    ("mixtral", 4096, 512, "on", 1, "q8_0"): 196.12,  # the walk: 196.12503 (32 bytes over, see below)
    ("mixtral", 1024, 16, "on", 1, "f16"): 6.28,
    ("mixtral", 16384, 1024, "on", 4, "f16"): 408.02,
    ("qwen2moe", 4096, 512, "on", 1, "f16"): 53.01,
    ("qwen2moe", 4096, 512, "off", 1, "f16"): 176.25,
    ("qwen2moe", 8192, 512, "on", 2, "f16"): 53.01,
    ("qwen2moe", 2048, 256, "on", 1, "f16"): 25.51,
    ("qwen2moe", 4096, 512, "on", 1, "q8_0"): 58.33,
    ("qwen2moe", 1024, 16, "on", 1, "f16"): 1.56,
    ("qwen2moe", 16384, 1024, "on", 4, "f16"): 106.02,
    ("gptoss", 4096, 512, "on", 1, "f16"): 97.14,
    ("gptoss", 4096, 512, "off", 1, "f16"): 558.39,
    ("gptoss", 8192, 512, "on", 2, "f16"): 97.14,
    ("gptoss", 2048, 256, "on", 1, "f16"): 47.45,
    ("gptoss", 4096, 512, "on", 1, "q8_0"): 97.21,
    ("gptoss", 1024, 16, "on", 1, "f16"): 2.93,
    ("gptoss", 16384, 1024, "on", 4, "f16"): 195.29,
}


def _cpu_graph(key):
    name, c, ub, fa, np_, cache = key
    shape = shape_from_config(MOE_SHAPES[name])
    return worst_case_graph(shape, c, ub, fa == "on", n_seq=np_, cache_k=cache, cache_v=cache, device=False)


@pytest.mark.parametrize("key", MOE_CPU_LOADS, ids=lambda k: "-".join(map(str, k)))
def test_the_moe_walk_equals_real_cpu_loads(key):
    """llama.cpp prints the buffer to 0.01 MiB (an exact 196.125 as 196.12: printf rounds a tie
    to even). 27 of the 28 agree to the print; Mixtral with a q8_0 cache is one 32-byte
    alignment unit over: a small tensor lands in another hole of the allocator than in the
    real walk. So: within the print's rounding and one alignment unit."""
    real = MOE_CPU_LOADS[key]
    assert abs(replay(_cpu_graph(key)) / MIB - real) <= 0.005 + 32 / MIB


def test_an_offloaded_expert_is_copied_into_the_device_buffer_for_prefill(qwen3):
    lay = expert_layout(qwen3, "Q4_K_M", True)
    copies = lay.copies(7)
    assert copies[2] > copies[0] == copies[1] > 100 * MIB  # down is Q6_K in the first layers, gate/up Q4_K
    plain = replay(worst_case_graph(qwen3, 4096, 512, True))
    offloaded = replay(worst_case_graph(qwen3, 4096, 512, True, expert_copy=copies))
    # the copy adds at most its own size (it may reuse the free space below the top)
    assert max(max(copies), plain) < offloaded <= plain + max(copies)
    # a micro-batch under 32 tokens is not offloaded to the GPU: no copy
    small = dict(n_ctx=4096, n_ubatch=16, flash_attn=True)
    assert replay(worst_case_graph(qwen3, **small, expert_copy=copies)) == replay(worst_case_graph(qwen3, **small))
    # a CPU-only run has nothing to copy
    assert worst_case_graph(qwen3, 4096, 512, True, device=False, expert_copy=copies).expert_copy == (0, 0, 0)


@pytest.mark.slow
def test_pinned_llama_server_reserves_what_the_moe_walk_says(tmp_path):
    """Half of MOE_CPU_LOADS again, from freshly written shaped GGUFs (sparse: no disk)."""
    from playbooks.modelgen.shaped_gguf import write_shaped_gguf
    from tests import llamacpp_tools
    from tests.testhosts import free_port

    server = llamacpp_tools.llama_server()
    buffer = re.compile(r"CPU compute buffer size =\s+([\d.]+) MiB")
    for key in list(MOE_CPU_LOADS)[::2]:
        name, c, ub, fa, np_, cache = key
        model = tmp_path / f"{name}.gguf"
        if not model.exists():  # the buffer holds activations only: any type the rules can make
            shape = shape_from_config(MOE_SHAPES[name])
            write_shaped_gguf(model, shape, "MXFP4_MOE" if quant_refusal(shape, "Q4_0") else "Q4_0")
        cmd = [str(server), "-m", str(model), "-c", str(c), "-ub", str(ub), "-fa", fa, "-np", str(np_)]
        cmd += ["-ctk", cache, "-ctv", cache, "--fit", "off", "-t", "1", "--host", "127.0.0.1"]
        # a port free now (a random one met another test's server once: the load stopped at bind)
        cmd += ["--port", str(free_port()), "-lv", "4"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        real, last = None, ""
        try:
            assert p.stdout is not None
            for line in p.stdout:
                if m := buffer.search(line):
                    real = float(m[1])
                if "graph: nodes" in line or "failed" in line:
                    last = line.strip()
                    break
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        assert real == MOE_CPU_LOADS[key], (key, last)


# ------------------------------------------------------------------------------------------
# recipes
# ------------------------------------------------------------------------------------------


def test_the_shipped_moe_recipes():
    r16 = load_recipe("qwen3-30b-a3b-v100-16gb")
    assert r16.recipe.n_cpu_moe == "auto" and resolve_n_cpu_moe(r16) == 7
    plan = plan_recipe(r16)
    assert plan.chosen is not None and plan.chosen.fits and plan.chosen.n_cpu_moe == 7
    assert plan.offload_quant == "Q4_K_M" and [st.n_cpu_moe for st in plan.offload][:2] == [0, 7]
    assert not plan.offload[0].fits and plan.offload[1].fits
    r32 = load_recipe("qwen3-30b-a3b-v100-32gb")
    assert r32.recipe.n_cpu_moe == 0 and resolve_n_cpu_moe(r32) == 0 and not plan_recipe(r32).offload
    oss = load_recipe("gpt-oss-20b-v100-16gb")
    assert oss.recipe.n_cpu_moe == "auto" and resolve_n_cpu_moe(oss) == 0  # it fits whole
    assert resolve_n_cpu_moe(load_recipe("qwen2.5-14b-v100-16gb")) == 0  # dense


def _recipe(tmp_path, body: str, config: dict | None = None):
    (tmp_path / "m.json").write_text(json.dumps(config or MOE_SHAPES["qwen3moe"] | {"num_hidden_layers": 48}))
    (tmp_path / "q.json").write_text((ROOT / QWEN14).read_text())
    p = tmp_path / "r.yaml"
    p.write_text(
        textwrap.dedent("""\
            model:
              repo: Qwen/Qwen3-30B-A3B
              revision: main
              config: m.json
            gpu: v100-16gb
            backend: llamacpp
            quant: Q4_K_M
            context: 4096
        """)
        + textwrap.dedent(body)
    )
    return p


def _recipe_error(tmp_path, body: str, config: dict | None = None) -> str:
    with pytest.raises(RecipeError) as exc:
        load_recipe(_recipe(tmp_path, body, config))
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize(
    "body,says",
    [
        ("n_cpu_moe: 49\n", "r.yaml:9: n_cpu_moe: 49 is more than the model's 48 layers"),
        ("n_cpu_moe: -1\n", "r.yaml:9: n_cpu_moe: must be a number of layers (0 or more) or auto (got -1)"),
        ("n_cpu_moe: true\n", "r.yaml:9: n_cpu_moe: must be a number of layers (0 or more) or auto (got True)"),
        ("n_cpu_moe: all\n", "r.yaml:9: n_cpu_moe: must be a number of layers (0 or more) or auto (got 'all')"),
        ("n_cpu_moe: 2.5\n", "r.yaml:9: n_cpu_moe: must be a number of layers"),
        ("planner:\n  host_membw_gb_s: 0\n", "planner.host_membw_gb_s"),
        ("planner:\n  host_ram_gib: -4\n", "planner.host_ram_gib"),
    ],
)
def test_bad_n_cpu_moe_in_a_recipe_is_one_line_naming_file_line_and_key(tmp_path, body, says):
    assert says in _recipe_error(tmp_path, body)


def test_a_dense_model_with_n_cpu_moe_is_refused(tmp_path):
    msg = _recipe_error(tmp_path, "n_cpu_moe: 4\n", json.loads((ROOT / QWEN14).read_text()))
    assert "r.yaml:9: n_cpu_moe: 4 but qwen2 is a dense model: it has no experts to keep in host RAM" in msg


def test_n_cpu_moe_with_exllamav2_is_refused(tmp_path):
    body = "n_cpu_moe: auto\ncache: {k: Q8, v: Q8}\n"
    p = _recipe(tmp_path, body)
    p.write_text(p.read_text().replace("backend: llamacpp", "backend: exllamav2").replace("Q4_K_M", "{bpw: 4.0}"))
    with pytest.raises(RecipeError, match=r"r\.yaml:9: n_cpu_moe: is llama-server's --n-cpu-moe; ExLlamaV2 keeps"):
        load_recipe(p)


def test_a_moe_config_without_its_expert_counts_is_refused(tmp_path):
    cfg = MOE_SHAPES["qwen3moe"] | {"num_hidden_layers": 48}
    del cfg["num_experts"]
    msg = _recipe_error(tmp_path, "n_cpu_moe: auto\n", cfg)
    assert "m.json: qwen3_moe is a mixture-of-experts model but the config has no num_experts" in msg


def test_recipe_host_figures_and_their_sources(tmp_path):
    loaded = load_recipe(_recipe(tmp_path, "n_cpu_moe: auto\nplanner:\n  host_membw_gb_s: 80\n  host_ram_gib: 64\n"))
    h = host_from_recipe(loaded)
    assert (h.membw_gb_s, h.membw_source, h.ram_bytes, h.ram_source) == (80, "given", 64 * GIB, "given")
    h = host_from_recipe(loaded, 21.5, 32 * GIB, "measured", membw_measured=True)
    assert (h.membw_gb_s, h.membw_source, h.ram_bytes, h.ram_source) == (21.5, "measured", 32 * GIB, "measured")
    loaded = load_recipe(_recipe(tmp_path, "n_cpu_moe: 3\n"))
    h = host_from_recipe(loaded)
    assert (h.membw_gb_s, h.membw_source, h.ram_bytes, h.ram_source) == (
        HOST_MEMBW_DEFAULT_GB_S,
        "default",
        None,
        "unknown",
    )
    assert resolve_n_cpu_moe(loaded) == 3 and plan_recipe(loaded).chosen.n_cpu_moe == 3


def test_auto_that_nothing_satisfies_is_an_error_for_a_deployment(tmp_path):
    # F16 fits only with most experts in host RAM, and the host holds 8 GiB
    assert resolve_n_cpu_moe(load_recipe(_recipe(tmp_path, "n_cpu_moe: auto\nplanner:\n  host_ram_gib: 8\n"))) == 7
    p = _recipe(tmp_path, "n_cpu_moe: auto\nplanner:\n  host_ram_gib: 8\n")
    p.write_text(p.read_text().replace("quant: Q4_K_M", "quant: F16"))
    with pytest.raises(VoltaforgeError, match=r"n_cpu_moe: auto: F16 does not fit .* host RAM"):
        resolve_n_cpu_moe(load_recipe(p))


def test_the_bench_ceiling_is_two_sided_with_the_measured_host_rate():
    loaded = load_recipe("qwen3-30b-a3b-v100-16gb")
    o = plan_recipe(loaded).chosen
    assert o is not None
    measured = ceilings(loaded, 21.5)
    assert measured["roofline_tok_s"] == round(
        two_sided_tok_s(o.gpu_bytes_per_token, 900, o.host_bytes_per_token, 21.5), 2
    )
    assert (
        "host measured 21.5 GB/s" in measured["roofline_basis"] and "experts of 7 layers" in measured["roofline_basis"]
    )
    assert "host default 50.0 GB/s" in ceilings(loaded, None)["roofline_basis"]


# ------------------------------------------------------------------------------------------
# the CLI
# ------------------------------------------------------------------------------------------


def invoke(*args):
    return subprocess.run(
        [sys.executable, "-m", "invoke", "plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_plan_qwen3_on_a_16gb_v100_offloads_experts_and_shows_both_sides():
    r = invoke("--model-config", QWEN3, "--gpu", "v100-16gb")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # rich wraps lines at 120 columns
    m = re.search(r"Planned quant Q4_K_M: .* in VRAM \(the experts of (\d+) of 48 layers, .* --n-cpu-moe \1\)", out)
    assert m, out
    n = int(m[1])
    assert "fits with" in out and "does not fit" not in out.split("Fit table")[0]
    two = re.search(
        rf"Roofline, two-sided \(--n-cpu-moe {n}\): ([\d.]+) GB per token on the GPU / 900 GB/s \+ ([\d.]+) GB per "
        r"token in host RAM / 50 GB/s \(default\) = (\d+) tok/s",
        out,
    )
    assert two, out
    gpu_gb, host_gb, tok_s = float(two[1]), float(two[2]), int(two[3])
    assert tok_s == pytest.approx(1 / (gpu_gb / 900 + host_gb / 50), abs=3)  # from the printed (rounded) figures
    assert "Expert offload, Q4_K_M" in out and "n-cpu-moe" in out and "host memory bandwidth 50 GB/s (default" in out


def test_plan_json_carries_the_offload_per_option():
    r = invoke("--model-config", QWEN3, "--gpu", "v100-16gb", "--json", "--host-membw", "80", "--host-ram", "64")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["host"] == {"membw_gb_s": 80.0, "membw_source": "given", "ram_bytes": 64 * GIB, "ram_source": "given"}
    assert data["serving"]["n_cpu_moe"] == "auto" and data["model"]["experts"] == 128
    keys = ("n_cpu_moe", "active_bytes_per_token", "host_bytes_per_token", "host_membw_gb_s", "host_membw_source")
    for q in [*data["quants"], data["chosen"], data["recommended"]]:
        assert all(k in q for k in keys), q
    c = data["chosen"]
    assert c["n_cpu_moe"] > 0 and c["host_membw_gb_s"] == 80.0 and c["host_membw_source"] == "given"
    assert c["active_bytes_per_token"] == c["gpu_bytes_per_token"] + c["host_bytes_per_token"]
    steps = data["offload"]["steps"]
    assert data["offload"]["quant"] == "Q4_K_M" and steps[0]["n_cpu_moe"] == 0 and not steps[0]["fits"]
    assert {"n_cpu_moe", "vram_bytes", "fits", "roofline_tok_s"} <= set(steps[1])


def test_n_cpu_moe_and_host_flags_change_the_plan():
    out = io.StringIO()
    assert run_plan(model_config=QWEN3, gpu="v100-16gb", n_cpu_moe=12, as_json=True, out=out) == 0
    assert json.loads(out.getvalue())["chosen"]["n_cpu_moe"] == 12
    out = io.StringIO()
    assert run_plan(model_config=QWEN3, gpu="v100-16gb", n_cpu_moe=2, as_json=True, out=out) == 1  # too few
    out = io.StringIO()
    assert run_plan(model_config=QWEN3, gpu="v100-16gb", host_ram_gib=2, as_json=True, out=out) == 1
    assert json.loads(out.getvalue())["chosen"]["unfit_reason"].startswith("host RAM")
    out = io.StringIO()
    assert run_plan(recipe="qwen3-30b-a3b-v100-16gb", n_cpu_moe=0, as_json=True, out=out) == 1  # the recipe, pinned off
    out = io.StringIO()  # a CPU holds every weight in host memory: the flag moves nothing, and the plan says so
    assert run_plan(recipe="tiny-moe-cpu", n_cpu_moe=2, as_json=True, out=out) == 0
    data = json.loads(out.getvalue())
    assert data["chosen"]["n_cpu_moe"] == 0 and any("moves no memory" in n for n in data["notes"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model-config", QWEN14, "--n-cpu-moe", "4"], "is a dense model (qwen2): it has no experts"),
        (["--recipe", "qwen2.5-14b-v100-16gb", "--n-cpu-moe", "auto"], "qwen2.5-14b-v100-16gb is a dense model"),
        (["--model-config", QWEN3, "--n-cpu-moe", "49"], "--n-cpu-moe 49 is more than the model's 48 layers"),
        (["--model-config", QWEN3, "--n-cpu-moe", "some"], "--n-cpu-moe 'some': want a number of layers or auto"),
        (["--model-config", QWEN3, "--n-cpu-moe", "-3"], "--n-cpu-moe must be a number of layers from 0"),
        (["--model-config", QWEN3, "--host-membw", "0"], "--host-membw must be a positive number of GB/s"),
        (["--model-config", QWEN3, "--host-ram", "lots"], "--host-ram 'lots' is not a number of GiB"),
    ],
)
def test_bad_moe_flags_are_one_line_and_exit_2(args, message):
    r = invoke(*args)
    assert r.returncode == 2, (r.stdout[-500:], r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_preflight_checks_the_offloaded_experts_against_the_hosts_ram():
    from playbooks.facts import system
    from playbooks.steps.preflight import judge
    from tests.test_preflight_judge import facts

    loaded = load_recipe("qwen3-30b-a3b-v100-16gb")
    small = facts(memory=system.MemInfo(available=True, mem_total_bytes=2 * GIB))
    fit = {c.name: c for c in judge(small, loaded, "/opt/voltaforge/models", "/opt/voltaforge").checks}["fit"]
    assert fit.status == "fail" and fit.blocking
    assert "Q4_K_M does not fit: host RAM: token_embd + the experts of 7 layer(s) need 2.7 GiB" in fit.detail
    assert "the host has 2.0 GiB (measured)" in fit.detail
    big = facts(memory=system.MemInfo(available=True, mem_total_bytes=64 * GIB))
    fit = {c.name: c for c in judge(big, loaded, "/opt/voltaforge/models", "/opt/voltaforge").checks}["fit"]
    assert fit.status == "pass" and "fits with" in fit.detail


@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b-instruct-v0.1"])
def test_the_offload_layout_agrees_with_the_size_models_expert_bytes(config):
    """moe.expert_layout and gguf_size.GgufEstimate count the same tensors two ways."""
    shape = load_config_file(ROOT / f"recipes/models/{config}.config.json")
    for ftype in ("MXFP4_MOE", "Q4_K_M", "Q8_0", "F16"):
        if quant_refusal(shape, ftype):
            continue
        est, lay = estimate_gguf(shape, ftype), expert_layout(shape, ftype)
        assert lay.expert_bytes == est.expert_bytes_per_layer
        assert sum(lay.per_token(0)) == est.active_bytes_per_token
        assert lay.host_expert_bytes(5) == est.host_expert_bytes(5)


def test_gguf_types_llama_cpp_cannot_make_are_left_out_and_said_so():
    gpt_oss = load_config_file(ROOT / "recipes/models/gpt-oss-20b.config.json")
    plan = make_plan(gpt_oss, V100_16, Serving(context=4096, n_cpu_moe="auto"))
    gguf = [o.quant for o in plan.options if o.backend == "llamacpp"]
    assert gguf == ["F16", "BF16", "MXFP4_MOE"]
    assert any(n.startswith("left out of the fit table: Q8_0, Q6_K") and "use MXFP4_MOE" in n for n in plan.notes)
    out = io.StringIO()  # no --quant: the default Q4_K_M cannot be made, gpt-oss's own type is planned
    assert run_plan(model_config="recipes/models/gpt-oss-20b.config.json", as_json=True, out=out) == 0
    assert json.loads(out.getvalue())["chosen"]["quant"] == "MXFP4_MOE"
    r = invoke("--model-config", "recipes/models/gpt-oss-20b.config.json", "--quant", "Q4_K_M")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--quant Q4_K_M: Q4_K_M for gpt_oss: its experts are MXFP4 in the checkpoint" in r.stderr


def test_a_recipe_whose_quant_llama_cpp_cannot_make_is_refused(tmp_path):
    cfg = json.loads((ROOT / "recipes/models/gpt-oss-20b.config.json").read_text())
    msg = _recipe_error(tmp_path, "", cfg)
    assert "r.yaml:7: quant: Q4_K_M for gpt_oss: its experts are MXFP4" in msg and "use MXFP4_MOE" in msg
