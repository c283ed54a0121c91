"""Host memory bandwidth: the membw probe's command and a pure parser of its JSON line.

Why: a CPU roofline (`tok/s <= bandwidth / bytes per token`) needs the host's own copy
bandwidth, and on shared machines it moves from run to run (16-24 GB/s on a 2-core host), so
`invoke bench` measures it beside the figure it explains instead of assuming a DDR4 number.
GB/s here means 1e9 bytes per second, counting read + write (2 x the buffer) per copy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from typing import Literal

from playbooks.facts import last_json_line

PROBE_NAME = "voltaforge-membw"
MEMBW_PROBE_PATH = Path(__file__).resolve().parent / "probes" / "membw_probe.py"


@dataclass(frozen=True)
class Membw:
    """One measurement, or why there is none (copy_gb_s None, error set)."""

    copy_gb_s: float | None
    method: Literal["numpy", "python"] | None = None
    bytes: int | None = None  # bytes moved by the best copy (read + write)
    repeats: int | None = None
    # The pure-python copy pays interpreter overhead: its figure is a floor, not the bandwidth.
    lower_bound: bool = False
    error: str | None = None
    kind: str | None = None


def membw_command(python: str, probe_path: str, mib: int = 256) -> str:
    """Shell command that runs the pushed probe with the host's python; exits 0 and prints an
    error line of its own when that python is missing."""
    if isinstance(mib, bool) or not isinstance(mib, int) or not 1 <= mib <= 65536:
        raise ValueError(f"mib must be an integer in 1..65536, got {mib!r}")
    missing = json.dumps({"probe": PROBE_NAME, "error": f"{python} not found", "kind": "no-python"})
    return (
        f"if command -v {quote(python)} >/dev/null 2>&1; then "
        f"{quote(python)} {quote(probe_path)} --mib {mib} 2>&1 || true; "
        f"else echo {quote(missing)}; fi"
    )


def read_membw(output: str) -> Membw:
    """The probe's last JSON line as a Membw; anything else (garbage, a traceback, a zero or
    negative figure) is Membw(copy_gb_s=None, error=...)."""
    data = last_json_line((output or "").strip(), PROBE_NAME)
    if data is None:
        first = next((ln.strip() for ln in (output or "").splitlines() if ln.strip()), "")
        reason = f"membw probe printed no line of its own: {first[:200]}" if first else "membw probe printed nothing"
        return Membw(copy_gb_s=None, error=reason, kind="no-output")
    if "error" in data:
        return Membw(copy_gb_s=None, error=str(data["error"]), kind=str(data.get("kind") or "unknown"))
    value = data.get("copy_gb_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return Membw(copy_gb_s=None, error=f"membw probe gave no usable copy_gb_s: {value!r}", kind="bad-value")
    method = data.get("method")
    moved, repeats = data.get("bytes"), data.get("repeats")
    return Membw(
        copy_gb_s=float(value),
        method=method if method in ("numpy", "python") else None,
        bytes=moved if isinstance(moved, int) else None,
        repeats=repeats if isinstance(repeats, int) else None,
        lower_bound=bool(data.get("lower_bound", method == "python")),
    )


def parse_membw(output: str) -> float | None:
    """Copy bandwidth in GB/s, or None when the output holds no measurement (see read_membw
    for why)."""
    return read_membw(output).copy_gb_s
