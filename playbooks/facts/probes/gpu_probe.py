#!/usr/bin/env python3
"""voltaforge GPU probe: pushed to a host and run there with its own python3 (3.8+).

It prints exactly ONE line of JSON on stdout and exits 0, whatever happens:

    {"probe": "voltaforge-gpu", "probe_version": 1, "source": "nvml", "driver": "...",
     "cuda_driver_version": [12, 8], "gpus": [{...}, ...]}
    {"probe": "voltaforge-gpu", "probe_version": 1, "source": "none", "reason": "...",
     "nvml_error": "NVML_ERROR_..." or null}

Why a probe and not only nvidia-smi: NVML gives the compute capability on every driver
(nvidia-smi's `compute_cap` field only exists from about R510), the throttle-reason bitmask
and the power limits in one call, with no text layout to guess. It needs the `pynvml`
module (PyPI `nvidia-ml-py`); when that module or the driver is missing the probe says so
in JSON instead of failing, so the caller can fall back to nvidia-smi.

Only the standard library and, optionally, pynvml are used. Keep it Python 3.8 compatible:
no `match`, no `X | Y` annotations, no 3.9+ APIs.
The GPU keys are the field names of voltaforge's GpuInfo model (playbooks/facts/gpu.py).
"""

import json
import sys

PROBE_VERSION = 1


def _text(value):
    """pynvml returns bytes on old releases and str on new ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _error_name(exc, pynvml):
    """Map an NVMLError to its NVML_ERROR_* constant name (e.g. NVML_ERROR_LIBRARY_NOT_FOUND)."""
    code = getattr(exc, "value", None)
    if code is not None and pynvml is not None:
        for name in dir(pynvml):
            if name.startswith("NVML_ERROR_") and getattr(pynvml, name, None) == code:
                return name
    return None


def _describe(exc):
    text = str(exc).strip()
    return text or exc.__class__.__name__


def _emit(obj):
    obj.setdefault("probe", "voltaforge-gpu")
    obj.setdefault("probe_version", PROBE_VERSION)
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def _none(reason, nvml_error=None):
    return {"source": "none", "reason": reason, "nvml_error": nvml_error}


def _gpu(pynvml, index):
    """Collect one GPU; every query may be unsupported, so each is tried on its own."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    gpu = {"index": index}
    errors = {}

    def query(key, fn):
        try:
            gpu[key] = fn()
        except Exception as exc:  # NVMLError_NotSupported, NoPermission, missing symbol...
            gpu[key] = None
            errors[key] = _describe(exc)

    query("name", lambda: _text(pynvml.nvmlDeviceGetName(handle)))
    query("uuid", lambda: _text(pynvml.nvmlDeviceGetUUID(handle)))
    query("pci_bus_id", lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    query("compute_capability", lambda: list(pynvml.nvmlDeviceGetCudaComputeCapability(handle)))

    def memory():
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        mib = 1024 * 1024
        return info.total // mib, info.used // mib, info.free // mib

    try:
        gpu["memory_total_mib"], gpu["memory_used_mib"], gpu["memory_free_mib"] = memory()
    except Exception as exc:
        for key in ("memory_total_mib", "memory_used_mib", "memory_free_mib"):
            gpu[key] = None
        errors["memory"] = _describe(exc)

    query("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    query("power_draw_w", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
    query("power_limit_w", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)

    def power_range():
        low, high = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        return low / 1000.0, high / 1000.0

    try:
        gpu["power_min_limit_w"], gpu["power_max_limit_w"] = power_range()
    except Exception as exc:
        gpu["power_min_limit_w"] = gpu["power_max_limit_w"] = None
        errors["power_range"] = _describe(exc)

    query("sm_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    query("max_sm_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    query("mem_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    query("max_mem_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    query("persistence_mode", lambda: pynvml.nvmlDeviceGetPersistenceMode(handle) == pynvml.NVML_FEATURE_ENABLED)
    query("pcie_gen", lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
    query("pcie_width", lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))

    def reasons():
        # Renamed "event reasons" in newer NVML; the old name is kept as an alias there.
        fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:
            fn = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    query("clocks_event_reasons_mask", reasons)
    gpu["errors"] = errors
    return gpu


def probe():
    try:
        import pynvml  # from PyPI nvidia-ml-py (or the older pynvml package)
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return _none(f"pynvml not importable: {_describe(exc)}")

    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError: LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, ...
        name = _error_name(exc, pynvml)
        return _none(f"NVML init failed: {_describe(exc)}", name)

    try:
        result: dict = {"source": "nvml", "gpus": []}  # the JSON object printed: values of any type
        try:
            result["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            result["driver"] = None
        try:
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12080
            result["cuda_driver_version"] = [version // 1000, (version % 1000) // 10]
        except Exception:
            result["cuda_driver_version"] = None
        count = pynvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                result["gpus"].append(_gpu(pynvml, index))
            except Exception as exc:  # handle lookup failed: GPU lost / no permission
                result["gpus"].append({"index": index, "errors": {"handle": _describe(exc)}})
        return result
    except Exception as exc:
        return _none(f"NVML query failed: {_describe(exc)}", _error_name(exc, pynvml))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def main():
    try:
        result = probe()
    except BaseException as exc:  # never a traceback: the caller parses stdout as JSON
        result = _none(f"probe crashed: {exc.__class__.__name__}: {_describe(exc)}")
    try:
        _emit(result)
    except Exception as exc:  # e.g. a non-serialisable value from an odd pynvml build
        _emit(_none(f"probe output not serialisable: {_describe(exc)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
