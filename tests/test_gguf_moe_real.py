"""The MoE type rules against the real llama-quantize of the pinned llama.cpp.

Tiny MoE GGUFs (qwen3moe, qwen2moe with a shared expert, an 8-expert Mixtral-like llama, gpt-oss
with and without MXFP4 experts) are written directly with gguf-py: the tensors and types voltaforge
predicts convert_hf_to_gguf.py writes (F16 matrices, F32 norms/biases/routers, MXFP4 experts for an
MXFP4 checkpoint), all-zero data. `llama-quantize --dry-run` then prints the type it would give
every tensor, which must be voltaforge's prediction. The converter itself is not exercised here
(that needs torch and a tokenizer); what it writes is checked by test_gguf_real.py for a dense model.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from playbooks.modelgen.shaped_gguf import write_shaped_gguf
from playbooks.plan.gguf_size import CONVERTER_TYPES, FILE_TYPES, assign_types, quant_refusal
from playbooks.plan.model_config import ModelShape, shape_from_config
from tests import llamacpp_tools

pytestmark = pytest.mark.slow

BASE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "num_experts_per_tok": 2,
}
# gpt-oss: hidden 320 is not a multiple of 256, as the real 2880 is not, so the fallbacks show
GPT_OSS = {
    "model_type": "gpt_oss",
    "num_local_experts": 4,
    "head_dim": 64,
    "attention_bias": True,
    "hidden_size": 320,
    "intermediate_size": 320,
}
SHAPES = {
    "qwen3moe": {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 256, "head_dim": 64},
    "qwen2moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 512,
    },
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8},
    "mixtral-704": {"model_type": "mixtral", "num_local_experts": 8, "intermediate_size": 704},
    "gpt-oss-mxfp4": {
        **GPT_OSS,
        "hidden_size": 320,
        "intermediate_size": 320,
        "quantization_config": {"quant_method": "mxfp4"},
    },
    "gpt-oss-bf16": GPT_OSS,
}
QUANTIZED = [q for q in FILE_TYPES if q not in CONVERTER_TYPES]
LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =\s*[\d.]+ MiB(?: ->\s*[\d.]+ MiB \((\S+)\))?")


def _shape(key: str) -> ModelShape:
    return shape_from_config({**BASE, **SHAPES[key]})


@pytest.fixture(scope="module")
def f16_files(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("moe")
    # the converter's file as the plan predicts it (weights/shaped_gguf.py: every tensor at its
    # predicted type, MXFP4 experts raw; zero data, which llama-quantize's dry run never reads)
    return {key: write_shaped_gguf(work / f"{key}-f16.gguf", _shape(key), "F16") for key in SHAPES}


def _dry_run(src: Path, ftype: str) -> dict[str, str]:
    out = subprocess.run(
        [str(llamacpp_tools.llama_quantize()), "--dry-run", str(src), ftype], capture_output=True, text=True
    )
    types = {m[1]: (m[3] or m[2]).upper() for m in LINE.finditer(out.stdout + out.stderr)}
    assert types, out.stderr[-2000:]
    return types


# the pairs llama-quantize accepts (MXFP4 experts refuse the others: the test below); no
# skips, since CI's strict mode fails on any
CASES = [(k, f) for k in SHAPES for f in QUANTIZED if not quant_refusal(_shape(k), f)]


@pytest.mark.parametrize(("key", "ftype"), CASES)
def test_llama_quantize_gives_every_moe_tensor_the_predicted_type(f16_files, key, ftype):
    shape = _shape(key)
    predicted = {t.name: ty.name for t, ty in assign_types(shape, ftype)}
    assert _dry_run(f16_files[key], ftype) == predicted


def test_llama_quantize_refuses_to_requantize_mxfp4_experts(f16_files, tmp_path):
    out = subprocess.run(
        [str(llamacpp_tools.llama_quantize()), str(f16_files["gpt-oss-mxfp4"]), str(tmp_path / "q.gguf"), "Q4_K_M"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "requantizing from type mxfp4 is disabled" in out.stdout + out.stderr
    assert quant_refusal(_shape("gpt-oss-mxfp4"), "Q4_K_M")
