"""Every shipped recipe plans and renders byte-identically to the texts kept under
tests/data/shipped/ (tests/tools/shipped_renders.py: why, and how to re-write them after a
change that means to move them).

What it proves: a change meant only to move code (a module split, a renamed folder) leaves every
plan and every deployed file of the shipped recipes as it was. What it does not: that they are
right (the planner's and the renderer's own tests say that); it only pins them."""

from __future__ import annotations

import pytest

from playbooks.config.recipe import list_recipes
from tests.tools.shipped_renders import kept, renders

SHIPPED = {p.stem: p for p in list_recipes()}
KEPT = kept()  # read once: every case compares against the same files


def test_the_kept_recipes_are_the_shipped_ones():
    assert sorted(KEPT) == sorted(SHIPPED)


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_a_shipped_recipe_plans_and_renders_as_kept(recipe):
    now, was = renders(SHIPPED[recipe]), KEPT.get(recipe, {})
    assert sorted(now) == sorted(was), "the files deploy writes changed"
    for name, text in now.items():
        assert text == was[name], f"{recipe}/{name} changed: python -m tests.tools.shipped_renders (then review)"
