"""What a measurement depends on beyond its own inputs: the host's kernel, CPU model, GPU model
and driver, and the memory-bandwidth fact it was judged against.

Why: `invoke tune` keeps each measurement by its inputs (build, artifact, the unit's command line,
workload) so a re-run measures nothing new. A kernel update, a new driver, another card in the
slot or a re-measured bandwidth can move the same inputs' figure by more than a tie's width;
a measurement carries these facts and is reused only where they are unchanged and it is
younger than a limit (conduct/tune.py).

One read-only POSIX sh command (exit 0 always) and a pure parser that never raises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from shlex import quote
from typing import Any

PROVENANCE_COMMAND_TEMPLATE = (
    "printf 'kernel=%s\\n' \"$(uname -r)\"; "
    "printf 'cpu_model=%s\\n' \"$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1)\"; "
    "if command -v nvidia-smi >/dev/null 2>&1; then "
    "printf 'gpu=%s\\n' \"$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null "
    '| head -n 1)"; fi; '
    'printf \'membw_at=%s\\n\' "$(sed -n \'s/.*"measured_at": *"\\([^"]*\\)".*/\\1/p\' {membw} 2>/dev/null '
    '| head -n 1)"'
)


def provenance_command(prefix: str) -> str:
    """The host's provenance facts; ``prefix``: where the stored bandwidth fact lives."""
    return PROVENANCE_COMMAND_TEMPLATE.replace("{membw}", quote(f"{prefix}/facts/membw.json"))


@dataclass(frozen=True)
class Provenance:
    kernel: str = "unknown"
    cpu_model: str = "unknown"
    gpu: str = "none"  # nvidia-smi's name and driver version, "none" without nvidia-smi
    membw_at: str = "none"  # when the stored bandwidth fact was measured (its id)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def changed(self, other: dict[str, Any] | None) -> list[str]:
        """The facts that differ from a stored ``as_dict`` (all of them for none stored)."""
        was = other or {}
        return [f"{k}: {was.get(k, 'not recorded')!r} -> {v!r}" for k, v in self.as_dict().items() if was.get(k) != v]


def parse_provenance(output: str) -> Provenance:
    """The command's ``key=value`` lines; a missing or empty value is its default."""
    fields: dict[str, str] = {}
    for line in (output or "").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in Provenance.__dataclass_fields__ and value.strip():
            fields[key.strip()] = " ".join(value.split())
    return Provenance(**fields)
