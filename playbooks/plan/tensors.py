"""Every tensor a dense decoder has, as llama.cpp's converter writes it (names, shapes, categories).

The GGUF and EXL2 size models, the parameter count and the tiny-model generator all walk this
one list, so they cannot disagree about what a model contains.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from playbooks.plan.model_config import ModelShape


class Cat(Enum):
    """llama.cpp's tensor_category, for the categories a dense decoder has."""

    TOKEN_EMBD = "token_embd"
    OUTPUT = "output"
    ATTN_Q = "attn_q"
    ATTN_K = "attn_k"
    ATTN_V = "attn_v"
    ATTN_OUTPUT = "attn_output"
    FFN_GATE = "ffn_gate"
    FFN_UP = "ffn_up"
    FFN_DOWN = "ffn_down"
    OTHER = "other"  # norms, biases: 1-D, never quantized


@dataclass(frozen=True)
class Tensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (input features)
    cat: Cat
    layer: int = -1

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@lru_cache(maxsize=64)
def model_tensors(shape: ModelShape) -> tuple[Tensor, ...]:
    """Every tensor convert_hf_to_gguf.py writes for a dense decoder, in file order.

    Cached: the planner asks for the same shape's tensors for every quant it evaluates."""
    h, ff, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    out = [Tensor("token_embd.weight", (h, shape.vocab_size), Cat.TOKEN_EMBD)]
    for i in range(shape.num_hidden_layers):
        b = f"blk.{i}."
        layer = [
            Tensor(b + "attn_norm.weight", (h,), Cat.OTHER, i),
            Tensor(b + "attn_q.weight", (h, q), Cat.ATTN_Q, i),
            Tensor(b + "attn_k.weight", (h, kv), Cat.ATTN_K, i),
            Tensor(b + "attn_v.weight", (h, kv), Cat.ATTN_V, i),
            Tensor(b + "attn_output.weight", (q, h), Cat.ATTN_OUTPUT, i),
            Tensor(b + "ffn_norm.weight", (h,), Cat.OTHER, i),
            Tensor(b + "ffn_gate.weight", (h, ff), Cat.FFN_GATE, i),
            Tensor(b + "ffn_up.weight", (h, ff), Cat.FFN_UP, i),
            Tensor(b + "ffn_down.weight", (ff, h), Cat.FFN_DOWN, i),
        ]
        if shape.attention_bias:
            layer += [
                Tensor(b + "attn_q.bias", (q,), Cat.OTHER, i),
                Tensor(b + "attn_k.bias", (kv,), Cat.OTHER, i),
                Tensor(b + "attn_v.bias", (kv,), Cat.OTHER, i),
            ]
        if shape.arch in ("qwen3", "gemma3"):
            layer += [
                Tensor(b + "attn_q_norm.weight", (shape.head_dim,), Cat.OTHER, i),
                Tensor(b + "attn_k_norm.weight", (shape.head_dim,), Cat.OTHER, i),
            ]
        if shape.arch in ("gemma2", "gemma3"):
            layer += [
                Tensor(b + "post_attention_norm.weight", (h,), Cat.OTHER, i),
                Tensor(b + "post_ffw_norm.weight", (h,), Cat.OTHER, i),
            ]
        out += layer
    out.append(Tensor("output_norm.weight", (h,), Cat.OTHER))
    if not shape.tie_word_embeddings:
        out.append(Tensor("output.weight", (h, shape.vocab_size), Cat.OUTPUT))
    return tuple(out)


def parameter_count(shape: ModelShape) -> int:
    """Weights only (no buffers), counted from the same tensor list the GGUF model uses."""
    return sum(t.n_elements for t in model_tensors(shape))
