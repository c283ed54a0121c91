"""What a host serves, resolved before anything connects: its one recipe, or each recipe of its
inventory ``serve:`` layout (config/inventory.py ``Placement``) with the GPUs, port and unit
names the layout gives it.

A host with ``recipe:`` (or none, or ``--recipe``) serves one recipe under the recipe's own
port and the default unit names (``voltaforge-llama-server``), as before layouts existed: a
re-provision does not rename a running unit. In a layout every llama.cpp recipe gets its own
unit, ``voltaforge-<recipe>.service`` (``voltaforge-<recipe>@.service`` for instances), and
serve directory; TabbyAPI has one unit and one config.yml per host, so a layout holds at most
one EXL2 recipe. The checks that need the recipes (a split's GPU count, a CPU recipe given
GPUs, ports that overlap) are made here, each one line naming the host and the recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from playbooks.config.inventory import HostSpec, Placement
from playbooks.config.recipe import LoadedRecipe
from playbooks.errors import VoltaforgeError
from playbooks.plan.engines import ENGINES, engine
from playbooks.plan.gpus import get_gpu
from playbooks.steps.serve.units import ServerLayout, default_gpu_indexes


@dataclass(frozen=True)
class Served:
    """One recipe on a host: the recipe as served there (its port the placement's), the GPU
    indexes (a CPU recipe's instance slots), and its unit name (None: the default)."""

    loaded: LoadedRecipe
    gpus: tuple[int, ...] | None = None
    unit_name: str | None = None

    @property
    def name(self) -> str:
        return self.loaded.recipe.name

    def layout(self, prefix: str) -> ServerLayout:
        return ServerLayout(prefix, self.unit_name) if self.unit_name else ServerLayout(prefix)

    def ports(self) -> list[int]:
        r = self.loaded.recipe
        slots = self.gpus if self.gpus is not None else default_gpu_indexes(r)
        if r.gpu_count > 1 or len(slots) == 1:
            return [r.service.port]
        return [r.service.port + i for i in slots]


def with_port(loaded: LoadedRecipe, port: int) -> LoadedRecipe:
    """The recipe served on another port (a layout's): the rest is the file's."""
    r = loaded.recipe
    service = r.service.model_copy(update={"port": port})
    return loaded.model_copy(update={"recipe": r.model_copy(update={"service": service})})


def placed(spec: HostSpec, p: Placement, loaded: LoadedRecipe) -> Served:
    """One placement checked against its recipe."""
    r = loaded.recipe
    where = f"{spec.name}: serve: {p.recipe}"
    cpu = get_gpu(r.gpu).is_cpu
    if cpu and p.gpus is not None:
        raise VoltaforgeError(f"{where}: a CPU recipe takes instances, not gpus")
    if not cpu and p.instances is not None:
        raise VoltaforgeError(f"{where}: a GPU recipe runs one instance per GPU: give gpus, not instances")
    gpus = p.gpus if p.gpus is not None else default_gpu_indexes(r)
    if cpu:
        gpus = tuple(range(p.instances or 1))
    if r.gpu_count > 1 and len(gpus) != r.gpu_count:
        raise VoltaforgeError(
            f"{where}: the recipe splits one server over {r.gpu_count} GPUs; the layout gives {len(gpus)}: {list(gpus)}"
        )
    e = engine(r.backend)
    if len(gpus) > 1 and e.one_server_per_host and r.gpu_count == 1:
        # (a split recipe is one server over its cards: the check above matched their count)
        raise VoltaforgeError(
            f"{where}: {e.server_label} serves one instance per host; give it one GPU, or split "
            f"the model over {len(gpus)} (gpu_count: {len(gpus)} in the recipe)"
        )
    if len(gpus) > 1 and r.rpc:
        raise VoltaforgeError(f"{where}: a recipe with RPC workers runs one server (the workers serve one client each)")
    if p.port is not None:
        loaded = with_port(loaded, p.port)
    served = Served(loaded, gpus, None if e.one_server_per_host else f"voltaforge-{r.name}.service")
    if served.ports()[-1] > 65535:
        raise VoltaforgeError(f"{where}: its last instance would listen on port {served.ports()[-1]}, above 65535")
    return served


def check_layout(spec: HostSpec, served: Sequence[Served]) -> None:
    """What only the whole layout can tell: two recipes on one port, two EXL2 recipes."""
    owner: dict[int, str] = {}
    for s in served:
        for port in s.ports():
            if port in owner:
                raise VoltaforgeError(
                    f"{spec.name}: serve: {owner[port]} and {s.name} both listen on port {port}: "
                    "give one of them another port (port: in its placement)"
                )
            owner[port] = s.name
    for e in (e for e in ENGINES if e.one_server_per_host):
        ones = [s.name for s in served if engine(s.loaded.recipe.backend) is e]
        if len(ones) > 1:
            raise VoltaforgeError(
                f"{spec.name}: serve: {', '.join(ones)} are {e.weights_format} recipes; "
                f"{e.server_label} has one unit per host: place one"
            )


def host_serves(
    spec: HostSpec, recipe: str | None, load: Callable[[str], LoadedRecipe], default: str | None = None
) -> list[Served]:
    """What ``spec`` serves: the flag's recipe (in a layout: that placement only), else the
    layout's every recipe, else the inventory's one recipe, else ``default``. An empty list:
    no recipe is named anywhere (the caller may ask the host's deployment records), or the
    flag names one of the layout's model sets, or the layout holds sets only (its sets:
    conduct/model_sets.py)."""
    if not spec.serve:
        name = recipe or spec.recipe or default
        return [Served(load(name))] if name else []
    if recipe is not None and any(recipe == s.set for s in spec.model_sets):
        return []  # a set's name: conduct/model_sets.py resolves it
    loaded = [(p, load(p.recipe)) for p in spec.placements]
    served = [placed(spec, p, lr) for p, lr in loaded]
    check_layout(spec, served)
    if recipe is None:
        return served
    chosen = [s for (p, _), s in zip(loaded, served, strict=True) if recipe in (p.recipe, s.name)]
    if not chosen:
        raise VoltaforgeError(
            f"{spec.name}: --recipe {recipe} is not in its serve: layout ({', '.join(s.name for s in served)}); "
            "add it there, or leave --recipe out to act on every recipe of the layout"
        )
    return chosen
