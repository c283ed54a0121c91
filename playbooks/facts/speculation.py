"""Speculative decoding's acceptance, read from llama-server's own per-response timings.

At the pinned llama.cpp (0c1e570) a response's ``timings`` carries ``draft_n`` (tokens the
drafter proposed for this request) and ``draft_n_accepted`` (how many of them the target
kept) only when something was drafted (tools/server/server-common.cpp:99-102); the counts are
per request (a slot's stats, reset for each task). A server started without speculation, or
a request whose drafter never found anything to propose (an n-gram type on text without
repeats), has neither key: that request drafted nothing.

The parser is pure and total: a response without timings, or a count that is not a
non-negative number, adds nothing; it never raises. The bench (per level) and the tuner
(per candidate setting) both sum over the responses they made.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict


class Acceptance(TypedDict):
    drafted: int
    accepted: int
    rate: float | None


def _count(timings: Mapping[str, Any], key: str) -> int:
    value = timings.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value < math.inf):  # not NaN
        return 0
    return int(value)


def acceptance(timings_list: Iterable[Mapping[str, Any] | None]) -> Acceptance:
    """Drafted and accepted tokens summed over the responses' ``timings`` dicts, and the
    accepted share of the drafted (None when nothing was drafted: no rate, rather than 0)."""
    drafted = accepted = 0
    for timings in timings_list:
        if not isinstance(timings, Mapping):
            continue
        drafted += _count(timings, "draft_n")
        accepted += _count(timings, "draft_n_accepted")
    return {"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else None}
