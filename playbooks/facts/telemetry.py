"""GPU telemetry during a benchmark: the probe's command, a pure parser, and a throttle summary.

Why: decode on a V100 is memory-bound, but the seed still lost 42 -> 30 tok/s after ten
minutes at 85 C because the clocks came down. A bench figure is only comparable with another
when the same run says whether a thermal or power cap held the GPU back, and from when.

The probe (probes/telemetry_probe.py) samples through pynvml, or through nvidia-smi's CSV
when pynvml is missing; its nvidia-smi lines carry the CSV verbatim and are read here with
gpu.parse_nvidia_smi_csv, and reason bitmasks with gpu.decode_clocks_event_reasons, so there
is one decoder of each. Anything unreadable becomes Telemetry(error=...), never an exception.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from typing import Any, Literal

from playbooks.facts import lines
from playbooks.facts.gpu import THROTTLE_REASONS, decode_clocks_event_reasons, parse_nvidia_smi_csv

PROBE_NAME = "voltaforge-telemetry"
TELEMETRY_PROBE_PATH = Path(__file__).resolve().parent / "probes" / "telemetry_probe.py"

# The fallback's --query-gpu fields (the probe holds a copy). Names as in gpu.QUERY_FIELDS,
# plus utilization.gpu, which only telemetry needs.
TELEMETRY_QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "temperature.gpu",
    "clocks.sm",
    "clocks.mem",
    "power.draw",
    "memory.used",
    "utilization.gpu",
    "clocks_throttle_reasons.active",
)

# A fall of more than this below the run's highest busy SM clock is reported as a clock drop.
CLOCK_DROP_FRACTION = 0.10

TelemetrySource = Literal["pynvml", "nvidia-smi", "none"]


@dataclass(frozen=True)
class Sample:
    """One GPU at one instant. None: the GPU did not report that value."""

    t: float  # seconds since the probe started (monotonic clock)
    gpu: int
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    power_w: float | None = None
    memory_used_mib: float | None = None
    utilization_gpu_pct: float | None = None
    # Active clock event/throttle reasons ('idle', 'sw_power_cap', ...); None: not reported.
    reasons: tuple[str, ...] | None = None

    @property
    def throttling(self) -> tuple[str, ...]:
        """Active reasons that are a thermal or power cap (gpu.THROTTLE_REASONS)."""
        return tuple(r for r in self.reasons or () if r in THROTTLE_REASONS)


@dataclass(frozen=True)
class Telemetry:
    """A probe run's samples, or why there are none (error, with the probe's kind)."""

    samples: tuple[Sample, ...] = ()
    error: str | None = None
    source: TelemetrySource = "none"
    kind: str | None = None  # the probe's error kind: 'no-pynvml', 'no-driver', ...
    warnings: tuple[str, ...] = ()


def _positive(name: str, value: float) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def telemetry_command(python: str, probe_path: str, interval: float, duration: float) -> str:
    """Shell command that runs the pushed probe with the host's python; exits 0 and prints an
    error line of its own when that python is missing.

    The probe stops when its stdin closes: run it with a stdin that stays open for the bench
    (Fabric: in_stream=False), since Invoke closes the remote stdin when the local one ends."""
    interval_s, duration_s = _positive("interval", interval), _positive("duration", duration)
    missing = json.dumps({"probe": PROBE_NAME, "error": f"{python} not found", "kind": "no-python"})
    return (
        f"if command -v {quote(python)} >/dev/null 2>&1; then "
        f"{quote(python)} {quote(probe_path)} --interval {interval_s!r} --duration {duration_s!r} 2>&1 || true; "
        f"else echo {quote(missing)}; fi"
    )


def background_telemetry_command(python: str, probe_path: str, out: str, interval: float, duration: float) -> str:
    """telemetry_command in its own session, into `out`, printing its pid: the bench's requests
    never wait on it, and stop_telemetry_command(PID) ends it. The probe's `if` is a compound command, so it runs
    under `sh -c` (setsid execs one program); stdin is /dev/null, so the probe runs until killed
    or for `duration`."""
    inner = telemetry_command(python, probe_path, interval, duration)
    return f"setsid sh -c {quote(inner)} > {quote(out)} 2>&1 < /dev/null & echo $!"


def stop_telemetry_command(pid: str) -> str:
    """End the background probe and its shell: the whole session's process group (the pid
    setsid made leader). Killing the pid alone ended the `sh -c` and left the probe running for
    its whole duration (seen: probes of an hour outliving the bench)."""
    if not pid.isdigit():
        raise ValueError(f"not a pid: {pid!r}")
    return f"kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid} 2>/dev/null; sleep 0.2"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _nvml_sample(data: dict[str, Any]) -> Sample | None:
    t, gpu = _number(data.get("t")), data.get("gpu")
    if t is None or not isinstance(gpu, int) or isinstance(gpu, bool):
        return None
    mask, names = data.get("reasons_mask"), data.get("reasons")
    reasons: tuple[str, ...] | None = None
    if isinstance(mask, int) and not isinstance(mask, bool) and mask >= 0:
        reasons = decode_clocks_event_reasons(mask)
    elif isinstance(names, list) and all(isinstance(n, str) for n in names):
        reasons = tuple(names)
    return Sample(
        t=t,
        gpu=gpu,
        temperature_c=_number(data.get("temperature_c")),
        sm_clock_mhz=_number(data.get("sm_clock_mhz")),
        mem_clock_mhz=_number(data.get("mem_clock_mhz")),
        power_w=_number(data.get("power_w")),
        memory_used_mib=_number(data.get("memory_used_mib")),
        utilization_gpu_pct=_number(data.get("utilization_gpu_pct")),
        reasons=reasons,
    )


def _csv_samples(t: float, csv: str) -> tuple[list[Sample], list[str], str | None]:
    """One tick of nvidia-smi CSV through gpu.py's parser: (samples, warnings, error)."""
    facts = parse_nvidia_smi_csv(csv, TELEMETRY_QUERY_FIELDS)
    if not facts.available:
        return [], list(facts.warnings), facts.reason
    samples = [
        Sample(
            t=t,
            gpu=g.index,
            temperature_c=None if g.temperature_c is None else float(g.temperature_c),
            sm_clock_mhz=None if g.sm_clock_mhz is None else float(g.sm_clock_mhz),
            mem_clock_mhz=None if g.mem_clock_mhz is None else float(g.mem_clock_mhz),
            power_w=g.power_draw_w,
            memory_used_mib=None if g.memory_used_mib is None else float(g.memory_used_mib),
            utilization_gpu_pct=None if g.utilization_gpu_pct is None else float(g.utilization_gpu_pct),
            reasons=g.clocks_event_reasons,
        )
        for g in facts.gpus
    ]
    return samples, list(facts.warnings), None


def parse_telemetry(output: str) -> Telemetry:
    """Parse the probe's JSON lines. Lines that are not the probe's (ssh banners, a vGPU shim's
    messages) are skipped; an error line sets error/kind and keeps the samples before it."""
    samples: list[Sample] = []
    warnings: list[str] = []
    sources: list[str] = []
    error: str | None = None
    kind: str | None = None
    seen_probe = False
    for raw in lines(output):
        line = raw.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except ValueError:
            warnings.append(f"unreadable line: {line[:120]}")
            continue
        if not isinstance(data, dict) or data.get("probe") != PROBE_NAME:
            continue
        seen_probe = True
        if "error" in data:
            error, kind = str(data["error"]), str(data.get("kind") or "unknown")
            continue
        for key, message in (data.get("errors") or {}).items():
            warnings.append(f"GPU {data.get('gpu')}: {key}: {message}")
        if data.get("source") == "nvidia-smi" and isinstance(data.get("csv"), str):
            t = _number(data.get("t"))
            if t is None:
                warnings.append(f"nvidia-smi sample without a time: {line[:120]}")
                continue
            tick, tick_warnings, tick_error = _csv_samples(t, data["csv"])
            warnings.extend(tick_warnings)
            if tick_error is not None:
                error, kind = f"nvidia-smi: {tick_error}", "nvidia-smi-failed"
                continue
            samples.extend(tick)
            sources.append("nvidia-smi")
        elif (sample := _nvml_sample(data)) is not None:
            samples.append(sample)
            sources.append("pynvml")
        else:
            warnings.append(f"probe line without t/gpu: {line[:120]}")
    if not seen_probe:
        first = next((ln.strip() for ln in lines(output) if ln.strip()), "")
        error = (
            f"telemetry probe printed no line of its own: {first[:200]}" if first else "telemetry probe printed nothing"
        )
        kind = "no-output"
    elif not samples and error is None:
        error, kind = "telemetry probe gave no sample", "no-samples"
    source: TelemetrySource = "none"
    if sources:
        source = "nvidia-smi" if sources[-1] == "nvidia-smi" else "pynvml"
    return Telemetry(samples=tuple(samples), error=error, source=source, kind=kind, warnings=tuple(warnings))


def _clock_drop(samples: tuple[Sample, ...]) -> dict[str, Any] | None:
    """The first time a GPU's SM clock fell more than CLOCK_DROP_FRACTION below the highest it
    had reached before, among busy samples.

    Samples with the 'idle' reason are left out: a bench starts and ends idle, and the idle
    clock (~135 MHz on a V100) next to the boost clock is not a drop."""
    peaks: dict[int, float] = {}
    for s in sorted(samples, key=lambda s: s.t):
        if s.sm_clock_mhz is None or "idle" in (s.reasons or ()):
            continue
        peak = peaks.get(s.gpu)
        if peak is not None and s.sm_clock_mhz < peak * (1 - CLOCK_DROP_FRACTION):
            return {
                "gpu": s.gpu,
                "at_s": s.t,
                "from_mhz": peak,
                "to_mhz": s.sm_clock_mhz,
                "drop_pct": round(100 * (1 - s.sm_clock_mhz / peak), 1),
                "reasons": list(s.reasons) if s.reasons is not None else None,
            }
        peaks[s.gpu] = max(peak or 0.0, s.sm_clock_mhz)
    return None


def throttle_summary(t: Telemetry) -> dict[str, Any]:
    """What the bench reports and gates on.

    throttled: a thermal or power cap reason (gpu.THROTTLE_REASONS) was active in some
    sample; started_at_s is the first such sample's time and throttled_gpus who. clock_drop
    (None or {gpu, at_s, from_mhz, to_mhz, drop_pct, reasons}) says when an SM clock fell more
    than 10% below its busy peak even with no cap reason shown (nvidia-smi may not report the
    reasons; a drop without one is worth a look). Min/max/mean are over all samples and GPUs."""
    samples = tuple(sorted(t.samples, key=lambda s: s.t))
    capped = [s for s in samples if s.throttling]
    reasons: list[str] = []
    for s in capped:
        reasons.extend(r for r in s.throttling if r not in reasons)
    temps = [s.temperature_c for s in samples if s.temperature_c is not None]
    clocks = [s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]
    powers = [s.power_w for s in samples if s.power_w is not None]
    return {
        "throttled": bool(capped),
        "started_at_s": capped[0].t if capped else None,
        "reasons": reasons,
        "throttled_gpus": sorted({s.gpu for s in capped}),
        "clock_drop": _clock_drop(samples),
        "max_temperature_c": max(temps) if temps else None,
        "min_sm_clock_mhz": min(clocks) if clocks else None,
        "max_sm_clock_mhz": max(clocks) if clocks else None,
        "mean_power_w": round(sum(powers) / len(powers), 2) if powers else None,
        "samples": len(samples),
        "error": t.error,
    }
