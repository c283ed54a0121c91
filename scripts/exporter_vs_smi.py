"""Our GPU exporter held to `nvidia-smi --query-gpu` on a real card (issue 57): which nvidia-smi
field each exported series must equal, and the comparison of one scrape with the two nvidia-smi
reads taken just before and just after it.

The two read the driver apart: nvidia-smi with its own code and units, the exporter
(playbooks/steps/monitor/gpu_exporter.py) through pynvml. So agreement checks the exporter's
choice of NVML call, its scale (Hz and MHz, bytes and MiB, a 0-1 ratio and a percentage, watts
and milliwatts) and its labels, against the tool a lab already trusts.

- A value that does not move (memory total, the power limit, ECC counts, retired pages, name and
  UUID) must be equal, within nvidia-smi's display rounding.
- A value that moves (clocks, temperature, power, memory used, utilization, the throttle reasons)
  must lie between the read before and the read after, widened by that rounding. One that moved
  past both within the scrape's few milliseconds is named, not hidden.
- A field nvidia-smi does not know on this driver, or answers ``[N/A]`` / ``[Not Supported]``,
  where the exporter also exports nothing, agrees as "neither answers". One side answering
  alone is a difference.

``memory.used``: NVML's v1 memory call counts the driver's reserved memory as used, and
nvidia-smi, since R510, shows that reserved memory apart. A difference equal to
``memory.reserved`` is reported as that: a finding about the two tools, not a wrong scale.

scripts/device_check.py's ``exporter`` phase runs it on a lent card. Here, tests/test_exporter_vs_smi.py
feeds it the exporter's own output on the stand-in NVML answering captured V100 values, with
nvidia-smi's side transcribed from the same captures: that proves the mapping and the scales on a
real card's numbers, not agreement with a real driver.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ABSENT = {"", "[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]"}

#: nvidia-smi's throttle-reason field: the name since R535, and the old name every driver keeps
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


@dataclass(frozen=True)
class Field:
    """One nvidia-smi field and the exported series that must equal it."""

    smi: str  # the --query-gpu name
    series: str  # the exported sample's name
    labels: Mapping[str, str] = field(default_factory=dict)  # beside gpu, e.g. kind="corrected"
    to_smi: float = 1.0  # the exported value times this is in nvidia-smi's unit
    moves: bool = False
    slack: float = 0.0  # nvidia-smi's display rounding, in its unit


MIB = 2**20
FIELDS: tuple[Field, ...] = (
    Field("clocks.sm", "voltaforge_gpu_sm_clock_hertz", to_smi=1e-6, moves=True, slack=1),
    Field("clocks.mem", "voltaforge_gpu_memory_clock_hertz", to_smi=1e-6, moves=True, slack=1),
    Field("temperature.gpu", "voltaforge_gpu_temperature_celsius", moves=True, slack=1),
    Field("power.draw", "voltaforge_gpu_power_watts", moves=True, slack=0.01),
    Field("power.draw.instant", "voltaforge_gpu_power_watts", moves=True, slack=0.01),
    Field("enforced.power.limit", "voltaforge_gpu_power_limit_watts", slack=0.01),
    Field("memory.used", "voltaforge_gpu_memory_used_bytes", to_smi=1 / MIB, moves=True, slack=1),
    Field("memory.total", "voltaforge_gpu_memory_total_bytes", to_smi=1 / MIB, slack=1),
    Field("utilization.gpu", "voltaforge_gpu_utilization_ratio", to_smi=100, moves=True, slack=1),
    Field("ecc.errors.corrected.aggregate.total", "voltaforge_gpu_ecc_errors_total", {"kind": "corrected"}),
    Field("ecc.errors.uncorrected.aggregate.total", "voltaforge_gpu_ecc_errors_total", {"kind": "uncorrected"}),
    Field("retired_pages.single_bit_ecc.count", "voltaforge_gpu_retired_pages", {"cause": "single_bit"}),
    Field("retired_pages.double_bit.count", "voltaforge_gpu_retired_pages", {"cause": "double_bit"}),
    Field("retired_pages.pending", "voltaforge_gpu_retired_pages_pending"),
)
#: read beside the compared fields: what they are checked by, not compared themselves
CONTEXT_FIELDS = ("index", "name", "uuid", "memory.reserved", "driver_version")


#: every field the comparison may ask, in the order one query asks them
WANTED: tuple[str, ...] = (*CONTEXT_FIELDS, *dict.fromkeys(f.smi for f in FIELDS), *REASON_FIELDS)


def query_fields(known: Sequence[str]) -> list[str]:
    """What one `nvidia-smi --query-gpu` asks, of the fields this driver knows (``known``: each
    asked alone first, since one unknown field fails the whole query)."""
    return [f for f in WANTED if f in known]


def parse_smi(text: str, fields: Sequence[str]) -> dict[str, dict[str, str | None]]:
    """`--format=csv,noheader,nounits` output of ``fields`` (``index`` first), per GPU index;
    an absent value is None."""
    out: dict[str, dict[str, str | None]] = {}
    for cells in csv.reader(line for line in text.splitlines() if line.strip()):
        cells = [c.strip() for c in cells]
        if len(cells) != len(fields):
            raise ValueError(f"nvidia-smi answered {len(cells)} values for {len(fields)} fields: {cells}")
        row = {f: (None if c.lower() in ABSENT else c) for f, c in zip(fields, cells, strict=True)}
        out[str(row["index"])] = row
    return out


Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


def parse_exporter(text: str) -> Samples:
    """The exporter's /metrics: each sample by (name, its labels)."""
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("yes", "no"):
        return 1.0 if v == "yes" else 0.0
    try:
        return float(int(v, 16)) if v.startswith("0x") else float(v)
    except ValueError:
        return None


@dataclass(frozen=True)
class Row:
    gpu: str
    smi: str
    before: float | str | None
    exported: float | str | None
    after: float | str | None
    verdict: str  # equal | between | neither answers | differs | only nvidia-smi | only the exporter
    note: str = ""

    @property
    def agrees(self) -> bool:
        return self.verdict in ("equal", "between", "neither answers")


def _judge(f: Field, before: float | None, exported: float | None, after: float | None) -> tuple[str, str]:
    if exported is None:
        return ("neither answers", "") if before is None and after is None else ("only nvidia-smi", "")
    if before is None and after is None:
        return "only the exporter", ""
    seen = [v for v in (before, after) if v is not None]
    low, high = min(seen) - f.slack, max(seen) + f.slack
    if low <= exported <= high:
        return ("between" if f.moves and max(seen) != min(seen) else "equal"), ""
    return "differs", f"by {exported - seen[0]:+g}"  # the read before, or after when before has none


def _exported(samples: Samples, f: Field, gpu: str) -> float | None:
    value = samples.get((f.series, frozenset({"gpu": gpu, **f.labels}.items())))
    return None if value is None else value * f.to_smi


def _reason_mask(samples: Samples, gpu: str, bits: Mapping[int, str]) -> int | None:
    by_reason = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "voltaforge_gpu_clocks_event_reason" and dict(labels).get("gpu") == gpu
    }
    if not by_reason:
        return None
    return sum(bit for bit, reason in bits.items() if by_reason.get(reason))


def compare(
    before: Mapping[str, Mapping[str, str | None]],
    exporter_text: str,
    after: Mapping[str, Mapping[str, str | None]],
    reason_bits: Mapping[int, str],
) -> list[Row]:
    """One scrape against the nvidia-smi reads around it, a row per GPU and field.
    ``reason_bits``: NVML's reason bit -> the exporter's label (telemetry_probe's table)."""
    samples = parse_exporter(exporter_text)
    rows: list[Row] = []
    info = {dict(labels).get("gpu"): dict(labels) for (name, labels) in samples if name == "voltaforge_gpu_info"}
    for gpu, b in sorted(before.items()):
        a = after.get(gpu, {})
        for key in ("name", "uuid"):
            if key in b:
                got = (info.get(gpu) or {}).get(key)
                ok = got == b[key]
                rows.append(Row(gpu, key, b[key], got, a.get(key), "equal" if ok else "differs"))
        for f in FIELDS:
            if f.smi not in b:
                continue  # this driver has no such field
            bv, av, ev = _number(b[f.smi]), _number(a.get(f.smi)), _exported(samples, f, gpu)
            verdict, note = _judge(f, bv, ev, av)
            if f.smi == "memory.used" and verdict == "differs" and ev is not None and bv is not None:
                reserved = _number(b.get("memory.reserved"))
                if reserved is not None and abs(ev - (bv + reserved)) <= f.slack * 2:
                    verdict, note = "differs", f"equals nvidia-smi's used + reserved ({reserved:g} MiB)"
            rows.append(Row(gpu, f.smi, bv, ev, av, verdict, note))
        smi_reason = next((r for r in REASON_FIELDS if r in b), None)
        if smi_reason:
            bm, am = _number(b[smi_reason]), _number(a.get(smi_reason))
            em = _reason_mask(samples, gpu, reason_bits)
            known = sum(reason_bits)
            seen = {int(v) & known for v in (bm, am) if v is not None}
            if em is None:
                verdict = "neither answers" if not seen else "only nvidia-smi"
            elif not seen:
                verdict = "only the exporter"
            else:
                verdict = "equal" if em in seen else "differs"
            rows.append(Row(gpu, smi_reason, _hex(bm), _hex(em), _hex(am), verdict, "the bits NVML names"))
    return rows


def _hex(v: float | int | None) -> str | None:
    return None if v is None else f"0x{int(v):x}"


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """The figures of one or more rounds: how many compared, how many agree, which differ."""
    return {
        "compared": len(rows),
        "agree": sum(r.agrees for r in rows),
        "differ": sum(not r.agrees for r in rows),
        "differing": sorted({f"{r.smi} ({r.verdict}{': ' + r.note if r.note else ''})" for r in rows if not r.agrees}),
    }
