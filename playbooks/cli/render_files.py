"""`invoke render`: every file `invoke deploy` would install for a recipe, written under a local
directory that mirrors the host's paths (DIR/etc/systemd/system/...). Needs no host: for review,
diffing and packaging."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text

from playbooks.cli import flags
from playbooks.cli.render import console
from playbooks.config.planning import refuse_unfit
from playbooks.config.recipe import RECIPES_DIR, load_recipe
from playbooks.steps.serve.units import ServerLayout, planned_service_files


def output_dir(value: object) -> Path:
    return flags.output_dir("--out", value)


def run_render(
    recipe: str | None,
    out: Path,
    gpus: tuple[int, ...] | None = None,
    recipes_dir: Path | None = None,
    prefix: str | None = None,
) -> int:
    if not recipe:
        raise flags.UsageError("--recipe is required (or voltaforge.recipe in invoke.yaml)")
    loaded = load_recipe(recipe, recipes_dir or RECIPES_DIR)
    layout = ServerLayout(prefix=prefix) if prefix else ServerLayout()
    refuse_unfit(loaded)
    files = planned_service_files(loaded, layout, gpus)
    show = console()
    for f in files:
        target = out / f.path.lstrip("/")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f.text)
            target.chmod(f.mode)
        except OSError as exc:
            raise flags.UsageError(f"--out {str(out)!r}: cannot write {target}: {exc.strerror or exc}") from None
        show.print(Text(f"wrote {target} ({f.kind}, mode {f.mode:04o}, host path {f.path})"))
    return 0
