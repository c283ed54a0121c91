"""What a tune candidate is served and measured as: its recipe (a scratch port, its context),
the concurrency its objective measures at, the bench's repeats at a rung, the key that makes
two measurements comparable; and the winner written out as a self-contained recipe."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from playbooks.config.recipe import Cache, Gate, LoadedRecipe
from playbooks.config.recorded import merged_text
from playbooks.steps.measure import tune_report
from playbooks.steps.measure.tune_cost import requests_for
from playbooks.steps.measure.tune_search import Measured
from playbooks.steps.measure.tune_space import Candidate


def candidate_recipe(loaded: LoadedRecipe, c: Candidate, port: int, context: int) -> LoadedRecipe:
    """The recipe with the candidate's settings (a scratch port, ``context`` per slot)."""
    r = loaded.recipe
    new = r.model_copy(
        update={
            "quant": c.quant,
            "cache": Cache(k=c.cache_k, v=c.cache_v),
            "flash_attn": c.flash_attn,
            "parallel": c.parallel,
            "context": context,
            "planner": r.planner.model_copy(update={"n_ubatch": c.ubatch}),
            "service": r.service.model_copy(update={"port": port}),
            "spec_type": c.spec_type,
            # the draft is loaded by draft-simple alone (the recipe schema refuses it beside others)
            "draft": r.draft if c.spec_type == "draft-simple" else None,
            "threads": c.threads,
        }
    )
    return loaded.model_copy(update={"recipe": new})


def rung_gate(g: Gate, rung: int, concurrency: int) -> Gate:
    """The bench's repeats at a rung: rung 0 the fewest requests, each rung twice the last."""
    least = requests_for(rung, concurrency)
    return g.model_copy(update={"requests_per_level": least, "max_requests_per_level": 4 * least})


def measurement_key(build: str, artifact_sha: str, argv: Sequence[str], workload: dict[str, Any]) -> str:
    """What makes two measurements comparable: the same build, artifact, command line, workload."""
    blob = json.dumps(
        {"build": build, "artifact": artifact_sha, "argv": list(argv), "workload": workload}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def winner_recipe_text(loaded: LoadedRecipe, winner: Measured, how: str, name: str) -> str:
    """The tuned recipe, self-contained (merged over its defaults, every reference written
    out), the recipe's own port, with a comment saying how it was found."""
    c = winner.candidate
    r = loaded.recipe
    tuned = candidate_recipe(loaded, c, r.service.port, r.context)
    tuned = tuned.model_copy(update={"recipe": tuned.recipe.model_copy(update={"name": name})})
    body = merged_text(tuned).split("\n", 2)[2]  # without merged_text's own two-line header
    lines = [f"# {name}: found by `invoke tune` ({how})", f"# winner: {c.label()}"]
    lines.append(f"# measured: {tune_report.figure_text(winner)}; {winner.level.get('decode', {}).get('n')} requests")
    return "\n".join(lines) + "\n" + body


def write_winner(text: str, name: str, recipes_dir: Path | None) -> Path:
    """Into the user's recipes directory (the setting, else ./recipes of the working directory)."""
    where = Path(recipes_dir) if recipes_dir else Path.cwd() / "recipes"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    yaml.safe_load(path.read_text())  # it parses
    return path
