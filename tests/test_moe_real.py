"""Mixture-of-experts through the real tools: the tiny generated Mixtral of the tiny-moe-cpu
recipe (4 experts, 2 per token, random BF16 weights, a trained SentencePiece tokenizer),
converted by llama.cpp's convert_hf_to_gguf.py, quantized by the pinned llama-quantize and
served by the pinned CPU llama-server with --n-cpu-moe.

Every tensor's name, type and bytes must equal the prediction (gguf_size.assign_types); the
expert FFN width (704) is not a multiple of 256, so the fallbacks run on 3-D expert tensors
too. The server is started from the recipe's own command line; its debug log (-lv 5 prints
one line per overridden tensor) must show exactly the first N layers' experts in host
memory, and it must answer over HTTP."""

import subprocess
import time
from pathlib import Path

import httpx
import pytest

from playbooks.config.planning import resolve_n_cpu_moe
from playbooks.config.recipe import load_recipe
from playbooks.facts.server_log import parse_load_log
from playbooks.modelgen.tinymodel import write_tiny_llama
from playbooks.plan.gguf_size import assign_types, estimate_gguf
from playbooks.steps.serve.engine_llamacpp import llama_server_argv
from playbooks.steps.serve.units import ServerLayout
from tests import llamacpp_tools
from tests.testhosts import free_port

pytestmark = pytest.mark.slow

LOADED = load_recipe("tiny-moe-cpu")
SHAPE = LOADED.shape
FTYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_XS", "Q3_K_M", "Q3_K_S", "Q2_K"]


@pytest.fixture(scope="module")
def moe_f16(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("moe")
    hf = write_tiny_llama(work / "hf", LOADED.recipe.model.config)
    return llamacpp_tools.convert_to_gguf(hf, work / "moe-f16.gguf", "f16")


def test_the_tiny_model_is_a_mixture_of_experts():
    assert SHAPE.is_moe and SHAPE.arch == "llama"
    assert (SHAPE.num_experts, SHAPE.num_experts_per_tok, SHAPE.expert_intermediate_size) == (4, 2, 704)


def test_converted_moe_matches_prediction_tensor_by_tensor(moe_f16):
    real = llamacpp_tools.gguf_tensors(moe_f16)
    predicted = {t.name: ty.name for t, ty in assign_types(SHAPE, "F16")}
    assert {n: ty for n, (ty, _) in real.items()} == predicted
    # the stacked experts and the router, as llama.cpp names and types them
    assert real["blk.0.ffn_gate_exps.weight"] == ("F16", 256 * 704 * 4 * 2)
    assert real["blk.3.ffn_down_exps.weight"][0] == "F16" and real["blk.0.ffn_gate_inp.weight"][0] == "F32"
    assert sum(b for _, b in real.values()) == estimate_gguf(SHAPE, "F16").tensor_bytes


@pytest.mark.parametrize("ftype", FTYPES)
def test_llama_quantize_moe_types_and_bytes_match_prediction(moe_f16, ftype):
    out = llamacpp_tools.quantize(moe_f16, moe_f16.with_name(f"moe-{ftype}.gguf"), ftype)
    real = llamacpp_tools.gguf_tensors(out)
    predicted = {t.name: ty.name for t, ty in assign_types(SHAPE, ftype, imatrix=False)}
    assert {n: ty for n, (ty, _) in real.items()} == predicted
    assert sum(b for _, b in real.values()) == estimate_gguf(SHAPE, ftype, imatrix=False).tensor_bytes


def _serve(argv: list[str], log: Path, port: int) -> subprocess.Popen:
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if client.get("/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    server.terminate()
    pytest.fail(f"llama-server not healthy (exit {server.poll()}): {log.read_text()[-3000:]}")


def test_served_with_experts_in_host_memory_answers_and_its_log_names_them(moe_f16, tmp_path):
    q4 = llamacpp_tools.quantize(moe_f16, tmp_path / "moe-Q4_K_M.gguf", "Q4_K_M")
    n_cpu_moe = resolve_n_cpu_moe(LOADED)  # the recipe's n_cpu_moe: 2
    port = free_port()
    argv, _ = llama_server_argv(LOADED.recipe, ServerLayout(str(tmp_path)), n_cpu_moe=n_cpu_moe)
    argv[0] = str(llamacpp_tools.llama_server())
    argv[argv.index("--model") + 1] = str(q4)
    argv[argv.index("--port") + 1] = str(port)
    # debug verbosity: llama.cpp names each overridden tensor only there
    argv[argv.index("--log-verbosity") + 1] = "5"
    assert n_cpu_moe == 2 and argv[argv.index("--n-cpu-moe") + 1] == "2"
    log = tmp_path / "llama-server.log"
    server = _serve(argv, log, port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            messages = [{"role": "user", "content": "Hello\nWho are you? 你好"}]
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.terminate()
        server.wait(timeout=30)
    loaded = parse_load_log(log.read_text(errors="replace"))
    assert not loaded.problems, loaded.problems
    experts = {t.name for t, _ in assign_types(SHAPE, "Q4_K_M") if t.experts and t.layer < n_cpu_moe}
    assert len(experts) == 3 * n_cpu_moe
    assert set(loaded.overridden) == experts
    assert all(buft.startswith("CPU") for buft in loaded.overridden.values())
