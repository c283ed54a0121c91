"""What one inventory host would get, from the inventory alone (`invoke render --inventory I
--host H`): every recipe of its layout (or its one recipe) with its GPUs, ports, unit names and
instance env files, exactly as deploy renders them for that host, each model set's router unit
and preset (conduct/set_deploy.py ``set_files``), and the units of the RPC workers the
inventory's recipes place on it. No host is reached: the same refusals as deploy
(a recipe that cannot fit, a bad layout) come first, one line each."""

from __future__ import annotations

from playbooks.conduct.placements import check_layout, host_serves
from playbooks.conduct.set_deploy import set_files
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import load_inventory
from playbooks.config.planning import refuse_unfit
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.rpc_worker import RpcLayout, render_rpc_unit, unit_path
from playbooks.steps.serve.service_files import planned_service_files
from playbooks.steps.serve.units import RenderedFile, default_gpu_indexes


def host_files(settings: Settings, host_name: str) -> list[RenderedFile]:
    """Every file deploy and rpc-worker would install on ``host_name``, in install order."""
    spec = settings.host_spec(host_name)
    files: list[RenderedFile] = []
    served = host_serves(spec, None, settings.load_recipe)
    check_layout(spec, served)
    for s in served:
        refuse_unfit(s.loaded)
        gpus = default_gpu_indexes(s.loaded.recipe) if s.gpus is None else s.gpus
        files += planned_service_files(s.loaded, s.layout(spec.prefix), gpus)
    for model_set in settings.sets(host_name, None):
        files += set_files(model_set, spec.prefix, systemd=True)[2]
    for loaded in _fleet_recipes(settings):
        r = loaded.recipe
        for w in (w for w in r.rpc if w.worker == host_name):
            layout = RpcLayout(spec.prefix, w.port)
            files.append(RenderedFile(unit_path(layout), render_rpc_unit(r, w, layout), 0o644, "unit"))
    if not files:
        raise VoltaforgeError(
            f"{host_name}: the inventory gives it no recipe (recipe: or serve:) and no recipe places an RPC "
            "worker on it: nothing would be installed"
        )
    unique: dict[str, RenderedFile] = {}
    for f in files:  # a file two recipes share (a layout's template) once, unless they differ
        if unique.setdefault(f.path, f).text != f.text:
            raise VoltaforgeError(f"{host_name}: two recipes would install {f.path} differently")
    return list(unique.values())


def _fleet_recipes(settings: Settings) -> list[LoadedRecipe]:
    """The recipes every inventory host serves (where an RPC worker's recipe is named)."""
    out: dict[str, LoadedRecipe] = {}
    for spec in load_inventory(settings.inventory).values():
        try:
            for s in host_serves(spec, None, settings.load_recipe):
                out.setdefault(s.loaded.recipe.name, s.loaded)
        except VoltaforgeError:
            continue  # another host's bad entry is its own render's error, not this host's
    return list(out.values())
