"""YAML loading that remembers where each key was, so errors can say file:line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from playbooks.errors import RecipeError

Lines = dict[tuple, int]


def _walk(node: yaml.Node, path: tuple, lines: Lines) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = path + (key_node.value,)
            lines[sub] = key_node.start_mark.line + 1
            _walk(value_node, sub, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines)


def load_yaml(path: Path) -> tuple[Any, Lines]:
    """Parse a YAML file; return (data, {key path: line}). Errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}{line}: invalid YAML: {exc.problem or exc.context}") from None
    lines: Lines = {}
    if node is not None:
        _walk(node, (), lines)
    return data, lines


def line_of(lines: Lines, loc: tuple) -> int | None:
    """The line of the longest prefix of `loc` that the file spelled out."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def _allowed_keys(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The field names pydantic accepts at `loc` (walking nested models)."""
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        model = next(
            (
                a
                for a in (field.annotation, *get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return list(model.model_fields) if model is not None else []


#: parts of an error's location that are no key of the file: pydantic's type names and the tags
#: of a discriminated union (config/inventory.py's serve: entries)
_NOT_KEYS = ("str", "Exl2Quant", "placement", "model-set")


def explain_validation(
    exc: ValidationError,
    where: Path,
    lines: Lines,
    root: type[BaseModel] | None = None,
    prefix: tuple = (),
) -> RecipeError:
    """Turn pydantic's first error into one line: file:line: key: what is wrong.

    `prefix` is where the validated mapping sits in the file (e.g. ('hosts', 'v100-01')).
    """
    errors = exc.errors(include_url=False)
    # A misspelt key also shows up as a missing one: report the unknown key, it explains both.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = prefix + tuple(
        p for p in err["loc"] if not (isinstance(p, str) and (p.startswith("function-") or p in _NOT_KEYS))
    )
    msg = err["msg"].removeprefix("Value error, ")
    # Cross-field checks raise at the model level; they name their key as "key: message".
    m = re.match(r"^([a-z_]+(?:\.[a-z_]+)*): (.*)$", msg, re.S)
    if m:
        loc = loc + tuple(m.group(1).split("."))
        msg = m.group(2)
    key = ".".join(str(p) for p in loc) or "(top level)"
    line = line_of(lines, loc)
    at = f"{where}:{line}" if line else str(where)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, loc[len(prefix) : -1])
        hint = f"; allowed here: {', '.join(allowed)}" if allowed else ""
        return RecipeError(f"{at}: unknown key {key!r}{hint}")
    got = err.get("input")
    shown = "" if isinstance(got, dict) or got is None or m else f" (got {got!r})"
    return RecipeError(f"{at}: {key}: {msg}{shown}")
