"""Recipes: one YAML file per deployable configuration, loaded and validated.

A recipe is merged over recipes/defaults.yaml (one commented file of shared defaults), then
validated against its schema (config/recipe_schema.py), then checked against its model's shape
(read from the model's config): what needs both, like a context past what the model was trained
on or a draft whose vocabulary llama.cpp refuses. Every error names the file, the line, the key,
the bad value and what is allowed. The schema's names are imported from here by their callers.
"""

from __future__ import annotations

import copy
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from playbooks.config.recipe_schema import (
    SERVED_NAME_RE,
    Cache,
    Draft,
    Exl2Quant,
    Gate,
    ModelSource,
    PlannerSettings,
    Recipe,
    RpcWorker,
    Service,
    Toolchain,
)
from playbooks.config.yamlfile import Lines, explain_validation, line_of, load_yaml
from playbooks.errors import RecipeError
from playbooks.plan.engines import engine
from playbooks.plan.model_config import ModelShape, load_config_file, shape_from_config
from playbooks.resources import resource_dir

# what callers import from here: the schema's names (config/recipe_schema.py) and the loading
__all__ = [
    "Cache",
    "DEFAULTS_FILE",
    "Draft",
    "Exl2Quant",
    "Gate",
    "LoadedRecipe",
    "ModelSource",
    "PlannerSettings",
    "RECIPES_DIR",
    "Recipe",
    "RecipeError",
    "RpcWorker",
    "SERVED_NAME_RE",
    "SPEC_VOCAB_MAX_SIZE_DIFFERENCE",
    "Service",
    "Toolchain",
    "list_recipes",
    "load_recipe",
    "recipe_argument",
    "resolve_recipe_path",
    "shadowed_shipped",
]

RECIPES_DIR = resource_dir("recipes")
DEFAULTS_FILE = "defaults.yaml"
# llama.cpp (common/speculative.cpp): a draft's vocabulary may differ from the target's by at
# most this many tokens before speculative decoding refuses it.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128


class LoadedRecipe(BaseModel):
    """A validated recipe with its resolved model shapes."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    path: Path
    recipe: Recipe
    shape: ModelShape
    draft_shape: ModelShape | None = None


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the filesystem, ...: no such recipe
        return False


def resolve_recipe_path(name_or_path: str, recipes_dir: Path = RECIPES_DIR) -> Path:
    """A recipe's file: a path as given; a name in ``recipes_dir`` (the user's, from settings),
    then among the shipped recipes, so a user's recipe of a shipped name wins over it."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or _exists(p):
        return p
    for where in dict.fromkeys([recipes_dir, RECIPES_DIR]):
        candidate = where / f"{name_or_path}.yaml"
        if _exists(candidate):
            return candidate
    shipped = [q.stem for q in list_recipes(RECIPES_DIR)]
    mine = [q.stem for q in list_recipes(recipes_dir)] if recipes_dir != RECIPES_DIR else []
    known = (f"recipes in {recipes_dir}: {', '.join(mine) or 'none'}; " if recipes_dir != RECIPES_DIR else "") + (
        f"shipped recipes: {', '.join(shipped)}"
    )
    raise RecipeError(f"unknown recipe {name_or_path!r}; {known}")


def shadowed_shipped(path: Path) -> Path | None:
    """The shipped recipe a user's recipe of the same name hides (None: it hides none)."""
    shipped = RECIPES_DIR / path.name
    if path.parent.resolve() == RECIPES_DIR.resolve() or not _exists(shipped):
        return None
    return shipped


def recipe_argument(path: Path) -> str:
    """How to name this recipe on a command line: a shipped one by its name, any other by path."""
    return path.stem if path.parent.resolve() == RECIPES_DIR.resolve() else str(path)


def _load_shape(src: ModelSource, recipe_path: Path, lines: Lines, loc: tuple) -> ModelShape:
    line = line_of(lines, loc + ("config",))
    where = f"{recipe_path}:{line}" if line else str(recipe_path)
    if isinstance(src.config, dict):
        return shape_from_config(src.config, where=f"{where}: {'.'.join(loc)}.config")
    assert src.config is not None  # ModelSource._one_source requires it
    # next to the recipe; then among the shipped models, so a copied shipped recipe keeps its
    # `models/...` config (a file next to it of that name wins)
    looked = [(recipe_path.parent / src.config).resolve(), (RECIPES_DIR / src.config).resolve()]
    cfg_path = next((c for c in looked if c.exists()), None)
    if cfg_path is None:
        raise RecipeError(
            f"{where}: {'.'.join(loc)}.config: file {src.config!r} not found "
            f"(looked at {' and '.join(str(c) for c in dict.fromkeys(looked))})"
        )
    return load_config_file(cfg_path)


def _default_cache(backend: object) -> tuple[str, str] | None:
    """The engine's own cache where the recipe names none (the defaults file's is llama.cpp's);
    an unknown or missing backend is left to the schema to refuse, with its line."""
    try:
        return engine(str(backend)).default_cache
    except ValueError:
        return None


def load_recipe(name_or_path: str | Path, recipes_dir: Path = RECIPES_DIR) -> LoadedRecipe:
    """Load, merge over defaults, validate and resolve a recipe. Raises RecipeError."""
    path = resolve_recipe_path(str(name_or_path), recipes_dir)
    data, lines = load_yaml(path)
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}:1: a recipe must be a mapping of keys, got {type(data).__name__}")
    defaults_path = path.parent / DEFAULTS_FILE
    if "cache" not in data and (own := _default_cache(data.get("backend"))):
        data = {**data, "cache": {"k": own[0], "v": own[1]}}
    if defaults_path.exists() and defaults_path.resolve() != path.resolve():
        defaults, _ = load_yaml(defaults_path)
        data = _deep_merge(defaults or {}, data)
    data.setdefault("name", path.stem)
    if "model" not in data:
        raise RecipeError(
            f"{path}: model: missing; give model.repo + revision, model.path or model.generate, and model.config"
        )
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise explain_validation(exc, path, lines, Recipe) from None
    shape = _load_shape(recipe.model, path, lines, ("model",))
    if recipe.context > shape.max_position_embeddings:
        line = line_of(lines, ("context",))
        raise RecipeError(
            f"{path}:{line}: context: {recipe.context} is above the model's maximum "
            f"(max_position_embeddings {shape.max_position_embeddings})"
        )
    _check_n_cpu_moe(recipe, shape, path, lines)
    if recipe.split and shape.is_moe and recipe.n_cpu_moe not in (None, 0):
        raise RecipeError(
            f"{path}:{line_of(lines, ('n_cpu_moe',))}: n_cpu_moe: {recipe.n_cpu_moe} beside a split is not "
            "planned: a split keeps every expert on a device; remove n_cpu_moe, or serve it on one card"
        )
    if why := engine(recipe.backend).quant_refusal(shape, recipe.quant_name):
        raise RecipeError(f"{path}:{line_of(lines, ('quant',))}: quant: {why}")
    draft_shape = None
    if recipe.draft is not None:
        draft_shape = _load_shape(recipe.draft.model, path, lines, ("draft", "model"))
        diff = abs(draft_shape.vocab_size - shape.vocab_size)
        if diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
            line = line_of(lines, ("draft",))
            raise RecipeError(
                f"{path}:{line}: draft: vocabulary {draft_shape.vocab_size} differs from the model's "
                f"{shape.vocab_size} by {diff} tokens; llama.cpp allows at most {SPEC_VOCAB_MAX_SIZE_DIFFERENCE}"
            )
    return LoadedRecipe(path=path, recipe=recipe, shape=shape, draft_shape=draft_shape)


def _check_n_cpu_moe(recipe: Recipe, shape: ModelShape, path: Path, lines: Lines) -> None:
    """n_cpu_moe against the model: only a MoE has experts, and only as many layers as it has."""
    v = recipe.n_cpu_moe
    if v is None:
        return
    at = f"{path}:{line_of(lines, ('n_cpu_moe',))}"
    if not shape.is_moe:
        raise RecipeError(
            f"{at}: n_cpu_moe: {v!r} but {shape.model_type} is a dense model: it has no experts to keep in host RAM "
            "(remove the key)"
        )
    if isinstance(v, int) and v > shape.num_hidden_layers:
        raise RecipeError(
            f"{at}: n_cpu_moe: {v} is more than the model's {shape.num_hidden_layers} layers "
            f"(all of them: {shape.num_hidden_layers}, or auto)"
        )


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[Path]:
    return sorted(p for p in recipes_dir.glob("*.yaml") if p.name != DEFAULTS_FILE)
