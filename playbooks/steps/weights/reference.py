"""What every quant is judged against: the F16 logits on the calibration text (the KL
divergence's base), the importance matrix, and the texts themselves on the host."""

from __future__ import annotations

import hashlib
import json
import shlex

from playbooks.facts import files, read_fact
from playbooks.host.base import Host
from playbooks.host.ops import Decision, Operation, OperationError, Shell, Upload
from playbooks.steps.build.build import BuildLayout
from playbooks.steps.weights.model_layout import (
    CALIBRATION_CHUNKS,
    CALIBRATION_CTX,
    ModelLayout,
    manifest_path,
)


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
