"""The tokenizer.json an EXL2 conversion and TabbyAPI need, checked before anything touches the GPU.

exllamav2 0.3.2 reads ``tokenizer.json`` only: its SentencePiece ``tokenizer.model`` reader was
removed in 0.3.1, so a model that ships ``tokenizer.model`` alone (several Llama-2-era
repositories do) fails in the converter with "No supported tokenizer found", after the
measurement pass has been scheduled on the GPU. So before the conversion this step finds the
file; where only ``tokenizer.model`` is there it writes ``tokenizer.json`` beside it with Hugging
Face's Llama converter in the toolchain venv (weights/tokenizer_json.py, which checks the
result encodes like the SentencePiece model) and says so; with neither, or without transformers
to convert with, it refuses in one line naming the file.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from playbooks.facts import python, read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Shell
from playbooks.modelgen import tokenizer_json
from playbooks.steps.weights.model_layout import ModelLayout

#: the converter, pushed beside the model and run with the venv's python (a script of its own)
TOKENIZER_JSON_PATH = Path(tokenizer_json.__file__)

#: the converter's packages (steps/weights/gguf.py installs them for a GGUF quant as well)
NEEDS = ("transformers", "sentencepiece", "protobuf")


class EnsureTokenizerJson(Operation):
    """The model's hf/ holds a tokenizer.json (written from tokenizer.model where it has none)."""

    def __init__(self, layout: ModelLayout, venv: str):
        self.layout, self.venv = layout, venv
        self.name = "Ensure the model has a tokenizer.json (exllamav2 reads no other)"

    @property
    def key(self) -> str:
        return f"{self.name} for {self.layout.root}"

    def read(self, host: Host) -> dict[str, object]:
        hf = shlex.quote(self.layout.hf)
        found = read_fact(
            host, f"cd -- {hf} 2>/dev/null && ls -1 -- tokenizer.json tokenizer.model 2>/dev/null || true"
        )
        names = set(found.split())
        packages = {n: python.read_package_version(host, self.venv, n) for n in NEEDS}
        return {"json": "tokenizer.json" in names, "model": "tokenizer.model" in names, **packages}

    def decide(self, facts: dict[str, object]) -> Decision:
        hf = self.layout.hf
        if facts["json"]:
            return Decision.ok(f"{hf}/tokenizer.json is there")
        if not facts["model"]:
            raise OperationError(
                f"{hf} has no tokenizer.json (nor a tokenizer.model to make one from): exllamav2 0.3.2 "
                "reads only tokenizer.json; add it to the model"
            )
        missing = [n for n in NEEDS if not facts.get(n)]
        if missing:
            raise OperationError(
                f"{hf} has tokenizer.model but no tokenizer.json, which exllamav2 0.3.2 needs, and "
                f"{self.venv} lacks {', '.join(missing)} to convert it: add tokenizer.json to the "
                f"model, or install them there ({self.venv}/bin/pip install transformers protobuf)"
            )
        probe = f"{self.layout.root}/.tokenizer_json.py"
        run = f"{shlex.quote(self.venv + '/bin/python')} {shlex.quote(probe)} {shlex.quote(hf)}"
        return Decision.act(
            f"{hf} has tokenizer.model only: tokenizer.json written beside it by transformers' "
            f"LlamaConverter {facts['transformers']}, checked to encode alike",
            Shell(run),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        host.write_file(f"{self.layout.root}/.tokenizer_json.py", TOKENIZER_JSON_PATH.read_bytes(), 0o644)
        (cmd,) = decision.commands
        assert isinstance(cmd, Shell)
        out = host.run(cmd.command, stream=False, check=False).stdout.strip().splitlines()
        try:
            result = json.loads(out[-1]) if out else {}
        except ValueError:
            result = {"error": out[-1][:300]}
        if not isinstance(result, dict) or not result.get("written"):
            why = result.get("error") if isinstance(result, dict) else None
            raise OperationError(f"tokenizer.json could not be made from {self.layout.hf}/tokenizer.model: {why}")
