"""The original weights on the host, under ``<model>/hf/`` with their source manifest: pushed file
by file from the controller (checksummed, into ``hf.partial/``, renamed when complete), or
downloaded on the host with huggingface_hub at a pinned revision."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from playbooks.facts import files, read_fact, system
from playbooks.facts.artifacts import (
    HUB_FETCH_PATH,
    parse_hub_fetch,
)
from playbooks.facts.unreachable import network_cause
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, PushFile, Record, Shell, Upload, run_command
from playbooks.plan.gpus import size_text
from playbooks.steps.build.buildenv import env_prefix
from playbooks.steps.build.proven_build import Probe
from playbooks.steps.weights.model_layout import (
    SOURCE_MANIFEST,
    ModelLayout,
)
from playbooks.steps.weights.sources import HubWeights, LocalWeights


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
