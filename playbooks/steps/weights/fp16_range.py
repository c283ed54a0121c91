"""V100 has no BF16: every weight must fit FP16 before a conversion is worth making."""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import Any

from playbooks.facts import read_fact
from playbooks.facts import weights as weights_facts
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError
from playbooks.steps.build.proven_build import Probe
from playbooks.steps.weights.model_layout import (
    ModelLayout,
)


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
