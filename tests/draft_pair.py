"""Generated models for speculative decoding with a known answer: a draft/target pair whose
greedy outputs agree by construction, a random draft whose proposals the target should almost
never accept, and a successor model for the n-gram types (tests/test_speculation_real.py
serves them and records what was measured).

- draft: the tiny Llama of tinymodel.write_tiny_llama (random BF16 weights, a SentencePiece
  tokenizer trained here);
- target: the draft's tensors, byte for byte, plus ``extra_layers`` decoder layers appended
  after its last one. Each extra layer's output projections (attention o_proj and MLP
  down_proj) are zero, so the layer adds exactly zero to the residual stream: the same
  function of the tokens as the draft, more bytes per token. The extra layers' other matrices
  are random, so they cost what a real layer costs (a zero matrix multiplies as slowly as any);
- random draft: the draft's shapes with other random weights (another seed), a different
  function, so its greedy proposals match the target's only by chance;
- successor model (for the draft-free n-gram types): the draft with every layer's output
  projections zero, so its logits depend on the current token only, and an lm_head whose row
  f(t) is token t's embedding, so its greedy next token is f(t) for a permutation f chosen
  here: one cycle through a sentence's tokens (the model continues that sentence forever) and
  one long cycle through the rest of the vocabulary (anything else runs on without repeating
  for thousands of tokens). Random weights alone do not give that contrast: a random model's
  greedy output falls into a loop of its own whatever the prompt, a loop that an n-gram
  lookup catches on prose as readily as on a repeated sentence.

All of them carry the draft's own tokenizer files, copied: llama.cpp refuses a draft whose
vocabulary differs from the target's (common_speculative_are_compatible, common/speculative.cpp:67).

Speculation with a pair like this, at the pinned llama.cpp (0c1e570, the llama-cpp-python
0.3.36 sdist's vendor/llama.cpp):

- ``--spec-type`` (common/arg.cpp:4249) takes a comma-separated list of the names in
  common/speculative.cpp:34-44: ``none``, ``draft-simple`` (a standalone draft model),
  ``draft-eagle3``, ``draft-mtp``, ``draft-dflash``, ``draft-dspark`` (draft heads),
  ``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod``, ``ngram-cache``
  (draft-free: proposals looked up in the text so far). The default is ``none``
  (common/common.h:373); with a draft model and no ``--spec-type`` the type is read from the
  draft GGUF's metadata (common/arg.cpp:566-573), so a test names it;
- ``--spec-draft-model`` / ``-md`` / ``--model-draft`` FNAME (common/arg.cpp:4241);
  ``--spec-draft-n-max`` N (arg.cpp:4140; default 3, common/common.h:328),
  ``--spec-draft-n-min`` (arg.cpp:4150), ``--spec-draft-p-min`` (arg.cpp:4197, default 0: a
  draft token is proposed whatever its probability, common.h:332); the draft-simple drafter
  takes the draft model's most likely token (its top-k 10 sampler's first candidate,
  speculative.cpp:236, 351-363);
- ``--spec-draft-threads`` / ``-td`` and ``--spec-draft-threads-batch`` / ``-tbd`` (arg.cpp:3982,
  3992): the draft's own threads, beside the target's ``-t`` / ``-tb``;
- ngram-mod: ``--spec-ngram-mod-n-match`` (lookup length, default 24), ``--spec-ngram-mod-n-min``
  / ``-n-max`` (default 48 / 64) (arg.cpp:4259-4288, common.h:354-359); ngram-simple:
  ``--spec-ngram-simple-size-n`` / ``-size-m`` / ``-min-hits`` (default 12 / 48 / 1)
  (arg.cpp:4290-4319, common.h:361-365); ngram-map-k and ngram-map-k4v:
  ``--spec-ngram-map-k-size-n`` ... and ``--spec-ngram-map-k4v-...`` with the same three
  (arg.cpp:4321-4381); ``--spec-default`` turns on ngram-mod with n-match 24, n-min 48,
  n-max 64 (arg.cpp:4723-4737); the old ``--draft-max`` / ``--draft-min`` /
  ``--spec-ngram-size-n`` are removed and refuse to start (arg.cpp:4387-4419);
- each response's ``timings`` carries ``draft_n`` (tokens drafted) and ``draft_n_accepted``
  only when something was drafted (tools/server/server-common.cpp:99-102); llama-server
  counts them per slot (tools/server/server-context.cpp:3034, 3961).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from playbooks.modelgen.tinymodel import write_safetensors, write_tiny_llama

#: the tokenizer files write_tiny_llama writes, copied so that every model here shares one vocabulary
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")
#: the extra layers' output projections: zero, so the layer adds nothing to the residual stream
ZERO_OUTPUT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class DraftPair:
    """Hugging Face directories: the draft, its agreeing target, and a random draft."""

    draft: Path
    target: Path
    random_draft: Path


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """A safetensors file's tensors: name -> (dtype, shape, raw bytes), in file order."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    out = {}
    for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = meta["data_offsets"]
        out[name] = (meta["dtype"], tuple(meta["shape"]), data[start:end])
    return out


def _order(name: str) -> tuple[int, int, str]:
    """Embeddings, then the layers in order, then the final norm and head."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return (0 if "embed_tokens" in name else 2, 0, name)


def _bf16(a: np.ndarray) -> bytes:
    """float32 -> bfloat16, round to nearest even (as tinymodel writes its weights)."""
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def _random(shape: tuple[int, ...], rng: np.random.Generator) -> bytes:
    return _bf16(rng.normal(0.0, 0.02, size=shape).astype(np.float32))


def _write(out_dir: Path, src_dir: Path, tensors: dict[str, tuple[tuple[int, ...], bytes]], **config: Any) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "model.safetensors", dict(sorted(tensors.items(), key=lambda kv: _order(kv[0]))))
    cfg = json.loads((src_dir / "config.json").read_text()) | config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copyfile(src_dir / name, out_dir / name)
    return out_dir


def _dense_bf16_llama(
    draft_dir: Path, who: str
) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...], bytes]]]:
    """The draft's config and tensors, checked to be what these writers edit: write_tiny_llama's
    dense Llama in BF16 (a Mixtral's experts would not be zeroed by their names here)."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{who} edits a dense Llama (model_type llama), not {cfg.get('model_type')!r}")
    src = read_safetensors(draft_dir / "model.safetensors")
    if any(dtype != "BF16" for dtype, _, _ in src.values()):
        raise ValueError(f"{who} reads write_tiny_llama's BF16 checkpoint")
    return cfg, src


def write_zero_layer_target(draft_dir: Path, out_dir: Path, extra_layers: int, seed: int = 1) -> Path:
    """The draft plus ``extra_layers`` layers after its last, each adding zero (o_proj and
    down_proj all zero; norms one; q, k, v, gate and up random from ``seed``)."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    if extra_layers < 1:
        raise ValueError("a target needs at least one extra layer")
    cfg, src = _dense_bf16_llama(draft_dir, "write_zero_layer_target")
    n = int(cfg["num_hidden_layers"])
    tensors = {name: (shape, data) for name, (_, shape, data) in src.items()}
    layer0 = {m.group(2): shape for name, (_, shape, _) in src.items() if (m := _LAYER.match(name)) and m[1] == "0"}
    rng = np.random.default_rng(seed)
    for i in range(n, n + extra_layers):
        for leaf, shape in layer0.items():
            if leaf in ZERO_OUTPUT:
                data = bytes(2 * int(np.prod(shape)))  # BF16 zeros
            elif "norm" in leaf:
                data = _bf16(np.ones(shape, dtype=np.float32))
            else:
                data = _random(shape, rng)
            tensors[f"model.layers.{i}.{leaf}"] = (shape, data)
    return _write(out_dir, draft_dir, tensors, num_hidden_layers=n + extra_layers)


def write_random_draft(draft_dir: Path, out_dir: Path, seed: int = 2) -> Path:
    """The draft's shapes and tokenizer with other random weights (norms one, the rest drawn
    from ``seed``): a model the target agrees with only by chance."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (_, shape, data) in read_safetensors(draft_dir / "model.safetensors").items():
        tensors[name] = (shape, data if "norm" in name else _random(shape, rng))
    return _write(out_dir, draft_dir, tensors)


def sentence_ids(tokenizer_dir: Path, sentence: str) -> list[int]:
    """The sentence's token ids under the SentencePiece model in tokenizer_dir."""
    import sentencepiece as spm

    return list(spm.SentencePieceProcessor(model_file=str(Path(tokenizer_dir) / "tokenizer.model")).encode(sentence))


def successor_permutation(
    vocab_size: int, cycle: list[int], seed: int = 3, fixed: tuple[int, ...] = (0, 1, 2)
) -> np.ndarray:
    """f as an array (f[t] is t's successor): ``cycle`` in order and back to its start, the
    ``fixed`` tokens (unk, bos, eos) to themselves, every other token on one long cycle in an
    order drawn from ``seed``."""
    if len(set(cycle)) != len(cycle) or set(cycle) & set(fixed) or not cycle:
        raise ValueError(f"the cycle needs distinct ordinary tokens, got {cycle}")
    f = np.arange(vocab_size)
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        f[a] = b
    rest = np.array([t for t in range(vocab_size) if t not in set(cycle) | set(fixed)])
    np.random.default_rng(seed).shuffle(rest)
    f[rest] = np.roll(rest, -1)
    return f


def write_successor_model(draft_dir: Path, out_dir: Path, sentence: str, seed: int = 3) -> Path:
    """The draft whose greedy next token is f(current token) for successor_permutation(the
    sentence's tokens): every layer's o_proj and down_proj zero (the residual stream stays the
    current token's embedding), lm_head row f(t) = embedding row t. A token's own embedding
    scores sqrt(hidden) standard deviations above any other row's (random rows are nearly
    orthogonal), so quantization does not move the argmax."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    cfg, src = _dense_bf16_llama(draft_dir, "write_successor_model")
    if cfg.get("tie_word_embeddings", False):
        raise ValueError("write_successor_model needs an lm_head of its own (tie_word_embeddings false)")
    tensors = {name: (shape, data) for name, (_, shape, data) in src.items()}
    for name, (shape, _) in tensors.items():
        m = _LAYER.match(name)
        if m and m.group(2) in ZERO_OUTPUT:
            tensors[name] = (shape, bytes(2 * int(np.prod(shape))))
    shape, embed = tensors["model.embed_tokens.weight"]
    f = successor_permutation(shape[0], sentence_ids(draft_dir, sentence), seed)
    inverse = np.empty_like(f)
    inverse[f] = np.arange(len(f))
    rows = np.frombuffer(embed, dtype=np.uint16).reshape(shape)
    tensors["lm_head.weight"] = (shape, rows[inverse].tobytes())  # row f(t) = embedding of t
    return _write(out_dir, draft_dir, tensors)


def write_draft_pair(out_dir: Path, config: dict[str, Any], extra_layers: int, seed: int = 0) -> DraftPair:
    """The draft (write_tiny_llama of ``config`` with ``seed``) under out_dir/draft, its target
    with ``extra_layers`` zero-output layers under out_dir/target, and a random draft (another
    seed) under out_dir/random-draft."""
    out_dir = Path(out_dir)
    draft = write_tiny_llama(out_dir / "draft", config, seed)
    target = write_zero_layer_target(draft, out_dir / "target", extra_layers, seed=seed + 1)
    random_draft = write_random_draft(draft, out_dir / "random-draft", seed=seed + 2)
    return DraftPair(draft, target, random_draft)
