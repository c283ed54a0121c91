#!/usr/bin/env python3
"""voltaforge telemetry probe: samples every GPU at a fixed interval while a benchmark runs.

    python3 telemetry_probe.py --interval 0.5 --duration 600

Why: the seed lost 42 -> 30 tok/s after ten minutes at 85 C. A benchmark figure means nothing
without the clocks, temperature, power and throttle ("clocks event") reasons of the same
seconds, so `invoke bench` runs this beside its load and keeps what it prints.

Output: JSON lines on stdout, each tagged "probe": "voltaforge-telemetry", exit 0 always.
- through pynvml, one line per GPU per tick:
    {"probe": ..., "source": "pynvml", "t": 0.5, "gpu": 0, "temperature_c": 32,
     "sm_clock_mhz": 1290, "mem_clock_mhz": 877, "power_w": 57.44, "memory_used_mib": 5,
     "utilization_gpu_pct": 97, "reasons": ["sw_power_cap"], "reasons_mask": 4}
  A query the GPU does not support gives null, and its error once per GPU in "errors".
- without pynvml but with nvidia-smi, one line per tick holding nvidia-smi's CSV verbatim
  ({"source": "nvidia-smi", "t": ..., "csv": "..."}): voltaforge parses it on the controller
  with the same CSV parser as its GPU facts, so the probe carries no second parser.
- when nothing can be sampled, one line {"probe": ..., "error": "...", "kind": "..."};
  kind is no-pynvml, no-driver, no-nvml-library, nvml-init-failed, no-gpu, nvidia-smi-failed
  or bad-arguments.

It stops after --duration seconds, or earlier when its stdin reaches end of file (the
controller closed the SSH channel), so an aborted bench never leaves it running on the host.
stdin that is /dev/null or a terminal is not watched (it would end the run at once);
--ignore-stdin turns the watch off.

Runs on the host's own python3 (3.8+): stdlib and, optionally, pynvml (PyPI nvidia-ml-py).
No `match`, no `X | Y` annotations. The reason names and the CSV field list are copies of
playbooks/facts/gpu.py's, kept equal by tests/test_telemetry.py.
"""

import argparse
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

PROBE = "voltaforge-telemetry"

# nvml.h nvmlClocksEventReason* bits: a copy of gpu.CLOCKS_EVENT_REASON_BITS.
CLOCKS_EVENT_REASON_BITS = {
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

# nvidia-smi --query-gpu fields for the fallback: a copy of telemetry.TELEMETRY_QUERY_FIELDS.
# clocks_throttle_reasons.active is the old name every driver back to R384 still accepts.
NVIDIA_SMI_FIELDS = (
    "index",
    "temperature.gpu",
    "clocks.sm",
    "clocks.mem",
    "power.draw",
    "memory.used",
    "utilization.gpu",
    "clocks_throttle_reasons.active",
)

_NVML_KIND = {
    "NVML_ERROR_DRIVER_NOT_LOADED": "no-driver",
    "NVML_ERROR_LIBRARY_NOT_FOUND": "no-nvml-library",
}


def decode_reasons(mask):
    """Bitmask -> names, unknown bits as 'bit_0x...' (same rule as gpu.decode_clocks_event_reasons)."""
    names = [name for bit, name in sorted(CLOCKS_EVENT_REASON_BITS.items()) if mask & bit]
    unknown = mask & ~sum(CLOCKS_EVENT_REASON_BITS)
    bit = 1
    while unknown:
        if unknown & bit:
            names.append(f"bit_{bit:#x}")
            unknown &= ~bit
        bit <<= 1
    return names


def _describe(exc):
    text = str(exc).strip()
    return text or exc.__class__.__name__


def _emit(obj):
    obj["probe"] = PROBE
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def _error(kind, message):
    _emit({"error": message, "kind": kind})


def _nvml_error_name(exc, pynvml):
    code = getattr(exc, "value", None)
    if code is not None:
        for name in dir(pynvml):
            if name.startswith("NVML_ERROR_") and getattr(pynvml, name, None) == code:
                return name
    return None


def _watch_stdin(stop):
    """End the run when the controller closes our stdin (SSH channel gone).

    /dev/null and terminals are not watched: the first reads EOF at once, the second never
    closes; a pipe or socket is what an SSH session without a pty gives."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISREG(mode)) or os.isatty(0):
        return

    def drain():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=drain, daemon=True).start()


def _ticks(interval, duration, stop):
    """Yield seconds since start at start + k*interval (monotonic, no drift) until duration or stop."""
    start = time.monotonic()
    k = 0
    while not stop.is_set():
        due = k * interval
        if due > duration + 1e-9:
            return
        wait = start + due - time.monotonic()
        if wait > 0 and stop.wait(wait):
            return
        yield time.monotonic() - start
        k += 1


def _sample_gpu(pynvml, index, handle, t, reported):
    """One GPU's sample; each query may be unsupported (V100s report no fan or some powers)."""
    sample = {"source": "pynvml", "t": round(t, 3), "gpu": index}
    errors = {}

    def query(key, fn):
        try:
            sample[key] = fn()
        except Exception as exc:  # NVMLError_NotSupported, NoPermission, GPU lost...
            sample[key] = None
            if (index, key) not in reported:  # once per GPU, not twice a second
                reported.add((index, key))
                errors[key] = _describe(exc)

    def mask():
        # Renamed "event reasons" in newer NVML; older bindings only have the throttle name.
        fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:
            fn = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    query("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    query("sm_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    query("mem_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    query("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
    query("memory_used_mib", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used // (1024 * 1024))
    query("utilization_gpu_pct", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    query("reasons_mask", mask)
    sample["reasons"] = None if sample["reasons_mask"] is None else decode_reasons(sample["reasons_mask"])
    if errors:
        sample["errors"] = errors
    return sample


def run_nvml(pynvml, interval, duration, stop):
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        name = _nvml_error_name(exc, pynvml)
        kind = _NVML_KIND.get(name, "nvml-init-failed")
        _error(kind, "NVML init failed: {}{}".format(_describe(exc), f" ({name})" if name else ""))
        return
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:
            _error("no-gpu", "NVML reports no GPU")
            return
        handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        reported: set = set()  # (gpu, key) whose query error was already reported
        for t in _ticks(interval, duration, stop):
            for index, handle in handles:
                _emit(_sample_gpu(pynvml, index, handle, t, reported))
    except Exception as exc:  # handle lookup failed, GPU fell off the bus mid-run
        _error("nvml-failed", f"NVML query failed: {_describe(exc)}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def run_nvidia_smi(nvidia_smi, interval, duration, stop):
    command = [nvidia_smi, "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader,nounits"]
    for t in _ticks(interval, duration, stop):
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
        except Exception as exc:  # hung driver (timeout), exec failure
            _error("nvidia-smi-failed", f"nvidia-smi did not run: {_describe(exc)}")
            return
        if done.returncode != 0:
            # 'NVIDIA-SMI has failed ...', 'Field "x" is not a valid field to query.'
            _error("nvidia-smi-failed", f"nvidia-smi exited {done.returncode}: {done.stdout.strip()}")
            return
        _emit({"source": "nvidia-smi", "t": round(t, 3), "csv": done.stdout})


def _arguments(argv):
    parser = argparse.ArgumentParser(prog="telemetry_probe.py", add_help=True)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--ignore-stdin", action="store_true")

    class _Bad(Exception):
        pass

    def fail(message):
        raise _Bad(message)

    parser.error = fail  # type: ignore[method-assign]  # an error line, not usage text and exit 2
    try:
        args = parser.parse_args(argv)
    except _Bad as exc:
        return None, str(exc)
    for name in ("interval", "duration"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            return None, f"--{name} must be a positive number, got {value!r}"
    return args, None


def main(argv=None):
    args, problem = _arguments(sys.argv[1:] if argv is None else argv)
    if problem:
        _error("bad-arguments", problem)
        return 0
    stop = threading.Event()
    if not args.ignore_stdin:
        _watch_stdin(stop)
    try:
        import pynvml  # PyPI nvidia-ml-py (or the older pynvml package)
    except Exception as exc:  # ImportError, or a broken install raising anything else
        nvidia_smi = shutil.which("nvidia-smi")
        if nvidia_smi is None:
            _error("no-pynvml", f"pynvml not importable ({_describe(exc)}) and no nvidia-smi on PATH")
            return 0
        run_nvidia_smi(nvidia_smi, args.interval, args.duration, stop)
        return 0
    run_nvml(pynvml, args.interval, args.duration, stop)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):  # the controller went away: nobody to tell
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        sys.exit(0)
    except Exception as exc:  # never a traceback: the controller parses stdout as JSON lines
        _error("probe-crashed", f"{exc.__class__.__name__}: {_describe(exc)}")
        sys.exit(0)
