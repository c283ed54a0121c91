"""`invoke quantize`: the recipe's weights to verified GGUF files with manifests (EXL2 with
--bpw), and `invoke artifacts`: what a host holds."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from playbooks.cli.converge import converge, report
from playbooks.cli.render import console, render_artifacts
from playbooks.conduct.artifacts import copy_artifacts, read_artifacts
from playbooks.conduct.converge import per_recipe
from playbooks.conduct.quantize import (
    parse_bpw,
    parse_quants,
    quantize_step,
)
from playbooks.conduct.settings import Settings
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import UsageError

if TYPE_CHECKING:  # cli/ never runs a host itself (tests/test_layers.py): the types only
    from playbooks.host import Host
    from playbooks.host.ops import Operation


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
    return run_copy(settings, on, host_name, name, quant, bpw, dry_run) or code


def run_copy(
    settings: Settings, source: str, target: str, recipe: str, quant: str | None, bpw: str | None, dry_run: bool
) -> int:
    """The artifacts ``source`` made, copied to ``target`` (conduct/artifacts.py), and the report."""
    return report(copy_artifacts(settings, source, target, recipe, quant, bpw, dry_run))


def run_artifacts(host_name: str, as_json: bool = False, settings: Settings | None = None) -> int:
    rows = read_artifacts(settings or Settings(), host_name)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_artifacts(rows, host_name, console())
    return 0
