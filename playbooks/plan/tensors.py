"""Every tensor a decoder has, as llama.cpp's converter writes it (names, shapes, categories).

The GGUF and EXL2 size models, the parameter count and the tiny-model generator all walk this
one list, so they cannot disagree about what a model contains.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from playbooks.plan.model_config import ModelShape


class Cat(Enum):
    """llama.cpp's tensor_category (src/llama-quant.cpp), for the categories our models have.

    llama.cpp files a tensor by a substring of its name, so the stacked experts
    (ffn_{gate,up,down}_exps) and the shared expert (ffn_*_shexp) are FFN_GATE / FFN_UP /
    FFN_DOWN like a dense FFN; `Tensor.experts` tells them apart. ROUTER is ours: the
    routers (ffn_gate_inp, ffn_gate_inp_shexp) are written F32 by the converter and never
    quantized (llama-quant.cpp skips `ffn_gate_inp.weight` by name; the shared-expert gate is
    (h, 1), 1-D to ggml, and only 2-D/3-D tensors are quantized).
    """

    TOKEN_EMBD = "token_embd"
    OUTPUT = "output"
    ATTN_Q = "attn_q"
    ATTN_K = "attn_k"
    ATTN_V = "attn_v"
    ATTN_OUTPUT = "attn_output"
    FFN_GATE = "ffn_gate"
    FFN_UP = "ffn_up"
    FFN_DOWN = "ffn_down"
    ROUTER = "router"
    OTHER = "other"  # norms, biases, attention sinks: never quantized


@dataclass(frozen=True)
class Tensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length (input features)
    cat: Cat
    layer: int = -1
    # A stacked expert tensor (last dimension = num_experts): one token reads only
    # num_experts_per_tok of its slices, and llama-server's --n-cpu-moe keeps it in host RAM.
    experts: bool = False

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@lru_cache(maxsize=64)
def model_tensors(shape: ModelShape) -> tuple[Tensor, ...]:
    """Every tensor convert_hf_to_gguf.py writes for the shape's architecture, in layer order.

    Cached: the planner asks for the same shape's tensors for every quant it evaluates."""
    h, q, kv = shape.hidden_size, shape.q_dim, shape.kv_dim
    out = [Tensor("token_embd.weight", (h, shape.vocab_size), Cat.TOKEN_EMBD)]
    for i in range(shape.num_hidden_layers):
        b = f"blk.{i}."
        layer = [
            Tensor(b + "attn_norm.weight", (h,), Cat.OTHER, i),
            Tensor(b + "attn_q.weight", (h, q), Cat.ATTN_Q, i),
            Tensor(b + "attn_k.weight", (h, kv), Cat.ATTN_K, i),
            Tensor(b + "attn_v.weight", (h, kv), Cat.ATTN_V, i),
            Tensor(b + "attn_output.weight", (q, h), Cat.ATTN_OUTPUT, i),
        ]
        if shape.attention_bias:
            layer += [
                Tensor(b + "attn_q.bias", (q,), Cat.OTHER, i),
                Tensor(b + "attn_k.bias", (kv,), Cat.OTHER, i),
                Tensor(b + "attn_v.bias", (kv,), Cat.OTHER, i),
            ]
        if shape.arch == "gpt-oss":
            # gpt-oss: an output bias, per-head attention sinks, and its FFN norm is named
            # post_attention_norm
            layer += [
                Tensor(b + "attn_output.bias", (h,), Cat.OTHER, i),
                Tensor(b + "attn_sinks.weight", (shape.num_attention_heads,), Cat.OTHER, i),
                Tensor(b + "post_attention_norm.weight", (h,), Cat.OTHER, i),
            ]
        else:
            layer.append(Tensor(b + "ffn_norm.weight", (h,), Cat.OTHER, i))
        if shape.arch in ("qwen3", "gemma3", "qwen3moe"):
            layer += [
                Tensor(b + "attn_q_norm.weight", (shape.head_dim,), Cat.OTHER, i),
                Tensor(b + "attn_k_norm.weight", (shape.head_dim,), Cat.OTHER, i),
            ]
        if shape.arch in ("gemma2", "gemma3"):
            layer += [
                Tensor(b + "post_attention_norm.weight", (h,), Cat.OTHER, i),
                Tensor(b + "post_ffw_norm.weight", (h,), Cat.OTHER, i),
            ]
        layer += _ffn(shape, b, i)
        out += layer
    out.append(Tensor("output_norm.weight", (h,), Cat.OTHER))
    if not shape.tie_word_embeddings:
        out.append(Tensor("output.weight", (h, shape.vocab_size), Cat.OUTPUT))
    return tuple(out)


def _ffn(shape: ModelShape, b: str, i: int) -> list[Tensor]:
    """One layer's FFN: dense, or router + stacked experts (+ the shared expert)."""
    h = shape.hidden_size
    if not shape.is_moe:
        ff = shape.intermediate_size
        return [
            Tensor(b + "ffn_gate.weight", (h, ff), Cat.FFN_GATE, i),
            Tensor(b + "ffn_up.weight", (h, ff), Cat.FFN_UP, i),
            Tensor(b + "ffn_down.weight", (ff, h), Cat.FFN_DOWN, i),
        ]
    n, ff = shape.num_experts, shape.expert_intermediate_size
    out = [
        Tensor(b + "ffn_gate_inp.weight", (h, n), Cat.ROUTER, i),
        Tensor(b + "ffn_gate_exps.weight", (h, ff, n), Cat.FFN_GATE, i, experts=True),
        Tensor(b + "ffn_up_exps.weight", (h, ff, n), Cat.FFN_UP, i, experts=True),
        Tensor(b + "ffn_down_exps.weight", (ff, h, n), Cat.FFN_DOWN, i, experts=True),
    ]
    if shape.arch == "gpt-oss":
        # biases: the router's and each expert's (read only for the active experts, kept with them)
        out += [
            Tensor(b + "ffn_gate_inp.bias", (n,), Cat.OTHER, i),
            Tensor(b + "ffn_gate_exps.bias", (ff, n), Cat.OTHER, i, experts=True),
            Tensor(b + "ffn_up_exps.bias", (ff, n), Cat.OTHER, i, experts=True),
            Tensor(b + "ffn_down_exps.bias", (h, n), Cat.OTHER, i, experts=True),
        ]
    if shape.shared_expert_intermediate_size:
        sh = shape.shared_expert_intermediate_size
        out += [
            Tensor(b + "ffn_gate_inp_shexp.weight", (h, 1), Cat.ROUTER, i),
            Tensor(b + "ffn_gate_shexp.weight", (h, sh), Cat.FFN_GATE, i),
            Tensor(b + "ffn_up_shexp.weight", (h, sh), Cat.FFN_UP, i),
            Tensor(b + "ffn_down_shexp.weight", (sh, h), Cat.FFN_DOWN, i),
        ]
    return out


def parameter_count(shape: ModelShape) -> int:
    """Weights only (no buffers), counted from the same tensor list the GGUF model uses."""
    return sum(t.n_elements for t in model_tensors(shape))


def active_parameter_count(shape: ModelShape) -> int:
    """Parameters one token uses: the expert tensors count by their active share (Qwen3-30B-A3B:
    the "A3B"). Equal to parameter_count for a dense model."""
    f = shape.active_expert_fraction
    return sum(round(t.n_elements * f) if t.experts else t.n_elements for t in model_tensors(shape))
