"""EXL2 sizes and ExLlamaV2's VRAM. No published EXL2 *file* sizes were found for the models in
recipes/models/ (tests/data/published_exl2_sizes.yaml says why); what was found is a model card's
VRAM table (gemma-2-9b-it at 4k, 16k and 32k tokens). Its steps between bpw branches check the
part of the estimate that scales with bpw; its absolute values check the planner's whole
ExLlamaV2 budget. The budget's terms are also checked one by one against hand calculations from
exllamav2 0.3.2's source, so that changing any of them fails a test.

Provenance of the over-bound (OVER_BOUND, 0.6 GiB): set after observing +0.03..+0.50 GiB against
this one card (bartowski/gemma-2-9b-it-exl2), whose branches were made with an older ExLlamaV2
(v0.1.7, per the card); no second model or ExLlamaV2 version was available to hold it out on."""

from pathlib import Path

import pytest
import yaml

from playbooks.plan.engine_exllamav2 import exl2_compute_bytes
from playbooks.plan.evaluate import evaluate
from playbooks.plan.exl2_size import (
    estimate_exl2,
    exl2_attention_bytes,
    exl2_scratch_bytes,
    head_bits_per_weight,
)
from playbooks.plan.gpus import GIB, MIB, get_gpu
from playbooks.plan.kv_cache import exl2_kv_bytes_per_token
from playbooks.plan.model_config import load_config_file
from playbooks.plan.serving import Serving
from tests.helpers import ROOT

ROWS = yaml.safe_load((Path(__file__).parent / "data/published_exl2_sizes.yaml").read_text())
CONTEXT = {"vram_4k_context": 4096, "vram_16k_context": 16384, "vram_32k_context": 32768}
GEMMA = load_config_file(ROOT / "recipes/models/gemma-2-9b-it.config.json")
MISTRAL = load_config_file(ROOT / "recipes/models/mistral-7b-instruct-v0.3.config.json")


def _shape(model):
    return load_config_file(ROOT / "recipes/models" / f"{model}.config.json")


def test_head_rate_matches_what_exllamav2_states():
    # turboderp (exllamav2 issue #3): a 6-bit head is stored at about 6.3 bits per weight
    assert head_bits_per_weight(6) == pytest.approx(6.33, abs=0.01)


def test_bpw_steps_match_a_published_vram_table():
    # 4k column only: the 32k column's 4_25 -> 3_5 step (0.4) contradicts the same step at 4k and
    # 16k (0.8), one of the card's own inconsistencies (see the yaml). The steps are read as 1e9
    # bytes, the reading they fit (the yaml explains why the absolute test reads 2^30).
    rows = [r for r in ROWS if r["quantity"] == "vram_4k_context"]
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    assert by_model, "no rows to check"
    for model, rs in by_model.items():
        shape = _shape(model)
        rs.sort(key=lambda r: -r["bpw"])
        for hi, lo in zip(rs, rs[1:], strict=False):
            published = (hi["size"] - lo["size"]) * 1e9
            predicted = (
                estimate_exl2(shape, hi["bpw"], hi["head_bits"] or 6).gpu_weight_bytes
                - estimate_exl2(shape, lo["bpw"], lo["head_bits"] or 6).gpu_weight_bytes
            )
            # the card rounds to 0.1 GB: each difference carries up to 0.1 GB of rounding
            assert abs(predicted - published) <= 0.1e9, (model, hi["bpw"], lo["bpw"], predicted, published)


def test_gemma2_weights_on_the_gpu_by_hand():
    # gemma-2-9b-it (recipes/models): hidden 3584, 16 x 256 query dims, 8 x 256 KV dims,
    # FFN 14336, 42 layers, vocab 256000, tied embeddings.
    linear_per_layer = (
        3584 * 4096  # q_proj
        + 2 * 3584 * 2048  # k_proj, v_proj
        + 4096 * 3584  # o_proj
        + 3 * 3584 * 14336  # gate_proj, up_proj, down_proj
    )
    linear = 42 * linear_per_layer * 4.0 / 8  # -b 4.0 over the decoder's linear layers
    # The converter writes a quantized lm_head even though Gemma ties it to the embeddings
    # (conversion/compile.py: get_q_module(job, module) for "lm_head"); the loader finds
    # "lm_head.q_weight" before its alt key model.embed_tokens (module.py load_weight).
    # -hb 6: 15% of rows at 8 bits, 85% at 6, a 4-bit scale per 128-row group (qparams.py).
    head = 256000 * 3584 * (0.15 * 8 + 0.85 * 6 + 4 / 128) / 8
    # FP16 norms: input, post-attention, pre-FFN, post-FFN per layer (architecture.py,
    # layer_keys_gemma2_norms) and the final norm.
    norms = (4 * 42 + 1) * 3584 * 2
    # The embedding table stays in host RAM (model.py set_device_map, embed_cpu=True).
    e = estimate_exl2(GEMMA, 4.0, 6)
    assert e.gpu_weight_bytes == int(linear) + int(head) + norms == 4_889_127_936
    assert e.embed_bytes == 256000 * 3584 * 2


def test_exllamav2_buffers_by_hand():
    """Gemma-2 9B, max_seq_len 4096, batch 1, ExLlamaV2's defaults max_input_len 2048,
    max_attention_size 2048^2, max_dq_size 512 Mi elements (config.py), no flash-attn (V100)."""
    rope = 2 * 4096 * 256 * 2  # sin and cos, FP16, max_seq_len x head_dim (device.py prepare_sincos)
    state = 2048 * 3584 * 2  # model.py set_device_map: state_size
    mask = 2048 * 2048 * 2  # model.py set_device_map: mask_size
    # The scratch ExLlamaV2 allocates at load: the largest scratch_space_fixed() of any module.
    head_dq = 2 * 512 * 1024**2  # lm_head: 3584 x 256000 FP16 dequant buffer, capped at max_dq_size
    mlp_fixed = (2048 * 3584 * 2 + 128) + 2 * (2048 * 14336 * 2 + 128) + 2 * 3584 * 14336
    attn_fixed = (2048 * 4096 * 2 + 128) + 2 * 3584 * 4096
    assert head_dq > mlp_fixed > attn_fixed
    scratch = head_dq
    # Attention's per-forward working set outside the scratch (attn.py temp_q/k/v, temp_kv for
    # repeat_kv over 4096 tokens x 16 heads, temp_attn_size: 2 x 2048^2 weights x 16 heads).
    attention = (
        (2048 * 4096 * 2 + 128)
        + 2 * (2048 * 2048 * 2 + 128)
        + (2 * 4096 * 16 * 256 * 2 + 128)
        + (2 * 2048**2 * 16 * 2 + 128)
    )
    logits = 256000 * 4  # the last token's logits, FP32
    assert exl2_scratch_bytes(GEMMA) == scratch
    assert exl2_attention_bytes(GEMMA, 4096) == attention
    assert exl2_compute_bytes(GEMMA, 4096) == rope + state + mask + scratch + attention + logits == 1_471_128_192


def test_scratch_is_the_largest_module_by_hand():
    # MLP decides: Mistral 7B at batch 2 (4096 rows) outgrows its head's 4096 x 32768 buffer
    mlp = (4096 * 4096 * 2 + 128) + 2 * (4096 * 14336 * 2 + 128) + 2 * 4096 * 14336
    assert mlp > 2 * 4096 * 32768
    assert exl2_scratch_bytes(MISTRAL, batch=2) == mlp
    # The head decides below the cap, over its vocabulary padded to 32 rows (linear.py padding)
    odd_vocab = MISTRAL.model_copy(update={"vocab_size": 32001})
    assert exl2_scratch_bytes(odd_vocab) == 2 * 4096 * 32032
    # Attention decides: a narrow model with wide attention (hidden 1024, 32 x 256 query dims)
    wide_attn = GEMMA.model_copy(
        update={
            "hidden_size": 1024,
            "intermediate_size": 1024,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 1000,
        }
    )
    assert exl2_scratch_bytes(wide_attn) == (2048 * 8192 * 2 + 128) + 2 * 1024 * 8192


def test_attention_working_set_by_hand():
    # Without GQA repeat_kv copies nothing; a short context caps the attention matrix at ctx^2.
    mha = MISTRAL.model_copy(update={"num_key_value_heads": 32})
    q = k = v = 2048 * 4096 * 2 + 128
    assert exl2_attention_bytes(mha, 1024) == q + k + v + (2 * 1024**2 * 32 * 2 + 128)
    # Batch multiplies the projections and the expanded KV, not the attention matrix.
    assert exl2_attention_bytes(MISTRAL, 8192, batch=2) == (
        (4096 * 4096 * 2 + 128)
        + 2 * (4096 * 1024 * 2 + 128)
        + (2 * 8192 * 2 * 32 * 128 * 2 + 128)
        + (2 * 2048**2 * 32 * 2 + 128)
    )


def test_card_figures_are_binary_units():
    # From 4k to 32k tokens ExLlamaV2's FP16 cache alone grows by 28,672 x 344,064 bytes. The
    # card's growth read as 1e9 bytes is smaller than that in all five branches (in four of them
    # even with 0.1 of rounding added; 3_5 carries the card's outlier step), so its "GB" cannot
    # be 1e9 bytes; read as 2^30 it covers the cache in all five.
    cache_growth = (32768 - 4096) * exl2_kv_bytes_per_token(GEMMA, "FP16")
    at = {(r["bpw"], r["quantity"]): r["size"] for r in ROWS if r["model"] == "gemma-2-9b-it"}
    growth = {b: at[b, "vram_32k_context"] - at[b, "vram_4k_context"] for b, _ in at}
    assert len(growth) == 5
    assert all(g * 1e9 < cache_growth <= g * GIB for g in growth.values()), growth
    assert sorted(b for b, g in growth.items() if (g + 0.1) * 1e9 < cache_growth) == [4.25, 5.0, 6.5, 8.0]


# Over-prediction allowed, under-prediction not. The card is read in GiB (the yaml says why), the
# larger of the two binary readings, so a plan that is not below it is not below either. Above it
# the planner may be by at most 0.6 GiB: its 256 MiB margin plus what a V100 allocates and a
# flash-attn run (as the card's author probably had) does not, at the card's main context of 4k:
# temp_kv 64 MiB and 256 MiB of attention weights against 24 MiB (attn.py temp_attn_size with
# flash-attn): 552 MiB = 0.54 GiB, rounded up. At 16k and 32k temp_kv is larger (256, 512 MiB),
# yet the card grows a little faster than the cache there (yaml), and the 4k bound still holds.
# Observed: +0.03 GiB (8_0 at 4k) to +0.50 GiB (5_0 at 32k).
# Provenance: this bound was set AFTER seeing those +0.03..+0.50 GiB, on ONE model card
# (bartowski/gemma-2-9b-it-exl2, 15 figures: 5 branches x 4k/16k/32k), whose files were made with
# ExLlamaV2 v0.1.7 (per the card), older than the 0.3.2 whose source the estimate reads, by a method
# the card does not state. It is a bound fitted to that card, not a held-out check.
OVER_BOUND = 0.6 * GIB


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['model']}-{r['bpw']}-{r['quantity']}")
def test_planned_vram_is_not_below_the_card(row):
    """The planner is never below the card and at most OVER_BOUND (0.6 GiB) above it. That bound
    was chosen after observing +0.03..+0.50 GiB on this same card (bartowski/gemma-2-9b-it-exl2,
    quantized with ExLlamaV2 v0.1.7, older than the 0.3.2 the estimate is read from): it shows
    the budget is consistent with one card, not that it holds on other models or versions."""
    shape = _shape(row["model"])
    s = Serving(
        backend="exllamav2",
        context=CONTEXT[row["quantity"]],
        cache_k="FP16",
        cache_v="FP16",
        head_bits=row["head_bits"] or 6,
    )
    o = evaluate(shape, f"EXL2-{row['bpw']}", get_gpu("a100-80gb"), s)
    assert o.overhead_bytes == (400 + 256) * MIB  # the CUDA context and margin the bound is about
    over = o.vram_bytes - row["size"] * GIB
    assert 0 <= over <= OVER_BOUND, (row["bpw"], row["quantity"], over / GIB)
