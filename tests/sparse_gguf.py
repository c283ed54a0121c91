"""GGUF files of any shape at no cost: metadata and tensor infos, then a sparse all-zero data
section (the file is truncated to its full length, so nothing is written and a mmap reads
zero pages). llama.cpp loads them like any model; what it reserves for compute depends on the
shape only, so a 2-layer file with Qwen2.5-14B's dimensions shows Qwen2.5-14B's compute buffer.

Archs: llama, qwen2, qwen3, gemma2, gemma3 (what voltaforge plans), and gptneox, glm4, bert
(the archs of older real CUDA logs, reproduced with an older llama.cpp tree in
tests/test_compute_buffer.py). The file name carries the shape: {arch}-E{hidden}-F{ffn}-L{layers}
-H{heads}-K{kv heads}-D{head dim}-V{vocab}[-W{sliding window}].gguf. Matrices are F16 (Q4_0
with q4=True, for a small RPC copy), norms F32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from playbooks.modelgen.shaped_gguf import add_byte_fallback_vocab

NAME = re.compile(
    r"(?P<arch>[a-z0-9]+)-E(?P<E>\d+)-F(?P<F>\d+)-L(?P<L>\d+)-H(?P<H>\d+)-K(?P<K>\d+)-D(?P<D>\d+)"
    r"-V(?P<V>\d+)(-W(?P<W>\d+))?\.gguf"
)
HF_MODEL_TYPE = {"gemma3": "gemma3_text"}


@dataclass(frozen=True)
class Shape:
    arch: str
    E: int
    F: int
    L: int
    H: int
    K: int
    D: int
    V: int
    W: int = 0  # sliding window (gemma2/gemma3)

    @property
    def file_name(self) -> str:
        w = f"-W{self.W}" if self.W else ""
        return f"{self.arch}-E{self.E}-F{self.F}-L{self.L}-H{self.H}-K{self.K}-D{self.D}-V{self.V}{w}.gguf"

    def hf_config(self) -> dict:
        """The config.json keys voltaforge's shape_from_config reads."""
        cfg = {
            "model_type": HF_MODEL_TYPE.get(self.arch, self.arch),
            "hidden_size": self.E,
            "intermediate_size": self.F,
            "num_hidden_layers": self.L,
            "num_attention_heads": self.H,
            "num_key_value_heads": self.K,
            "head_dim": self.D,
            "vocab_size": self.V,
        }
        return cfg | ({"sliding_window": self.W} if self.W else {})


def shape_of(file_name: str) -> Shape:
    m = NAME.fullmatch(Path(file_name).name)
    if not m:
        raise ValueError(f"not a sparse_gguf file name: {file_name}")
    return Shape(m["arch"], *(int(m[k]) for k in "EFLHKDV"), W=int(m["W"] or 0))


def write(directory: Path, s: Shape, ctx_train: int = 131072, q4: bool = False, rope_dims: int | None = None) -> Path:
    path = Path(directory) / s.file_name
    if path.exists():
        return path
    arch, E, F, H, K, D, V = s.arch, s.E, s.F, s.H, s.K, s.D, s.V
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(ctx_train)
    w.add_embedding_length(E)
    w.add_block_count(s.L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_rope_dimension_count(rope_dims or D)
    if D * H != E:
        w.add_key_length(D)
        w.add_value_length(D)
    if arch in ("gptneox", "bert"):
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
    if arch == "gptneox":
        w.add_bool(f"{arch}.use_parallel_residual", True)
    if s.W:
        w.add_sliding_window(s.W)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "bert":
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType.CLS)
        w.add_tokenizer_model("bert")
        w.add_uint32("tokenizer.ggml.token_type_count", 2)
        w.add_token_list(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(V - 5)])
        w.add_token_types([3] * 5 + [1] * (V - 5))
        for add, i in (
            (w.add_pad_token_id, 0),
            (w.add_unk_token_id, 1),
            (w.add_bos_token_id, 2),
            (w.add_eos_token_id, 3),
            (w.add_sep_token_id, 3),
            (w.add_mask_token_id, 4),
        ):
            add(i)
    else:
        add_byte_fallback_vocab(w, V)
    sizes: list[int] = []

    def t(name: str, *ne: int, matrix: bool = True) -> None:  # numpy order: (rows, columns)
        if matrix and q4:
            n = int(np.prod(ne)) // 32 * GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0][1]
            w.add_tensor_info(
                name, (*ne[:-1], ne[-1] // 32 * 18), np.dtype(np.uint8), n, raw_dtype=GGMLQuantizationType.Q4_0
            )
        else:
            dtype = np.dtype(np.float16 if matrix else np.float32)
            n = int(np.prod(ne)) * dtype.itemsize
            w.add_tensor_info(name, ne, dtype, n)
        sizes.append(n)

    Eq, Ekv = H * D, K * D
    t("token_embd.weight", V, E)
    if arch == "bert":
        t("token_types.weight", 2, E, matrix=False)
        t("position_embd.weight", ctx_train, E, matrix=False)
        t("token_embd_norm.weight", E, matrix=False)
        t("token_embd_norm.bias", E, matrix=False)
    else:
        t("output_norm.weight", E, matrix=False)
        if arch == "gptneox":
            t("output_norm.bias", E, matrix=False)
        if not arch.startswith("gemma"):  # Gemma ties the LM head to the embeddings
            t("output.weight", V, E)
    for i in range(s.L):
        p = f"blk.{i}."
        if arch == "bert":
            for n, rows in (("attn_q", Eq), ("attn_k", Ekv), ("attn_v", Ekv)):
                t(p + n + ".weight", rows, E)
                t(p + n + ".bias", rows, matrix=False)
            t(p + "attn_output.weight", E, Eq)
            for n in ("attn_output.bias", "attn_output_norm.weight", "attn_output_norm.bias"):
                t(p + n, E, matrix=False)
            t(p + "ffn_up.weight", F, E)
            t(p + "ffn_up.bias", F, matrix=False)
            t(p + "ffn_down.weight", E, F)
            for n in ("ffn_down.bias", "layer_output_norm.weight", "layer_output_norm.bias"):
                t(p + n, E, matrix=False)
            continue
        t(p + "attn_norm.weight", E, matrix=False)
        if arch == "gptneox":
            t(p + "attn_norm.bias", E, matrix=False)
            t(p + "attn_qkv.weight", Eq + 2 * Ekv, E)
            t(p + "attn_qkv.bias", Eq + 2 * Ekv, matrix=False)
        else:
            t(p + "attn_q.weight", Eq, E)
            t(p + "attn_k.weight", Ekv, E)
            t(p + "attn_v.weight", Ekv, E)
            if arch in ("qwen2", "glm4"):
                for n, rows in (("attn_q", Eq), ("attn_k", Ekv), ("attn_v", Ekv)):
                    t(p + n + ".bias", rows, matrix=False)
            if arch in ("qwen3", "gemma3"):
                t(p + "attn_q_norm.weight", D, matrix=False)
                t(p + "attn_k_norm.weight", D, matrix=False)
        t(p + "attn_output.weight", E, Eq)
        if arch == "gptneox":
            t(p + "attn_output.bias", E, matrix=False)
        if arch in ("glm4", "gemma2", "gemma3"):
            t(p + "post_attention_norm.weight", E, matrix=False)
        t(p + "ffn_norm.weight", E, matrix=False)
        if arch == "gptneox":
            t(p + "ffn_norm.bias", E, matrix=False)
            t(p + "ffn_up.weight", F, E)
            t(p + "ffn_up.bias", F, matrix=False)
            t(p + "ffn_down.weight", E, F)
            t(p + "ffn_down.bias", E, matrix=False)
        elif arch == "glm4":
            t(p + "ffn_up.weight", 2 * F, E)  # gate and up in one matrix
            t(p + "ffn_down.weight", E, F)
            t(p + "post_ffw_norm.weight", E, matrix=False)
        else:
            t(p + "ffn_gate.weight", F, E)
            t(p + "ffn_up.weight", F, E)
            t(p + "ffn_down.weight", E, F)
            if arch.startswith("gemma"):
                t(p + "post_ffw_norm.weight", E, matrix=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    start = f.tell() + (-f.tell() % w.data_alignment)
    f.truncate(start + sum(n + (-n % w.data_alignment) for n in sizes))
    f.close()
    return path
