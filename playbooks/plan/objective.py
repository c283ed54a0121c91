"""What "the best configuration" means: one objective, shared by the planner's recommendation
and by a tuner that searches the same space.

Pure: candidates in (a quant, its bits per weight, its single-stream decode roofline), one pick out.

The objective, in one sentence: among the candidates that fit and are of at least `min_bpw` bits
per weight (the quality floor), the best quality whose decode roofline reaches `min_tok_s` (the
speed floor); with no speed floor, the fastest. When no candidate reaches the speed floor, the
fastest is picked and said to fall short. A MoE quant with experts in host RAM is judged by its
two-sided roofline like any other: offloading cannot buy quality below the speed floor.

Quality is ranked by expected divergence from the full-precision model (mean KL divergence of
the token distributions, lower is better), not by bits per weight: K-quants are better per bit
than the legacy _0/_1 quants (Q5_K_M beats Q5_1 at fewer bits). In order of precedence:

1. measured: the mean KLD a host's quantize step measured for this model against its own F16
   file (the artifacts' manifests: verification.kld.mean_kld); a plan without a host has none;
2. published: llama.cpp's own table for Llama-3-8B (tools/perplexity/README.md at the pinned
   ref 0c1e570, "LLaMA 3 quantization", CUDA on an RTX 4090, sorted by KLD against FP16), with
   the imatrix rows ("WT 10m") where the table has them, since voltaforge quantizes with an
   imatrix (planner.imatrix). Its order is the order of tools/quantize/quantize.cpp's help
   table (perplexity increase @ Llama-3-8B: Q8_0 +0.0026 ... Q5_K_M +0.0569, Q5_1 +0.1062 ...
   Q2_K +3.5199), which has no figure for IQ4_NL/IQ4_XS; the perplexity table does;
3. interpolated: an EXL2 rate has no figure on llama.cpp's scale, so it is placed on the same
   table's curve of KLD against bits per weight (log-linear between the neighbouring K-quants,
   Q8_0 and F16; extended from the last two below Q2_K): an assumption that ExLlamaV2 is as good
   per bit as a K-quant;
4. assumed: MXFP4_MOE has no published figure. For gpt-oss its experts are the checkpoint's own
   MXFP4 and everything else Q8_0, so it ranks as Q8_0; for any other MoE it ranks as Q4_0
   (MXFP4 is a 32-value block of 4-bit values with one shared power-of-two scale, Q4_0's shape
   with a coarser scale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from playbooks.plan.engines import engine_of_quant

#: the quality floor in bits per weight (recipes/defaults.yaml planner.min_bpw): the smallest
#: rate the seed report served (EXL2 3.3 bpw); below ~3 bpw 14-32B models degrade quickly
MIN_BPW = 3.3
#: the speed floor, a single-stream decode roofline in tok/s (planner.min_tok_s): a ceiling, so
#: about 55-77% of it is what llama.cpp measures on a V100 (knowledge.md section 1): ~20 tok/s,
#: faster than one reads
MIN_TOK_S = 30.0

#: Llama-3-8B's parameters: the published table gives sizes in GiB, its bits per weight follow
LLAMA3_8B_PARAMS = 8_030_261_248

#: llama.cpp 0c1e570 tools/perplexity/README.md, Llama-3-8B: file type -> (model size GiB,
#: mean KLD without an imatrix, mean KLD with the "WT 10m" imatrix). None: no such row.
PUBLISHED_KLD: dict[str, tuple[float, float | None, float | None]] = {
    "F16": (14.97, 0.000551, None),
    "Q8_0": (7.96, 0.001355, None),
    "Q6_K": (6.14, 0.005452, None),
    "Q5_K_M": (5.33, 0.010762, None),
    "Q5_K_S": (5.21, 0.016595, None),
    "Q5_1": (5.65, 0.018045, None),
    "Q5_0": (5.21, 0.022239, None),
    "Q4_K_M": (4.58, 0.031273, 0.028152),
    "Q4_K_S": (4.37, 0.043136, 0.031951),
    "IQ4_NL": (4.35, None, 0.035742),
    "IQ4_XS": (4.14, None, 0.036334),
    "Q4_1": (4.78, 0.071683, None),
    "Q4_0": (4.34, 0.071940, None),
    "Q3_K_L": (4.03, 0.087176, 0.073077),
    "Q3_K_M": (3.74, 0.101913, 0.084358),
    "Q3_K_S": (3.41, 0.228217, 0.199821),
    "Q2_K": (2.96, 0.445132, 0.332223),
}
#: the curve an EXL2 rate is placed on: the K-quants, Q8_0 and F16, by bits per weight
CURVE_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16")

Source = Literal["measured", "published", "interpolated", "assumed"]
Kind = Literal["quality", "fastest", "below_speed_floor"]


@dataclass(frozen=True)
class Quality:
    kld: float  # mean KL divergence from the full-precision model: lower is better
    source: Source

    def text(self) -> str:
        return f"KL divergence {self.kld:.4f}, {self.source}"


class Candidate(Protocol):
    @property
    def quant(self) -> str: ...
    @property
    def bpw(self) -> float: ...
    @property
    def roofline_tok_s(self) -> float: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class Pick(Generic[C]):
    candidate: C
    kind: Kind  # quality: the best quality at the speed floor; fastest: no speed floor;
    # below_speed_floor: none reaches it, this is the fastest
    quality: Quality


def published_kld(quant: str, imatrix: bool = True) -> float | None:
    """The published mean KLD of a GGUF file type (BF16 as F16: both keep every weight's 16
    bits, the converter's output), or None."""
    row = PUBLISHED_KLD.get("F16" if quant == "BF16" else quant)
    if row is None:
        return None
    _, plain, with_imatrix = row
    return (with_imatrix if imatrix else plain) or plain or with_imatrix


def published_bpw(quant: str) -> float:
    """Bits per weight of the published Llama-3-8B file of this type (its size over its parameters)."""
    return PUBLISHED_KLD[quant][0] * 2**30 * 8 / LLAMA3_8B_PARAMS


def curve_kld(bpw: float, imatrix: bool = True) -> float:
    """KLD at `bpw` on the published curve, log-linear between neighbours (extended past the ends)."""
    points = sorted((published_bpw(q), math.log(published_kld(q, imatrix) or math.nan)) for q in CURVE_TYPES)
    # the segment holding bpw: the first whose right end is above it (the first or last segment outside)
    i = next((k for k in range(1, len(points) - 1) if bpw < points[k][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return math.exp(y0 + (y1 - y0) * (bpw - x0) / (x1 - x0))


@dataclass(frozen=True)
class Objective:
    """The best quality at or above both floors; see the module's docstring."""

    min_bpw: float = MIN_BPW
    min_tok_s: float | None = MIN_TOK_S  # None: no speed floor, the fastest wins
    measured_kld: Mapping[str, float] = field(default_factory=dict)  # quant -> mean KLD on this model
    imatrix: bool = True
    mxfp4_experts: bool = False  # the model's checkpoint ships its experts in MXFP4 (gpt-oss)

    def quality(self, quant: str, bpw: float) -> Quality:
        measured = self.measured_kld.get(quant)
        if measured is not None and math.isfinite(measured):
            return Quality(measured, "measured")
        if quant == "MXFP4_MOE":
            return Quality(published_kld("Q8_0" if self.mxfp4_experts else "Q4_0", self.imatrix) or 0, "assumed")
        if engine_of_quant(quant).continuous_rate:
            return Quality(curve_kld(bpw, self.imatrix), "interpolated")
        kld = published_kld(quant, self.imatrix)
        if kld is None:
            raise ValueError(f"{quant}: no quality figure to rank it by")
        return Quality(kld, "published")

    def pick(self, candidates: Sequence[C]) -> Pick[C] | None:
        """The candidate the objective prefers among `candidates` (all of which fit); None when
        none is of at least min_bpw bits per weight."""
        good = [c for c in candidates if c.bpw >= self.min_bpw]
        if not good:
            return None
        q = {id(c): self.quality(c.quant, c.bpw) for c in good}
        fastest = max(good, key=lambda c: (c.roofline_tok_s, -q[id(c)].kld))
        if self.min_tok_s is None:
            return Pick(fastest, "fastest", q[id(fastest)])
        fast = [c for c in good if c.roofline_tok_s >= self.min_tok_s]
        if not fast:
            return Pick(fastest, "below_speed_floor", q[id(fastest)])
        best = min(fast, key=lambda c: (q[id(c)].kld, -c.roofline_tok_s))
        return Pick(best, "quality", q[id(best)])
