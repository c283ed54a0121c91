"""A model set on a host (issue 55): one llama-server started without a model, a *router*, serving
several recipes' GGUFs on one port and starting a child server per model when it is first asked
for (its engine renders the files: ``ServerEngine.render_set_files``).

What the router is given (``RouterSet``) and where a set's files go: its unit (a managed process
keeps its copy in its state directory, like any server's), its preset ``models.ini`` in its serve
directory (the router's command line names it), its state and deployment record under deploy/.
The preset names each member's verified GGUF by its own path, not through a link: the preset is
then the whole of what the router serves, and a rollback that puts the preset back puts back
which files it serves (a link switched beside it would not be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from playbooks.steps.serve.units import ServerLayout

if TYPE_CHECKING:
    from playbooks.config.recipe import Recipe


@dataclass(frozen=True)
class RouterSet:
    """A model set as its router serves it: each member's recipe and the path of its GGUF, in
    the set's order; the router's port and address; the count the residency plan allows
    resident (``models_max``); the cards its children share (``gpu_indexes``, when ``gpu``);
    an idle child's sleep; the served names loaded at start; the API key file the router checks
    (the members' one key, None: none)."""

    name: str
    members: tuple[tuple[Recipe, str], ...]
    port: int
    bind: str
    models_max: int
    gpu: bool
    gpu_indexes: tuple[int, ...] = (0,)
    sleep_idle_s: int | None = None
    load_at_start: frozenset[str] = frozenset()
    api_key_file: str | None = None


def set_unit_name(name: str) -> str:
    """A set's unit: ``voltaforge-set-<name>.service`` (no recipe's unit can be named so: a
    recipe's is ``voltaforge-<recipe>``, and the set's name is checked apart)."""
    return f"voltaforge-set-{name}.service"


def set_layout(prefix: str, name: str) -> ServerLayout:
    return ServerLayout(prefix=prefix, unit_name=set_unit_name(name))


def preset_path(layout: ServerLayout) -> str:
    """The router's preset, in the set's serve directory."""
    return f"{layout.serve_dir}/models.ini"
