"""Issue 54's guard (removed once the engine move has landed): every shipped recipe renders
the same files, byte for byte, and `invoke plan --json` says the same, with its own quant and
with the other engine's, as before the move (tests/data/engine_guard.json, captured by
tests/tools/engine_guard.py at the commit before it). What it proves: the move changed no
output for these recipes; it says nothing of whether those outputs are right (the other tests
do)."""

from __future__ import annotations

import json

import pytest

from tests.tools import engine_guard

BEFORE = json.loads(engine_guard.DATA.read_text())


def test_the_shipped_recipes_are_the_ones_captured():
    assert sorted(BEFORE) == engine_guard.shipped()


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_a_shipped_recipe_renders_and_plans_as_before(name):
    now = json.loads(json.dumps(engine_guard.outputs(name)))  # the capture's JSON forms (lists, not tuples)
    for key in sorted(set(BEFORE[name]) | set(now)):
        assert now.get(key) == BEFORE[name].get(key), f"{name}: {key} differs from before the engine move"
