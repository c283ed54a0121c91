"""Every fact parser answers any text, empty or garbled, with a value and never raises
(facts/__init__.py promises it): a reads pass answers a read it has not fetched yet with
empty output, and a host can print anything. Found by walking facts/, so a new parser is held
to it the day it is written."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import playbooks.facts as facts

ODD = ["", "\n", "   ", "missing", "|||", "a|b|c|d", "\x00\xff", "{", "[1, 2", "Error: nothing\n" * 3, "9" * 400]


def _parsers():
    for m in pkgutil.iter_modules(facts.__path__):
        if m.name == "probes":
            continue
        mod = importlib.import_module(f"playbooks.facts.{m.name}")
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or not name.startswith("parse"):
                continue
            params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
            if len(params) == 1:
                yield pytest.param(fn, id=f"{m.name}.{name}")


PARSERS = list(_parsers())


def test_the_walk_finds_the_parsers():
    assert len(PARSERS) > 30


@pytest.mark.parametrize("parse", PARSERS)
def test_a_parser_never_raises(parse):
    for text in ODD:
        parse(text)  # a value, whatever it is: raising here is the defect


def test_stat_of_garbage_is_none_and_a_real_line_is_read():
    from playbooks.facts.files import FileStat, parse_stat

    assert parse_stat("directory|755|root|root\n") == FileStat("directory", 0o755, "root", "root")
    assert parse_stat("missing\n") is None and parse_stat("") is None and parse_stat("x|9z|a|b") is None
