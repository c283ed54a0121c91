"""Predicted GGUF file size, tensor by tensor, following llama.cpp's own type rules.

`llama-quantize` does not store every tensor at the file type's base type: the K-quant mixes
keep some tensors at higher types (Q4_K_M puts `output.weight` and part of `attn_v` and
`ffn_down` at Q6_K), norms and biases stay F32, and rows whose length does not divide the
block size fall back to another type. This module reproduces, from src/llama-quant.cpp of
llama.cpp 0c1e570 (vendored by llama-cpp-python 0.3.36):

- `tensor_allows_quantization` (lines 287-383): which tensors llama-quantize touches at all;
  the others (1-D tensors, norms, biases, the MoE router `ffn_gate_inp.weight`) keep the type
  the converter wrote;
- `llama_tensor_get_type_impl` (446-714), including its mixture-of-experts rules: `layer_info`
  taking the layer of a stacked expert tensor from its name, the `n_expert == 8` (Mixtral)
  bumps of attn_v/attn_k/attn_output, and LLAMA_FTYPE_MOSTLY_MXFP4_MOE;
- `tensor_type_fallback` (390-443), `llama_ftype_get_default_type` (881-924) and the
  counters of `init_quantize_state_counters` (927-940);
- the order llama-quantize visits tensors in (llama-model-loader.h, weight_name_comparer:
  by layer, then by name), which drives its attn_v counter;

for the dense and MoE architectures of model_config.py and the file types in FILE_TYPES. What
the converter writes (conversion/base.py, prepare_tensors, 1080-1156; conversion/gpt_oss.py)
is modelled too, since F16/BF16 files come from it and untouched tensors keep its types. Block
sizes and bytes per block come from the `gguf` package (GGML_QUANT_SIZES), which mirrors ggml.c.

Only the tensor data is exact; the metadata (tokenizer strings, tensor index, alignment
padding) is an estimate: about 6 MB for a 152k-token vocabulary, under 0.05% of any
14B+ quant (it misses gpt-oss's o200k tokenizer, with twice as many BPE merges as tokens, by
5 MB, and over-counts SentencePiece vocabularies, which have no merges, by about 0.5 MB).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from playbooks.errors import RecipeError
from playbooks.plan.ggml_types import GGML_QUANT_SIZES
from playbooks.plan.ggml_types import GGMLQuantizationType as T
from playbooks.plan.model_config import ModelShape
from playbooks.plan.tensors import Cat, Tensor, model_tensors

# File types: the name llama-quantize takes -> the default (base) tensor type
# (llama_ftype_get_default_type; the names are tools/quantize/quantize.cpp's QUANT_OPTIONS).
FILE_TYPES: dict[str, T] = {
    "F16": T.F16,
    "BF16": T.BF16,
    "Q8_0": T.Q8_0,
    "Q6_K": T.Q6_K,
    "Q5_K_M": T.Q5_K,
    "Q5_K_S": T.Q5_K,
    "Q5_1": T.Q5_1,
    "Q5_0": T.Q5_0,
    "Q4_K_M": T.Q4_K,
    "Q4_K_S": T.Q4_K,
    "Q4_1": T.Q4_1,
    "Q4_0": T.Q4_0,
    "IQ4_NL": T.IQ4_NL,
    "IQ4_XS": T.IQ4_XS,
    "Q3_K_L": T.Q3_K,
    "Q3_K_M": T.Q3_K,
    "Q3_K_S": T.Q3_K,
    "Q2_K": T.Q2_K,
    # Stacked expert tensors MXFP4, every other quantizable tensor Q8_0 (for a dense model: Q8_0).
    "MXFP4_MOE": T.MXFP4,
}

# F16 and BF16 files are what convert_hf_to_gguf.py writes with that --outtype; llama-quantize
# never makes them here (it would refuse to turn gpt-oss's MXFP4 experts back into F16).
CONVERTER_TYPES = ("F16", "BF16")

# Architectures whose MoE tensor layout tensors.py models, checked against llama.cpp's loaders
# (src/models/llama.cpp for Mixtral, qwen2moe.cpp, qwen3moe.cpp, openai-moe.cpp).
MOE_ARCHS = ("llama", "qwen2moe", "qwen3moe", "gpt-oss")
_MOE_ONLY_ARCHS = ("qwen2moe", "qwen3moe", "gpt-oss")

_QUANTIZED = {t for t in T if t not in (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64)}


def tensor_bytes(ne: tuple[int, ...], ttype: T) -> int:
    block, size = GGML_QUANT_SIZES[ttype]
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return n_rows * (ne[0] // block) * size


def _n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count (Qwen2-MoE's (h, 1) shared gate is 1-D)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama.cpp: the first and last eighth of the layers, and every third one between.
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(ne0: int, target: T) -> T:
    """tensor_type_fallback: a row length the block does not divide gets another type.

    The 32-block types (Q4_0 ... Q8_0, IQ4_NL, MXFP4) have no smaller block to demote to, and a
    fallback that still does not divide the row becomes F16."""
    block = GGML_QUANT_SIZES[target][0]
    if ne0 % block == 0:
        return target
    fallbacks = {
        T.IQ4_XS: T.IQ4_NL,
        T.Q2_K: T.Q4_0,
        T.Q3_K: T.Q4_0,
        T.Q4_K: T.Q5_0,
        T.Q5_K: T.Q5_1,
        T.Q6_K: T.Q8_0,
    }
    result = fallbacks.get(target, target)
    if ne0 % GGML_QUANT_SIZES[result][0] != 0:
        result = T.F16
    return result


def converter_type(shape: ModelShape, t: Tensor, outtype: T = T.F16) -> T:
    """The type convert_hf_to_gguf.py writes a tensor in for --outtype f16/bf16/q8_0.

    conversion/base.py (prepare_tensors, 1080-1156): 1-D tensors and `*_norm.weight` are F32; the routers
    (FFN_GATE_INP, FFN_GATE_INP_SHEXP) and every tensor whose name does not end in `.weight`
    (biases) are "always in float32"; the rest gets the outtype. conversion/gpt_oss.py writes a
    checkpoint's MXFP4 experts as they are (repack_mxfp4, raw_dtype MXFP4).
    """
    if t.experts and shape.mxfp4_experts and t.name.endswith(".weight"):
        return T.MXFP4
    if len(t.ne) <= 1 or t.name.endswith("_norm.weight") or t.cat is Cat.ROUTER or not t.name.endswith(".weight"):
        return T.F32
    return outtype


def _allows_quantization(t: Tensor) -> bool:
    """tensor_allows_quantization, for the tensor names our architectures have: 2-D and 3-D
    `*weight` tensors except norms and the expert router `ffn_gate_inp.weight` (its `_shexp`
    sibling is 1-D in ggml's eyes and excluded by the first test)."""
    return (
        _n_dims(t.ne) >= 2
        and t.name.endswith("weight")
        and "_norm.weight" not in t.name
        and "ffn_gate_inp.weight" not in t.name
    )


def _quantize_order(t: Tensor) -> tuple[int, str]:
    """llama-model-loader.h weight_name_comparer: by the layer in `blk.N.` (-1 for the others), then by name."""
    m = re.match(r"blk\.(\d+)\.", t.name)
    return (int(m.group(1)) if m else -1, t.name)


def quant_refusal(shape: ModelShape, ftype: str) -> str | None:
    """Why this file type cannot be made or sized for this model, or None when it can.

    A planner can skip the refused types instead of catching RecipeError from estimate_gguf.
    """
    if ftype not in FILE_TYPES:
        return f"unknown GGUF file type {ftype!r}; known: {', '.join(FILE_TYPES)}"
    if shape.is_moe and shape.arch not in MOE_ARCHS:
        return (
            f"mixture-of-experts architecture {shape.arch!r} ({shape.model_type}): its GGUF tensors and "
            f"llama-quantize rules are not modelled (modelled: {', '.join(MOE_ARCHS)})"
        )
    if shape.arch in _MOE_ONLY_ARCHS and not shape.is_moe:
        return f"{shape.model_type} ({shape.arch}) has no experts: llama.cpp's {shape.arch} needs num_experts > 0"
    if shape.mxfp4_experts and ftype not in (*CONVERTER_TYPES, "MXFP4_MOE"):
        # llama-quantize (llama-quant.cpp 1306-1308): "requantizing from type mxfp4 is disabled" unless
        # --allow-requantize, which voltaforge does not pass; MXFP4_MOE keeps them (same type, copied).
        return (
            f"{ftype} for {shape.model_type}: its experts are MXFP4 in the checkpoint and llama-quantize "
            "refuses to requantize them (no --allow-requantize); use MXFP4_MOE"
        )
    return None


@dataclass
class _QuantState:
    """quantize_state_impl's counters (init_quantize_state_counters)."""

    n_attention_wv: int
    n_layer: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0  # i_ffn_gate / i_ffn_up only matter to IQ3_XS, which is not modelled


def _type_impl(shape: ModelShape, t: Tensor, ftype: str, new: T, qs: _QuantState, tied: bool, imatrix: bool) -> T:
    """llama_tensor_get_type_impl for the file types in FILE_TYPES (no IQ1/IQ2/IQ3 branches)."""
    n_expert = shape.num_experts  # hparams.n_expert: 0 for a dense model
    gqa = shape.n_gqa

    def layer_info(i_counter: int) -> int:
        # MoE: "experts" of Mixtral are not consecutive, so the layer comes from the name (blk.N.).
        if max(1, n_expert) > 1:
            return t.layer
        return i_counter

    # llama.cpp's LLM_TYPE_70B: models/qwen2.cpp at 80 layers; models/llama.cpp at 80 layers with
    # GQA, unless n_expert == 8 (then it is 8x7B / 8x22B).
    is_70b = shape.num_hidden_layers == 80 and (
        shape.arch == "qwen2" or (shape.arch == "llama" and n_expert != 8 and gqa > 1)
    )

    if t.cat is Cat.OUTPUT or (tied and t.cat is Cat.TOKEN_EMBD):
        if ftype == "MXFP4_MOE" or t.ne[0] % GGML_QUANT_SIZES[new][0] != 0:
            return T.Q8_0
        return new if new == T.Q8_0 else T.Q6_K
    if ftype == "MXFP4_MOE":
        # MoE tensors -> MXFP4, other tensors -> Q8_0: "MoE" is any 3-D tensor (ne[2] > 1).
        return T.MXFP4 if len(t.ne) > 2 and t.ne[2] > 1 else T.Q8_0
    if t.cat is Cat.TOKEN_EMBD:
        return new  # only the IQ1/IQ2/IQ3_XXS and TQ types change it
    if t.cat is Cat.ATTN_V:
        if ftype == "Q2_K":
            new = T.Q4_K if gqa >= 4 else T.Q3_K
        elif ftype == "Q3_K_M":
            new = T.Q5_K if qs.i_attention_wv < 2 else T.Q4_K
        elif ftype == "Q3_K_L":
            new = T.Q5_K
        elif ftype in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
            new = T.Q5_K
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new = T.Q6_K
        elif ftype == "Q4_K_S" and qs.i_attention_wv < 4:
            new = T.Q5_K
        if is_70b and new in (T.Q3_K, T.Q4_K):
            # 8 heads share attn_v in the 70B model: more bits cost almost nothing.
            new = T.Q5_K
        if n_expert == 8:
            # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB", whatever the file type
            new = T.Q8_0
        qs.i_attention_wv += 1
        return new
    if t.cat is Cat.ATTN_K:
        return T.Q8_0 if n_expert == 8 else new
    if t.cat is Cat.ATTN_Q:
        return new  # only IQ3_XS / IQ3_XXS change it
    if t.cat is Cat.FFN_DOWN:
        i, n = layer_info(qs.i_ffn_down), qs.n_layer
        qs.i_ffn_down += 1
        if ftype == "Q2_K":
            return T.Q3_K
        if ftype == "Q3_K_M":
            # Falcon only would keep Q3_K outside use_more_bits
            return T.Q5_K if i < n // 16 else T.Q4_K
        if ftype == "Q3_K_L":
            return T.Q5_K
        if ftype == "Q4_K_M":
            return T.Q6_K if _use_more_bits(i, n) else new
        if i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not imatrix:
            return T.Q5_K
        if ftype == "Q5_K_M" and _use_more_bits(i, n):
            return T.Q6_K
        if ftype == "Q4_K_S" and i < n // 8:
            return T.Q5_K
        if ftype in ("Q4_0", "Q5_0") and imatrix and i < n // 8:
            return T.Q4_1 if ftype == "Q4_0" else T.Q5_1
        return new
    if t.cat is Cat.ATTN_OUTPUT:
        if n_expert == 8:
            # Mixtral: Q5_K for these file types (and Q3_K_L keeps its Q3_K: it is not in the list)
            return T.Q5_K if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS") else new
        return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(ftype, new)
    return new  # ffn_gate / ffn_up (dense, experts, shared expert): only IQ3_XS changes them


def assign_types(shape: ModelShape, ftype: str, imatrix: bool = False) -> list[tuple[Tensor, T]]:
    """The type of every tensor of the GGUF file `ftype` (a key of FILE_TYPES): one entry per
    tensor, named as llama.cpp names it, in the order llama-quantize writes them (by layer, then
    by name; the converter's F16/BF16 file orders them differently: compare by name).

    F16/BF16 are the converter's output; the other types are llama-quantize's from that F16 file.
    `imatrix` matters for Q4_0/Q5_0/IQ4_NL/IQ4_XS, whose first ffn_down layers change with it.
    Raises RecipeError for a type or architecture the rules here do not cover (quant_refusal).
    """
    refusal = quant_refusal(shape, ftype)
    if refusal:
        raise RecipeError(refusal)
    tensors = sorted(model_tensors(shape), key=_quantize_order)
    if ftype in CONVERTER_TYPES:
        return [(t, converter_type(shape, t, FILE_TYPES[ftype])) for t in tensors]
    base = FILE_TYPES[ftype]
    qs = _QuantState(
        n_attention_wv=sum(1 for t in tensors if t.cat is Cat.ATTN_V),
        # init_quantize_state_counters: n_ffn_down = n_ffn_gate = n_ffn_up = n_layer_all
        n_layer=shape.num_hidden_layers,
    )
    tied = not any(t.cat is Cat.OUTPUT for t in tensors)
    result: list[tuple[Tensor, T]] = []
    for t in tensors:
        source = converter_type(shape, t)
        if not _allows_quantization(t):
            result.append((t, source))  # norms, biases, sinks, routers: as the converter wrote them
            continue
        new = _fallback(t.ne[0], _type_impl(shape, t, ftype, base, qs, tied, imatrix))
        if source in _QUANTIZED and new != source:
            # quant_refusal rules these out; reaching here means a rule above and it disagree
            raise RecipeError(f"{t.name}: llama-quantize would requantize {source.name} to {new.name} ({ftype})")
        result.append((t, new))
    return result


def metadata_bytes_estimate(shape: ModelShape) -> int:
    """GGUF header, tokenizer and tensor index: an estimate (see module docstring).

    Per vocabulary entry: a token string (8-byte length + ~7 bytes), its int32 type, and a BPE
    merge string (8 + ~11 bytes); per tensor: its index entry (~72 bytes) and 16 bytes of
    average alignment padding (GGUF aligns tensor data to 32 bytes). Plus 16 KiB of
    scalar keys and chat template.
    """
    n_tensors = len(model_tensors(shape))
    return shape.vocab_size * (8 + 7 + 4 + 8 + 11) + n_tensors * (72 + 16) + 16384


@dataclass(frozen=True)
class GgufEstimate:
    ftype: str
    tensor_bytes: int  # exact: sum over tensors
    metadata_bytes: int  # estimate
    token_embd_bytes: int  # llama.cpp keeps token_embd in host memory, not VRAM
    type_counts: dict[str, int]
    # Tied embeddings (Gemma, small Qwen2.5): the file has no output.weight, and llama.cpp loads
    # token_embd a second time as the output layer, on the GPU (llama-model-loader.cpp,
    # buft_for_tensor: "the tensor is duplicated ... loaded as the output tensor").
    tied_output: bool = False
    # Mixture of experts (empty / 0 for a dense model). expert_bytes_per_layer[i] is the exact size
    # of layer i's stacked expert tensors: what llama-server's `--n-cpu-moe N` (and `-ot exps=CPU`)
    # keeps in host RAM for the first N layers. Those are the tensors matching its regex
    # `blk\.i\.ffn_(up|down|gate)_exps` (common/common.h LLM_FFN_EXPS_REGEX): the gate/up/down
    # expert weights and, for gpt-oss, their biases. Not the router (ffn_gate_inp) nor Qwen2-MoE's
    # shared expert (ffn_*_shexp), which every token uses.
    expert_bytes_per_layer: tuple[int, ...] = field(default_factory=tuple)
    n_expert: int = 0
    n_expert_used: int = 0

    @property
    def file_bytes(self) -> int:
        return self.tensor_bytes + self.metadata_bytes

    @property
    def gpu_weight_bytes(self) -> int:
        """Bytes llama.cpp puts on the GPU with all layers offloaded (-ngl all), experts included."""
        return self.tensor_bytes if self.tied_output else self.tensor_bytes - self.token_embd_bytes

    @property
    def streamed_bytes_per_token(self) -> int:
        """Weight bytes a dense read of the model costs per decoded token: all but token_embd, of
        which one row is read (tied: all of it, since the output matmul reads the whole matrix).
        For a MoE model this counts every expert; see active_bytes_per_token."""
        return self.tensor_bytes if self.tied_output else self.tensor_bytes - self.token_embd_bytes

    @property
    def expert_bytes(self) -> int:
        """All layers' stacked expert tensors (0 for a dense model)."""
        return sum(self.expert_bytes_per_layer)

    def host_expert_bytes(self, n_cpu_moe: int) -> int:
        """Expert bytes `--n-cpu-moe n_cpu_moe` moves from the GPU to host RAM (layers 0..n-1)."""
        return sum(self.expert_bytes_per_layer[: max(0, n_cpu_moe)])

    @property
    def active_bytes_per_token(self) -> int:
        """Weight bytes read to decode one token when it is routed to n_expert_used experts per layer:
        streamed_bytes_per_token with each expert tensor counted by its active share
        (n_expert_used / n_expert; every expert's slice of a stacked tensor is the same size).
        A single sequence reads exactly this; a batch of tokens routed to different experts reads
        more, up to streamed_bytes_per_token. Equal to streamed_bytes_per_token for a dense model."""
        if not self.n_expert:
            return self.streamed_bytes_per_token
        active = self.expert_bytes // self.n_expert * self.n_expert_used
        return self.streamed_bytes_per_token - self.expert_bytes + active


def estimate_gguf(shape: ModelShape, ftype: str, imatrix: bool = False) -> GgufEstimate:
    total = 0
    embd = 0
    counts: dict[str, int] = {}
    experts = [0] * shape.num_hidden_layers if shape.is_moe else []
    for t, ttype in assign_types(shape, ftype, imatrix=imatrix):
        size = tensor_bytes(t.ne, ttype)
        total += size
        if t.cat is Cat.TOKEN_EMBD:
            embd = size
        if t.experts:
            experts[t.layer] += size
        counts[ttype.name] = counts.get(ttype.name, 0) + 1
    return GgufEstimate(
        ftype,
        total,
        metadata_bytes_estimate(shape),
        embd,
        counts,
        shape.tie_word_embeddings,
        expert_bytes_per_layer=tuple(experts),
        n_expert=shape.num_experts,
        n_expert_used=shape.num_experts_per_tok,
    )
