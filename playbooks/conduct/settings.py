"""What every host task shares, from flags > Invoke configuration > built-in defaults: where the
inventory and the recipes are, the install prefix for hosts the inventory does not place, and
how long to wait for an SSH server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from playbooks.conduct.deployed import deployed_recipe
from playbooks.conduct.model_sets import ServedSet, check_set_ports, host_sets
from playbooks.conduct.placements import Served, host_serves
from playbooks.config.inventory import HostSpec, LbSpec, load_lb, resolve_host
from playbooks.config.monitor_spec import MonitorSpec, load_monitor
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
        spec = self.host_spec(host_name)
        served = host_serves(spec, recipe, self.load_recipe, default)
        if not served and spec.model_sets:
            names = ", ".join(s.set for s in spec.model_sets)
            raise VoltaforgeError(
                f"{host_name}: serves model sets ({names}) and no single recipe"
                + (f" named {recipe}" if recipe else "")
                + ": this command acts on single recipes; provision, status, stop and remove act on sets"
            )
        if not served:
            raise VoltaforgeError(f"{host_name}: no recipe: pass --recipe or set one in inventory.yaml")
        return served

    def sets(self, host_name: str, recipe: str | None) -> list[ServedSet]:
        """The host's model sets (conduct/model_sets.py), planned and checked before connecting:
        every one, or the one ``recipe`` names."""
        return host_sets(self.host_spec(host_name), recipe, self.recipes_dir or RECIPES_DIR)

    def targets(self, host_name: str, recipe: str | None, default: str | None = None) -> list[Served | ServedSet]:
        """Everything the host serves, single recipes and model sets, checked together (one port
        each); a flag naming a set: that set. One line when nothing is named anywhere."""
        spec = self.host_spec(host_name)
        sets = self.sets(host_name, recipe)
        if recipe is not None and sets:
            return list(sets)
        served = self.serves(host_name, recipe, default) if spec.placements or not sets else []
        check_set_ports(spec, [(s.name, p) for s in served for p in s.ports()], sets)
        return [*served, *sets]

    def named_serves(self, host_name: str, recipe: str | None) -> list[Served]:
        """What the host serves by name: the flag's recipe, the inventory's, or its layout,
        loaded and checked before connecting (a bad name is one line then). [] when no recipe
        is named anywhere: once connected, deployed_serves asks the host."""
        spec = self.host_spec(host_name)
        return self.serves(host_name, recipe) if recipe or spec.recipe or spec.serve else []

    def named_targets(self, host_name: str, recipe: str | None) -> list[Served | ServedSet]:
        """Like :meth:`named_serves`, with the host's model sets: [] when nothing is named."""
        spec = self.host_spec(host_name)
        return self.targets(host_name, recipe) if recipe or spec.recipe or spec.serve else []

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

    def monitor(self) -> MonitorSpec:
        """The inventory's ``monitor:`` entry (the defaults when it has none)."""
        return load_monitor(self.inventory)

    def load_recipe(self, name: str) -> LoadedRecipe:
        return load_recipe(name, self.recipes_dir or RECIPES_DIR)

    def connect(self, spec: HostSpec, printer: Printer | None = None) -> Host:
        return connect(spec, printer, connect_timeout=self.connect_timeout)
