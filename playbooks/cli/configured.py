"""Flag > configuration > default, for the values several tasks share.

Shared defaults live in the collection's configuration under ``voltaforge:``, so
``invoke.yaml`` in the project, ``~/.invoke.yaml`` and ``INVOKE_VOLTAFORGE_*`` variables
override them the way every Invoke user expects, e.g.::

    # invoke.yaml
    voltaforge:
      host: v100-01
      recipe: qwen2.5-14b-v100-16gb
      inventory: /etc/voltaforge/inventory.yaml
      recipes_dir: /etc/voltaforge/recipes   # beside the shipped recipes (a same-named one wins)
      prefix: /srv/voltaforge                # for hosts the inventory does not place
      connect_timeout: 20                    # seconds to wait for an SSH server

Each value is checked like a flag (flags.py): a bad one in invoke.yaml is one line naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from invoke import Context

from playbooks.cli import flags
from playbooks.conduct.settings import Settings

DEFAULTS = {
    "voltaforge": {
        "host": "local",
        "recipe": None,
        "inventory": "inventory.yaml",
        "recipes_dir": None,
        "prefix": None,
        "connect_timeout": 10,
    }
}


def cfg(c: Context, key: str, flag: str | None = None) -> Any:
    """The flag's value when given (even an empty one, which flags.py then refuses), else the
    configuration's, else the built-in default."""
    if flag is not None:
        return flag
    return flags.config_section(c.config.get("voltaforge"), DEFAULTS["voltaforge"]).get(
        key, DEFAULTS["voltaforge"][key]
    )


def host(c: Context, flag: str | None) -> str:
    """--host: one host, else voltaforge.host, else local."""
    return flags.one_host("--host", cfg(c, "host", flag))


def recipe(c: Context, flag: str | None) -> str | None:
    """--recipe: a name or path, else voltaforge.recipe, else none (the inventory's)."""
    return flags.name_or_path("--recipe", cfg(c, "recipe", flag))


def recipes_dir(c: Context) -> Path | None:
    return flags.directory("voltaforge.recipes_dir", cfg(c, "recipes_dir"))


def settings(c: Context, inventory: str | None) -> Settings:
    """The shared settings, each value checked like a flag (a bad one in invoke.yaml is one line)."""
    return Settings(
        inventory=flags.inventory_file(
            "--inventory" if inventory is not None else "voltaforge.inventory",
            cfg(c, "inventory", inventory),
            DEFAULTS["voltaforge"]["inventory"],
        ),
        recipes_dir=recipes_dir(c),
        prefix=flags.install_prefix("voltaforge.prefix", cfg(c, "prefix")),
        connect_timeout=flags.positive_float(
            "voltaforge.connect_timeout", cfg(c, "connect_timeout"), "seconds", maximum=3600
        ),
    )
