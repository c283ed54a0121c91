"""What every host task shares, from flags > Invoke configuration > built-in defaults: where the
inventory and the recipes are, the install prefix for hosts the inventory does not place, and
how long to wait for an SSH server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from playbooks.conduct.deployed import deployed_recipe
from playbooks.conduct.placements import Served, host_serves
from playbooks.config.inventory import HostSpec, LbSpec, load_lb, resolve_host
from playbooks.config.recipe import RECIPES_DIR, LoadedRecipe, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.host import Host, connect
from playbooks.host.output import Printer


@dataclass(frozen=True)
class Settings:
    inventory: Path = Path("inventory.yaml")
    recipes_dir: Path | None = None
    prefix: str | None = None  # for hosts whose inventory entry names none (default /opt/voltaforge)
    connect_timeout: float = 10.0
    #: a provision's rolling change (conduct/roll.py) changes in place the servers of a balancer
    #: whose runtime API does not answer (`--in-place`), instead of failing: nothing is served
    #: through a balancer that does not run
    in_place: bool = False

    def host_spec(self, name: str) -> HostSpec:
        spec = resolve_host(name, self.inventory)
        if self.prefix and "prefix" not in spec.model_fields_set:
            spec = HostSpec.model_validate({**spec.model_dump(), "prefix": self.prefix})
        return spec

    def recipe_for(self, host_name: str, recipe: str | None, host: Host | None = None) -> str:
        """The flag's recipe, else the inventory's for that host, else (given the connected
        host) the one its deployment record says it serves; one line when none names one."""
        spec = self.host_spec(host_name)
        name = recipe or spec.recipe
        if name:
            return name
        if spec.serve:
            raise VoltaforgeError(
                f"{host_name} serves several recipes ({', '.join(p.recipe for p in spec.placements)}): pass --recipe"
            )
        if host is None:
            raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
        return deployed_recipe(host, spec.prefix)

    def serves(self, host_name: str, recipe: str | None, default: str | None = None) -> list[Served]:
        """What the host serves (conduct/placements.py), loaded and checked before connecting;
        one line when no recipe is named anywhere."""
        served = host_serves(self.host_spec(host_name), recipe, self.load_recipe, default)
        if not served:
            raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
        return served

    def named_serves(self, host_name: str, recipe: str | None) -> list[Served]:
        """What the host serves by name: the flag's recipe, the inventory's, or its layout,
        loaded and checked before connecting (a bad name is one line then). [] when no recipe
        is named anywhere: once connected, deployed_serves asks the host."""
        spec = self.host_spec(host_name)
        return self.serves(host_name, recipe) if recipe or spec.recipe or spec.serve else []

    def deployed_serves(self, host_name: str, recipe: str | None, host: Host) -> list[Served]:
        """The connected host's one recipe as its deployment record names it (no name given)."""
        return [Served(self.load_recipe(self.recipe_for(host_name, recipe, host)))]

    def one_recipe(self, host_name: str, recipe: str | None) -> Served | None:
        """The one recipe a task that serves one (lb, bench --lb) acts on: the flag's, the
        inventory's, or the layout's only one; one line when the layout has several. None when
        no recipe is named anywhere (the caller may ask the host's deployment records)."""
        served = self.named_serves(host_name, recipe)
        if not served:
            return None
        if len(served) > 1:
            raise VoltaforgeError(
                f"{host_name} serves several recipes ({', '.join(s.name for s in served)}): pass --recipe"
            )
        return served[0]

    def lb(self) -> LbSpec:
        """The inventory's ``lb:`` entry (empty when it has none)."""
        return load_lb(self.inventory)

    def load_recipe(self, name: str) -> LoadedRecipe:
        return load_recipe(name, self.recipes_dir or RECIPES_DIR)

    def connect(self, spec: HostSpec, printer: Printer | None = None) -> Host:
        return connect(spec, printer, connect_timeout=self.connect_timeout)
