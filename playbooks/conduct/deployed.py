"""What a host serves, read from its deployment records (facts/deployments.py): the recipe that
bare `invoke bench` and `invoke stop` use, and the rows of `invoke status`.

The record keeps the recipe's path and its merged text (config/recorded.py). The path is used
when it still holds the same recipe; otherwise (a temporary file that is gone, another
machine's path, a file edited since) the recorded text is written under the local cache
(``$VOLTAFORGE_CACHE/deployed-recipes/``) and loaded from there: what the host serves, not
what the file says now.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from playbooks.config.recipe import load_recipe
from playbooks.config.recorded import recipe_record
from playbooks.errors import RecipeError, VoltaforgeError
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment, RecordedRecipe, deployments_command, parse_deployments
from playbooks.facts.files import cat_command
from playbooks.facts.service import parse_process_state, parse_unit_state
from playbooks.host import Host
from playbooks.steps.serve.deploy_record import DeployLayout
from playbooks.steps.serve.service_manager import Manager, Systemd, make_manager


def read_deployments(host: Host, prefix: str) -> list[Deployment]:
    """Every deployment record under the prefix, in one command."""
    return parse_deployments(read_fact(host, deployments_command(prefix)))


def recipes_cache() -> Path:
    return Path(os.environ.get("VOLTAFORGE_CACHE") or Path.home() / ".cache" / "voltaforge") / "deployed-recipes"


def _same_file(recorded: RecordedRecipe) -> bool:
    """The recorded path exists here and still loads to the recorded text."""
    path = Path(recorded.path)
    try:
        if not path.is_file():
            return False
        return recipe_record(load_recipe(path))["sha256"] == recorded.sha256
    except (OSError, VoltaforgeError):
        return False


def recipe_file(recorded: RecordedRecipe, where: str) -> str:
    """A path that loads the recorded recipe: its own, or the recorded text under the cache."""
    if _same_file(recorded):
        return recorded.path
    name = recorded.name if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", recorded.name) else "recipe"
    path = recipes_cache() / recorded.sha256[:16] / f"{name}.yaml"
    if not path.is_file() or path.read_text() != recorded.yaml:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(recorded.yaml)
        tmp.replace(path)
    try:
        load_recipe(path)
    except RecipeError as exc:
        raise VoltaforgeError(
            f"{where}: the recipe recorded there ({recorded.name}) does not load here: {exc}"
        ) from None
    return str(path)


def _listed(found: list[Deployment]) -> str:
    return ", ".join(
        f"{d.service} ({d.recipe.name})" if d.recipe else f"{d.service} (no recipe recorded)" for d in found
    )


def deployed_recipe(host: Host, prefix: str) -> str:
    """The recipe the host serves, as a path to load; one line when it serves none, several,
    or one whose record does not name its recipe."""
    found = read_deployments(host, prefix)
    if not found:
        raise VoltaforgeError(f"nothing deployed on {host.name} under {prefix}: pass --recipe or run invoke provision")
    recipes = {d.recipe.sha256: d.recipe for d in found if d.recipe}
    if len(found) == 1 and not recipes:
        d = found[0]
        if d.record is None:
            raise VoltaforgeError(
                f"{host.name}: the deployment record of {d.service} under {prefix} cannot be read: pass --recipe"
            )
        raise VoltaforgeError(
            f"{host.name}: {d.service} was deployed before voltaforge recorded its recipe: pass --recipe once "
            f"(`invoke deploy --host {host.name} --recipe RECIPE` records it, without a restart)"
        )
    if len(recipes) != 1 or any(d.recipe is None for d in found):
        raise VoltaforgeError(
            f"{host.name} serves {len(found)} deployments under {prefix}: {_listed(found)}: pass --recipe to choose one"
        )
    [recorded] = recipes.values()  # several instances of one recipe (one per GPU): that recipe
    return recipe_file(recorded, host.name)


def deployment_manager(host: Host, prefix: str, d: Deployment) -> Manager | None:
    """Who runs the deployment, as deploy made it: its unit, or the unit's command line as a
    process (read back from the unit file kept in its state directory)."""
    if d.manager == "systemd":
        return Systemd(f"{d.service}.service")
    if d.manager != "process" or not d.unit_file:
        return None
    text = read_fact(host, cat_command(d.unit_file))
    if not text.strip():
        return None
    try:
        return make_manager("process", DeployLayout(prefix, d.service), d.unit_file.rsplit("/", 1)[1], text)
    except VoltaforgeError:
        return None


def stopped(host: Host, prefix: str, d: Deployment) -> bool:
    """Whether the deployment was stopped (`invoke stop`), not merely down: a unit systemd says
    is ``inactive`` (a crash leaves it ``failed``, or restarting), a managed process whose pid
    file the stop removed (a process that died keeps its pid file). A server that crashed stays
    a backend: HAProxy's health check takes it out until it answers again. A deployment whose
    manager cannot be told (an unreadable record) is not called stopped."""
    mgr = deployment_manager(host, prefix, d)
    if mgr is None:
        return False
    out = read_fact(host, mgr.state_command())
    if isinstance(mgr, Systemd):
        return parse_unit_state(out).active == "inactive"
    return parse_process_state(out).pid == 0
