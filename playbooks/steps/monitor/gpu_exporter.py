#!/usr/bin/env python3
"""voltaforge GPU exporter: every GPU's clocks, temperature, power, throttle reasons, memory,
utilization and memory errors, as Prometheus metrics, read through NVML at each scrape.

    python3 gpu_exporter.py --listen 127.0.0.1:9835

Why our own: NVIDIA's DCGM exporter needs DCGM and a container runtime, and reads nothing a
V100 lab asks of it that NVML does not give; this is one small process on the host's own python3
with Debian's python3-prometheus-client and NVIDIA's NVML binding (pynvml.py from PyPI
nvidia-ml-py, shipped beside it: it loads whichever driver's libnvidia-ml.so.1 the host has). It reads what the bench's
telemetry reads (facts/probes/telemetry_probe.py, shipped beside it: its table of reason bits
and its NVML error names are imported, not copied), plus the power limit, memory total, ECC
error counts and retired pages where the card has them.

Read at scrape time, not sampled in a thread: a value is as old as the scrape, and a process
nobody scrapes costs nothing. A query the card does not support leaves its series out and sets
``voltaforge_gpu_query_unsupported{gpu,query}`` once; a host with no GPU, no driver or no NVML
library exports ``voltaforge_gpus 0`` and ``voltaforge_nvml_error{kind}`` and keeps running (NVML
is tried again at the next scrape: a driver loaded later is found)."""

import argparse
import signal
import sys
import threading

# Debian's python3-prometheus-client on the host (the controller's venv has it too, for the
# tests), and the probe shipped beside this file (not importable where mypy runs)
from prometheus_client import start_http_server
from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
)
from telemetry_probe import (  # type: ignore[import-not-found]
    _NVML_KIND,
    CLOCKS_EVENT_REASON_BITS,
    _describe,
    _nvml_error_name,
)

PREFIX = "voltaforge_gpu_"
MIB = 1024 * 1024


def _gauge(name, doc, labels=("gpu",)):
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


class NvmlCollector:
    """One collect() is one NVML pass over every GPU (prometheus_client calls it per scrape)."""

    def __init__(self, pynvml):
        self.nvml = pynvml
        self.ready = False

    def _init(self):
        if self.ready:
            return None
        try:
            self.nvml.nvmlInit()
        except Exception as exc:
            name = _nvml_error_name(exc, self.nvml)
            return _NVML_KIND.get(name, "nvml-init-failed"), _describe(exc)
        self.ready = True
        return None

    def collect(self):
        gpus = GaugeMetricFamily("voltaforge_gpus", "GPUs NVML sees on this host (0: none, or NVML failed)")
        error = GaugeMetricFamily(
            "voltaforge_nvml_error", "1 while NVML cannot be read, by why (no-driver, no-nvml-library, ...)",
            labels=["kind", "message"],
        )  # fmt: skip
        failed = self._init()
        if failed is None:
            try:
                count = int(self.nvml.nvmlDeviceGetCount())
            except Exception as exc:  # the driver went away under us: init again next time
                self.ready, failed = False, ("nvml-failed", _describe(exc))
        if failed is not None:
            gpus.add_metric([], 0)
            error.add_metric(list(failed), 1)
            yield gpus
            yield error
            return
        gpus.add_metric([], count)
        yield gpus
        yield error
        yield from self._per_gpu(count)

    def _per_gpu(self, count):
        nv = self.nvml
        fam = {
            "info": _gauge("info", "the GPU's name and UUID (always 1)", ("gpu", "name", "uuid")),
            "sm": _gauge("sm_clock_hertz", "SM clock"),
            "mem": _gauge("memory_clock_hertz", "memory clock"),
            "temp": _gauge("temperature_celsius", "GPU temperature"),
            "power": _gauge("power_watts", "power draw"),
            "limit": _gauge("power_limit_watts", "enforced power limit"),
            "reason": _gauge(
                "clocks_event_reason", "1 while this reason holds the clocks down (nvmlClocksEventReasons)",
                ("gpu", "reason"),
            ),
            "used": _gauge("memory_used_bytes", "framebuffer memory used"),
            "total": _gauge("memory_total_bytes", "framebuffer memory"),
            "util": _gauge("utilization_ratio", "share of the last sample period a kernel ran (0-1)"),
            "ecc": CounterMetricFamily(
                PREFIX + "ecc_errors", "memory errors over the card's life (aggregate)", labels=["gpu", "kind"]
            ),
            "retired": _gauge("retired_pages", "memory pages retired, by cause", ("gpu", "cause")),
            "pending": _gauge("retired_pages_pending", "1 when a page waits for a reboot to be retired"),
            "unsupported": _gauge(
                "query_unsupported", "1 for a query this card or driver does not answer", ("gpu", "query")
            ),
        }  # fmt: skip
        for index in range(count):
            gpu = str(index)

            def query(key, fn, gpu=gpu):
                try:
                    return fn()
                except Exception:  # NotSupported (a V100 has no fan reading), NoPermission, GPU lost
                    fam["unsupported"].add_metric([gpu, key], 1)
                    return None

            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
            except Exception:
                fam["unsupported"].add_metric([gpu, "handle"], 1)
                continue
            name = query("name", lambda h=handle: nv.nvmlDeviceGetName(h))
            uuid = query("uuid", lambda h=handle: nv.nvmlDeviceGetUUID(h))
            fam["info"].add_metric([gpu, _text(name), _text(uuid)], 1)
            for key, fn, scale in (
                ("sm", lambda h=handle: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1e6),
                ("mem", lambda h=handle: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM), 1e6),
                ("temp", lambda h=handle: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), 1),
                ("power", lambda h=handle: nv.nvmlDeviceGetPowerUsage(h), 1e-3),
                ("limit", lambda h=handle: nv.nvmlDeviceGetEnforcedPowerLimit(h), 1e-3),
                ("util", lambda h=handle: nv.nvmlDeviceGetUtilizationRates(h).gpu, 1e-2),
            ):
                value = query(key, fn)
                if value is not None:
                    fam[key].add_metric([gpu], float(value) * scale)
            memory = query("memory", lambda h=handle: nv.nvmlDeviceGetMemoryInfo(h))
            if memory is not None:
                fam["used"].add_metric([gpu], float(memory.used))
                fam["total"].add_metric([gpu], float(memory.total))
            mask = query("clocks_event_reasons", lambda h=handle: _reasons_mask(nv, h))
            if mask is not None:
                for bit, reason in sorted(CLOCKS_EVENT_REASON_BITS.items()):
                    fam["reason"].add_metric([gpu, reason], 1 if mask & bit else 0)
            for kind, which in (("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                                ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):  # fmt: skip
                value = query(
                    f"ecc_{kind}",
                    lambda h=handle, w=which: nv.nvmlDeviceGetTotalEccErrors(h, getattr(nv, w), nv.NVML_AGGREGATE_ECC),
                )
                if value is not None:
                    fam["ecc"].add_metric([gpu, kind], float(value))
            for cause, which in (("single_bit", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                                 ("double_bit", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")):  # fmt: skip
                pages = query(
                    f"retired_{cause}", lambda h=handle, w=which: nv.nvmlDeviceGetRetiredPages(h, getattr(nv, w))
                )
                if pages is not None:
                    fam["retired"].add_metric([gpu, cause], float(len(pages)))
            pending = query("retired_pending", lambda h=handle: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
            if pending is not None:
                fam["pending"].add_metric([gpu], 1 if int(pending) else 0)
        yield from fam.values()


def _reasons_mask(nv, handle):
    # renamed "event reasons" in newer NVML; older bindings only have the throttle name
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(fn(handle))


def _text(value):
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


class _NoNvml:
    """pynvml not importable: the same series as a host whose NVML fails."""

    def __init__(self, why):
        self.why = why

    def collect(self):
        gpus = GaugeMetricFamily("voltaforge_gpus", "GPUs NVML sees on this host (0: none, or NVML failed)")
        gpus.add_metric([], 0)
        error = GaugeMetricFamily("voltaforge_nvml_error", "1 while NVML cannot be read", labels=["kind", "message"])
        error.add_metric(["no-pynvml", self.why], 1)
        yield gpus
        yield error


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_exporter.py")
    parser.add_argument("--listen", required=True, help="ADDRESS:PORT (loopback unless the inventory names one)")
    args = parser.parse_args(argv)
    address, _, port = args.listen.rpartition(":")
    try:
        import pynvml  # nvidia-ml-py's, shipped beside this file (first on sys.path)
    except Exception as exc:
        REGISTRY.register(_NoNvml(_describe(exc)))
    else:
        REGISTRY.register(NvmlCollector(pynvml))
    start_http_server(int(port), addr=address.strip("[]"))
    print(f"voltaforge GPU exporter listening on {args.listen}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
