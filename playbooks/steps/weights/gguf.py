"""GGUF files from the original weights: the converter's packages in the venv, then F16 and each
quant made from the current build, verified (KL divergence against F16, a load through
llama-cpp-python) and described by a manifest before they count."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from playbooks.errors import HostError
from playbooks.facts import builds, files, python, read_fact, system
from playbooks.facts.artifacts import (
    GGUF_CHECK_PATH,
    parse_gguf_check,
    parse_kld,
    parse_stat_size_mtime,
    stat_size_mtime_command,
)
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Record, Shell, run_command
from playbooks.plan.gguf_size import estimate_gguf
from playbooks.plan.gpus import size_text
from playbooks.plan.model_config import ModelShape
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.build.proven_build import Probe, build_failure
from playbooks.steps.build.toolchain import pip_install_keeping_torch, read_local_wheels, run_pip
from playbooks.steps.weights.model_layout import (
    CALIBRATION_CHUNKS,
    CALIBRATION_CTX,
    ModelLayout,
    manifest_path,
)
from playbooks.steps.weights.sources import HubWeights, LocalWeights

#: convert_hf_to_gguf.py's imports (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt),
#: torch aside: the toolchain pins it
CONVERT_REQUIREMENTS = ("transformers>=4.45,<5", "sentencepiece>=0.2,<0.3", "protobuf>=4.21,<5", "safetensors")


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
                    if cmd.key == "kld" and result.exited == 0 and parse_kld(result.stdout) is None:
                        # exit 0 and not even the last chunk's row (parse_kld reads the figures
                        # from it when only the closing statistics were lost to llama.cpp's log
                        # thread at exit): one more run, then the judge says what is missing
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
                missing = "; its statistics (Mean KLD, Same top p) are missing" if code == 0 else ""
                raise OperationError(f"{what}: llama-perplexity --kl-divergence failed (exit {code}{missing}): {tail}")
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
