"""The model sets a host serves (issue 55), resolved before anything connects: each set of its
inventory ``serve:`` layout (config/inventory.py ``ModelSetSpec``) with its members loaded, its
residency plan made (config/model_set.py) and refused when a member does not fit alone, its port,
cards and unit name.

Decisions recorded here:
- A set's router takes one API key and one address for all its members: the members must name
  the same ``api_key_ref`` and the same ``service.bind`` (one line naming both otherwise).
- Its port is the set's ``port:``, else its first member's; its cards the set's ``gpus:``, else 0.
- ``--recipe NAME`` picks a set by its name; a member's name picks nothing (a member is served by
  its set, never alone on that host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from playbooks.config.inventory import HostSpec, ModelSetSpec
from playbooks.config.model_set import SetPlan, plan_set
from playbooks.config.recipe import LoadedRecipe, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.steps.serve.router import set_layout, set_unit_name
from playbooks.steps.serve.units import ServerLayout


@dataclass(frozen=True)
class ServedSet:
    """One model set on a host: its entry, its members as loaded, its plan, port and cards."""

    spec: ModelSetSpec
    members: tuple[LoadedRecipe, ...]
    plan: SetPlan
    port: int
    gpus: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spec.set

    @property
    def unit_name(self) -> str:
        return set_unit_name(self.spec.set)

    @property
    def models_max(self) -> int:
        return self.plan.residency.models_max

    @property
    def served_names(self) -> tuple[str, ...]:
        return tuple(m.recipe.served_name for m in self.members)

    def layout(self, prefix: str) -> ServerLayout:
        return set_layout(prefix, self.spec.set)

    def ports(self) -> list[int]:
        return [self.port]


def _where(spec: HostSpec, entry: ModelSetSpec) -> str:
    return f"{spec.name}: serve: set {entry.set}"


def host_set_plan(spec: HostSpec, entry: ModelSetSpec, recipes_dir: Path) -> SetPlan:
    """The plan of one set of ``spec``'s layout on the host's GPU (a CPU host: its
    ``memory_budget_gib``); a set that cannot be planned (an unknown recipe, a name served
    twice) is one line naming the host and the set."""
    try:
        return plan_set(
            entry.models, spec.gpu, spec.memory_budget_gib, recipes_dir, budget_from=f"{spec.name}'s memory_budget_gib"
        )
    except VoltaforgeError as exc:
        raise type(exc)(f"{_where(spec, entry)}: {exc}") from None  # its kind kept: the exit code says it


def served_set(spec: HostSpec, entry: ModelSetSpec, recipes_dir: Path) -> ServedSet:
    """One set of ``spec``'s layout, planned (``host_set_plan``) and checked; one line naming the
    host and the set otherwise."""
    where = _where(spec, entry)
    plan = host_set_plan(spec, entry, recipes_dir)
    if plan.refusal:
        raise VoltaforgeError(f"{where}: {plan.refusal} (`invoke plan --host {spec.name}` shows the set's plan)")
    members = tuple(load_recipe(name, recipes_dir) for name in entry.models)
    for what, value in (
        ("API key (service.api_key_ref)", lambda r: r.service.api_key_ref or "(none)"),
        ("address (service.bind)", lambda r: r.service.bind),
    ):
        seen = {m.recipe.name: value(m.recipe) for m in members}
        if len(set(seen.values())) > 1:
            taken = ", ".join(f"{n}: {v}" for n, v in seen.items())
            raise VoltaforgeError(f"{where}: its router has one {what} for all its members: {taken}")
    port = entry.port or members[0].recipe.service.port
    return ServedSet(entry, members, plan, port, entry.gpus or (0,))


def host_sets(spec: HostSpec, recipe: str | None, recipes_dir: Path) -> list[ServedSet]:
    """The host's sets: every one, or the one ``recipe`` names (by the set's name; none when it
    names something else)."""
    entries = [e for e in spec.model_sets if recipe is None or e.set == recipe]
    return [served_set(spec, e, recipes_dir) for e in entries]


def check_set_ports(spec: HostSpec, ports: Sequence[tuple[str, int]], sets: Sequence[ServedSet]) -> None:
    """No set's router listens where another server of the layout does (``ports``: (who, port))."""
    owner = dict((p, who) for who, p in ports)
    for s in sets:
        if s.port in owner:
            raise VoltaforgeError(
                f"{spec.name}: serve: {owner[s.port]} and set {s.name} both listen on port {s.port}: "
                "give one of them another port (port: in its entry)"
            )
        owner[s.port] = f"set {s.name}"
