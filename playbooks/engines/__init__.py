"""The serving engines, one module each (llamacpp.py, exllamav2.py), behind one interface
(base.py). The recipe names the engine (`backend:`); the rest of the package asks it:
:func:`engine` by that name, :func:`engine_of_quant` by a quant's name (``EXL2-4.0`` is
ExLlamaV2's, a GGUF type llama.cpp's). Adding an engine: docs/layout.md."""

from __future__ import annotations

from playbooks.engines.base import Engine, SplitPlan
from playbooks.engines.exllamav2 import EXLLAMAV2
from playbooks.engines.llamacpp import LLAMACPP

#: every engine, in the order the plan lists their quants
ENGINES: tuple[Engine, ...] = (LLAMACPP, EXLLAMAV2)

__all__ = ["ENGINES", "EXLLAMAV2", "LLAMACPP", "Engine", "SplitPlan", "engine", "engine_of_quant"]


def engine(name: str) -> Engine:
    """The engine a recipe's `backend:` names."""
    for e in ENGINES:
        if e.name == name:
            return e
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(e.name for e in ENGINES)}")


def engine_of_quant(quant: str) -> Engine:
    """The engine that serves a quant of this name."""
    return next(e for e in ENGINES if e.owns_quant(quant))
