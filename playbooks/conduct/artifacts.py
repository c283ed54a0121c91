"""Artifacts between hosts and on a host: `invoke quantize --on H` copies what one host made to
the serving host (streamed, checked by sha256 on the way), and `invoke artifacts` lists what a
host's manifests say."""

from __future__ import annotations

import json
import shlex
from typing import Any

from playbooks.conduct.converge import prefix_needs_sudo, run_locked
from playbooks.conduct.quantize import made_artifacts
from playbooks.conduct.settings import Settings
from playbooks.facts import read_fact
from playbooks.host.ops import Change, EnsureDirectory, Operation
from playbooks.steps.weights.artifact_copy import EnsureArtifactCopy


def copy_artifacts(
    settings: Settings, source: str, target: str, recipe: str, quant: str | None, bpw: str | None, dry_run: bool
) -> list[Change]:
    """The artifacts ``source`` made, streamed to ``target`` (checked by sha256 on the way)."""
    loaded = settings.load_recipe(recipe)
    src_spec, dst_spec = settings.host_spec(source), settings.host_spec(target)
    with settings.connect(src_spec) as src, settings.connect(dst_spec) as dst:
        made = made_artifacts(loaded, quant, bpw, src_spec.prefix)
        wanted = made_artifacts(loaded, quant, bpw, dst_spec.prefix)
        dirs = sorted({a.path.rsplit("/", 1)[0] for a in wanted})
        ops: list[Operation] = [
            EnsureDirectory(f"{dst_spec.prefix}/models", 0o755),
            *(EnsureDirectory(d, 0o755) for d in dirs if d != f"{dst_spec.prefix}/models"),
            *(EnsureArtifactCopy(src, a, b, pending=dry_run) for a, b in zip(made, wanted, strict=True)),
        ]
        return run_locked(dst, dst_spec.prefix, ops, dry_run, prefix_needs_sudo(dst, dst_spec.prefix))


ARTIFACTS_COMMAND = (
    "find {root} -name '*.manifest.json' -type f 2>/dev/null | sort | while read -r f; do "
    'printf "%s\\n" "### voltaforge-manifest $f"; cat -- "$f"; echo; done'
)


def parse_manifests(output: str) -> list[dict[str, Any]]:
    """The manifests printed by ARTIFACTS_COMMAND; unreadable ones are listed as such."""
    found: list[dict[str, Any]] = []
    for block in output.split("### voltaforge-manifest ")[1:]:
        path, _, body = block.partition("\n")
        try:
            data = json.loads(body)
        except ValueError:
            data = {"path": path.removesuffix(".manifest.json"), "error": "unreadable manifest"}
        found.append(data)
    return found


def read_artifacts(settings: Settings, host_name: str) -> list[dict[str, Any]]:
    """What the host's manifests say, one row per artifact (an unreadable manifest is a row
    saying so)."""
    spec = settings.host_spec(host_name)
    with settings.connect(spec) as host:
        out = read_fact(host, ARTIFACTS_COMMAND.format(root=shlex.quote(f"{spec.prefix}/models")))
    return [
        {
            "path": m.get("path"),
            "kind": m.get("kind"),
            "quant": m.get("quant"),
            "bytes": m.get("bytes"),
            "sha256": m.get("sha256"),
            "predicted_bytes": m.get("predicted_bytes"),
            "model_id": m.get("model_id"),
            "verification": m.get("verification"),
            "created_at": m.get("created_at"),
            **({"error": m["error"]} if "error" in m else {}),
        }
        for m in parse_manifests(out)
    ]
