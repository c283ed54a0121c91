"""tests/draft_pair.py without the real tools: the edits it makes to a draft's
checkpoint, read back byte for byte (tests/test_speculation_real.py converts and serves them).

The draft here is written by hand (write_safetensors, a stand-in tokenizer file) so that no
SentencePiece training runs; the successor model's sentence tokens are given directly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from playbooks.modelgen.tinymodel import write_safetensors
from tests import draft_pair
from tests.draft_pair import (
    ZERO_OUTPUT,
    read_safetensors,
    successor_permutation,
    write_random_draft,
    write_successor_model,
    write_zero_layer_target,
)

V, H, FF, LAYERS = 256, 128, 192, 2
LEAVES = {
    "input_layernorm.weight": (H,),
    "self_attn.q_proj.weight": (H, H),
    "self_attn.k_proj.weight": (H // 2, H),
    "self_attn.v_proj.weight": (H // 2, H),
    "self_attn.o_proj.weight": (H, H),
    "post_attention_layernorm.weight": (H,),
    "mlp.gate_proj.weight": (FF, H),
    "mlp.up_proj.weight": (FF, H),
    "mlp.down_proj.weight": (H, FF),
}


def _bf16(a: np.ndarray) -> bytes:
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _from_bf16(data: bytes, shape) -> np.ndarray:
    return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


@pytest.fixture
def draft(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {"model.embed_tokens.weight": ((V, H), _bf16(rng.normal(0, 0.02, (V, H))))}
    for i in range(LAYERS):
        for leaf, shape in LEAVES.items():
            values = np.ones(shape) if "norm" in leaf else rng.normal(0, 0.02, shape)
            tensors[f"model.layers.{i}.{leaf}"] = (shape, _bf16(values))
    tensors["model.norm.weight"] = ((H,), _bf16(np.ones(H)))
    tensors["lm_head.weight"] = ((V, H), _bf16(rng.normal(0, 0.02, (V, H))))
    d = tmp_path / "draft"
    d.mkdir()
    write_safetensors(d / "model.safetensors", tensors)
    config = {"model_type": "llama", "num_hidden_layers": LAYERS, "hidden_size": H, "vocab_size": V}
    (d / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    (d / "tokenizer.model").write_bytes(b"stand-in sentencepiece model")
    (d / "tokenizer_config.json").write_text("{}")
    return d


def test_safetensors_read_back_as_written(draft):
    got = read_safetensors(draft / "model.safetensors")
    assert len(got) == 3 + LAYERS * len(LEAVES)  # embeddings, final norm, head
    dtype, shape, data = got["model.layers.1.mlp.down_proj.weight"]
    assert (dtype, shape, len(data)) == ("BF16", (H, FF), H * FF * 2)


def test_the_target_is_the_draft_byte_for_byte_plus_layers_that_add_zero(draft, tmp_path):
    target = write_zero_layer_target(draft, tmp_path / "target", extra_layers=3)
    src, got = read_safetensors(draft / "model.safetensors"), read_safetensors(target / "model.safetensors")
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == LAYERS + 3
    assert all(got[name] == tensor for name, tensor in src.items())
    assert set(got) - set(src) == {f"model.layers.{i}.{leaf}" for i in range(LAYERS, LAYERS + 3) for leaf in LEAVES}
    for i in range(LAYERS, LAYERS + 3):
        for leaf, shape in LEAVES.items():
            values = _from_bf16(got[f"model.layers.{i}.{leaf}"][2], shape)
            if leaf in ZERO_OUTPUT:
                assert not values.any(), leaf
            elif "norm" in leaf:
                assert (values == 1).all(), leaf
            else:
                assert 0.01 < values.std() < 0.03, leaf
    # the layers follow in order in the file, the head last (as a checkpoint lists them)
    names = list(got)
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["lm_head.weight", "model.norm.weight"]
    assert (target / "tokenizer.model").read_bytes() == (draft / "tokenizer.model").read_bytes()


def test_the_random_draft_has_the_shapes_and_tokenizer_and_other_weights(draft, tmp_path):
    other = write_random_draft(draft, tmp_path / "random")
    src, got = read_safetensors(draft / "model.safetensors"), read_safetensors(other / "model.safetensors")
    assert {n: t[:2] for n, t in got.items()} == {n: t[:2] for n, t in src.items()}
    for name in src:
        assert (got[name][2] == src[name][2]) == ("norm" in name), name
    assert json.loads((other / "config.json").read_text()) == json.loads((draft / "config.json").read_text())
    assert (other / "tokenizer.model").read_bytes() == (draft / "tokenizer.model").read_bytes()


def test_successor_permutation_cycles_the_sentence_and_runs_the_rest_on_one_long_cycle():
    cycle = [40, 7, 199, 3]
    f = successor_permutation(V, cycle)
    assert sorted(f) == list(range(V))  # a permutation
    assert [f[t] for t in cycle] == [7, 199, 3, 40]
    assert list(f[:3]) == [0, 1, 2]  # unk, bos, eos stay where they are
    t, seen = 5, []
    while t not in seen:
        seen.append(t)
        t = f[t]
    assert len(seen) == V - len(cycle) - 3 and not set(seen) & set(cycle)
    with pytest.raises(ValueError, match="distinct ordinary tokens"):
        successor_permutation(V, [5, 6, 5])
    with pytest.raises(ValueError, match="distinct ordinary tokens"):
        successor_permutation(V, [2, 9])


def test_the_successor_models_greedy_next_token_is_the_successor(draft, tmp_path, monkeypatch):
    monkeypatch.setattr(draft_pair, "sentence_ids", lambda _dir, _sentence: [11, 12, 13])
    model = write_successor_model(draft, tmp_path / "successor", "eleven twelve thirteen")
    got = read_safetensors(model / "model.safetensors")
    for i in range(LAYERS):
        for leaf in ZERO_OUTPUT:
            assert not any(got[f"model.layers.{i}.{leaf}"][2]), leaf
    # every layer adds zero, so the last hidden state is the token's embedding; RMS norm with
    # unit weights only scales it, and the head then picks f(t), for every token
    embed = _from_bf16(got["model.embed_tokens.weight"][2], (V, H))
    head = _from_bf16(got["lm_head.weight"][2], (V, H))
    f = successor_permutation(V, [11, 12, 13])
    assert ((embed @ head.T).argmax(axis=1) == f).all()
    assert f[13] == 11


def test_a_mixture_of_experts_is_refused(draft, tmp_path):
    config = json.loads((draft / "config.json").read_text()) | {"model_type": "mixtral"}
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dense Llama"):
        write_zero_layer_target(draft, tmp_path / "target", extra_layers=1)
