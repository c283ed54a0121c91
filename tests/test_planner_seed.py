"""The seed report's own arithmetic, reproduced exactly (docs/knowledge.md, section 1)."""

from fractions import Fraction

import pytest

from playbooks.plan.evaluate import evaluate
from playbooks.plan.gpus import MIB, get_gpu
from playbooks.plan.kv_cache import exl2_kv_bytes_per_token, kv_bytes_per_token, llamacpp_kv_bytes_per_token
from playbooks.plan.model_config import load_config_file
from playbooks.plan.roofline import mbu, roofline_tok_s
from playbooks.plan.serving import Serving
from tests.helpers import ROOT

SEED = ROOT / "recipes/models/seed-stated-shape.config.json"


@pytest.fixture(scope="module")
def seed():
    return load_config_file(SEED)


def test_seed_shape_is_what_the_seed_states(seed):
    assert (seed.num_hidden_layers, seed.num_key_value_heads, seed.head_dim) == (64, 4, 128)


def test_seed_kv_bytes_per_token_fp16(seed):
    assert kv_bytes_per_token(seed, Fraction(2)) == 131_072
    assert llamacpp_kv_bytes_per_token(seed, "f16") == 131_072
    assert exl2_kv_bytes_per_token(seed, "FP16") == 131_072


@pytest.mark.parametrize("ctx,mib", [(2048, 256), (4096, 512), (8192, 1024), (32768, 4096)])
def test_seed_kv_totals(seed, ctx, mib):
    assert llamacpp_kv_bytes_per_token(seed) * ctx == mib * MIB


def test_q8_0_cache_is_34_bytes_per_32_values(seed):
    # "q8_0 cache halves it": 34/32 bytes instead of 2 per value, exactly
    assert llamacpp_kv_bytes_per_token(seed, "q8_0") == 131_072 * 34 // 64


@pytest.mark.parametrize("gb,tok_s", [(15.5, 58), (16.3, 55), (13.9, 65)])
def test_seed_rooflines(gb, tok_s):
    assert round(roofline_tok_s(900, gb * 1e9)) == tok_s


def test_mbu_of_a_measured_run():
    """docs/knowledge.md section 8, measured on this kind of machine: llama-bench tg128 on the f16
    tiny model (a 1.57 GB file) ran 13.4 tok/s, "21 GB/s (~59% of a numpy-copy 35.9 GB/s)"."""
    assert round(mbu(13.4, 1.57e9, 35.9), 2) == 0.59


def test_declared_head_dim_wins_over_hidden_over_heads():
    from playbooks.plan.model_config import shape_from_config

    # Gemma-2-27B: hidden 4608 / 32 heads would be 144, but it declares head_dim 128
    shape = shape_from_config(
        {
            "model_type": "gemma2",
            "hidden_size": 4608,
            "intermediate_size": 36864,
            "num_hidden_layers": 46,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
        }
    )
    assert shape.head_dim == 128
    assert llamacpp_kv_bytes_per_token(shape) == 2 * 46 * 16 * 128 * 2


def test_budget_parts_the_seed_states(seed):
    o = evaluate(seed, "Q4_K_M", get_gpu("v100-16gb"), Serving(context=4096))
    assert o.kv_bytes == 512 * MIB  # the seed: 4096 tokens of FP16 cache = 512 MiB
    assert o.overhead_bytes == (400 + 256) * MIB


def test_llamacpp_pads_the_context_to_256_cells(seed):
    from playbooks.plan.kv_cache import llamacpp_kv_bytes

    assert llamacpp_kv_bytes(seed, 4000) == llamacpp_kv_bytes(seed, 4096) == 512 * MIB


def test_gemma2_sliding_window_layers_hold_only_the_window():
    """llama.cpp (models/gemma2.cpp, llama-kv-cache-iswa.cpp): every even layer of Gemma 2 is
    a sliding-window layer holding min(n_ctx, 4096 + n_ubatch) cells, padded to 256."""
    from playbooks.plan.kv_cache import llamacpp_kv_bytes, llamacpp_kv_cells
    from playbooks.plan.model_config import load_config_file
    from tests.helpers import ROOT

    g = load_config_file(ROOT / "recipes/models/gemma-2-27b-it.config.json")
    assert (g.sliding_window, g.swa_layers) == (4096, 23)
    assert llamacpp_kv_cells(g, 8192) == (8192, 4608)
    per_layer_token = 2 * 16 * 128 * 2
    assert llamacpp_kv_bytes(g, 8192) == per_layer_token * (23 * 8192 + 23 * 4608)
    # below the window every layer holds the whole context
    assert llamacpp_kv_bytes(g, 2048) == per_layer_token * 46 * 2048


def test_a_draft_model_costs_its_weights_its_own_cache_and_its_own_compute_buffer(seed):
    """Qwen2.5-0.5B as a Q8_0 draft, by hand (Q8_0: 34 bytes per 32 weights; F32 norms and
    biases; tied embeddings, so llama.cpp loads token_embd a second time as the output layer
    on the GPU - llama-model-loader.cpp buft_for_tensor, TENSOR_DUPLICATED). llama-server gives
    the draft a context of its own (common/speculative.cpp at 0c1e570): the target's n_ctx, the
    same -ub, -fa and slots, so it reserves the compute buffer the draft model would reserve
    served alone at that context."""
    from playbooks.plan.model_config import shape_from_config
    from playbooks.plan.serving import DraftPlan

    draft = shape_from_config(
        {  # Qwen2.5-0.5B's config.json
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 152064,
            "tie_word_embeddings": True,
        }
    )
    per_layer = 896 * 896 + 896 * 128 + 896 * 128 + 896 * 896 + 3 * 896 * 4864  # q, k, v, o, gate/up/down
    linear = 24 * per_layer * 34 // 32  # 380,190,720 B
    small = (24 * (896 + 896 + 896 + 128 + 128) + 896) * 4  # norms + qkv biases, F32
    tied_output = 152064 * 896 * 34 // 32  # 144,764,928 B
    kv = 24 * 2 * 2 * 64 * 2 * 4096  # f16 K and V, 4096 cells
    gpu, s = get_gpu("v100-16gb"), Serving(context=4096)
    alone = evaluate(seed, "Q4_K_M", gpu, s)
    paired = evaluate(seed, "Q4_K_M", gpu, s, DraftPlan(draft, "Q8_0"))
    served_alone = evaluate(draft, "Q8_0", gpu, s)
    assert paired.draft_kv_bytes == kv == served_alone.kv_bytes
    assert paired.draft_compute_bytes == served_alone.compute_bytes > 0
    weights = linear + small + tied_output
    assert weights == served_alone.gpu_weights_bytes == 525_241_856
    assert paired.draft_bytes == weights + kv + paired.draft_compute_bytes
    assert paired.vram_bytes - alone.vram_bytes == paired.draft_bytes
    assert paired.max_ctx <= alone.max_ctx  # both may reach the model maximum (32768)


def test_an_exl2_recipes_cache_translated_for_llamacpp_turns_its_flash_attention_on():
    """EXL2 recipes say flash_attn: false (the flash-attn library has no sm_70 build); the same
    Q8 cache in llama.cpp is q8_0, which llama.cpp only allows with its own FA kernels."""
    from playbooks.plan.engine_llamacpp import llamacpp_compute_buffer_bytes
    from playbooks.plan.serving import serving_for

    s = serving_for("Q4_K_M", Serving(backend="exllamav2", cache_k="Q8", cache_v="Q8", flash_attn=False))
    assert (s.backend, s.cache_k, s.cache_v, s.flash_attn) == ("llamacpp", "q8_0", "q8_0", True)
    s = serving_for("Q4_K_M", Serving(backend="exllamav2", cache_k="FP16", cache_v="FP16", flash_attn=False))
    assert (s.cache_v, s.flash_attn) == ("f16", False)
    with pytest.raises(ValueError, match="needs flash attention for a quantized V cache"):
        llamacpp_compute_buffer_bytes(load_config_file(SEED), 4096, 512, False, cache_k="q8_0", cache_v="q8_0")
