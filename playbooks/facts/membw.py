"""Host memory bandwidth: the membw probe's command, a pure parser of its JSON line, and the
figure kept as a host fact.

Why: a CPU roofline (`tok/s <= bandwidth / bytes per token`) and the host side of a MoE with
experts in host RAM need the host's own copy bandwidth. Measured afresh beside every bench on
a shared 2-core host it moved 26-36 GB/s between five back-to-back runs, so the MBU moved 0.48
to 0.70 with the server's own rate moving 13%. A ceiling must hold still: the probe reports the
way STREAM does (the best of several trials, every core, a buffer four times the last-level
cache and at least 256 MiB so the copy leaves the caches), and the figure is kept on the host
(``<prefix>/facts/membw.json``) with what identifies the host's memory system (CPU model, CPUs
online, memory size, kernel) and reused until one of those changes, it is MAX_AGE_DAYS old, or
``--remeasure``. A pure-Python copy's figure is a lower bound: never a ceiling.
GB/s here means 1e9 bytes per second, counting read + write (2 x the buffer) per copy.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from shlex import quote
from typing import Any, Literal

from playbooks.facts import last_json_line

PROBE_NAME = "voltaforge-membw"
MEMBW_PROBE_PATH = Path(__file__).resolve().parent / "probes" / "membw_probe.py"


@dataclass(frozen=True)
class Membw:
    """One measurement, or why there is none (copy_gb_s None, error set)."""

    copy_gb_s: float | None
    method: Literal["numpy", "python", "torch-cuda"] | None = None
    bytes: int | None = None  # bytes moved by the best copy (read + write)
    repeats: int | None = None
    # The pure-python copy pays interpreter overhead: its figure is a floor, not the bandwidth.
    lower_bound: bool = False
    error: str | None = None
    kind: str | None = None
    trials: list[float] | None = None  # every trial's GB/s, the best of which is copy_gb_s
    threads: int | None = None
    buffer_bytes: int | None = None


def membw_command(python: str, probe_path: str, mib: int | None = None) -> str:
    """Shell command that runs the pushed probe with the host's python; exits 0 and prints an
    error line of its own when that python is missing. ``mib`` None: the probe sizes the buffer
    from the host's last-level cache."""
    if mib is not None and (isinstance(mib, bool) or not isinstance(mib, int) or not 1 <= mib <= 65536):
        raise ValueError(f"mib must be an integer in 1..65536, got {mib!r}")
    missing = json.dumps({"probe": PROBE_NAME, "error": f"{python} not found", "kind": "no-python"})
    size = f" --mib {mib}" if mib is not None else ""
    return (
        f"if command -v {quote(python)} >/dev/null 2>&1; then "
        f"{quote(python)} {quote(probe_path)}{size} 2>&1 || true; "
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
    trials = data.get("trials_gb_s")
    threads, buffer = data.get("threads"), data.get("buffer_bytes")
    return Membw(
        copy_gb_s=float(value),
        method=method if method in ("numpy", "python", "torch-cuda") else None,
        bytes=moved if isinstance(moved, int) else None,
        repeats=repeats if isinstance(repeats, int) else None,
        lower_bound=bool(data.get("lower_bound", method == "python")),
        trials=[float(t) for t in trials if isinstance(t, (int, float))] if isinstance(trials, list) else None,
        threads=threads if isinstance(threads, int) else None,
        buffer_bytes=buffer if isinstance(buffer, int) else None,
    )


# ------------------------------------------------------------------------------------------
# the figure kept as a host fact
# ------------------------------------------------------------------------------------------

STORED_VERSION = 1


def stored_path(prefix: str) -> str:
    return f"{prefix}/facts/membw.json"


@dataclass(frozen=True)
class MemoryIdentity:
    """What a stored bandwidth figure is valid for: the same CPU model, CPUs online, memory
    size and kernel. Another DIMM, a cgroup with fewer CPUs, a kernel update: measure again."""

    cpu_model: str
    cpus: int | None
    mem_total_kb: int | None
    kernel: str


def identity_command(prefix: str) -> str:
    """One read: the host's memory identity, then the stored figure (nothing when none)."""
    return (
        "printf 'cpu_model=%s\\n' \"$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)\"; "
        "printf 'cpus=%s\\n' \"$(nproc 2>/dev/null)\"; "
        "printf 'mem_total_kb=%s\\n' \"$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)\"; "
        "printf 'kernel=%s\\n' \"$(uname -r)\"; "
        "echo '--- stored'; "
        f"cat -- {quote(stored_path(prefix))} 2>/dev/null || true"
    )


def parse_identity(output: str) -> tuple[MemoryIdentity, dict | None]:
    """The identity and the stored record (None: none, or not a record of ours)."""
    head, _, stored_text = (output or "").partition("--- stored")
    fields: dict[str, str] = {}
    for line in head.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()

    def number(key: str) -> int | None:
        v = fields.get(key, "")
        return int(v) if v.isdigit() else None

    ident = MemoryIdentity(
        cpu_model=fields.get("cpu_model") or "unknown",
        cpus=number("cpus"),
        mem_total_kb=number("mem_total_kb"),
        kernel=fields.get("kernel") or "unknown",
    )
    try:
        stored = json.loads(stored_text.strip()) if stored_text.strip() else None
    except ValueError:
        stored = None
    if not isinstance(stored, dict) or stored.get("version") != STORED_VERSION:
        stored = None
    return ident, stored


#: a stored figure older than this is measured again: a BIOS setting, a DIMM in another slot or
#: a firmware update changes the memory system without changing what identifies it
MAX_AGE_DAYS = 30


def age_days(measured_at: Any, now: datetime) -> float | None:
    """Days since a ``%Y-%m-%dT%H:%M:%SZ`` time (None: not such a time)."""
    try:
        at = datetime.strptime(str(measured_at), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return (now - at).total_seconds() / 86400


def reusable(
    stored: dict | None, ident: MemoryIdentity, now: datetime | None = None, max_age_days: float = MAX_AGE_DAYS
) -> tuple[Membw | None, str]:
    """The stored figure when it was measured on this same memory system, is younger than
    ``max_age_days`` and is a ceiling (not a pure-Python lower bound), with why (or why not)."""
    if stored is None:
        return None, "no stored figure on the host"
    was = stored.get("identity") or {}
    changed = [k for k, v in asdict(ident).items() if was.get(k) != v]
    if changed:
        return None, "the host changed since it was measured (" + ", ".join(
            f"{k}: {was.get(k)!r} -> {getattr(ident, k)!r}" for k in changed
        ) + ")"
    m = stored.get("membw") or {}
    value = m.get("copy_gb_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None, "the stored figure is not a usable number"
    if m.get("lower_bound"):
        return None, "the stored figure is a pure-Python lower bound, not a ceiling"
    age = age_days(stored.get("measured_at"), now or datetime.now(timezone.utc))
    if age is None:
        return None, "the stored figure has no time of measurement"
    if age > max_age_days:
        return None, f"the stored figure is {age:.0f} days old (the limit: {max_age_days:g})"
    fields: dict[str, Any] = {k: m.get(k) for k in Membw.__dataclass_fields__ if k in m}
    return Membw(**fields), f"stored, measured {stored.get('measured_at')}"


def ceiling_refusal(m: Membw) -> str | None:
    """Why a measured figure cannot be a roofline's ceiling (None: it can): the pure-Python copy
    pays the interpreter on every element, so its figure is a floor under the bandwidth."""
    if m.lower_bound:
        return (
            f"not a ceiling: {m.copy_gb_s:.1f} GB/s from pure-Python copies is a lower bound (the host's python "
            "has no numpy; the toolchain venv has it)"
        )
    return None


def stored_record(ident: MemoryIdentity, membw: Membw, measured_at: str) -> dict:
    return {"version": STORED_VERSION, "identity": asdict(ident), "membw": asdict(membw), "measured_at": measured_at}


def store_command(prefix: str, record: dict) -> str:
    """Write the record atomically (a temp file renamed over the old one)."""
    path = stored_path(prefix)
    text = json.dumps(record, sort_keys=True)
    return (
        f"mkdir -p -- {quote(prefix + '/facts')} && printf '%s\\n' {quote(text)} > {quote(path + '.tmp')} "
        f"&& mv -f -- {quote(path + '.tmp')} {quote(path)}"
    )
