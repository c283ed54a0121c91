"""The recommendation's objective (playbooks/plan/objective.py): the best quality of at least
min_bpw bits per weight whose decode roofline reaches min_tok_s, the fastest without a speed
floor; quality ranked by KL divergence, measured before published before interpolated."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from playbooks.plan.objective import (
    CURVE_TYPES,
    MIN_BPW,
    PUBLISHED_KLD,
    Objective,
    curve_kld,
    published_bpw,
    published_kld,
)
from tests import llamacpp_tools


@dataclass(frozen=True)
class Q:
    quant: str
    bpw: float
    roofline_tok_s: float


def test_k_quants_outrank_legacy_quants_of_more_bits():
    """Q5_1 has more bits per weight than Q5_K_M, and diverges more (the issue's example)."""
    o = Objective(min_tok_s=30)
    q5_1, q5_k_m = Q("Q5_1", 6.02, 40), Q("Q5_K_M", 5.68, 40)
    assert o.pick([q5_1, q5_k_m]).candidate is q5_k_m
    assert o.pick([q5_k_m, q5_1]).candidate is q5_k_m
    assert o.quality("Q5_K_M", 5.68).kld < o.quality("Q5_1", 6.02).kld
    assert o.quality("Q4_K_M", 4.85).kld < o.quality("Q4_1", 5.04).kld < o.quality("Q3_K_M", 3.89).kld


def test_the_published_order_is_quantize_cpps_perplexity_order():
    """tools/quantize/quantize.cpp's help table (perplexity increase @ Llama-3-8B, no imatrix)
    and the perplexity README's KLD rank the types the same way."""
    ppl = {  # quantize.cpp QUANT_OPTIONS at 0c1e570
        "Q8_0": 0.0026,
        "Q6_K": 0.0217,
        "Q5_K_M": 0.0569,
        "Q5_K_S": 0.1049,
        "Q5_1": 0.1062,
        "Q5_0": 0.1316,
        "Q4_K_M": 0.1754,
        "Q4_K_S": 0.2689,
        "Q4_1": 0.4511,
        "Q4_0": 0.4685,
        "Q3_K_L": 0.5562,
        "Q3_K_M": 0.6569,
        "Q3_K_S": 1.6321,
        "Q2_K": 3.5199,
    }
    for imatrix in (False, True):
        by_kld = sorted(ppl, key=lambda q: published_kld(q, imatrix))
        assert by_kld == sorted(ppl, key=ppl.__getitem__), imatrix


@pytest.mark.slow
def test_the_transcribed_figures_are_the_pinned_trees():
    """Every figure of PUBLISHED_KLD is a row of tools/perplexity/README.md in the pinned tree
    (the "None" imatrix row and the "WT 10m" one), and quantize.cpp's table is where the
    module docstring says."""
    tree = llamacpp_tools.llamacpp_tree()
    text = (tree / "tools/perplexity/README.md").read_text()
    rows: dict[tuple[str, str], tuple[float, float]] = {}
    for m in re.finditer(r"^\| (\S+)\s+\| (None|WT 10m)\s+\|\s+([\d.]+) \|[^|]+\|[^|]+\| ([\d.]+) ±", text, re.M):
        rows[(m.group(1).upper(), m.group(2))] = (float(m.group(3)), float(m.group(4)))
    for quant, (size, plain, with_imatrix) in PUBLISHED_KLD.items():
        for imatrix, kld in (("None", plain), ("WT 10m", with_imatrix)):
            if kld is None:
                assert (quant, imatrix) not in rows, (quant, imatrix)
            else:
                assert rows[(quant, imatrix)] == (size, kld), (quant, imatrix)
    quantize = (tree / "tools/quantize/quantize.cpp").read_text()
    assert '{ "Q5_1",     LLAMA_FTYPE_MOSTLY_Q5_1,     " 5.65G, +0.1062 ppl @ Llama-3-8B",  },' in quantize
    assert '{ "Q5_K_M",   LLAMA_FTYPE_MOSTLY_Q5_K_M,   " 5.33G, +0.0569 ppl @ Llama-3-8B",  },' in quantize


def test_the_best_quality_that_reaches_the_speed_floor():
    o = Objective(min_bpw=3.3, min_tok_s=30)
    f16 = Q("F16", 16.0, 16)  # e.g. a MoE with most experts in host RAM: best quality, too slow
    q8 = Q("Q8_0", 8.5, 43)
    q4 = Q("Q4_K_M", 4.86, 188)
    pick = o.pick([f16, q8, q4])
    assert pick is not None and pick.candidate is q8 and pick.kind == "quality"
    assert pick.quality.source == "published" and pick.quality.kld == 0.001355
    # a lower floor lets F16 in; no floor at all: the fastest
    assert Objective(min_tok_s=10).pick([f16, q8, q4]).candidate is f16
    fastest = Objective(min_tok_s=None).pick([f16, q8, q4])
    assert fastest.candidate is q4 and fastest.kind == "fastest"


def test_none_reaches_the_speed_floor_the_fastest_is_picked_and_said_to_fall_short():
    slow = [Q("Q8_0", 8.5, 12), Q("Q4_K_M", 4.86, 25), Q("Q2_K", 3.0, 40)]
    pick = Objective(min_bpw=3.3, min_tok_s=30).pick(slow)
    assert pick is not None and pick.candidate.quant == "Q4_K_M" and pick.kind == "below_speed_floor"


def test_the_quality_floor_filters_first():
    assert Objective(min_bpw=3.3).pick([Q("Q2_K", 3.01, 75), Q("EXL2-3.0", 3.0, 73)]) is None
    assert (
        Objective(min_bpw=3.3, min_tok_s=None).pick([Q("Q2_K", 3.01, 75), Q("EXL2-3.3", 3.3, 67)]).candidate.bpw == 3.3
    )


def test_a_measured_divergence_ranks_before_the_published_one():
    """The quantize step measured this model's Q4_K_M against its own F16: that figure, not
    Llama-3-8B's, places it (here better than the published Q6_K)."""
    cands = [Q("Q6_K", 6.56, 40), Q("Q4_K_M", 4.85, 50)]
    assert Objective().pick(cands).candidate.quant == "Q6_K"
    measured = Objective(measured_kld={"Q4_K_M": 0.004})
    pick = measured.pick(cands)
    assert pick.candidate.quant == "Q4_K_M" and pick.quality.source == "measured" and pick.quality.kld == 0.004
    # not a number (a failed measurement) is no measurement
    assert Objective(measured_kld={"Q4_K_M": float("nan")}).quality("Q4_K_M", 4.85).source == "published"


def test_exl2_is_placed_on_the_k_quant_curve_by_bits_per_weight():
    for q in CURVE_TYPES:
        assert curve_kld(published_bpw(q)) == pytest.approx(published_kld(q))
    rates = [2.5, 3.0, 3.3, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0]
    klds = [Objective().quality(f"EXL2-{b}", b) for b in rates]
    assert all(k.source == "interpolated" for k in klds)
    assert all(a.kld > b.kld for a, b in zip(klds, klds[1:], strict=False))  # more bits, less divergence
    # EXL2 4.0 sits between Q3_K_M (4.00 bpw on Llama-3-8B) and Q3_K_L
    assert published_kld("Q3_K_L") < Objective().quality("EXL2-4.0", 4.0).kld <= published_kld("Q3_K_M") * 1.01


def test_mxfp4_moe_is_ranked_as_stated():
    assert Objective(mxfp4_experts=True).quality("MXFP4_MOE", 4.3).kld == published_kld("Q8_0")
    assert Objective().quality("MXFP4_MOE", 4.3).kld == published_kld("Q4_0")
    assert Objective().quality("BF16", 16).kld == published_kld("F16")


def test_the_default_quality_floor():
    assert Objective().min_bpw == MIN_BPW == 3.3
