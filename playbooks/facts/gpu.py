"""GPU facts: what nvidia-smi (or NVML, through the GPU probe) says about a host's GPUs.

Why: every plan voltaforge makes for a V100 starts from these numbers. The compute
capability decides the toolchain (sm_70 needs CUDA 9.0-12.x), the memory total decides the
VRAM budget (a "16 GB" V100 reports 16384 MiB, the 32 GB DGX-1 part 32502 or 32768 MiB), and
temperature, power limit, clocks and the throttle/"event" reasons are what explain the
seed's 42 -> 30 tok/s slowdown at 85 C.

Each fact is a read-only POSIX sh command (a constant named *_COMMAND) plus a pure parser
of its output. The commands always exit 0: a missing nvidia-smi prints NVIDIA_SMI_ABSENT,
and every failure ends up as `GpuFacts(available=False, reason=...)`, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from playbooks.facts import lines

# --------------------------------------------------------------------------- models


class GpuInfo(BaseModel):
    """One GPU as reported by one source. Fields the source does not report are None."""

    model_config = ConfigDict(frozen=True)

    index: int
    name: str | None = None
    # nvidia-smi's table truncates long names ('Tesla V100-SXM2...'); the name is then a prefix.
    name_truncated: bool = False
    uuid: str | None = None
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = None
    architecture: str | None = None  # 'Volta' (nvidia-smi -q 'Product Architecture')
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    # From the table this is total - used; nvidia-smi/NVML 'free' also excludes reserved memory.
    memory_free_mib: int | None = None
    driver_version: str | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None  # the limit in force (enforced/current)
    power_min_limit_w: float | None = None
    power_max_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    # Percent of the last sample period a kernel ran (telemetry's 'was the GPU busy at all').
    utilization_gpu_pct: int | None = None
    persistence_mode: bool | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    # Active clock throttle ("event") reasons, normalised ('idle', 'sw_power_cap',
    # 'hw_thermal_slowdown', ...); None when the source does not report them at all.
    clocks_event_reasons: tuple[str, ...] | None = None

    @property
    def is_volta(self) -> bool:
        """True for compute capability 7.0 (V100, TITAN V, Quadro GV100)."""
        return self.compute_capability == (7, 0)

    @property
    def throttling(self) -> tuple[str, ...]:
        """Active reasons that hold clocks down under load (power or thermal caps).

        'idle', application-clock and display settings are not throttling in that sense.
        """
        return tuple(r for r in self.clocks_event_reasons or () if r in THROTTLE_REASONS)


Source = Literal["nvml", "nvidia-smi", "none"]


class GpuFacts(BaseModel):
    """All GPUs of a host, or why none could be read (available=False + reason)."""

    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    source: Source = "none"
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    # Newest CUDA the driver supports ('CUDA Version: 12.8' in the nvidia-smi header).
    cuda_driver_version: tuple[int, int] | None = None
    # nvidia-smi older than ~R510 rejects the compute_cap field: rerun with the legacy query.
    needs_legacy_query: bool = False
    invalid_field: str | None = None
    # The output ended before the GPU section closed (e.g. a cut-off paste): more GPUs may exist.
    truncated: bool = False
    warnings: tuple[str, ...] = ()

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


# --------------------------------------------------------------------------- shared helpers

NVIDIA_SMI_ABSENT = "voltaforge: nvidia-smi not found"

# Known compute capabilities by marketing name, for sources that print only the name
# (the table; nvidia-smi -q). Order matters: first match wins.
_NAME_TO_CC: tuple[tuple[re.Pattern[str], tuple[int, int]], ...] = tuple(
    (re.compile(p, re.IGNORECASE), cc)
    for p, cc in (
        (r"\bH200\b", (9, 0)),
        (r"\bH100\b", (9, 0)),
        (r"\bA100\b", (8, 0)),
        (r"\bRTX 4090\b", (8, 9)),
        (r"\bRTX 3090\b", (8, 6)),
        (r"\bT4\b", (7, 5)),
        (r"\bTITAN V\b", (7, 0)),
        (r"\bG?V100", (7, 0)),  # V100, V100S, V100-SXM2..., V100-PCIE, Quadro GV100
        (r"\bP100\b", (6, 0)),
        (r"\bP40\b", (6, 1)),
    )
)

# Architectures where every product has the same compute capability.
ARCH_TO_CC = {"volta": (7, 0)}


def compute_capability_from_name(name: str | None) -> tuple[int, int] | None:
    """Compute capability from a GPU name ('Tesla V100-SXM2...' -> (7, 0)); None if unknown."""
    if not name:
        return None
    for pattern, cc in _NAME_TO_CC:
        if pattern.search(name):
            return cc
    return None


# NVML clocks event/throttle reason bits (nvml.h nvmlClocksEventReason*).
CLOCKS_EVENT_REASON_BITS: dict[int, str] = {
    0x1: "idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

THROTTLE_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def decode_clocks_event_reasons(mask: int) -> tuple[str, ...]:
    """Decode NVML's reason bitmask (0x...01 -> ('idle',)); unknown bits as 'bit_0x...'."""
    reasons = [name for bit, name in CLOCKS_EVENT_REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(CLOCKS_EVENT_REASON_BITS)
    bit = 1
    while unknown:
        if unknown & bit:
            reasons.append(f"bit_{bit:#x}")
            unknown &= ~bit
        bit <<= 1
    return tuple(reasons)


_MISSING_VALUES = {
    "",
    "n/a",
    "[n/a]",
    "[not supported]",
    "not supported",
    "[unknown error]",
    "[insufficient permissions]",
    "[gpu is lost]",
    "err!",
    "[err!]",
    "unknown",
}


def cell(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value.lower() in _MISSING_VALUES else value


def leading_number(value: str | None) -> float | None:
    """Leading number of a value with or without unit ('16384 MiB', '300.00 W', '32 C', '16x')."""
    value = cell(value)
    if value is None:
        return None
    m = re.match(r"[-+]?\d+(?:\.\d+)?", value)
    return float(m.group()) if m else None


def cell_int(value: str | None) -> int | None:
    number = leading_number(value)
    return None if number is None else int(number)


def cell_bool(value: str | None) -> bool | None:
    value = cell(value)
    if value is None:
        return None
    low = value.lower()
    if low in ("enabled", "on", "yes", "true", "1"):
        return True
    if low in ("disabled", "off", "no", "false", "0"):
        return False
    return None


def cell_cc(value: str | None) -> tuple[int, int] | None:
    value = cell(value)
    m = re.fullmatch(r"(\d+)\.(\d+)", value or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvidia_smi_failure(text: str | None) -> GpuFacts | None:
    """The outputs that mean 'no usable GPU' whatever was asked of nvidia-smi."""
    stripped = (text or "").strip()
    if not stripped:
        return GpuFacts(available=False, source="none", reason="nvidia-smi printed nothing")
    if NVIDIA_SMI_ABSENT in stripped:
        return GpuFacts(available=False, source="none", reason="nvidia-smi not found")
    for line in lines(stripped):
        # Driver not loaded / wrong kernel module; container without the GPU mapped in.
        if "NVIDIA-SMI has failed" in line or line.strip() == "No devices were found":
            return GpuFacts(available=False, source="nvidia-smi", reason=line.strip())
    return None


def nvidia_smi_command(args: str) -> str:
    return (
        "if command -v nvidia-smi >/dev/null 2>&1; then "
        f"nvidia-smi {args} 2>&1 || true; "
        f"else echo '{NVIDIA_SMI_ABSENT}'; fi"
    )


# --------------------------------------------------------------------------- --query-gpu CSV

# The fields voltaforge asks for, in order. clocks_throttle_reasons.active is the old name of
# clocks_event_reasons.active; the old name is the one drivers back to R384 know.
QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "compute_cap",
    "driver_version",
    "memory.total",
    "memory.used",
    "memory.free",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "clocks.max.mem",
    "persistence_mode",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "clocks_throttle_reasons.active",
)
# Drivers before ~R510 (e.g. 470.182.03) reject compute_cap and then print NOTHING else:
# rerun without it and infer the capability from the name.
QUERY_FIELDS_LEGACY: tuple[str, ...] = tuple(f for f in QUERY_FIELDS if f != "compute_cap")


def nvidia_smi_csv_command(fields: Sequence[str] = QUERY_FIELDS) -> str:
    """`nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`, safe when absent."""
    return nvidia_smi_command(f"--query-gpu={','.join(fields)} --format=csv,noheader,nounits")


NVIDIA_SMI_CSV_COMMAND = nvidia_smi_csv_command(QUERY_FIELDS)
NVIDIA_SMI_CSV_LEGACY_COMMAND = nvidia_smi_csv_command(QUERY_FIELDS_LEGACY)

# Alternative spellings nvidia-smi accepts (and prints in CSV headers) for the same value.
_FIELD_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
    "clocks.current.sm": "clocks.sm",
    "clocks.current.memory": "clocks.mem",
    "clocks.max.memory": "clocks.max.mem",
    "clocks_event_reasons.active": "clocks_throttle_reasons.active",
    "enforced.power.limit": "power.limit",
}

_INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
_HEADER_CELL = re.compile(r"[a-z_][a-z0-9_.]*")


def _csv_row_to_gpu(row: Mapping[str, str], position: int) -> GpuInfo:
    index = cell_int(row.get("index"))
    name = cell(row.get("name"))
    cc = cell_cc(row.get("compute_cap")) or compute_capability_from_name(name)
    mask_text = cell(row.get("clocks_throttle_reasons.active"))
    reasons = None
    if mask_text is not None:
        try:
            reasons = decode_clocks_event_reasons(int(mask_text, 16 if "x" in mask_text else 10))
        except ValueError:
            reasons = None
    return GpuInfo(
        index=position if index is None else index,
        name=name,
        uuid=cell(row.get("uuid")),
        pci_bus_id=cell(row.get("pci.bus_id")),
        compute_capability=cc,
        memory_total_mib=cell_int(row.get("memory.total")),
        memory_used_mib=cell_int(row.get("memory.used")),
        memory_free_mib=cell_int(row.get("memory.free")),
        driver_version=cell(row.get("driver_version")),
        temperature_c=cell_int(row.get("temperature.gpu")),
        power_draw_w=leading_number(row.get("power.draw")),
        power_limit_w=leading_number(row.get("power.limit")),
        sm_clock_mhz=cell_int(row.get("clocks.sm")),
        max_sm_clock_mhz=cell_int(row.get("clocks.max.sm")),
        mem_clock_mhz=cell_int(row.get("clocks.mem")),
        max_mem_clock_mhz=cell_int(row.get("clocks.max.mem")),
        utilization_gpu_pct=cell_int(row.get("utilization.gpu")),
        persistence_mode=cell_bool(row.get("persistence_mode")),
        pcie_gen=cell_int(row.get("pcie.link.gen.current")),
        pcie_width=cell_int(row.get("pcie.link.width.current")),
        clocks_event_reasons=reasons,
    )


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] | None = QUERY_FIELDS) -> GpuFacts:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]`.

    `fields` is the list the command asked for. A header line (plain `--format=csv`) takes
    precedence and may carry units ('memory.total [MiB]'); values may carry units too.
    '[N/A]' / '[Not Supported]' become None. The driver-470 error 'Field "compute_cap" is
    not a valid field to query.' gives available=False with needs_legacy_query=True.
    """
    failure = nvidia_smi_failure(text)
    if failure is not None:
        return failure
    for line in lines(text):
        m = _INVALID_FIELD.search(line)
        if m:
            field = m.group(1)
            return GpuFacts(
                available=False,
                source="nvidia-smi",
                reason=line.strip(),
                invalid_field=field,
                needs_legacy_query=field == "compute_cap",
            )

    columns = [_FIELD_ALIASES.get(f, f) for f in fields] if fields else None
    gpus: list[GpuInfo] = []
    warnings: list[str] = []
    for line in lines(text):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        names = [re.sub(r"\s*\[[^\]]*\]$", "", c) for c in cells]
        if all(_HEADER_CELL.fullmatch(n) for n in names) and (
            "index" in names or "name" in names or set(names) & set(QUERY_FIELDS)
        ):
            columns = [_FIELD_ALIASES.get(n, n) for n in names]
            continue
        if columns is None or len(cells) != len(columns):
            warnings.append(f"ignored line: {line.strip()}")
            continue
        row = dict(zip(columns, cells, strict=True))
        if "index" in row and cell_int(row["index"]) is None:
            warnings.append(f"ignored line: {line.strip()}")
            continue
        gpus.append(_csv_row_to_gpu(row, len(gpus)))

    if not gpus:
        first = next((ln.strip() for ln in lines(text) if ln.strip()), "")
        return GpuFacts(
            available=False,
            source="nvidia-smi",
            reason=f"no GPU rows in nvidia-smi CSV output: {first}",
            warnings=tuple(warnings),
        )
    drivers = {g.driver_version for g in gpus if g.driver_version}
    return GpuFacts(
        available=True,
        source="nvidia-smi",
        gpus=tuple(gpus),
        driver_version=drivers.pop() if len(drivers) == 1 else None,
        warnings=tuple(warnings),
    )


# --------------------------------------------------------------------------- NVML probe

# The standalone probe script (stdlib + optional pynvml), shipped as package data.
GPU_PROBE_PATH = Path(__file__).resolve().parent / "probes" / "gpu_probe.py"
GPU_PROBE = GPU_PROBE_PATH
_PROBE_NO_PYTHON = '{"source": "none", "reason": "python3 not found"}'

# Feed the probe on stdin (`ssh host "$GPU_PROBE_STDIN_COMMAND" < gpu_probe.py`): no file push.
GPU_PROBE_STDIN_COMMAND = (
    f"if command -v python3 >/dev/null 2>&1; then python3 - 2>&1 || true; else echo '{_PROBE_NO_PYTHON}'; fi"
)


def parse_gpu_probe_json(text: str) -> GpuFacts:
    """Parse the probe's one JSON line (the last line starting with '{'; other lines are noise
    such as a vGPU shim's messages). Anything unreadable gives available=False."""
    candidates = [ln.strip() for ln in lines(text) if ln.strip().startswith("{")]
    if not candidates:
        first = next((ln.strip() for ln in lines(text) if ln.strip()), "")
        return GpuFacts(
            available=False,
            source="none",
            reason=f"GPU probe printed no JSON: {first}" if first else "GPU probe printed nothing",
        )
    try:
        data = json.loads(candidates[-1])
    except ValueError as exc:
        return GpuFacts(available=False, source="none", reason=f"GPU probe output is not JSON: {exc}")
    if not isinstance(data, dict):
        return GpuFacts(available=False, source="none", reason="GPU probe JSON is not an object")
    if data.get("source") != "nvml":
        reason = str(data.get("reason") or "GPU probe found no NVML")
        if data.get("nvml_error"):
            reason = f"{reason} ({data['nvml_error']})"
        return GpuFacts(available=False, source="none", reason=reason)

    driver = data.get("driver")
    cuda = data.get("cuda_driver_version")
    warnings: list[str] = []
    gpus: list[GpuInfo] = []
    for position, raw in enumerate(data.get("gpus") or []):
        if not isinstance(raw, dict):
            warnings.append(f"GPU entry {position} is not an object")
            continue
        for key, error in (raw.get("errors") or {}).items():
            warnings.append(f"GPU {raw.get('index', position)}: {key}: {error}")
        fields = {k: v for k, v in raw.items() if k in GpuInfo.model_fields and v is not None}
        fields.setdefault("index", position)
        cc = fields.get("compute_capability")
        fields["compute_capability"] = (
            tuple(cc)
            if isinstance(cc, (list, tuple)) and len(cc) == 2
            else compute_capability_from_name(fields.get("name"))
        )
        mask = raw.get("clocks_event_reasons_mask")
        if isinstance(mask, int):
            fields["clocks_event_reasons"] = decode_clocks_event_reasons(mask)
        fields.setdefault("driver_version", driver)
        try:
            gpus.append(GpuInfo(**fields))
        except ValueError as exc:
            warnings.append(f"GPU entry {position} unreadable: {exc}")
    return GpuFacts(
        available=bool(gpus),
        reason="" if gpus else "NVML reports no GPU",
        source="nvml",
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_driver_version=tuple(cuda) if isinstance(cuda, list) and len(cuda) == 2 else None,
        warnings=tuple(warnings),
    )
