"""EXL2 sizes. No published EXL2 *file* sizes were found for the models in recipes/models/
(tests/data/published_exl2_sizes.yaml says why); what was found is a model card's VRAM table,
whose steps between bpw branches check the part of the estimate that scales with bpw."""

from pathlib import Path

import pytest
import yaml

from playbooks.plan.exl2_size import estimate_exl2, head_bits_per_weight
from playbooks.plan.model_config import load_config_file
from tests.helpers import ROOT

ROWS = yaml.safe_load((Path(__file__).parent / "data/published_exl2_sizes.yaml").read_text())


def test_head_rate_matches_what_exllamav2_states():
    # turboderp (exllamav2 issue #3): a 6-bit head is stored at about 6.3 bits per weight
    assert head_bits_per_weight(6) == pytest.approx(6.33, abs=0.01)


def test_bpw_steps_match_a_published_vram_table():
    rows = [r for r in ROWS if r["quantity"] == "vram_4k_context"]
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    assert by_model, "no rows to check"
    for model, rs in by_model.items():
        shape = load_config_file(ROOT / "recipes/models" / f"{model}.config.json")
        rs.sort(key=lambda r: -r["bpw"])
        for hi, lo in zip(rs, rs[1:]):
            published = (hi["size"] - lo["size"]) * 1e9
            predicted = (estimate_exl2(shape, hi["bpw"], hi["head_bits"] or 6).gpu_weight_bytes
                         - estimate_exl2(shape, lo["bpw"], lo["head_bits"] or 6).gpu_weight_bytes)
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
    e = estimate_exl2(load_config_file(ROOT / "recipes/models/gemma-2-9b-it.config.json"), 4.0, 6)
    assert e.gpu_weight_bytes == int(linear) + int(head) + norms == 4_889_127_936
    assert e.embed_bytes == 256000 * 3584 * 2
