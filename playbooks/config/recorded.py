"""A recipe as a deployment record keeps it: its name, the path it was loaded from, and its
merged YAML text with the sha256 of that text.

The text is self-contained, so the host's record alone can load the recipe again on any
controller, even when the file it came from (a temporary path, another machine's) is gone:
it is the recipe merged over defaults.yaml and validated, every default written out, the
model's config.json inlined, and paths that were relative to the recipe (``model.path``,
``model.calibration``) made absolute. Loading that text gives the same ``Recipe``
(tests/test_status.py loads every shipped recipe back).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from playbooks.config.recipe import LoadedRecipe, ModelSource
from playbooks.errors import RecipeError

#: the keys a deployment record's ``recipe`` entry holds
RECORD_KEYS = ("name", "path", "sha256", "yaml")


def _self_contained(src: ModelSource, data: dict[str, Any], base: Path) -> None:
    """``data`` (the dump of ``src``) with its file references made independent of ``base``."""
    if isinstance(src.config, str):
        cfg = (base / src.config).resolve()
        try:
            data["config"] = json.loads(cfg.read_text())
        except (OSError, ValueError) as exc:
            raise RecipeError(f"{cfg}: cannot read the model config to record it: {exc}") from None
    for key in ("path", "calibration"):
        value = getattr(src, key)
        if value is not None and not Path(value).expanduser().is_absolute():
            data[key] = str((base / value).resolve())


def merged_text(loaded: LoadedRecipe) -> str:
    """The recipe as it was deployed: merged, validated, every default and reference written out."""
    data = loaded.recipe.model_dump(mode="json")
    base = loaded.path.parent
    _self_contained(loaded.recipe.model, data["model"], base)
    if loaded.recipe.draft is not None:
        _self_contained(loaded.recipe.draft.model, data["draft"]["model"], base)
    head = (
        f"# recipe {loaded.recipe.name} as deployed: merged over its defaults.yaml, every default and\n"
        "# the model's config written out (recorded by voltaforge; its source is the record's path)\n"
    )
    return head + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def recipe_record(loaded: LoadedRecipe) -> dict[str, str]:
    """The ``recipe`` entry of a deployment record."""
    text = merged_text(loaded)
    return {"name": loaded.recipe.name, "path": str(loaded.path.resolve()), "sha256": text_sha256(text), "yaml": text}
