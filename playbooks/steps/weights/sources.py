"""The weights on the controller, before they reach a host: a generated tiny model, a directory
(``model.path``), or a Hugging Face repository at a pinned revision; and the calibration text
a model is measured on."""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from playbooks.errors import VoltaforgeError
from playbooks.resources import resource_dir
from playbooks.steps.build.llamacpp_source import file_sha256


@dataclass(frozen=True)
class LocalWeights:
    """A model directory on the controller (generated, or the recipe's model.path), hashed."""

    model_id: str
    directory: Path
    files: dict[str, tuple[int, str]]  # name -> (bytes, sha256)
    origin: dict[str, Any]

    def manifest(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "origin": self.origin,
            "files": {k: {"bytes": b, "sha256": s} for k, (b, s) in sorted(self.files.items())},
        }

    @property
    def source_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.manifest(), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class HubWeights:
    """The recipe's model.repo at model.revision, downloaded by the host itself."""

    repo: str
    revision: str
    token_file: str | None = None

    @property
    def model_id(self) -> str:
        return f"{self.repo.replace('/', '--')}-{self.revision[:12]}"

    @property
    def origin(self) -> dict[str, Any]:
        return {"repo": self.repo, "revision": self.revision}

    @property
    def source_sha256(self) -> str:
        # a pinned revision is the commit itself; a branch is recorded as asked (and flagged by
        # the plan): the source manifest on the host holds the sha it resolved to
        return hashlib.sha256(f"{self.repo}@{self.revision}".encode()).hexdigest()


#: a controller file's sha256 by (path, size, mtime): the hosts of a fleet that share a model,
#: and the steps of one host that each name it, hash it once per run (a 14B model: 28 GB)
_HASHED: dict[tuple[str, int, int], str] = {}


def _hash_dir(directory: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        digest = _HASHED.get(key)
        if digest is None:
            digest = _HASHED[key] = file_sha256(p)
        out[p.name] = (st.st_size, digest)
    return out


def generated_weights(config: dict[str, Any], cache: Path) -> LocalWeights:
    """The tiny random Llama of `config`, generated once into the controller's cache."""
    from playbooks.modelgen.tinymodel import GENERATOR_VERSION, write_tiny_llama

    # The id names what is cached here and on hosts (models/<id>/: the weights, their GGUFs),
    # and a cached model is never regenerated: so the key holds the generator's version as well
    # as the config, and a generator that writes something new (a chat template, say) makes a
    # new model instead of reusing one an older generator left.
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    keyed = {"config_sha256": config_sha, "generator": GENERATOR_VERSION}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    model_id = f"tiny-llama-{key}"
    where = cache / model_id
    if not (where / ".complete").exists():
        tmp = cache / f".{model_id}.partial"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        write_tiny_llama(tmp, config)
        (tmp / ".complete").write_text("")
        tmp.rename(where)
    return LocalWeights(model_id, where, _hash_dir(where), {"generate": "tiny-llama", **keyed})


def path_weights(directory: Path) -> LocalWeights:
    if not directory.is_dir():
        raise VoltaforgeError(f"model.path {directory}: no such directory on the controller")
    hashed = _hash_dir(directory)
    if "config.json" not in hashed:
        raise VoltaforgeError(f"model.path {directory}: holds no config.json: not a Hugging Face model directory")
    digest = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:12]
    return LocalWeights(f"{directory.name}-{digest}", directory, hashed, {"path": str(directory)})


@functools.cache
def _generated_model_text() -> str:
    """The generated model's calibration text: the same every time, so made once per run."""
    from playbooks.modelgen.tinymodel import corpus

    return corpus(600, random.Random(1)) + "\nHello, World! The quick brown fox.\n"


def calibration_text(weights: LocalWeights | HubWeights, named: Path | None = None) -> str:
    """What imatrix and the KL divergence read: the recipe's file (``model.calibration``), else
    for the generated tiny model its own kind of text (words of its syllables, newlines, and a
    line with capitals it never saw: byte fallback covers them), else the shipped multi-domain
    text (recipes/calibration/general.txt: prose, dialogue, code, data, maths, Chinese and
    other languages, about 7-8 k tokens of a real tokenizer)."""
    if named is not None:
        try:
            text = named.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise VoltaforgeError(f"model.calibration {named}: cannot read it as UTF-8 text: {exc}") from None
        if len(text.split()) < 200:
            raise VoltaforgeError(f"model.calibration {named}: {len(text.split())} words; imatrix wants thousands")
        return text
    if isinstance(weights, LocalWeights) and weights.origin.get("generate"):
        return _generated_model_text()
    return (resource_dir("recipes") / "calibration" / "general.txt").read_text(encoding="utf-8")
