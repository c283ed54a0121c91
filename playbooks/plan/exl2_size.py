"""Predicted EXL2 size at a bits-per-weight target.

ExLlamaV2's converter (convert.py -b BPW -hb HEAD_BITS) spends BPW bits per weight on
average over the decoder's linear layers - scales and group overhead included, since the
target is measured on the stored tensors - and HEAD_BITS options on lm_head, whose stored
rate is set by qparams_headoptions (conversion/qparams.py, 0.3.2): 6 -> 15% of rows at 8
bits and 85% at 6, groups of 128 with 4-bit scales. Embeddings and norms stay FP16.

At run time ExLlamaV2 keeps the embedding table in system RAM (model.py set_device_map,
embed_cpu=True), so it does not count against VRAM, and a decoded token does not stream it.
"""

from __future__ import annotations

from dataclasses import dataclass

from playbooks.plan.tensors import Cat, model_tensors
from playbooks.plan.model_config import ModelShape

EXL2_BPW_LADDER = (2.5, 3.0, 3.3, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0)
EXL2_BPW_RANGE = (2.0, 8.0)

# head bits option -> (fractions of rows, bits, group size): qparams_headoptions
_HEAD_OPTIONS = {
    2: ((0.3, 4), (0.7, 2), 32),
    3: ((0.15, 4), (0.85, 3), 32),
    4: ((0.15, 6), (0.85, 4), 32),
    5: ((0.15, 6), (0.85, 5), 128),
    6: ((0.15, 8), (0.85, 6), 128),
    8: ((1.0, 8), (0.0, 0), 128),
}
HEAD_BITS_OPTIONS = tuple(_HEAD_OPTIONS)


def exl2_quant_name(bpw: float) -> str:
    """'EXL2-4.0', 'EXL2-3.3', 'EXL2-2.25': at least one decimal, as EXL2 repos name them."""
    text = f"{bpw:.1f}" if round(bpw, 1) == bpw else f"{bpw:g}"
    return f"EXL2-{text}"


def head_bits_per_weight(head_bits: int) -> float:
    (f1, b1), (f2, b2), group = _HEAD_OPTIONS[head_bits]
    return f1 * b1 + f2 * b2 + 4 / group  # 4-bit scale per group


@dataclass(frozen=True)
class Exl2Estimate:
    bpw: float
    head_bits: int
    linear_bytes: int
    head_bytes: int
    embed_bytes: int
    norm_bytes: int

    @property
    def file_bytes(self) -> int:
        return self.linear_bytes + self.head_bytes + self.embed_bytes + self.norm_bytes

    @property
    def gpu_weight_bytes(self) -> int:
        return self.linear_bytes + self.head_bytes + self.norm_bytes

    @property
    def streamed_bytes_per_token(self) -> int:
        return self.gpu_weight_bytes


def estimate_exl2(shape: ModelShape, bpw: float, head_bits: int = 6) -> Exl2Estimate:
    linear = head = embed = norms = 0
    for t in model_tensors(shape):
        if t.cat is Cat.TOKEN_EMBD:
            embed += t.n_elements
        elif t.cat is Cat.OUTPUT:
            head += t.n_elements
        elif t.cat is Cat.OTHER:
            norms += t.n_elements
        else:
            linear += t.n_elements
    if shape.tie_word_embeddings:
        # the converter writes a separate quantized lm_head for tied models
        head = shape.vocab_size * shape.hidden_size
    return Exl2Estimate(
        bpw=bpw,
        head_bits=head_bits,
        linear_bytes=int(linear * bpw / 8),
        head_bytes=int(head * head_bits_per_weight(head_bits) / 8),
        embed_bytes=embed * 2,
        norm_bytes=norms * 2,
    )
