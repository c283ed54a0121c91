"""What a decode rate may say about its ceiling (pure): one wording for the bench's JSON, its
reports, the gate's line, tune's table and the device check.

A share of the bandwidth roofline is a utilisation (MBU) only while the roofline bounds the
rate. Two cases where it does not:

- **Cache-resident.** A CPU's roofline is its measured DRAM copy rate over the bytes a token
  reads. When those bytes fit the last-level cache they are read from the cache after the first
  token, and the DRAM rate bounds nothing: the tiny test model (2.3 MB per token) came out at
  "102% of the roofline". No share is given, and the basis says why.
- **Above the ceiling.** A per-stream rate over its roofline means the ceiling is wrong (a
  datasheet or a copy rate that is not the memory's) or the measurement is: it is reported as
  that, never as "102%". (An aggregate above the single-stream roofline is not one: a batched
  decode step reads the weights once for every stream.)
"""

from __future__ import annotations

import math
from typing import Any

#: a per-stream rate, or the MBU, above the roofline
ABOVE_CEILING = "above the ceiling: a ceiling or measurement error"
#: the short form, in a table cell (the table's note spells it out)
ABOVE_CEILING_CELL = "above the ceiling"
#: where the bytes a token reads fit the last-level cache
DOES_NOT_BIND = "the DRAM ceiling does not bind"


def finite(v: Any) -> float | None:
    """A finite number, or None (missing, null, NaN: a server that does not report a figure)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def is_cache_resident(bytes_per_token: float, llc_bytes: int | None) -> bool:
    """Whether a token's weight bytes fit one instance of the host's last-level cache (the size a
    thread can count on: :func:`playbooks.facts.system.parse_llc`)."""
    return bool(llc_bytes) and 0 < bytes_per_token <= (llc_bytes or 0)


def cache_resident_basis(bytes_per_token: float, llc_bytes: int) -> str:
    """``cache-resident: 2.3 MB per token fits the 32 MiB last-level cache, the DRAM ceiling does
    not bind`` (MB: 1e6 bytes as every bytes-per-token figure; the cache in the kernel's MiB)."""
    return (
        f"cache-resident: {bytes_per_token / 1e6:.1f} MB per token fits the {llc_bytes / 2**20:g} MiB "
        f"last-level cache, {DOES_NOT_BIND}"
    )


def above(mbu: Any) -> bool:
    """An MBU (or any rate over its ceiling) above 1."""
    n = finite(mbu)
    return n is not None and n > 1


def share_text(rate: Any, ceiling: Any, bounded: bool = True) -> str:
    """`` (51%)`` after a rate: its share of ``ceiling``; `` (above the ceiling)`` for a bounded
    rate over it (a per-stream one); nothing without a ceiling. ``bounded=False``: an aggregate,
    which may pass the single-stream roofline."""
    n, c = finite(rate), finite(ceiling)
    if n is None or not c:
        return ""
    if bounded and n > c:
        return f" ({ABOVE_CEILING_CELL})"
    return f" ({n / c:.0%})"


def mbu_note(result: dict[str, Any]) -> str | None:
    """What the result's MBU cannot say, in words: above the ceiling, or a ceiling that does not
    bind (None: the MBU is a utilisation, or there is none)."""
    if result.get("cache_resident"):
        return f"none: {result.get('roofline_basis') or 'cache-resident, ' + DOES_NOT_BIND}"
    if above(result.get("mbu")):
        return ABOVE_CEILING
    return None


def mbu_text(result: dict[str, Any]) -> str:
    """``51%``; ``above the ceiling: a ceiling or measurement error (decode 1.02x the 14531.0 tok/s
    roofline)``; ``none: cache-resident: ...``; ``-`` where there is no MBU."""
    mbu = finite(result.get("mbu"))
    note = mbu_note(result)
    if note and mbu is not None and above(mbu):
        roof = finite(result.get("roofline_tok_s"))
        return f"{note} (decode {mbu:.2f}x the " + (f"{roof:.1f} tok/s " if roof else "") + "roofline)"
    if note:
        return note
    return "-" if mbu is None else f"{mbu:.0%}"
