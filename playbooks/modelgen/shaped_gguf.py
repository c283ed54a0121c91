"""A GGUF of any planned shape and quant at no cost: every tensor the plan predicts, each at
the type the plan predicts, and an all-zero data section left sparse.

What llama.cpp does with a model's memory (what it puts on the GPU, what `--n-cpu-moe` keeps
in host RAM, what `llama-fit-params` projects, how fast a token is decoded) depends on the
tensors' shapes and types, not on their values. So a file written from the planner's own
tensor list (`gguf_size.assign_types`) answers "is the plan right about this model?" for a
30B model in a second and without a download: the file is truncated to its full length, so
no data is written and a mmap reads zero pages. Zero weights decode zero logits (the same
token again and again); speed and memory are the real ones. A real file's speed can differ
where the data matters: the router of an all-zero MoE picks the same experts every token.

The tokenizer is a small SentencePiece-style vocabulary with byte fallback (enough for
llama-server to tokenize any prompt); the vocabulary size is the shape's, so the embedding
and output matrices have their real size.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from playbooks.plan.gguf_size import assign_types
from playbooks.plan.model_config import ModelShape

# llama.cpp's GGUF architecture names for the planner's arch families
_GGUF_ARCH = {"gpt-oss": "gpt-oss"}


def _metadata(w: gguf.GGUFWriter, shape: ModelShape, ctx_train: int) -> None:
    w.add_context_length(ctx_train)
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if shape.is_moe:
        w.add_expert_count(shape.num_experts)
        w.add_expert_used_count(shape.num_experts_per_tok)
        w.add_expert_feed_forward_length(shape.expert_intermediate_size)
        if shape.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(shape.shared_expert_intermediate_size)
    add_byte_fallback_vocab(w, shape.vocab_size)


def add_byte_fallback_vocab(w: gguf.GGUFWriter, v: int) -> None:
    """A SentencePiece-style vocabulary of `v` tokens: <unk> <s> </s>, the 256 byte tokens (so
    any text tokenizes), then filler pieces up to the model's real vocabulary size."""
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    w.add_token_list(tokens + [f"\u2581t{i}" for i in range(v - len(tokens))])
    w.add_token_scores([0.0] * v)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_shaped_gguf(
    path: Path, shape: ModelShape, ftype: str, *, imatrix: bool = False, ctx_train: int = 32768
) -> Path:
    """Write `path` (overwritten) with the tensors and types the planner predicts for
    (shape, ftype); returns path. The file's length is the real one, its data sparse."""
    if shape.vocab_size < 259:
        raise ValueError("the shaped GGUF's tokenizer needs a vocabulary of at least 259 tokens")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), _GGUF_ARCH.get(shape.arch, shape.arch))
    _metadata(w, shape, ctx_train)
    sizes: list[int] = []
    for t, ttype in assign_types(shape, ftype, imatrix=imatrix):
        np_shape = tuple(reversed(t.ne))  # numpy order: the row length last
        if ttype in (T.F32, T.F16):
            dtype = np.dtype(np.float32 if ttype is T.F32 else np.float16)
            nbytes = int(np.prod(np_shape)) * dtype.itemsize
            w.add_tensor_info(t.name, np_shape, dtype, nbytes)
        else:
            block, size = GGML_QUANT_SIZES[ttype]
            byte_shape = (*np_shape[:-1], np_shape[-1] // block * size)
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ttype)
        sizes.append(nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None  # open: the header was just written to it
    f = w.fout[0]
    start = f.tell() + (-f.tell() % w.data_alignment)
    f.truncate(start + sum(n + (-n % w.data_alignment) for n in sizes))
    f.close()
    return path
