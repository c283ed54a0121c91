"""`invoke wheelhouse --python 3.11`: TabbyAPI's dependencies as wheels for hosts without an
index. Made on this controller from the staged TabbyAPI's pyproject (steps/build/wheelhouse.py);
the tabbyapi step pushes it to every host whose venv runs that Python, and installs offline."""

from __future__ import annotations

from playbooks.config.recipe import Toolchain, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.build import wheelhouse
from playbooks.steps.build.tabbyapi import stage_hint, staged_archive


def run_wheelhouse(python: str, recipe: str | None = None) -> int:
    tag = wheelhouse.python_tag(python)  # refuses junk before anything else
    tc = load_recipe(recipe).recipe.toolchain if recipe else Toolchain()
    archive = staged_archive(tc.tabbyapi_ref)
    if not archive.is_file():
        raise VoltaforgeError(f"TabbyAPI {tc.tabbyapi_ref[:12]} is not staged: {stage_hint(tc, archive)}")
    tar = wheelhouse.build(archive, python)
    wheels = len(list(wheelhouse.wheels_dir(tc.tabbyapi_ref, tag).glob("*.whl")))
    size = tar.stat().st_size / 2**20
    print(f"{tar} ({wheels} wheels, {size:.1f} MiB): pushed to the hosts whose venv runs Python {python}")
    return 0
