"""`invoke quantize`, GGUF: the weights fetched once, converted to F16, quantized from the
current build, each file verified before it counts and described by a manifest.

On the host, under ``<prefix>/models/<model id>/``:

- ``hf/``: the original weights and ``.voltaforge-source.json`` (every file's size and sha256,
  where they came from). A generated tiny model (``model.generate``) or a directory on the
  controller (``model.path``) is pushed file by file, checksummed, into ``hf.partial/`` and
  renamed when complete.
- ``gguf/<id>-F16.gguf``: ``convert_hf_to_gguf.py --outtype f16`` from the llama.cpp tree the
  current build came from, run by the toolchain venv; verified against the original weights
  (the same token ids through llama-cpp-python and through transformers: top-1 agreement and
  the largest logit difference).
- ``gguf/imatrix.gguf``: ``llama-imatrix`` on the calibration text, when ``planner.imatrix``.
- ``gguf/<id>-<TYPE>.gguf``: ``llama-quantize [--imatrix] F16 out TYPE``; verified against the
  F16 file with ``llama-perplexity --kl-divergence`` (mean KLD, same top token) and by loading
  it through llama-cpp-python and generating (finite logits, output).

Every artifact is written as ``<file>.partial`` and renamed only after its verification, then
described by ``<file>.manifest.json`` (inputs, tools, bytes, sha256, the planner's predicted
bytes, the verification figures). A file without a manifest does not count. The same inputs
again are ``ok (artifact present)`` after a ``stat``: size and mtime against the manifest, no
re-hash (``--verify`` re-hashes).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import random
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.errors import HostError, VoltaforgeError
from playbooks.facts import builds, files, python, read_fact, system
from playbooks.facts import weights as weights_facts
from playbooks.facts.artifacts import (
    GGUF_CHECK_PATH,
    HUB_FETCH_PATH,
    parse_gguf_check,
    parse_hub_fetch,
    parse_kld,
    parse_stat_size_mtime,
    stat_size_mtime_command,
)
from playbooks.facts.unreachable import network_cause
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, PushFile, Record, Shell, Upload, run_command
from playbooks.plan.gguf_size import estimate_gguf
from playbooks.plan.gpus import size_text
from playbooks.plan.model_config import ModelShape
from playbooks.resources import resource_dir
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.buildenv import env_prefix
from playbooks.steps.build.llamacpp_source import file_sha256
from playbooks.steps.build.proven_build import Probe, build_failure
from playbooks.steps.build.toolchain import pip_install_keeping_torch, read_local_wheels, run_pip

SOURCE_MANIFEST = ".voltaforge-source.json"
#: convert_hf_to_gguf.py's imports (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt),
#: torch aside: the toolchain pins it
CONVERT_REQUIREMENTS = ("transformers>=4.45,<5", "sentencepiece>=0.2,<0.3", "protobuf>=4.21,<5", "safetensors")
#: how many 128-token chunks imatrix and the KL divergence read (a small, fixed sample)
CALIBRATION_CHUNKS = 20
CALIBRATION_CTX = 128


# ------------------------------------------------------------------------------------------
# where things are
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLayout:
    prefix: str
    model_id: str

    @property
    def root(self) -> str:
        return f"{self.prefix}/models/{self.model_id}"

    @property
    def hf(self) -> str:
        return f"{self.root}/hf"

    @property
    def gguf_dir(self) -> str:
        return f"{self.root}/gguf"

    def gguf(self, quant: str) -> str:
        return f"{self.gguf_dir}/{self.model_id}-{quant}.gguf"

    @property
    def imatrix(self) -> str:
        return f"{self.gguf_dir}/imatrix.gguf"

    @property
    def calibration(self) -> str:
        return f"{self.root}/calibration.txt"

    @property
    def prompt(self) -> str:
        return f"{self.root}/prompt.txt"

    @property
    def kld_base(self) -> str:
        return f"{self.gguf_dir}/F16.kld"


def manifest_path(artifact: str) -> str:
    return f"{artifact}.manifest.json"


# ------------------------------------------------------------------------------------------
# the weights, on the controller
# ------------------------------------------------------------------------------------------


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


def _hash_dir(directory: Path) -> dict[str, tuple[int, str]]:
    wanted = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")]
    return {p.name: (p.stat().st_size, file_sha256(p)) for p in wanted}


def generated_weights(config: dict[str, Any], cache: Path) -> LocalWeights:
    """The tiny random Llama of `config`, generated once into the controller's cache."""
    from playbooks.weights.tinymodel import GENERATOR_VERSION, write_tiny_llama

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
        from playbooks.weights.tinymodel import corpus

        return corpus(600, random.Random(1)) + "\nHello, World! The quick brown fox.\n"
    return (resource_dir("recipes") / "calibration" / "general.txt").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------
# operations
# ------------------------------------------------------------------------------------------


class EnsureWeights(Operation):
    """The original weights on the host, exactly these files (size and sha256 recorded)."""

    def __init__(self, layout: ModelLayout, weights: LocalWeights):
        self.layout, self.weights = layout, weights
        self.name = f"Ensure the weights of {weights.model_id} are on the host"

    def read(self, host: Host) -> tuple[dict[str, Any] | None, int | None]:
        text = read_fact(host, f"cat -- {shlex.quote(self.layout.hf + '/' + SOURCE_MANIFEST)} 2>/dev/null || true")
        disk = system.parse_df(read_fact(host, system.disk_free_command([self.layout.root]))).get(self.layout.root)
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        return (data if isinstance(data, dict) else None), (disk.available_bytes if disk else None)

    def decide(self, facts: tuple[dict[str, Any] | None, int | None]) -> Decision:
        manifest, free = facts
        want = self.weights.manifest()
        total = sum(b for b, _ in self.weights.files.values())
        if manifest and manifest.get("files") == want["files"]:
            return Decision.ok(f"{len(want['files'])} files, {size_text(total)}, checked by sha256 when pushed")
        if free is not None and free < 2 * total:
            raise OperationError(
                f"{size_text(free)} free under {self.layout.root}, the weights need about {size_text(2 * total)} "
                "(the files and their F16 conversion): free space there"
            )
        tmp = self.layout.hf + ".partial"
        cmds: list[Shell | PushFile | Upload] = [Shell(f"mkdir -p -- {shlex.quote(tmp)}")]
        for name, (_, sha) in sorted(self.weights.files.items()):
            cmds.append(PushFile(f"{tmp}/{name}", self.weights.directory / name, sha))
        cmds.append(Upload(f"{tmp}/{SOURCE_MANIFEST}", (json.dumps(want, indent=2) + "\n").encode(), 0o644))
        q = shlex.quote(self.layout.hf)
        cmds.append(Shell(f"rm -rf -- {q} && mv -T -- {shlex.quote(tmp)} {q}"))
        why = "not on the host" if not manifest else "the host has other files"
        return Decision.act(f"{why}: pushing {len(want['files'])} files ({size_text(total)})", *cmds)


class EnsureFp16Range(Operation):
    """V100 has no BF16: the weights become FP16, where a BF16 value of magnitude 65408 or more
    is inf. Count such values shard by shard on the host (facts/probes/fp16_range_probe.py),
    once per set of weights (the result is kept beside them), and refuse with the count and the
    tensors named."""

    def __init__(self, layout: ModelLayout, venv: str, source_sha256: str, clamp: bool = False):
        self.layout, self.venv, self.source_sha256, self.clamp = layout, venv, source_sha256, clamp
        self.result = f"{layout.root}/fp16-range.json"
        self.name = "Ensure every weight fits FP16 (V100 has no BF16)"

    @property
    def key(self) -> str:
        return f"{self.name} for {self.layout.root}"

    def read(self, host: Host) -> dict[str, Any] | None:
        text = read_fact(host, f"cat -- {shlex.quote(self.result)} 2>/dev/null || true")
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            return None
        return data if isinstance(data, dict) and data.get("source_sha256") == self.source_sha256 else None

    def decide(self, facts: dict[str, Any] | None) -> Decision:
        unclamped = facts is not None and facts.get("overflow_values") and not facts.get("clamped")
        if facts is not None and not (unclamped and self.clamp):
            if unclamped:
                raise OperationError(str(facts.get("summary")))
            return Decision.ok(str(facts.get("summary")))
        probe = f"{self.layout.root}/.fp16_range_probe.py"
        python = f"{self.venv}/bin/python"
        commands = [Probe(weights_facts.fp16_range_command(python, probe, [self.layout.hf]), key="fp16_range")]
        if self.clamp:
            # the recipe says clamp (model.fp16_overflow: clamp): on overflow, clamped copies of
            # the shards replace the originals before conversion (written aside, then moved)
            clamped = f"{self.layout.root}/hf.clamped"
            commands.append(
                Probe(
                    weights_facts.fp16_range_command(python, probe, [self.layout.hf], clamp_dir=clamped),
                    key="clamp",
                )
            )
        return Decision.act("not checked for these weights", *commands)

    def apply(self, host: Host, decision: Decision) -> None:
        host.write_file(
            f"{self.layout.root}/.fp16_range_probe.py", weights_facts.FP16_RANGE_PROBE_PATH.read_bytes(), 0o644
        )
        probes = {c.key: c for c in decision.commands if isinstance(c, Probe)}
        found = weights_facts.parse_fp16_range(host.run(probes["fp16_range"].command, stream=False, check=False).stdout)
        if found.error:
            raise OperationError(found.summary)
        record: dict[str, Any] = {
            "source_sha256": self.source_sha256,
            "summary": found.summary,
            "overflow_values": found.overflow_values,
            "nonfinite_values": found.nonfinite_values,
            "dtypes": found.dtypes,
        }
        if found.overflow_values and "clamp" in probes:
            done = weights_facts.parse_fp16_range(host.run(probes["clamp"].command, stream=False, check=False).stdout)
            if done.error or not done.written:
                raise OperationError(f"clamping failed: {done.summary}")
            moves = " && ".join(
                f"mv -f -- {shlex.quote(w)} {shlex.quote(self.layout.hf + '/' + posixpath.basename(w))}"
                for w in done.written
            )
            host.run(f"{moves} && rm -rf -- {shlex.quote(self.layout.root + '/hf.clamped')}", stream=False)
            record["clamped"] = done.clamped_values
            record["summary"] = f"{found.summary}; clamped to the largest FP16-safe value, as the recipe says"
        host.write_file(self.result, (json.dumps(record, indent=2) + "\n").encode(), 0o644)
        if found.overflow_values and "clamped" not in record:
            raise OperationError(
                found.summary + ": the converted model would compute inf; fix the checkpoint, or set "
                "model.fp16_overflow: clamp in the recipe"
            )


@dataclass(frozen=True)
class HubFacts:
    manifest: dict[str, Any] | None
    token_mode: int | None  # the token file's permission bits; None: no such file
    disk_free: int | None


class EnsureHubWeights(Operation):
    """model.repo at model.revision on the host: only the files a conversion needs, resumable,
    every LFS file checked against the sha256 the hub publishes, the token from a 0600 file
    (huggingface_hub reads HF_TOKEN_PATH itself: never argv, never a log)."""

    def __init__(self, layout: ModelLayout, weights: HubWeights, venv: str, need_bytes: int):
        self.layout, self.weights, self.venv, self.need_bytes = layout, weights, venv, need_bytes
        self.name = f"Ensure {weights.repo} at {weights.revision[:12]} is downloaded"

    def read(self, host: Host) -> HubFacts:
        text = read_fact(host, f"cat -- {shlex.quote(self.layout.hf + '/' + SOURCE_MANIFEST)} 2>/dev/null || true")
        try:
            manifest = json.loads(text) if text.strip() else None
        except ValueError:
            manifest = None
        mode = None
        if self.weights.token_file:
            stat = files.parse_stat(read_fact(host, files.stat_command(self.weights.token_file)))
            mode = stat.mode if stat else None
        disk = system.parse_df(read_fact(host, system.disk_free_command([self.layout.root]))).get(self.layout.root)
        return HubFacts(manifest if isinstance(manifest, dict) else None, mode, disk.available_bytes if disk else None)

    def decide(self, facts: HubFacts) -> Decision:
        w = self.weights
        m = facts.manifest or {}
        if m.get("origin", {}).get("repo") == w.repo and m.get("origin", {}).get("revision") == w.revision:
            sha = str(m["origin"].get("sha", "?"))
            return Decision.ok(f"{len(m.get('files', {}))} files at {sha[:12]}, checked against the hub's sha256")
        if w.token_file and facts.token_mode is None:
            raise OperationError(f"model.token_file {w.token_file} does not exist on the host")
        if w.token_file and facts.token_mode is not None and facts.token_mode & 0o077:
            raise OperationError(
                f"model.token_file {w.token_file} is mode {facts.token_mode:04o}: others can read the token; "
                "chmod 600 it"
            )
        if facts.disk_free is not None and facts.disk_free < self.need_bytes:
            raise OperationError(
                f"{size_text(facts.disk_free)} free under {self.layout.root}, {w.repo} needs about "
                f"{size_text(self.need_bytes)} (the weights and the F16 file): free space there"
            )
        env = {"HF_HUB_DISABLE_TELEMETRY": "1", **({"HF_TOKEN_PATH": w.token_file} if w.token_file else {})}
        script = shlex.quote(f"{self.layout.root}/.hub_fetch.py")
        tmp = shlex.quote(self.layout.hf + ".partial")
        fetch = Probe(
            f"{env_prefix(env)} {shlex.quote(self.venv + '/bin/python')} {script} {shlex.quote(w.repo)} "
            f"{shlex.quote(w.revision)} {tmp}",
            key="fetch",
        )
        record = Record(f"{self.layout.hf}.partial/{SOURCE_MANIFEST}", "the source manifest")
        q = shlex.quote(self.layout.hf)
        return Decision.act(
            "not downloaded" if not m else "another revision is on the host",
            Shell(f"mkdir -p -- {tmp}"),
            fetch,
            record,
            Shell(f"rm -rf -- {q} && mv -T -- {tmp} {q}"),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        host.write_file(f"{self.layout.root}/.hub_fetch.py", HUB_FETCH_PATH.read_bytes(), 0o644)
        result: dict[str, Any] = {}
        for cmd in decision.commands:
            if isinstance(cmd, Probe):
                result = parse_hub_fetch(host.run(cmd.command, stream=False, check=False).stdout)
                if "error" in result:
                    raise OperationError(self._error(result))
            elif isinstance(cmd, Record):
                manifest = {
                    "model_id": self.weights.model_id,
                    "origin": {**self.weights.origin, "sha": result.get("sha")},
                    "files": result.get("files", {}),
                }
                host.write_file(cmd.path, (json.dumps(manifest, indent=2) + "\n").encode(), 0o644)
            else:
                run_command(host, cmd)

    def _error(self, result: dict[str, Any]) -> str:
        w, kind, message = self.weights, result.get("error"), result.get("message", "")
        where = w.token_file or "a 0600 file"
        return {
            "revision-not-found": f"{w.repo} has no revision {w.revision!r} (model.revision): "
            "pin an existing commit sha",
            "gated": f"{w.repo} is gated: accept its terms on huggingface.co, put a read token in {where} on the "
            "host and name it in model.token_file",
            "repo-not-found": f"no repo {w.repo} on the hub, or it is private: set model.token_file",
            "unreachable": f"the host cannot reach huggingface.co ({network_cause(message)}): give it access, or "
            f"stage the weights: on a machine with access run `huggingface-cli download {w.repo} --revision "
            f"{w.revision} --local-dir DIR`, copy DIR to this controller and set model.path to it instead of "
            "model.repo",
            "corrupt": f"{w.repo}: {message}: the download is corrupt; re-run to fetch it again",
        }.get(str(kind), f"downloading {w.repo} failed: {message}")


class EnsureConvertDeps(Operation):
    """What convert_hf_to_gguf.py imports, in the toolchain venv, torch left as pinned."""

    def __init__(self, venv: str, tc: Any):
        self.venv, self.tc = venv, tc
        self.name = "Ensure the converter's Python packages are in the venv"

    def read(self, host: Host) -> dict[str, str | None]:
        names = ("torch", "transformers", "sentencepiece", "safetensors", "llama_cpp_python")
        facts = {n: python.read_package_version(host, self.venv, n) for n in names}
        return {**facts, "pip_find_links": "yes" if read_local_wheels(host) else None}

    def decide(self, facts: dict[str, str | None]) -> Decision:
        if not facts.get("torch"):
            raise OperationError(f"no torch in {self.venv}: run `invoke toolchain` first (the converter imports it)")
        if not facts.get("llama_cpp_python"):
            raise OperationError(f"no llama-cpp-python in {self.venv}: run `invoke build` first (it verifies GGUFs)")
        missing = [n for n in ("transformers", "sentencepiece", "safetensors") if not facts.get(n)]
        if not missing:
            return Decision.ok(f"transformers {facts['transformers']}, sentencepiece {facts['sentencepiece']}")
        return Decision.act(
            f"missing: {', '.join(missing)}",
            Shell(
                pip_install_keeping_torch(
                    self.venv, self.tc, *CONVERT_REQUIREMENTS, local_wheels=bool(facts.get("pip_find_links"))
                )
            ),
        )

    def apply(self, host: Host, decision: Decision) -> None:
        for cmd in decision.commands:
            assert isinstance(cmd, Shell)  # decide() makes only the pip install
            run_pip(host, cmd.command, self.tc, *CONVERT_REQUIREMENTS)


@dataclass(frozen=True)
class ArtifactFacts:
    manifest: dict[str, Any] | None = None
    stat: tuple[int, int] | None = None  # (bytes, mtime) of the artifact
    build: dict[str, Any] | None = None  # the current llama.cpp build's stamp
    disk_free: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class EnsureGguf(Operation):
    """One GGUF artifact (F16 or a quant type), made from the current build, verified, with
    its manifest; or ok when its manifest says it was made from the same inputs."""

    def __init__(
        self,
        layout: ModelLayout,
        build: BuildLayout,
        venv: str,
        weights: LocalWeights | HubWeights,
        shape: ModelShape,
        quant: str,
        *,
        imatrix: bool = False,
        kld_ceiling: float | None = None,
        verify: bool = False,
        recipe_sha256: str | None = None,
    ):
        self.layout, self.build, self.venv, self.weights, self.shape = layout, build, venv, weights, shape
        self.recipe_sha256 = recipe_sha256
        self.quant, self.imatrix, self.kld_ceiling, self.verify = quant, imatrix and quant != "F16", kld_ceiling, verify
        self.path = layout.gguf(quant)
        self.name = f"Ensure {weights.model_id} {quant} GGUF is made and verified"

    # -- facts -------------------------------------------------------------------------------

    def read(self, host: Host) -> ArtifactFacts:
        text = read_fact(host, f"cat -- {shlex.quote(manifest_path(self.path))} 2>/dev/null || true")
        try:
            manifest = json.loads(text) if text.strip() else None
        except ValueError:
            manifest = None
        stamp = builds.parse_stamp(read_fact(host, builds.stamp_command(self.build.current)))
        disk = system.parse_df(read_fact(host, system.disk_free_command([self.layout.gguf_dir]))).get(
            self.layout.gguf_dir
        )
        facts = ArtifactFacts(
            manifest=manifest if isinstance(manifest, dict) else None,
            stat=parse_stat_size_mtime(read_fact(host, stat_size_mtime_command(self.path))),
            build=stamp,
            disk_free=disk.available_bytes if disk else None,
        )
        if self.verify and facts.manifest and facts.stat:
            facts.extra["sha256"] = files.parse_sha256(read_fact(host, files.sha256_command(self.path)))
        return facts

    # -- decision ----------------------------------------------------------------------------

    def inputs(self, build: dict[str, Any]) -> dict[str, Any]:
        return {
            "model_id": self.weights.model_id,
            "source_sha256": self.weights.source_sha256,
            "quant": self.quant,
            "imatrix": self.imatrix,
            "llama_cpp_build": build.get("id"),
        }

    def predicted_bytes(self) -> int:
        return estimate_gguf(self.shape, self.quant, imatrix=self.imatrix).file_bytes

    def decide(self, facts: ArtifactFacts) -> Decision:
        if not facts.build:
            raise OperationError(f"no proven llama.cpp build at {self.build.current}: run `invoke build` first")
        inputs = self.inputs(facts.build)
        m = facts.manifest or {}
        if m.get("inputs") == inputs and facts.stat and facts.stat == (m.get("bytes"), m.get("mtime")):
            if self.verify:
                if facts.extra.get("sha256") != m.get("sha256"):
                    raise OperationError(
                        f"{self.path}: sha256 {str(facts.extra.get('sha256'))[:12]} is not the manifest's "
                        f"{str(m.get('sha256'))[:12]}: the file changed after it was verified; delete it and re-run"
                    )
                return Decision.ok(f"artifact present, sha256 re-checked ({m['sha256'][:12]})")
            return Decision.ok(f"artifact present ({size_text(m['bytes'])}, sha256 {m['sha256'][:12]})")
        need = 2 * self.predicted_bytes()
        if facts.disk_free is not None and facts.disk_free < need:
            raise OperationError(
                f"{size_text(facts.disk_free)} free under {self.layout.gguf_dir}, {self.quant} needs about "
                f"{size_text(need)} (the file and its scratch): free space there"
            )
        why = (
            "not made yet"
            if not m
            else "made from other inputs"
            if m.get("inputs") != inputs
            else "the file changed since its manifest"
        )
        partial = f"{self.path}.partial"
        bin_dir = f"{self.build.current}/bin"
        py = shlex.quote(f"{self.venv}/bin/python")
        check = shlex.quote(f"{self.layout.root}/.gguf_check.py")
        q, qp = shlex.quote(self.path), shlex.quote(partial)
        cmds: list[Any] = [Shell(f"mkdir -p -- {shlex.quote(self.layout.gguf_dir)} && rm -f -- {qp}")]
        verify: list[Probe] = []
        if self.quant == "F16":
            # the converter of the very tree the current build was compiled from
            made = facts.build.get("inputs") or {}
            tree = f"{made.get('prefix')}/src/llama.cpp-{made.get('ref')}-{str(made.get('source_sha256'))[:12]}"
            convert = shlex.quote(f"{tree}/convert_hf_to_gguf.py")
            cmds.append(Shell(f"{py} {convert} {shlex.quote(self.layout.hf)} --outtype f16 --outfile {qp}"))
            verify.append(
                Probe(
                    f"{py} {check} compare {qp} {shlex.quote(self.layout.hf)} {shlex.quote(self.layout.prompt)}",
                    key="compare",
                )
            )
        else:
            f16 = shlex.quote(self.layout.gguf("F16"))
            imx = f"--imatrix {shlex.quote(self.layout.imatrix)} " if self.imatrix else ""
            cmds.append(Shell(f"{shlex.quote(bin_dir + '/llama-quantize')} {imx}{f16} {qp} {shlex.quote(self.quant)}"))
            common = f"-c {CALIBRATION_CTX} --chunks {CALIBRATION_CHUNKS}"
            verify.append(
                Probe(
                    f"{shlex.quote(bin_dir + '/llama-perplexity')} -m {qp} {common} "
                    f"--kl-divergence-base {shlex.quote(self.layout.kld_base)} --kl-divergence 2>&1",
                    key="kld",
                )
            )
        verify.append(Probe(f"{py} {check} run {qp} {shlex.quote(self.layout.prompt)}", key="run"))
        tools = {
            "llama_cpp_build": facts.build.get("id"),
            "llama_server_version": facts.build.get("llama_server_version"),
            "llama_cpp_ref": (facts.build.get("inputs") or {}).get("ref"),
        }
        meta = {"inputs": inputs, "tools": tools, "recipe_sha256": self.recipe_sha256}
        record = Record(manifest_path(self.path), "the manifest", json.dumps(meta, sort_keys=True))
        cmds += [*verify, Shell(f"mv -f -- {qp} {q}"), record]
        return Decision.act(why, *cmds)

    # -- acting ------------------------------------------------------------------------------

    def apply(self, host: Host, decision: Decision) -> None:
        host.write_file(f"{self.layout.root}/.gguf_check.py", GGUF_CHECK_PATH.read_bytes(), 0o644)
        proof: dict[str, Any] = {}
        try:
            for cmd in decision.commands:
                if isinstance(cmd, Probe):
                    result = host.run(cmd.command, stream=False, check=False)
                    proof[cmd.key] = self._judge(cmd.key, result.stdout, result.exited)
                elif isinstance(cmd, Record):
                    host.write_file(cmd.path, self._manifest(host, **json.loads(cmd.meta), proof=proof), 0o644)
                else:
                    run_command(host, cmd)
        except OperationError:
            host.run(f"rm -f -- {shlex.quote(self.path + '.partial')}", stream=False, check=False)
            raise
        except HostError as exc:
            host.run(f"rm -f -- {shlex.quote(self.path + '.partial')}", stream=False, check=False)
            raise build_failure(exc, "re-run", during=f"the {self.quant} GGUF") from None

    def _judge(self, key: str, output: str, code: int) -> dict[str, Any]:
        """The verification figures, or a one-line refusal saying which check failed and why."""
        what = f"{self.quant} GGUF"
        if key == "kld":
            kld = parse_kld(output)
            if code != 0 or kld is None:
                tail = (output.strip().splitlines() or ["no output"])[-1][:200]
                raise OperationError(f"{what}: llama-perplexity --kl-divergence failed (exit {code}): {tail}")
            if kld["mean_kld"] != kld["mean_kld"]:  # NaN
                raise OperationError(f"{what}: the KL divergence against F16 is NaN: the file is broken")
            if self.kld_ceiling is not None and kld["mean_kld"] > self.kld_ceiling:
                raise OperationError(
                    f"{what}: mean KLD {kld['mean_kld']:.4f} against F16 is above the recipe's ceiling "
                    f"{self.kld_ceiling}"
                )
            return kld
        check = parse_gguf_check(output)
        if check.get("error"):
            raise OperationError(f"{what}: {key} check failed: {check['error']}")
        if not check.get("finite", False):
            raise OperationError(f"{what}: NaN or inf in the logits ({key} check)")
        if key == "run" and not check.get("tokens_out"):
            raise OperationError(f"{what}: loads but generates nothing")
        return check

    def _manifest(
        self,
        host: Host,
        inputs: dict[str, Any],
        tools: dict[str, Any],
        recipe_sha256: str | None,
        proof: dict[str, Any],
    ) -> bytes:
        stat = parse_stat_size_mtime(read_fact(host, stat_size_mtime_command(self.path)))
        if stat is None:
            raise OperationError(f"{self.path}: missing after the rename")
        sha = host.sha256(self.path)
        manifest = {
            "path": self.path,
            "kind": "gguf",
            "quant": self.quant,
            "model_id": self.weights.model_id,
            "source": self.weights.origin,
            "inputs": inputs,
            "tools": tools,
            "recipe_sha256": recipe_sha256,
            "bytes": stat[0],
            "mtime": stat[1],
            "sha256": sha,
            "predicted_bytes": self.predicted_bytes(),
            "verification": proof,
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


class EnsureReference(Operation):
    """What every quant is made and judged against, computed once per F16 file: the F16
    logits on the calibration text (the KL divergence's base) and, when the planner wants it,
    the importance matrix (llama-imatrix). Keyed by the F16 file's sha256."""

    def __init__(self, layout: ModelLayout, build: BuildLayout, imatrix: bool):
        self.layout, self.build, self.imatrix = layout, build, imatrix
        self.marker = f"{layout.gguf_dir}/reference.source"
        self.name = "Ensure the F16 reference (KL divergence base" + (", importance matrix)" if imatrix else ")")

    @property
    def key(self) -> str:
        return f"{self.name} for {self.layout.root}"

    def read(self, host: Host) -> tuple[str | None, str | None]:
        text = read_fact(host, f"cat -- {shlex.quote(manifest_path(self.layout.gguf('F16')))} 2>/dev/null || true")
        try:
            f16 = json.loads(text).get("sha256") if text.strip() else None
        except (ValueError, AttributeError):
            f16 = None
        made = read_fact(host, f"cat -- {shlex.quote(self.marker)} 2>/dev/null || true").strip()
        return f16, made or None

    def reference_key(self, f16_sha: str) -> str:
        return f"f16 {f16_sha} ctx {CALIBRATION_CTX} chunks {CALIBRATION_CHUNKS} imatrix {int(self.imatrix)}"

    def decide(self, facts: tuple[str | None, str | None]) -> Decision:
        f16, made = facts
        if f16 is None:
            # a dry run before the F16 file exists: say what would run after it
            f16 = "(the F16 file made above)"
        if made == self.reference_key(f16):
            return Decision.ok("computed for this F16 file")
        bin_dir = f"{self.build.current}/bin"
        common = f"-c {CALIBRATION_CTX} --chunks {CALIBRATION_CHUNKS}"
        f16_path, cal = shlex.quote(self.layout.gguf("F16")), shlex.quote(self.layout.calibration)
        cmds = [
            Shell(f"rm -f -- {shlex.quote(self.marker)}"),
            Shell(
                f"{shlex.quote(bin_dir + '/llama-perplexity')} -m {f16_path} -f {cal} {common} "
                f"--kl-divergence-base {shlex.quote(self.layout.kld_base)}"
            ),
        ]
        if self.imatrix:
            out = shlex.quote(self.layout.imatrix)
            cmds.append(
                Shell(
                    f"{shlex.quote(bin_dir + '/llama-imatrix')} -m {f16_path} -f {cal} -o {out}.partial.gguf "
                    f"{common} && mv -f -- {out}.partial.gguf {out}"
                )
            )
        cmds.append(Shell(f"echo {shlex.quote(self.reference_key(f16))} > {shlex.quote(self.marker)}"))
        return Decision.act("not computed for this F16 file" if made else "not computed yet", *cmds)

    def apply(self, host: Host, decision: Decision) -> None:
        # the key names the F16 file as it is now (the dry-run placeholder never reaches here)
        f16, _ = self.read(host)
        if f16 is None:
            raise OperationError(f"no verified F16 file at {self.layout.gguf('F16')}")
        super().apply(host, decision)


class EnsureTexts(Operation):
    """The calibration text and the fixed prompt the verification reads."""

    def __init__(self, layout: ModelLayout, calibration: str, prompt: str):
        self.layout = layout
        self.files = {layout.calibration: calibration.encode(), layout.prompt: prompt.encode()}
        self.name = "Ensure the calibration text and the test prompt are on the host"

    @property
    def key(self) -> str:
        return f"{self.name} for {self.layout.root}"

    def read(self, host: Host) -> dict[str, str | None]:
        return {p: files.parse_sha256(read_fact(host, files.sha256_command(p))) for p in self.files}

    def decide(self, facts: dict[str, str | None]) -> Decision:
        stale = [p for p, data in self.files.items() if facts.get(p) != hashlib.sha256(data).hexdigest()]
        if not stale:
            return Decision.ok("both present")
        return Decision.act(
            f"{len(stale)} to write",
            Shell(f"mkdir -p -- {shlex.quote(self.layout.root)}"),
            *(Upload(p, self.files[p], 0o644) for p in stale),
        )
