"""Predicted GGUF file size, tensor by tensor, following llama.cpp's own type rules.

`llama-quantize` does not store every tensor at the file type's base type: the K-quant mixes
keep some tensors at higher types (Q4_K_M puts `output.weight` and part of `attn_v` and
`ffn_down` at Q6_K), norms and biases stay F32, and rows whose length does not divide the
block size fall back to another type. This module reproduces `llama_tensor_get_type_impl`,
`tensor_type_fallback` and `llama_ftype_get_default_type` from src/llama-quant.cpp
(llama.cpp 0c1e570, vendored by llama-cpp-python 0.3.36) for dense decoder models and the
file types listed in FILE_TYPES. Block sizes and bytes per block come from the `gguf`
package (GGML_QUANT_SIZES), which mirrors ggml.c.

Only the tensor data is exact; the metadata (tokenizer strings, tensor index, alignment
padding) is an estimate: about 6 MB for a 152k-token vocabulary, under 0.05% of any
14B+ quant.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from playbooks.plan.model_config import ModelShape
from playbooks.plan.tensors import Cat, Tensor, model_tensors

# File types: the name llama-quantize takes -> the default (base) tensor type.
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
}

_UNQUANTIZED = {T.F32, T.F16, T.BF16}


def tensor_bytes(ne: tuple[int, ...], ttype: T) -> int:
    block, size = GGML_QUANT_SIZES[ttype]
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return n_rows * (ne[0] // block) * size


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama.cpp: the first and last eighth of the layers, and every third one between.
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fallback(ne0: int, target: T) -> T:
    """tensor_type_fallback: a row length the block does not divide gets another type."""
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


def assign_types(shape: ModelShape, ftype: str, imatrix: bool = False) -> list[tuple[Tensor, T]]:
    """The type llama-quantize gives each tensor for `ftype` (a key of FILE_TYPES).

    `imatrix` matters for Q4_0/IQ4_NL/IQ4_XS, whose first ffn_down layers change with it.
    """
    base = FILE_TYPES[ftype]
    tensors = model_tensors(shape)
    n_layer = shape.num_hidden_layers
    n_attention_wv = sum(1 for t in tensors if t.cat is Cat.ATTN_V)
    tied = not any(t.cat is Cat.OUTPUT for t in tensors)
    # llama.cpp's LLM_TYPE_70B (models/llama.cpp, models/qwen2.cpp: 80 layers, GQA for llama)
    is_70b = n_layer == 80 and (shape.arch == "qwen2" or (shape.arch == "llama" and shape.n_gqa > 1))
    gqa = shape.n_gqa
    i_attention_wv = 0
    i_ffn_down = 0
    result: list[tuple[Tensor, T]] = []
    for t in tensors:
        if t.cat is Cat.OTHER or len(t.ne) < 2:
            # 1-D tensors are never quantized; the converter writes them as F32.
            result.append((t, T.F32))
            continue
        if base in _UNQUANTIZED:
            result.append((t, base))
            continue
        new = base
        if t.cat is Cat.OUTPUT or (tied and t.cat is Cat.TOKEN_EMBD):
            if t.ne[0] % GGML_QUANT_SIZES[base][0] != 0:
                new = T.Q8_0
            elif new != T.Q8_0:
                new = T.Q6_K
        elif t.cat is Cat.ATTN_V:
            if ftype == "Q2_K":
                new = T.Q4_K if gqa >= 4 else T.Q3_K
            elif ftype == "Q3_K_M":
                new = T.Q5_K if i_attention_wv < 2 else T.Q4_K
            elif ftype == "Q3_K_L":
                new = T.Q5_K
            elif ftype in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
                new = T.Q5_K
            elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_attention_wv, n_attention_wv):
                new = T.Q6_K
            elif ftype == "Q4_K_S" and i_attention_wv < 4:
                new = T.Q5_K
            if is_70b and new in (T.Q3_K, T.Q4_K):
                # 8 heads share attn_v in the 70B model: more bits cost almost nothing.
                new = T.Q5_K
            i_attention_wv += 1
        elif t.cat is Cat.FFN_DOWN:
            i = i_ffn_down
            if ftype == "Q2_K":
                new = T.Q3_K
            elif ftype == "Q3_K_M":
                new = T.Q5_K if i < n_layer // 16 else T.Q4_K
            elif ftype == "Q3_K_L":
                new = T.Q5_K
            elif ftype == "Q4_K_M":
                if _use_more_bits(i, n_layer):
                    new = T.Q6_K
            elif i < n_layer // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not imatrix:
                new = T.Q5_K
            elif ftype == "Q5_K_M" and _use_more_bits(i, n_layer):
                new = T.Q6_K
            elif ftype == "Q4_K_S" and i < n_layer // 8:
                new = T.Q5_K
            elif ftype in ("Q4_0", "Q5_0") and imatrix and i < n_layer // 8:
                new = T.Q4_1 if ftype == "Q4_0" else T.Q5_1
            i_ffn_down += 1
        elif t.cat is Cat.ATTN_OUTPUT:
            new = {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(ftype, new)
        result.append((t, _fallback(t.ne[0], new)))
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

    @property
    def file_bytes(self) -> int:
        return self.tensor_bytes + self.metadata_bytes

    @property
    def gpu_weight_bytes(self) -> int:
        """Bytes llama.cpp puts on the GPU with all layers offloaded (-ngl all)."""
        return self.tensor_bytes if self.tied_output else self.tensor_bytes - self.token_embd_bytes

    @property
    def streamed_bytes_per_token(self) -> int:
        """Weight bytes read per decoded token: all but token_embd, of which one row is read
        (tied: all of it, since the output matmul reads the whole matrix)."""
        return self.tensor_bytes if self.tied_output else self.tensor_bytes - self.token_embd_bytes


def estimate_gguf(shape: ModelShape, ftype: str, imatrix: bool = False) -> GgufEstimate:
    total = 0
    embd = 0
    counts: dict[str, int] = {}
    for t, ttype in assign_types(shape, ftype, imatrix=imatrix):
        size = tensor_bytes(t.ne, ttype)
        total += size
        if t.cat is Cat.TOKEN_EMBD:
            embd = size
        counts[ttype.name] = counts.get(ttype.name, 0) + 1
    return GgufEstimate(ftype, total, metadata_bytes_estimate(shape), embd, counts, shape.tie_word_embeddings)
