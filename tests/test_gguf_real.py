"""The GGUF size model against the real tools: a generated tiny Llama (random BF16 weights,
a trained SentencePiece tokenizer), converted by llama.cpp's convert_hf_to_gguf.py and
quantized by a real llama-quantize build of the pinned llama.cpp. Every tensor's type and the
sum of tensor bytes must equal what voltaforge predicts, exactly. The tiny model's FFN width
(704) is not a multiple of 256, so llama.cpp's fallbacks are exercised for real."""

from pathlib import Path

import pytest
import yaml

from playbooks.modelgen.tinymodel import write_tiny_llama
from playbooks.plan.gguf_size import assign_types, estimate_gguf
from playbooks.plan.model_config import shape_from_config
from tests import llamacpp_tools
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

TINY = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"]
# imatrix-free file types (Q2_K and the IQ types below 4 bits want an importance matrix)
FTYPES = [
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_0",
    "Q4_K_M",
    "Q4_K_S",
    "Q4_0",
    "IQ4_XS",
    "IQ4_NL",
    "Q3_K_L",
    "Q3_K_M",
    "Q3_K_S",
    "Q2_K",
]


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_llama(work / "hf", TINY)
    return llamacpp_tools.convert_to_gguf(hf, work / "tiny-f16.gguf", "f16")


def test_converted_f16_matches_prediction(tiny_f16):
    shape = shape_from_config(TINY)
    real = llamacpp_tools.gguf_tensors(tiny_f16)
    assert {n: ty for n, (ty, _) in real.items()} == {t.name: ty.name for t, ty in assign_types(shape, "F16")}
    assert real["token_embd.weight"][0] == "F16" and real["blk.0.attn_norm.weight"][0] == "F32"
    assert sum(b for _, b in real.values()) == estimate_gguf(shape, "F16").tensor_bytes


@pytest.mark.parametrize("ftype", FTYPES)
def test_llama_quantize_types_and_bytes_match_prediction(tiny_f16, ftype):
    out = llamacpp_tools.quantize(tiny_f16, tiny_f16.with_name(f"tiny-{ftype}.gguf"), ftype)
    shape = shape_from_config(TINY)
    real = llamacpp_tools.gguf_tensors(out)
    predicted = {t.name: ty.name for t, ty in assign_types(shape, ftype, imatrix=False)}
    assert {n: ty for n, (ty, _) in real.items()} == predicted
    assert sum(b for _, b in real.values()) == estimate_gguf(shape, ftype, imatrix=False).tensor_bytes


def test_the_converter_still_reads_the_sentencepiece_vocabulary(tiny_f16):
    """The generated model ships tokenizer.json beside tokenizer.model (for exllamav2); llama.cpp's
    converter must still take the SentencePiece vocabulary (its `llama` tokenizer), not the BPE
    one it would build from tokenizer.json alone."""
    from gguf import GGUFReader

    assert (tiny_f16.parent / "hf" / "tokenizer.json").is_file()
    field = GGUFReader(tiny_f16).fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
