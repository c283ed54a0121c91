"""GGUF sizes: llama.cpp's per-tensor type rules, and published file sizes within 1%."""

from pathlib import Path

import pytest
import yaml
from gguf import GGMLQuantizationType as T

from playbooks.plan.gguf_size import assign_types, estimate_gguf
from playbooks.plan.model_config import load_config_file, shape_from_config
from tests.helpers import ROOT

PUBLISHED = yaml.safe_load((Path(__file__).parent / "data/published_gguf_sizes.yaml").read_text())
UNITS = {"bytes": 1, "GB": 10**9, "GiB": 2**30}


def _shape(name):
    return load_config_file(ROOT / "recipes/models" / f"{name}.config.json")


@pytest.mark.parametrize("entry", PUBLISHED, ids=[f"{e['model']}-{e['quant']}" for e in PUBLISHED])
def test_published_size_within_one_percent(entry):
    published = entry["size"] * UNITS[entry["unit"]]
    predicted = estimate_gguf(
        _shape(entry["model"]), entry["quant"], imatrix="imatrix" in entry.get("quantizer", "")
    ).file_bytes
    assert abs(predicted - published) / published < 0.01, (predicted, published, entry["source"])


def test_enough_published_sizes_for_the_shipped_models():
    per_model = {}
    for e in PUBLISHED:
        per_model.setdefault(e["model"], set()).add(e["quant"])
    assert len(per_model["qwen2.5-32b-instruct"]) >= 5
    assert len(per_model["qwen2.5-14b-instruct"]) >= 5


def test_q4_k_m_mix_for_qwen32b():
    types = {t.name: ty for t, ty in assign_types(_shape("qwen2.5-32b-instruct"), "Q4_K_M")}
    assert types["output.weight"] is T.Q6_K
    assert types["token_embd.weight"] is T.Q4_K
    assert types["blk.0.attn_norm.weight"] is T.F32
    assert types["blk.0.attn_q.bias"] is T.F32
    # use_more_bits: first and last eighth of 64 layers, and every third layer between
    assert types["blk.0.attn_v.weight"] is T.Q6_K and types["blk.7.attn_v.weight"] is T.Q6_K
    assert types["blk.8.attn_v.weight"] is T.Q4_K and types["blk.10.attn_v.weight"] is T.Q6_K
    assert types["blk.56.ffn_down.weight"] is T.Q6_K and types["blk.55.ffn_down.weight"] is T.Q6_K
    assert types["blk.54.ffn_down.weight"] is T.Q4_K
    assert types["blk.30.attn_q.weight"] is T.Q4_K
    q6 = [n for n, ty in types.items() if ty is T.Q6_K]
    assert len(q6) == 65  # output + 32 attn_v + 32 ffn_down


def test_rows_not_divisible_by_256_fall_back():
    tiny = shape_from_config(
        {
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 2048,
        }
    )
    types = {t.name: ty for t, ty in assign_types(tiny, "Q4_K_M")}
    # ffn_down rows are 704 long: Q4_K -> Q5_0 and Q6_K -> Q8_0 (tensor_type_fallback)
    assert types["blk.1.ffn_down.weight"] is T.Q5_0
    assert types["blk.3.ffn_down.weight"] is T.Q8_0 and types["blk.2.ffn_down.weight"] is T.Q8_0
    assert types["blk.1.ffn_up.weight"] is T.Q4_K


def test_tied_embeddings_quantize_token_embd_like_output():
    shape = shape_from_config(
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        }
    )
    types = {t.name: ty for t, ty in assign_types(shape, "Q4_K_M")}
    assert "output.weight" not in types
    # 896 is not a multiple of 256: the output rule picks Q8_0 for the tied embedding
    assert types["token_embd.weight"] is T.Q8_0


def test_f16_keeps_norms_f32():
    types = {t.name: ty for t, ty in assign_types(_shape("qwen2.5-14b-instruct"), "F16")}
    assert types["output_norm.weight"] is T.F32 and types["output.weight"] is T.F16


def test_80_layer_models_get_llama_cpps_70b_attn_v_bump():
    """models/qwen2.cpp and models/llama.cpp (GQA) type 80-layer models LLM_TYPE_70B, and
    llama-quant.cpp then raises attn_v from Q3_K/Q4_K to Q5_K (8 heads share it)."""

    def attn_v(model_type, kv):
        shape = shape_from_config(
            {
                "model_type": model_type,
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": kv,
                "vocab_size": 128256,
            }
        )
        return {t.name: ty for t, ty in assign_types(shape, "Q3_K_M")}["blk.40.attn_v.weight"]

    assert attn_v("qwen2", 8) is T.Q5_K
    assert attn_v("llama", 8) is T.Q5_K
    assert attn_v("llama", 64) is T.Q4_K  # no GQA: llama.cpp calls it 65B, no bump


def test_ffn_width_not_divisible_by_256_falls_back_at_scale():
    """Qwen2.5-72B's intermediate_size 29568 is not a multiple of 256: its ffn_down rows fall
    back from Q4_K to Q5_0 and from Q6_K to Q8_0 in a Q4_K_M file."""
    shape = shape_from_config(
        {
            "model_type": "qwen2",
            "hidden_size": 8192,
            "intermediate_size": 29568,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
        }
    )
    types = {t.name: ty for t, ty in assign_types(shape, "Q4_K_M")}
    assert types["blk.0.ffn_down.weight"] is T.Q8_0 and types["blk.11.ffn_down.weight"] is T.Q5_0
    assert types["blk.11.ffn_up.weight"] is T.Q4_K


def test_gemma_ties_embeddings_when_the_config_does_not_say():
    """Gemma-2's published config.json has no tie_word_embeddings key; transformers'
    Gemma2Config defaults it to True, so there is no output.weight in the GGUF."""
    cfg = {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
    }
    assert shape_from_config(cfg).tie_word_embeddings
    assert not shape_from_config({**cfg, "model_type": "llama"}).tie_word_embeddings
