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


def test_tied_embeddings_get_a_separate_quantized_head():
    shape = load_config_file(ROOT / "recipes/models/gemma-2-9b-it.config.json")
    e = estimate_exl2(shape, 4.0)
    assert e.head_bytes > 0 and e.embed_bytes == 256000 * 3584 * 2
    assert e.gpu_weight_bytes == e.file_bytes - e.embed_bytes  # embeddings stay in host RAM
