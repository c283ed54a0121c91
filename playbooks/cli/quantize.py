"""`invoke quantize`: the recipe's weights to verified GGUF files with manifests (EXL2 with
--bpw), and `invoke artifacts`: what a host holds."""

from __future__ import annotations

import json
from typing import Any

from playbooks.cli.converge import converge
from playbooks.cli.edge import write_details
from playbooks.cli.render import console, render_artifacts, render_report
from playbooks.conduct.converge import per_recipe, prefix_needs_sudo
from playbooks.conduct.quantize import (
    made_artifacts,
    parse_bpw,
    parse_quants,
    quantize_step,
)
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import UsageError
from playbooks.facts import read_fact
from playbooks.host import Host
from playbooks.host.lock import host_lock
from playbooks.host.ops import EnsureDirectory, Operation, run_ops
from playbooks.steps.weights.artifact_copy import EnsureArtifactCopy


def run_quantize(
    host_name: str,
    recipe: str | None = None,
    quant: str | None = None,
    bpw: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = False,
    settings: Settings | None = None,
    on: str | None = None,
) -> int:
    """Converge the quantize operations on ``host_name``; with ``on``, make the artifacts on
    that host instead and copy the finished ones to ``host_name`` (EXL2 needs a CUDA GPU; a
    big quantize wants RAM and disk the serving host may lack)."""

    def ops(loaded: LoadedRecipe, host: Host, prefix: str, sudo: bool) -> list[Operation]:
        return quantize_step(loaded, prefix, quant, bpw, force, verify)

    # the flags are judged before any host is reached (the recipe's quant comes later)
    if bpw is not None and quant is not None:
        raise UsageError("--bpw makes an EXL2 quant and --quant GGUF types: give one")
    if bpw is not None:
        parse_bpw(bpw)
    if quant is not None:
        parse_quants(quant, "")
    settings = settings or Settings()
    if not on or on == host_name:
        return converge(settings, host_name, recipe, per_recipe(ops), dry_run)
    # the serving host's recipe, made on the other host
    name = settings.recipe_for(host_name, recipe)
    code = converge(settings, on, name, per_recipe(ops), dry_run)
    if code and not dry_run:
        return code
    return copy_artifacts(settings, on, host_name, name, quant, bpw, dry_run) or code


def copy_artifacts(
    settings: Settings, source: str, target: str, recipe: str, quant: str | None, bpw: str | None, dry_run: bool
) -> int:
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
        if dry_run:
            changes = run_ops(dst, ops, dry_run=True)
        else:
            with host_lock(dst, dst_spec.prefix, sudo=prefix_needs_sudo(dst, dst_spec.prefix)):
                changes = run_ops(dst, ops)
    render_report(changes, log=write_details(changes))
    return 1 if any(c.status == "failed" for c in changes) else 0


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


def run_artifacts(host_name: str, as_json: bool = False, settings: Settings | None = None) -> int:
    import shlex

    settings = settings or Settings()
    spec = settings.host_spec(host_name)
    with settings.connect(spec) as host:
        out = read_fact(host, ARTIFACTS_COMMAND.format(root=shlex.quote(f"{spec.prefix}/models")))
    manifests = parse_manifests(out)
    rows = [
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
        for m in manifests
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_artifacts(rows, host_name, console())
    return 0
