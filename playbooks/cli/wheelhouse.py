"""`invoke stage-tabbyapi`: TabbyAPI's pinned commit staged on this controller
(steps/build/tabbyapi_stage.py). `invoke wheelhouse --python 3.11`: its dependencies as wheels
for hosts without an index, made here from the staged TabbyAPI's pyproject
(steps/build/wheelhouse.py); the tabbyapi step pushes it to every host whose venv runs that
Python, and installs offline."""

from __future__ import annotations

from pathlib import Path

from playbooks.config.recipe import Toolchain, load_recipe
from playbooks.steps.build import tabbyapi_stage, wheelhouse


def run_wheelhouse(python: str, recipe: str | None = None) -> int:
    tag = wheelhouse.python_tag(python)  # refuses junk before anything else
    tc = load_recipe(recipe).recipe.toolchain if recipe else Toolchain()
    archive, _ = tabbyapi_stage.stage(tc)  # staged, from VOLTAFORGE_TABBYAPI_ARCHIVE, or fetched; else says how
    tar = wheelhouse.build(archive, python)
    wheels = len(list(wheelhouse.wheels_dir(tc.tabbyapi_ref, tag).glob("*.whl")))
    size = tar.stat().st_size / 2**20
    print(f"{tar} ({wheels} wheels, {size:.1f} MiB): pushed to the hosts whose venv runs Python {python}")
    return 0


def run_stage_tabbyapi(archive: Path | None, recipe: str | None = None) -> int:
    if archive is not None:
        tabbyapi_stage.commit_of(archive)  # the flag's own error before the recipe's
    tc = load_recipe(recipe).recipe.toolchain if recipe else Toolchain()
    path, how = tabbyapi_stage.stage(tc, archive)
    print(f"TabbyAPI {tc.tabbyapi_ref[:12]}: {how} ({path})")
    return 0
