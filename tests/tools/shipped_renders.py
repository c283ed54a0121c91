"""What every shipped recipe becomes, kept as text: the guard that a change meant to move code
(issue 59's splits) changes no behaviour.

Per recipe under recipes/: its plan as `invoke plan --json` prints it (cli/render.plan_json of
config/planning.plan_recipe), and every file deploy writes for it under the default layout
(steps/serve/service_files.planned_service_files: the unit or units, TabbyAPI's config). The
texts live under tests/data/shipped/<recipe>/, one file each, so a change shows as a diff in
review; tests/test_shipped_renders.py compares them with what the code makes now.

    python -m tests.tools.shipped_renders --write    # after a change meant to move them: review the diff

What it does not hold: commands that need a host (`provision --dry-run`): the real tests do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from playbooks.cli.render import plan_json
from playbooks.config.planning import plan_recipe
from playbooks.config.recipe import list_recipes, load_recipe
from playbooks.steps.serve.service_files import planned_service_files

ROOT = Path(__file__).resolve().parents[2]
KEPT = ROOT / "tests" / "data" / "shipped"


def renders(path: Path) -> dict[str, str]:
    """File name -> text for one recipe: ``plan.json`` and each deployed file by its base name."""
    loaded = load_recipe(path)
    out = {"plan.json": json.dumps(plan_json(plan_recipe(loaded), loaded.recipe.name), indent=1, sort_keys=True) + "\n"}
    for f in planned_service_files(loaded):
        out[f.path.rsplit("/", 1)[1]] = f.text if f.text.endswith("\n") else f.text + "\n"
    return out


def all_renders() -> dict[str, dict[str, str]]:
    return {p.stem: renders(p) for p in list_recipes()}


def kept() -> dict[str, dict[str, str]]:
    return {d.name: {f.name: f.read_text() for f in sorted(d.iterdir())} for d in sorted(KEPT.iterdir()) if d.is_dir()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the kept texts with what the code makes now")
    args = ap.parse_args()
    now = all_renders()
    if not args.write:
        was = kept()
        differ = sorted(f"{r}/{f}" for r in now.keys() | was.keys() for f in _differing(now, was, r))
        print("\n".join(differ) or "identical")
        return 1 if differ else 0
    shutil.rmtree(KEPT, ignore_errors=True)
    for recipe, files in now.items():
        (KEPT / recipe).mkdir(parents=True)
        for name, text in files.items():
            (KEPT / recipe / name).write_text(text)
    print(f"wrote {sum(len(f) for f in now.values())} files for {len(now)} recipes under {KEPT.relative_to(ROOT)}")
    return 0


def _differing(a: dict[str, dict[str, str]], b: dict[str, dict[str, str]], recipe: str) -> list[str]:
    x, y = a.get(recipe, {}), b.get(recipe, {})
    return [f for f in sorted(x.keys() | y.keys()) if x.get(f) != y.get(f)]


if __name__ == "__main__":
    sys.exit(main())
