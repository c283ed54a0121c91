"""Predicted EXL2 size at a bits-per-weight target.

ExLlamaV2's converter (convert.py -b BPW -hb HEAD_BITS) spends BPW bits per weight on
average over the decoder's linear layers - scales and group overhead included, since the
target is measured on the stored tensors - and HEAD_BITS options on lm_head, whose stored
rate is set by qparams_headoptions (conversion/qparams.py, 0.3.2): 6 -> 15% of rows at 8
bits and 85% at 6, groups of 128 with 4-bit scales. Embeddings and norms stay FP16.

At run time ExLlamaV2 keeps the embedding table in system RAM (model.py set_device_map,
embed_cpu=True), so it does not count against VRAM, and a decoded token does not stream it.

Besides weights and cache ExLlamaV2 holds a scratch tensor from load on (exl2_scratch_bytes;
the head's 1 GiB dequant buffer for most models) and allocates attention's working set per
forward (exl2_attention_bytes); planner.exl2_compute_bytes adds them up.

What checks the whole budget: one model card's VRAM table (bartowski/gemma-2-9b-it-exl2, made
with ExLlamaV2 v0.1.7, older than the 0.3.2 read here). tests/test_exl2_size.py allows the plan
0.6 GiB over it (OVER_BOUND), a bound set after observing +0.03..+0.50 GiB on that same card.
"""

from __future__ import annotations

from dataclasses import dataclass

from playbooks.plan.model_config import ModelShape
from playbooks.plan.tensors import Cat, model_tensors

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


# ExLlamaV2's working memory besides weights and cache, sized the way its own source sizes it
# (exllamav2 0.3.2; these functions are unchanged since 0.1.7 except where noted). The limits
# are config.py defaults, which TabbyAPI and the examples keep (TabbyAPI's chunk_size 2048 sets
# the same max_input_len and max_attention_size).
EXL2_MAX_INPUT_LEN = 2048  # config.max_input_len: tokens per forward chunk
EXL2_MAX_ATTENTION_SIZE = 2048**2  # config.max_attention_size: q_len x k_len per chunk
EXL2_MAX_DQ_SIZE = 512 * 1024**2  # config.max_dq_size: elements a matrix dequantizes at once


def _dq_bytes(in_features: int, out_features: int) -> int:
    """linear.py temp_dq_size: the FP16 buffer a quantized matrix is dequantized into (for
    prompt-sized inputs), capped at max_dq_size elements. (0.1.7 added 128 bytes.)"""
    return 2 * min(in_features * out_features, EXL2_MAX_DQ_SIZE)


def exl2_scratch_bytes(shape: ModelShape, max_input_len: int = EXL2_MAX_INPUT_LEN, batch: int = 1) -> int:
    """The scratch tensor ExLlamaV2 allocates on a GPU when the first layer loads and keeps for
    the model's lifetime (device.py ExLlamaV2DeviceContext.prepare; its size is the largest
    scratch_space_fixed() of any module there, model.py set_device_map / load_autosplit_gen).

    attention (attn.py): temp_state + the largest temp_dq of q/k/v/o
    MLP (mlp.py): temp_state + temp_a + temp_b + the largest temp_dq of gate/up/down
    head (linear.py, not a sub-module): its temp_dq only, over the vocabulary padded to 32 rows
    The head decides for every model whose hidden x vocab passes max_dq_size (512 Mi elements):
    1 GiB, whatever the context (Gemma-2 9B: 3584 x 256000; Qwen2.5-32B: 5120 x 152064).
    """
    rows = max_input_len * batch
    h, q, kv, ff = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    attention = rows * max(q, h) * 2 + 128 + max(_dq_bytes(h, q), _dq_bytes(h, kv), _dq_bytes(q, h))
    mlp = rows * h * 2 + 128 + 2 * (rows * max(h, ff) * 2 + 128) + max(_dq_bytes(h, ff), _dq_bytes(ff, h))
    head = _dq_bytes(h, shape.vocab_size + -shape.vocab_size % 32)
    return max(attention, mlp, head)


def exl2_chunk_bytes(
    shape: ModelShape, max_seq_len: int, max_input_len: int = EXL2_MAX_INPUT_LEN, batch: int = 1
) -> int:
    """What model.py set_device_map counts once per card besides modules and scratch: the RoPE
    sin/cos tables for max_seq_len (device.py prepare_sincos), one chunk's hidden state and its
    attention mask (state_size, mask_size)."""
    rope = shape.head_dim * max_seq_len * 2 * 2
    state = shape.hidden_size * max_input_len * batch * 2
    mask = max_input_len**2 * batch * 2
    return rope + state + mask


def exl2_attention_bytes(
    shape: ModelShape, max_seq_len: int, max_input_len: int = EXL2_MAX_INPUT_LEN, batch: int = 1
) -> int:
    """What attention allocates per forward outside the scratch, in attn.py's own sizes, on the
    path a V100 takes (flash-attn has no sm_70 build, so _attn_torch):

    temp_q, temp_k, temp_v: the projections of one input chunk. scratch_space() counts them, but
      load() no longer slices them from the scratch (the lines are commented out), so forward()
      allocates them (K and V go straight into the cache only at batch 1).
    temp_kv: repeat_kv copies K and V to every query head over the whole sequence, when the
      model has fewer KV heads than query heads: 2 x max_seq_len x heads x head_dim, FP16.
    temp_attn_size: the attention weights of a chunk, min(max_attention_size, max_seq_len^2)
      per head, twice; model.py set_device_map reserves it per device (reserve_bytes_attn).
    """
    rows = max_input_len * batch
    h_q = shape.num_attention_heads
    q = rows * shape.q_dim * 2 + 128
    k = v = rows * shape.kv_dim * 2 + 128
    expanded_kv = 0
    if shape.num_key_value_heads != h_q:
        expanded_kv = 2 * max_seq_len * batch * h_q * shape.head_dim * 2 + 128
    weights = 2 * min(EXL2_MAX_ATTENTION_SIZE, max_seq_len**2) * h_q * 2 + 128
    return q + k + v + expanded_kv + weights
