"""tokenizer.json for exllamav2 0.3.2, which reads no other tokenizer (a lent H200's conversion
stopped with "No supported tokenizer found" on the generated model, which shipped
tokenizer.model alone). Real parts: the SentencePiece model the generator trains, transformers'
LlamaConverter, the tokenizers library reading the result, and the quantize step's operation run
on this machine against a model directory, with this venv as the toolchain's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from playbooks.host.local import LocalHost
from playbooks.host.ops import run_ops
from playbooks.modelgen import tinymodel
from playbooks.steps.weights.exl2_tokenizer import EnsureTokenizerJson
from playbooks.steps.weights.model_layout import ModelLayout

SMALL = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_generated_model_ships_a_tokenizer_json_that_encodes_like_its_sentencepiece_model(tmp_path, cache):
    import sentencepiece as spm
    from tokenizers import Tokenizer

    from playbooks.modelgen.tokenizer_json import SAMPLES

    hf = tinymodel.write_tiny_llama(tmp_path / "hf", SMALL)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    fast = Tokenizer.from_file(str(hf / "tokenizer.json"))
    # text it was not checked on when made: other lines of its own kind, and a person's text
    texts = tinymodel.corpus(40, random.Random(77)).splitlines() + ["Hi there!\n\n  kalo  mine\truta ~ 42", *SAMPLES]
    assert all(fast.encode(t, add_special_tokens=False).ids == sp.encode(t) for t in texts)
    # a newline is its byte token, as in Llama's own tokenizer (no NFKC turning it into a space)
    assert "<0x0A>" in sp.encode("a\nb", out_type=str)
    # made once per tokenizer.model: the next generation takes it from the cache, same bytes
    (made,) = (cache / "tokenizers").glob("*.json")
    again = tinymodel.write_tiny_llama(tmp_path / "again", SMALL)
    assert (again / "tokenizer.json").read_bytes() == made.read_bytes() == (hf / "tokenizer.json").read_bytes()


def test_without_transformers_the_generator_names_what_to_install_or_where_the_file_goes(tmp_path, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'voltaforge\[tiny\]', or put the file made elsewhere at "):
        tinymodel.write_tiny_llama(tmp_path / "hf", SMALL)


def test_the_converter_refuses_a_tokenizer_json_that_encodes_otherwise(tmp_path, cache):
    """The check is real: text the fast tokenizer reads differently (it takes "<s>" as the BOS
    token, SentencePiece as characters) stops the write, and no file is left."""
    from playbooks.modelgen.tokenizer_json import convert

    tinymodel.train_tokenizer(tmp_path, 512)
    with pytest.raises(ValueError, match="tokenizer.json not written"):
        convert(str(tmp_path / "tokenizer.model"), str(tmp_path / "tokenizer.json"), ["<s> hello"])
    assert not list(tmp_path.glob("tokenizer.json*"))


def _layout(tmp_path: Path) -> ModelLayout:
    layout = ModelLayout(str(tmp_path / "prefix"), "m")
    Path(layout.hf).mkdir(parents=True)
    return layout


def test_the_quantize_step_writes_tokenizer_json_for_a_model_with_tokenizer_model_only(tmp_path):
    """A repository with tokenizer.model alone (several Llama-2-era ones): tokenizer.json is
    written beside it by the toolchain venv's transformers (this venv here), before any GPU
    work, and says so; a second run changes nothing."""
    layout = _layout(tmp_path)
    tinymodel.train_tokenizer(Path(layout.hf), 512)
    op = EnsureTokenizerJson(layout, sys.prefix)
    with LocalHost() as host:
        (first,) = run_ops(host, [op])
        assert first.status == "changed", first.why
        assert "has tokenizer.model only: tokenizer.json written beside it by transformers' LlamaConverter" in first.why
        assert (Path(layout.hf) / "tokenizer.json").is_file()
        (second,) = run_ops(host, [op])
        assert (second.status, second.why) == ("ok", f"{layout.hf}/tokenizer.json is there")


def test_a_model_without_any_tokenizer_or_a_venv_without_transformers_is_refused_in_one_line(tmp_path):
    layout = _layout(tmp_path)
    op = EnsureTokenizerJson(layout, sys.prefix)
    with LocalHost() as host:
        (none,) = run_ops(host, [op])
        assert none.status == "failed" and "\n" not in none.why
        assert none.why.startswith(f"{layout.hf} has no tokenizer.json (nor a tokenizer.model to make one from)")
        (Path(layout.hf) / "tokenizer.model").write_bytes(b"x")
        bare = EnsureTokenizerJson(layout, str(tmp_path / "no-venv"))
        (lacking,) = run_ops(host, [bare])
        assert lacking.status == "failed" and "lacks transformers, sentencepiece, protobuf" in lacking.why
        assert not (Path(layout.hf) / "tokenizer.json").exists()


def test_a_broken_tokenizer_model_fails_with_the_converters_line_and_writes_nothing(tmp_path):
    layout = _layout(tmp_path)
    (Path(layout.hf) / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with LocalHost() as host:
        (change,) = run_ops(host, [EnsureTokenizerJson(layout, sys.prefix)])
    assert change.status == "failed"
    assert change.why.startswith(f"tokenizer.json could not be made from {layout.hf}/tokenizer.model: ")
    assert not (Path(layout.hf) / "tokenizer.json").exists()
