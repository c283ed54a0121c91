#!/usr/bin/env python3
"""voltaforge tokenizer.json writer: pushed to the host that holds the weights, run with its venv python.

Why: exllamav2 0.3.2 reads ``tokenizer.json`` only (its SentencePiece ``tokenizer.model``
support went in 0.3.1: "No supported tokenizer found"), while several Llama-2-era repositories
and voltaforge's generated model ship ``tokenizer.model`` alone. This writes ``tokenizer.json``
beside it with Hugging Face's own converter for a SentencePiece Llama model
(``transformers.convert_slow_tokenizer.LlamaConverter``: ``tokenizers`` alone has no importer
for a SentencePiece BPE model), then checks on sample text that the new file encodes exactly
like the SentencePiece model before it keeps it (text that spells a special token, "<s>", is
left out: the fast tokenizer reads it as that token, SentencePiece as characters, by design).

    python tokenizer_json.py MODEL_DIR [--out PATH]

It prints ONE line of JSON on stdout and exits 0 when written, 1 otherwise:

    {"probe": "voltaforge-tokenizer-json", "written": "/m/hf/tokenizer.json", "pieces": 32000,
     "samples": 12, "transformers": "4.57.6"}
    {"probe": "voltaforge-tokenizer-json", "error": "<what>"}

The converter reads the model through protobuf. transformers takes sentencepiece's own
generated module when sentencepiece is installed, and sentencepiece 0.2.3's refuses any
protobuf runtime older than the one it was generated with (7.x); transformers' copy
(``sentencepiece_model_pb2_new``) works with any protobuf >= 4, so the converter is given that.
Python 3.8 compatible.
"""

import importlib
import json
import os
import sys
from typing import Any, Dict, List, Optional

PROBE = "voltaforge-tokenizer-json"

#: text a person types and calibration text holds: words, punctuation, digits, newlines, runs
#: of spaces, accents and scripts the vocabulary may only spell in bytes
SAMPLES = (
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\nafter a blank line\ttab",
    "numbers 0123456789 and 3.14159, 1e-5",
    "def f(x):\n    return x ** 2  # code",
    "caf\u00e9 na\u00efve \u00fcber \u00f1and\u00fa",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440",
    "emoji \U0001f600 and symbols <>&|~^",
    "",
)


def _own_protobuf_module() -> Any:
    """transformers' generated sentencepiece_model module (works with protobuf >= 4)."""
    protobuf = importlib.import_module("google.protobuf")
    new = int(protobuf.__version__.split(".")[0]) >= 4
    return importlib.import_module("transformers.utils.sentencepiece_model_pb2" + ("_new" if new else ""))


def convert(model_file: str, out: str, samples: Optional[List[str]] = None) -> Dict[str, Any]:
    """tokenizer.json for the SentencePiece model ``model_file``, written to ``out`` only when it
    encodes every sample like the model does; raises ValueError saying which sample differs."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not "None of PyTorch ... found" on every call
    import sentencepiece as spm

    transformers = importlib.import_module("transformers")
    cst = importlib.import_module("transformers.convert_slow_tokenizer")
    Tokenizer = importlib.import_module("tokenizers").Tokenizer

    setattr(cst, "import_protobuf", lambda error_message="": _own_protobuf_module())  # noqa: B010 (a module's function replaced)
    LlamaTokenizer = transformers.LlamaTokenizer
    slow = LlamaTokenizer(vocab_file=model_file, legacy=True)
    fast = cst.LlamaConverter(slow).converted()
    tmp = out + ".partial"
    fast.save(tmp)
    try:
        made = Tokenizer.from_file(tmp)
        sp = spm.SentencePieceProcessor(model_file=model_file)
        texts = list(SAMPLES) + list(samples or [])
        for text in texts:
            want = sp.encode(text)
            got = made.encode(text, add_special_tokens=False).ids
            if want != got:
                raise ValueError(
                    f"the converted tokenizer encodes {text[:60]!r} as {got[:12]}..., "
                    f"the SentencePiece model as {want[:12]}...: tokenizer.json not written"
                )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {
        "written": out,
        "pieces": sp.get_piece_size(),
        "samples": len(texts),
        "transformers": transformers.__version__,
    }


def main(argv: List[str]) -> int:
    args = [a for a in argv if a != "--"]
    out = None
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1:
        print(json.dumps({"probe": PROBE, "error": "usage: tokenizer_json.py MODEL_DIR [--out PATH]"}))
        return 1
    model = os.path.join(args[0], "tokenizer.model")
    try:
        if not os.path.isfile(model):
            raise ValueError(f"no tokenizer.model in {args[0]}")
        result = convert(model, out or os.path.join(args[0], "tokenizer.json"))
    except Exception as exc:  # one line, whatever failed: the step quotes it
        print(json.dumps({"probe": PROBE, "error": f"{type(exc).__name__}: {exc}"[:400]}))
        return 1
    print(json.dumps({"probe": PROBE, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
