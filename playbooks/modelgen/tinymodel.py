"""A tiny Llama with random weights in real formats: the `generate: tiny-llama` model source.

The config may also be a Mixtral (model_type mixtral: a Llama whose FFN is num_local_experts
experts, num_experts_per_tok of them per token): the tiny mixture-of-experts model the MoE
tests convert, quantize and serve with experts kept in host RAM. Mixtral is the MoE layout
whose conversion takes this SentencePiece tokenizer (llama.cpp converts it as `llama`); the
Qwen MoE converters want a BPE tokenizer.json with a known pre-tokenizer.

The tests and the README demo need a model that is real to every tool downstream
(convert_hf_to_gguf.py, llama-quantize, llama-server) without a download: a Hugging Face
directory with config.json, BF16 safetensors (as real checkpoints ship them, so the BF16 ->
FP16 step is exercised) and a SentencePiece tokenizer trained here on generated text, with the
tokenizer.json Hugging Face's converter makes from it (exllamav2 reads only that; llama.cpp's
converter still takes tokenizer.model, its `llama` vocabulary).
Random weights produce random text; that is fine for sizes, speed and plumbing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from playbooks.plan.model_config import shape_from_config
from playbooks.plan.tensors import Cat, model_tensors

# HF parameter names for llama.cpp's GGUF names (convert_hf_to_gguf.py maps them back).
_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixtral: the router, and the stacked experts (ffn_*_exps), written one matrix per expert
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
# llama.cpp's stacked expert tensor -> Mixtral's per-expert matrix (w1 gate, w2 down, w3 up)
_HF_EXPERT = {
    "ffn_gate_exps.weight": "w1",
    "ffn_down_exps.weight": "w2",
    "ffn_up_exps.weight": "w3",
}

# What the generator writes: part of the generated model's id (steps/weights/sources.py
# generated_weights), so a changed generator never reuses a model an older one cached.
# 1: weights, config and tokenizer; 2: a chat template in tokenizer_config.json; 3: the
# tokenizer trained as Llama's (identity normalization, spaces kept) and tokenizer.json beside
# tokenizer.model (exllamav2 0.3.2 reads tokenizer.json only).
GENERATOR_VERSION = 3

# ChatML's layout ("<|im_start|>role\n...") with this tokenizer's own special tokens. The
# template opens with bos_token, as Hugging Face chat templates do: llama.cpp drops it again
# when the vocabulary adds a BOS itself (add_bos_token below), so the prompt has one BOS either
# way. A turn ends with eos_token (</s>) rather than ChatML's <|im_end|>: the vocabulary has no
# <|im_end|> token (byte fallback would spell it as ten byte tokens that no server stops at),
# while </s> is one token that llama-server ends a reply on. add_generation_prompt opens the
# assistant's turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "de", "ba", "po", "gu", "fe", "zi", "ha", "wy")


def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even, as torch does."""
    import numpy as np  # here: a no-op reads GENERATOR_VERSION and the corpus, never numpy (0.07 s)

    bits = a.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16).tobytes()


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], bytes]], dtype: str = "BF16") -> None:
    """The safetensors format: u64 header length, JSON header, then the raw tensor bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, data in tensors.values():
            f.write(data)


def corpus(n_lines: int, rng: random.Random) -> str:
    """Lines of words made of the tiny model's syllables: what its tokenizer was trained on."""
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(n_lines))


def train_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> None:
    """A SentencePiece BPE model (tokenizer.model) of exactly `vocab_size` pieces.

    BPE rather than unigram: unigram training stops short of the size on repetitive text.
    """
    import sentencepiece as spm

    rng = random.Random(seed)
    model = io.BytesIO()
    # the corpus from memory and the model into memory: with files, the trainer spec inside
    # tokenizer.model names their paths, so the same seed gave other bytes in another directory
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(20000, rng).splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
        hard_vocab_limit=True,
        # any byte has a token (<0x0A> for a newline, <0x48> for an "H" it never saw): text a
        # person types, and calibration text with newlines, must tokenize
        byte_fallback=True,
        # as Llama's own tokenizer.model: text kept as it is (no NFKC, spaces not collapsed), so
        # the tokenizer.json Hugging Face's Llama converter makes from it encodes alike
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",  # a newline stays <0x0A>, not a space (NFKC's rule)
    )
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": True,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def write_tiny_llama(out_dir: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Write a Hugging Face Llama checkpoint for `config` into out_dir; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = shape_from_config(config, where="tiny-llama config")
    if shape.arch != "llama" or shape.attention_bias:
        raise ValueError("write_tiny_llama writes Llama and Mixtral checkpoints (model_type llama/mixtral, no biases)")
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[tuple[int, ...], bytes]] = {}
    for t in model_tensors(shape):
        hf_shape = tuple(reversed(t.ne))  # torch order: (out_features, in_features)
        if t.cat is Cat.OTHER:
            values = np.ones(hf_shape, dtype=np.float32)  # norm weights start at one
        else:
            values = rng.normal(0.0, 0.02, size=hf_shape).astype(np.float32)
        if t.experts:  # (n_expert, out, in) -> one (out, in) matrix per expert
            leaf = t.name.split(".", 2)[2]
            for e in range(shape.num_experts):
                hf = f"model.layers.{t.layer}.block_sparse_moe.experts.{e}.{_HF_EXPERT[leaf]}.weight"
                tensors[hf] = (hf_shape[1:], _bf16_bytes(values[e]))
            continue
        if t.layer >= 0:  # blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight
            leaf = t.name.split(".", 2)[2]
            hf = f"model.layers.{t.layer}.{_HF_NAMES[leaf]}"
        else:
            hf = _HF_NAMES[t.name]
        tensors[hf] = (hf_shape, _bf16_bytes(values))
    write_safetensors(out_dir / "model.safetensors", tensors)
    moe = shape.model_type == "mixtral"
    full = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": shape.model_type,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        **config,
    }
    (out_dir / "config.json").write_text(json.dumps(full, indent=2))
    train_tokenizer(out_dir, shape.vocab_size, seed)
    write_tokenizer_json(out_dir)
    return out_dir


def cached_tokenizer_json(model: Path) -> Path:
    """Where the tokenizer.json made from this tokenizer.model is kept: by the model's sha256."""
    base = os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge"
    return Path(base) / "tokenizers" / f"{hashlib.sha256(model.read_bytes()).hexdigest()}.json"


def write_tokenizer_json(out_dir: Path) -> Path:
    """tokenizer.json beside the generated tokenizer.model, made by Hugging Face's Llama
    converter and checked to encode like the SentencePiece model (weights/tokenizer_json.py,
    the same code the quantize step runs on a host for a real model), on its sample text and on
    lines of the text the tokenizer was trained on.

    The training is deterministic (the same seed and size give the same bytes), so one made file
    serves every generation of that tokenizer: it is kept by the tokenizer.model's sha256
    (``cached_tokenizer_json``), and taken from there where transformers is not installed (a GPU
    device, whose payload has no room for it, carries the file made on the controller)."""
    model = out_dir / "tokenizer.model"
    out = out_dir / "tokenizer.json"
    cached = cached_tokenizer_json(model)
    if cached.is_file():
        shutil.copyfile(cached, out)
        return out
    from playbooks.modelgen.tokenizer_json import convert

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its import warns that there is no torch
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"the generated model's tokenizer.json is made with transformers, which is not installed "
            f"here: pip install 'voltaforge[tiny]', or put the file made elsewhere at {cached}"
        ) from None
    convert(str(model), str(out), corpus(50, random.Random(1)).splitlines())
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".partial")
    shutil.copyfile(out, tmp)
    tmp.replace(cached)
    return out
