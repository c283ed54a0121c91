"""The serving engines' host halves, one module each (engine_llamacpp.py, engine_exllamav2.py),
behind one interface (engine_base.py), found by the recipe's `backend:` like their plan halves
(plan/engines.py). Adding an engine: docs/layout.md."""

from __future__ import annotations

from playbooks.steps.serve.engine_base import ServerEngine
from playbooks.steps.serve.engine_exllamav2 import EXLLAMAV2_SERVER
from playbooks.steps.serve.engine_llamacpp import LLAMACPP_SERVER

#: every engine's server, in the plan's order of engines
SERVER_ENGINES: tuple[ServerEngine, ...] = (LLAMACPP_SERVER, EXLLAMAV2_SERVER)


def server_engine(name: str) -> ServerEngine:
    """The host half of the engine a recipe's `backend:` names."""
    for s in SERVER_ENGINES:
        if s.engine.name == name:
            return s
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(s.engine.name for s in SERVER_ENGINES)}")
