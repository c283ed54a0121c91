"""The serving engines, one module each (llamacpp.py, exllamav2.py), behind one interface
(base.py). The recipe names the engine (`backend:`); the rest of the package asks it:
:func:`engine` by that name, :func:`engine_of_quant` by a quant's name (``EXL2-4.0`` is
ExLlamaV2's, a GGUF type llama.cpp's). Adding an engine: docs/layout.md."""

from __future__ import annotations

from playbooks.plan.engine_base import Engine, SplitPlan
from playbooks.plan.engine_exllamav2 import EXLLAMAV2
from playbooks.plan.engine_llamacpp import LLAMACPP

#: every engine, in the order the plan lists their quants
ENGINES: tuple[Engine, ...] = (LLAMACPP, EXLLAMAV2)

__all__ = [
    "ENGINES",
    "EXLLAMAV2",
    "LLAMACPP",
    "Engine",
    "SplitPlan",
    "engine",
    "engine_of_quant",
    "engine_of_server",
    "parse_quant",
]


def engine(name: str) -> Engine:
    """The engine a recipe's `backend:` names."""
    for e in ENGINES:
        if e.name == name:
            return e
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(e.name for e in ENGINES)}")


def parse_quant(text: str) -> str:
    """A --quant flag's text as a quant name: the first engine that claims it (ExLlamaV2 claims
    ``EXL2-``, llama.cpp the rest, in upper case)."""
    for e in sorted(ENGINES, key=lambda e: e is LLAMACPP):  # the catch-all last
        found = e.parse_quant(text)
        if found is not None:
            return found
    raise AssertionError("llama.cpp claims every name")


def engine_of_server(server: str) -> Engine:
    """The engine whose server a bench record names (its ``kind``: llama-server, tabbyapi)."""
    for e in ENGINES:
        if e.server == server:
            return e
    raise ValueError(f"unknown server {server!r}; known: {', '.join(e.server for e in ENGINES)}")


def engine_of_quant(quant: str) -> Engine:
    """The engine that serves a quant of this name."""
    return next(e for e in ENGINES if e.owns_quant(quant))
