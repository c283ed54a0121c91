"""What a balancer balances: every server its hosts serve, grouped by served model name.

Two sources, one set of checks (``fleet_of``):

- **the deployment records** (``deployed_fleet``, `invoke lb`): what each host's
  ``<prefix>/deploy/*/deployed.json`` says it serves: every recipe, layout and instance that
  was really deployed, each on its recorded port. A host with no record yet falls back to what
  the inventory places there (a first `invoke lb` before the first provision), and says so.
- **the inventory** (``placed_fleet``, `invoke render --lb`): what each host's ``recipe:`` or
  ``serve:`` layout places there, without connecting.

The checks: one model name is one base model (two quants of one model share a name; two models
must not), and every backend accepts the balancer's one key (the edge checks it and forwards it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from playbooks.conduct.deployed import read_deployments, recipe_file, stopped
from playbooks.conduct.placements import host_serves
from playbooks.conduct.quantize import recipe_weights
from playbooks.conduct.settings import Settings
from playbooks.config.inventory import HostSpec
from playbooks.config.recipe import LoadedRecipe, Recipe
from playbooks.errors import VoltaforgeError
from playbooks.facts.deployments import Deployment, RecordedRecipe
from playbooks.steps.serve.balancer import Backend, backends_for, by_model


@dataclass(frozen=True)
class HostServers:
    """One recipe's servers on one backend host: the recipe as served, its ports."""

    spec: HostSpec
    loaded: LoadedRecipe
    ports: tuple[int, ...]
    source: str  # "deployed" (its records) or "inventory"


@dataclass(frozen=True)
class Fleet:
    backends: tuple[Backend, ...]
    key_ref: str | None
    servers: tuple[HostServers, ...]
    #: each backend's host (its inventory name), in the order of ``backends``
    owners: tuple[str, ...] = ()
    #: one line per deployment left out because it does not run
    left_out: tuple[str, ...] = ()

    @property
    def loaded(self) -> LoadedRecipe:
        """One backend's recipe: the edge's defaults (its key is the fleet's one key)."""
        return self.servers[0].loaded

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

    @property
    def models(self) -> dict[str, tuple[Backend, ...]]:
        return by_model(self.backends)

    @property
    def notes(self) -> list[str]:
        return list(self.left_out) + [
            f"{s.spec.name}: nothing deployed yet; balancing what the inventory places there ({s.loaded.recipe.name})"
            for s in self.servers
            if s.source == "inventory"
        ]


def same_host(a: HostSpec, b: HostSpec) -> bool:
    return a.name == b.name or a.host == b.host or (a.local and b.local)


def fleet_of(lb_spec: HostSpec, servers: Sequence[HostServers], key_ref: str | None) -> Fleet:
    """The backends of every host's servers, checked. ``key_ref``: the balancer's own key
    (the inventory's ``lb: api_key_ref``); None: the backends' one key, whichever it is."""
    if not servers:
        raise VoltaforgeError("the balancer's hosts serve nothing: deploy a recipe there first")
    keys = {s.loaded.recipe.service.api_key_ref for s in servers}
    if key_ref is None and len(keys) > 1:
        taken = ", ".join(f"{s.spec.name}: {s.loaded.recipe.service.api_key_ref or '(none)'}" for s in servers)
        raise VoltaforgeError(
            f"the backends take different keys ({taken}): every backend of one balancer must accept its one key "
            "(one api_key_ref)"
        )
    edge_key = key_ref if key_ref is not None else next(iter(keys))
    backends: list[Backend] = []
    owners: list[str] = []
    weights: dict[str, set[str]] = {}
    per_host = Counter(s.spec.name for s in servers)
    for s in servers:
        r = s.loaded.recipe
        if r.service.api_key_ref != edge_key:
            raise VoltaforgeError(
                f"{s.spec.name}: {r.name} takes the key {r.service.api_key_ref or '(none)'}, the balancer's edge "
                f"checks {edge_key or '(none)'}: every backend must accept the balancer's key (one api_key_ref)"
            )
        weights.setdefault(r.served_name, set()).add(recipe_weights(s.loaded).model_id)
        theirs = backends_for(r, [(s.spec.name, s.spec.host, same_host(s.spec, lb_spec), s.ports)])
        # a host with several recipes (a layout): each server named by its port
        if per_host[s.spec.name] > 1:
            theirs = tuple(replace(b, name=f"{s.spec.name}-{b.port}") for b in theirs)
        backends += theirs
        owners += [s.spec.name] * len(theirs)
    for name, ids in weights.items():
        if len(ids) > 1:
            raise VoltaforgeError(
                f"model name {name} is served from {len(ids)} different base models ({', '.join(sorted(ids))}): "
                "give each its own service.model_name"
            )
    return Fleet(tuple(backends), edge_key, tuple(servers), tuple(owners))


def placed_servers(settings: Settings, spec: HostSpec, recipe: str | None) -> list[HostServers]:
    """What the inventory places on a host (its layout, its recipe; ``recipe``: that one, a
    recipe or a set by name): each single recipe on its ports, and each member of a model set
    on its set's port (the router serves every member there)."""
    singles = host_serves(spec, recipe, settings.load_recipe)
    placed = [HostServers(spec, s.loaded, tuple(s.ports()), "inventory") for s in singles]
    for each in settings.sets(spec.name, recipe):
        placed += [HostServers(spec, member, (each.port,), "inventory") for member in each.members]
    return placed


def placed_fleet(
    settings: Settings, lb_spec: HostSpec, backend_specs: Sequence[HostSpec], recipe: str | None, key_ref: str | None
) -> Fleet:
    """The fleet as the inventory places it, without connecting (`invoke render --lb`)."""
    servers: list[HostServers] = []
    for s in backend_specs:
        theirs = placed_servers(settings, s, recipe)
        if not theirs:
            raise VoltaforgeError(f"{s.name}: serves no recipe (give it one in the inventory, or pass --recipe)")
        servers += theirs
    return fleet_of(lb_spec, servers, key_ref)


def deployed_servers(settings: Settings, spec: HostSpec, wanted: str | None) -> tuple[list[HostServers], list[str]]:
    """What a host's deployment records say it serves (one read), each recipe with the ports
    of its running instances; ``wanted``: only the deployments of the recipe of that name. A
    stopped deployment is left out, with one line saying so (its key, port and model never
    count: a server `invoke stop` stopped is not served)."""
    with settings.connect(spec) as host:
        found = [d for d in read_deployments(host, spec.prefix) if _serves(d) and d.port is not None]
        found = [d for d in found if not wanted or any(r.name == wanted for r in _served_recipes(d))]
        down = {d.service for d in found if stopped(host, spec.prefix, d)}
    left_out = [
        f"{spec.name}: {d.service} ({', '.join(r.name for r in _served_recipes(d)) or '?'}) is stopped: left out "
        "of the balancer "
        f"(`invoke deploy --host {spec.name}` starts it, `invoke remove --host {spec.name}` takes it off)"
        for d in found
        if d.service in down
    ]
    by_recipe: dict[str, tuple[LoadedRecipe, list[int]]] = {}
    for d in found:
        if d.port is None or d.service in down:
            continue
        # a model set's router is each member's server: the edge routes a member's name to it
        for recorded in _served_recipes(d):
            if recorded.sha256 not in by_recipe:
                by_recipe[recorded.sha256] = (settings.load_recipe(recipe_file(recorded, spec.name)), [])
            by_recipe[recorded.sha256][1].append(d.port)
    # the recorded recipe keeps the file's port; each instance listens where its record says
    servers = [HostServers(spec, loaded, tuple(sorted(ports)), "deployed") for loaded, ports in by_recipe.values()]
    return servers, (left_out if found else [])


def _served_recipes(d: Deployment) -> tuple[RecordedRecipe, ...]:
    """What a deployment serves: its recipe, or a model set's members."""
    return d.members or ((d.recipe,) if d.recipe else ())


def _serves(d: Deployment) -> bool:
    return bool(_served_recipes(d))


def deployed_fleet(
    settings: Settings, lb_spec: HostSpec, backend_specs: Sequence[HostSpec], recipe: str | None, key_ref: str | None
) -> Fleet:
    """The fleet as the hosts' deployment records say (`invoke lb`); a host with none yet: as
    the inventory places it (Fleet.notes says which). A host whose deployments are all stopped
    is left out (it serves nothing); none serving anything: one line."""
    wanted = settings.load_recipe(recipe).recipe.name if recipe else None
    servers: list[HostServers] = []
    left_out: list[str] = []
    for s in backend_specs:
        theirs, stopped_here = deployed_servers(settings, s, wanted)
        left_out += stopped_here
        if not theirs and not stopped_here:
            theirs = placed_servers(settings, s, recipe)
            if not theirs:
                raise VoltaforgeError(
                    f"{s.name}: nothing deployed under {s.prefix} and no recipe in the inventory: provision it first"
                )
        servers += theirs
    if not servers:
        raise VoltaforgeError(
            "every server on the balancer's hosts is stopped: "
            + "; ".join(line.split(": left out")[0] for line in left_out)
            + ": start one with `invoke deploy`"
        )
    return replace(fleet_of(lb_spec, servers, key_ref), left_out=tuple(left_out))
