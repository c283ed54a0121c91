"""Telemetry and membw probes: run for real here (no GPU), run against stand-in pynvml modules
and a stand-in nvidia-smi that answer with REAL captured values (tests/fixtures, see headers),
and their parsers fed garbage.

NVML: the probe runs with the REAL nvidia-ml-py package (a test extra; tests/nvml_env.py) for
every path this machine can show without a GPU: pynvml absent (the interpreter without its
site-packages), the library installed but no driver (NVMLError_DriverNotLoaded), and no library
(NVMLError_LibraryNotFound, libnvidia-ml.so.1 hidden in a private mount namespace). Stand-in
pynvml modules are used ONLY where GPU values are needed (samples, reasons, a thermal slowdown):
there is no GPU here to give them."""

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from playbooks.facts import gpu, membw, telemetry
from playbooks.facts.membw import Membw, membw_command, read_membw
from playbooks.facts.telemetry import (
    TELEMETRY_QUERY_FIELDS,
    Sample,
    Telemetry,
    parse_telemetry,
    telemetry_command,
    throttle_summary,
)
from tests.helpers import fixture_body
from tests.nvml_env import (
    WHICH_ERROR,
    real_pynvml_version,
    require_nvml_library_without_driver,
    without_nvml_library,
)

REPO = Path(__file__).resolve().parent.parent
PROBES = REPO / "playbooks" / "facts" / "probes"
TELEMETRY_PROBE = PROBES / "telemetry_probe.py"
MEMBW_PROBE = PROBES / "membw_probe.py"


def _load_probe_module():
    spec = importlib.util.spec_from_file_location("telemetry_probe_under_test", TELEMETRY_PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(pythonpath=None, path_prefix=None):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_telemetry(*args, pythonpath=None, path_prefix=None, timeout=60, no_site=False, wrap=list):
    """The probe under this python; no_site: without site-packages (-S), so the installed
    pynvml is not importable; wrap: a function of the argv (without_nvml_library)."""
    python = [sys.executable, "-S"] if no_site else [sys.executable]
    return subprocess.run(
        wrap([*python, str(TELEMETRY_PROBE), *args]),
        env=_env(pythonpath, path_prefix),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _json_lines(stdout):
    return [json.loads(ln) for ln in stdout.splitlines() if ln.strip()]


# --------------------------------------------------------------------------- the probe, for real


def _one_error_line(run, kind, error):
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    (line,) = _json_lines(run.stdout)  # one error line, not a sample per tick
    assert line == {"probe": "voltaforge-telemetry", "kind": kind, "error": error}
    parsed = parse_telemetry(run.stdout)
    assert parsed == Telemetry(samples=(), error=error, source="none", kind=kind)
    assert throttle_summary(parsed)["throttled"] is False


def test_telemetry_probe_without_pynvml_says_so():
    """pynvml really absent: this python without its site-packages (-S), where the test extra
    nvidia-ml-py is installed; and no nvidia-smi on this machine."""
    assert shutil.which("nvidia-smi") is None
    absent = subprocess.run([sys.executable, "-S", "-c", "import pynvml"], capture_output=True, text=True)
    assert "No module named 'pynvml'" in absent.stderr
    run = _run_telemetry("--interval", "0.5", "--duration", "1", no_site=True)
    _one_error_line(run, "no-pynvml", "pynvml not importable (No module named 'pynvml') and no nvidia-smi on PATH")


def test_telemetry_probe_with_the_real_nvml_package_and_no_driver():
    """The REAL nvidia-ml-py here, where libnvidia-ml.so.1 is installed and no nvidia driver is
    loaded: the package raises NVMLError_DriverNotLoaded (checked first), and that is the
    probe's one error line, kind no-driver. No stand-in."""
    require_nvml_library_without_driver()
    real_pynvml_version()
    which = subprocess.run([sys.executable, "-c", WHICH_ERROR], env=_env(), capture_output=True, text=True)
    assert which.stdout.split() == ["NVMLError_DriverNotLoaded", "9"], (which.stdout, which.stderr)
    run = _run_telemetry("--interval", "0.5", "--duration", "1")
    _one_error_line(run, "no-driver", "NVML init failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED)")


def test_telemetry_probe_with_the_real_nvml_package_and_no_library():
    """The REAL nvidia-ml-py with libnvidia-ml.so.1 hidden (tests/nvml_env.py): the package's own
    CDLL fails and it raises NVMLError_LibraryNotFound (checked first, in the same namespace);
    that is the probe's one error line, kind no-nvml-library. No stand-in."""
    real_pynvml_version()
    which = subprocess.run(
        without_nvml_library([sys.executable, "-c", WHICH_ERROR]), env=_env(), capture_output=True, text=True
    )
    assert which.stdout.split() == ["NVMLError_LibraryNotFound", "12"], (which.stdout, which.stderr)
    run = _run_telemetry("--interval", "0.5", "--duration", "1", wrap=without_nvml_library)
    error = "NVML init failed: NVML Shared Library Not Found (NVML_ERROR_LIBRARY_NOT_FOUND)"
    _one_error_line(run, "no-nvml-library", error)


@pytest.mark.parametrize("args", [["--interval", "0", "--duration", "1"], ["--duration", "nan"], []])
def test_telemetry_probe_bad_arguments_are_an_error_line(args):
    run = _run_telemetry(*args)
    assert run.returncode == 0 and run.stderr == ""
    (line,) = _json_lines(run.stdout)
    assert line["kind"] == "bad-arguments"


def test_probe_tables_agree_with_gpu_facts():
    probe = _load_probe_module()
    assert probe.CLOCKS_EVENT_REASON_BITS == gpu.CLOCKS_EVENT_REASON_BITS
    assert probe.NVIDIA_SMI_FIELDS == TELEMETRY_QUERY_FIELDS
    # every fallback field is one gpu.py's CSV parser reads into GpuInfo
    assert set(TELEMETRY_QUERY_FIELDS) - {"utilization.gpu"} <= set(gpu.QUERY_FIELDS)
    for mask in (0, 0x1, 0x4 | 0x40, 0x1FF, 0x1000 | 0x20):
        assert tuple(probe.decode_reasons(mask)) == gpu.decode_clocks_event_reasons(mask)


# --------------------------------------------------------------------------- stand-in pynvml
# Only for GPU VALUES (there is no GPU here): every value below is a real capture's. The paths
# without a GPU run the real nvidia-ml-py above.

# nvml.h's nvmlClocksEventReason* bits by nvidia-smi -q label (written out independently).
NVML_EVENT_REASON_BITS = {
    "Idle": 0x1,
    "Applications Clocks Setting": 0x2,
    "SW Power Cap": 0x4,
    "HW Slowdown": 0x8,
    "Sync Boost": 0x10,
    "SW Thermal Slowdown": 0x20,
    "HW Thermal Slowdown": 0x40,
    "HW Power Brake Slowdown": 0x80,
    "Display Clock Setting": 0x100,
}


def _v100_capture():
    """Values read from the real V100-SXM2-32GB nvidia-smi -q capture."""
    text = fixture_body("nvidia-smi-q-v100-sxm2-32gb-temp-power-clocks.txt")

    def value(section, key):
        block = re.search(rf"^ {{4}}{section}\n((?: {{8}}.*\n?)+)", text, re.M).group(1)
        return float(re.search(rf"^ +{key} +: ([\d.]+)", block, re.M).group(1))

    return {
        "temp": value("Temperature", "GPU Current Temp"),
        "slowdown_temp": value("Temperature", "GPU Slowdown Temp"),
        "power_w": value("Power Readings", "Power Draw"),
        "sm": value("Clocks", "SM"),
        "mem": value("Clocks", "Memory"),
        "max_sm": value("Max Clocks", "SM"),
    }


def _reasons_mask(text):
    block = re.search(r"^( *)Clocks (?:Event|Throttle) Reasons\n((?:\1 +.*\n)+)", text, re.M).group(2)
    mask = 0
    for label, state in re.findall(r"^ +(.+?)\s+: (Active|Not Active)$", block, re.M):
        mask |= NVML_EVENT_REASON_BITS[label] if state == "Active" else 0
    return mask


def _h100_reasons(idle=True, hw_thermal=False):
    text = fixture_body("nvidia-smi-q-clocks-event-reasons-newdriver-h100.txt")
    if not idle:
        text = text.replace(
            "Idle                              : Active", "Idle                              : Not Active"
        )
    if hw_thermal:
        text = text.replace("HW Thermal Slowdown           : Not Active", "HW Thermal Slowdown           : Active")
    return text


def test_v100_capture_values_as_the_stand_ins_use_them():
    assert _v100_capture() == {
        "temp": 32.0,
        "slowdown_temp": 87.0,
        "power_w": 57.44,
        "sm": 1290.0,
        "mem": 877.0,
        "max_sm": 1530.0,
    }
    assert _reasons_mask(_h100_reasons()) == 0x1
    assert _reasons_mask(_h100_reasons(idle=False)) == 0x0
    assert _reasons_mask(_h100_reasons(idle=False, hw_thermal=True)) == 0x40


_STANDIN_COMMON = """
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_ERROR_NOT_SUPPORTED = 3
MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return "Not Supported"


def _not_supported(*args):
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetHandleByIndex(i): return i
nvmlDeviceGetUtilizationRates = _not_supported  # not in the captures: not invented
"""

_STANDIN_AS_CAPTURED = (
    '''"""STAND-IN pynvml written by tests/test_telemetry.py: an OLD binding (only the
ClocksThrottleReasons name) with two GPUs. GPU 0 answers with the V100-SXM2-32GB capture
(temperature, power draw, SM and memory clocks; it shows no reasons or memory use, so those
raise NOT_SUPPORTED); GPU 1 with the H100 capture (FB memory used, reasons: Idle)."""
'''
    + _STANDIN_COMMON
    + """
class _Memory:
    used = {h100_used} * MIB


def nvmlDeviceGetCount(): return 2
def nvmlDeviceGetTemperature(h, s): return {temp} if h == 0 else _not_supported()
def nvmlDeviceGetPowerUsage(h): return {power_mw} if h == 0 else _not_supported()
def nvmlDeviceGetClockInfo(h, c):
    if h != 0:
        _not_supported()
    return {sm} if c == NVML_CLOCK_SM else {mem}
def nvmlDeviceGetMemoryInfo(h): return _Memory() if h == 1 else _not_supported()
def nvmlDeviceGetCurrentClocksThrottleReasons(h): return {h100_mask} if h == 1 else _not_supported()
"""
)

_STANDIN_THERMAL = (
    '''"""STAND-IN pynvml written by tests/test_telemetry.py: a NEWER binding
(ClocksEventReasons) with one GPU that hits a thermal slowdown mid-run. Every value is a real
capture's, the sequence is constructed: for the first {calm} samples the V100-SXM2-32GB
capture's Max Clocks SM (boost) and GPU Current Temp with no reason active (the H100 capture
with Idle set Not Active); from then on its Clocks SM, its GPU Slowdown Temp and the H100
capture with HW Thermal Slowdown Active."""
'''
    + _STANDIN_COMMON
    + """
_calls = [0]


def _hot():  # sample k (0-based) queries this before its reasons, with _calls == k
    return _calls[0] >= {calm}


def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetTemperature(h, s): return {slowdown_temp} if _hot() else {temp}
def nvmlDeviceGetPowerUsage(h): return {power_mw}
def nvmlDeviceGetClockInfo(h, c):
    if c == NVML_CLOCK_MEM:
        return {mem}
    return {sm} if _hot() else {max_sm}
nvmlDeviceGetMemoryInfo = _not_supported
def nvmlDeviceGetCurrentClocksEventReasons(h):
    hot = _hot()
    _calls[0] += 1  # last query of a sample: the next sample sees the new count
    return {hot_mask} if hot else {calm_mask}
def nvmlDeviceGetCurrentClocksThrottleReasons(h):
    raise AssertionError("the deprecated name was called although the new one exists")
"""
)


def _capture_format_values():
    v = _v100_capture()
    return {
        "temp": int(v["temp"]),
        "slowdown_temp": int(v["slowdown_temp"]),
        "power_mw": int(round(v["power_w"] * 1000)),
        "sm": int(v["sm"]),
        "mem": int(v["mem"]),
        "max_sm": int(v["max_sm"]),
    }


def test_probe_with_stand_in_pynvml_samples_every_gpu_as_captured(tmp_path):
    h100 = _h100_reasons()
    used = int(re.search(r"FB Memory Usage\n(?:.*\n)*? +Used +: (\d+) MiB", h100).group(1))
    (tmp_path / "pynvml.py").write_text(
        _STANDIN_AS_CAPTURED.format(h100_used=used, h100_mask=_reasons_mask(h100), **_capture_format_values())
    )
    run = _run_telemetry("--interval", "0.05", "--duration", "0.3", pythonpath=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    raw = _json_lines(run.stdout)
    assert all(r["probe"] == "voltaforge-telemetry" and r["source"] == "pynvml" for r in raw)
    # unsupported queries are reported once per GPU, not in every sample
    assert [sorted(r["errors"]) for r in raw if "errors" in r] == [
        ["memory_used_mib", "reasons_mask", "utilization_gpu_pct"],
        ["mem_clock_mhz", "power_w", "sm_clock_mhz", "temperature_c", "utilization_gpu_pct"],
    ]

    parsed = parse_telemetry(run.stdout)
    assert parsed.error is None and parsed.source == "pynvml"
    gpu0 = [s for s in parsed.samples if s.gpu == 0]
    gpu1 = [s for s in parsed.samples if s.gpu == 1]
    assert len(gpu0) == len(gpu1) >= 5  # 0.3 s at 0.05 s: 7 ticks, a slow machine may lag
    times = [s.t for s in gpu0]
    assert times == sorted(times) and times[0] < 0.05 and times[-1] <= 0.3 + 0.2
    assert gpu0[0] == Sample(
        t=gpu0[0].t,
        gpu=0,
        temperature_c=32.0,
        sm_clock_mhz=1290.0,
        mem_clock_mhz=877.0,
        power_w=57.44,
        memory_used_mib=None,
        utilization_gpu_pct=None,
        reasons=None,
    )
    assert gpu1[0] == Sample(t=gpu1[0].t, gpu=1, memory_used_mib=1.0, reasons=("idle",))
    summary = throttle_summary(parsed)
    assert summary["throttled"] is False and summary["started_at_s"] is None
    assert summary["reasons"] == [] and summary["clock_drop"] is None
    assert (summary["max_temperature_c"], summary["min_sm_clock_mhz"], summary["max_sm_clock_mhz"]) == (
        32.0,
        1290.0,
        1290.0,
    )
    assert summary["mean_power_w"] == 57.44


def test_probe_with_stand_in_pynvml_thermal_slowdown_mid_run(tmp_path):
    calm = 3
    (tmp_path / "pynvml.py").write_text(
        _STANDIN_THERMAL.format(
            calm=calm,
            calm_mask=_reasons_mask(_h100_reasons(idle=False)),
            hot_mask=_reasons_mask(_h100_reasons(idle=False, hw_thermal=True)),
            **_capture_format_values(),
        )
    )
    run = _run_telemetry("--interval", "0.05", "--duration", "0.4", pythonpath=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    parsed = parse_telemetry(run.stdout)
    assert parsed.error is None and parsed.source == "pynvml"
    samples = parsed.samples
    assert len(samples) >= 6
    assert [s.reasons for s in samples[:calm]] == [()] * calm
    assert all(s.reasons == ("hw_thermal_slowdown",) for s in samples[calm:])
    assert [s.sm_clock_mhz for s in samples[calm - 1 : calm + 1]] == [1530.0, 1290.0]

    summary = throttle_summary(parsed)
    assert summary["throttled"] is True
    assert summary["started_at_s"] == samples[calm].t and summary["started_at_s"] > 0
    assert summary["reasons"] == ["hw_thermal_slowdown"] and summary["throttled_gpus"] == [0]
    assert summary["clock_drop"] == {
        "gpu": 0,
        "at_s": samples[calm].t,
        "from_mhz": 1530.0,
        "to_mhz": 1290.0,
        "drop_pct": 15.7,
        "reasons": ["hw_thermal_slowdown"],
    }
    assert summary["max_temperature_c"] == 87.0
    assert (summary["min_sm_clock_mhz"], summary["max_sm_clock_mhz"]) == (1290.0, 1530.0)


def test_probe_stops_when_stdin_closes(tmp_path):
    (tmp_path / "pynvml.py").write_text(
        _STANDIN_THERMAL.format(calm=1000, calm_mask=0, hot_mask=0, **_capture_format_values())
    )
    proc = subprocess.Popen(
        [sys.executable, str(TELEMETRY_PROBE), "--interval", "0.05", "--duration", "120"],
        env=_env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        assert json.loads(first)["gpu"] == 0
        started = time.monotonic()
        proc.stdin.close()
        proc.wait(timeout=10)
        rest, err = proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and err == ""
    assert time.monotonic() - started < 5  # not the 120 s duration
    assert parse_telemetry(first + rest).error is None


# --------------------------------------------------------------------------- nvidia-smi fallback


def _fake_nvidia_smi(tmp_path, fixture, rc=0):
    """A stand-in nvidia-smi printing a captured output verbatim, logging its arguments. The
    probe runs without site-packages (no_site=True), so pynvml is really not importable."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "capture.txt").write_text(fixture_body(fixture))
    script = bin_dir / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/args\ncat {tmp_path}/capture.txt\nexit {rc}\n')
    script.chmod(0o755)
    return bin_dir


def test_nvidia_smi_fallback_from_captured_csv(tmp_path):
    bin_dir = _fake_nvidia_smi(tmp_path, "nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt")
    run = _run_telemetry("--interval", "0.05", "--duration", "0.2", no_site=True, path_prefix=bin_dir)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    raw = _json_lines(run.stdout)
    assert len(raw) >= 3 and all(r["source"] == "nvidia-smi" and "csv" in r for r in raw)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[0] == f"--query-gpu={','.join(TELEMETRY_QUERY_FIELDS)} --format=csv,noheader,nounits"

    parsed = parse_telemetry(run.stdout)
    assert parsed.error is None and parsed.source == "nvidia-smi"
    # two GPUs per tick; this capture answers another field list, so only the index maps
    assert [s.gpu for s in parsed.samples[:4]] == [0, 1, 0, 1]
    assert parsed.samples[0] == Sample(t=raw[0]["t"], gpu=0)
    assert parsed.samples[1].t == parsed.samples[0].t
    assert any("ignored line: $ nvidia-smi" in w for w in parsed.warnings)


@pytest.mark.parametrize("rc", [0, 6])
def test_nvidia_smi_fallback_driver470_field_error(tmp_path, rc):
    bin_dir = _fake_nvidia_smi(tmp_path, "nvidia-smi-csv-compute-cap-invalid-field-driver470.txt", rc)
    run = _run_telemetry("--interval", "0.05", "--duration", "0.1", no_site=True, path_prefix=bin_dir)
    assert run.returncode == 0
    parsed = parse_telemetry(run.stdout)
    assert parsed.samples == () and parsed.kind == "nvidia-smi-failed"
    assert 'Field "compute_cap" is not a valid field to query.' in parsed.error


def test_nvidia_smi_csv_sample_maps_every_field():
    # CONSTRUCTED, not captured (no V100 telemetry CSV capture exists): one noheader,nounits
    # row in TELEMETRY_QUERY_FIELDS order with the V100-SXM2-32GB capture's values, an
    # invented utilization and memory use, and SW power cap + HW thermal slowdown as a hex mask.
    line = json.dumps(
        {
            "probe": "voltaforge-telemetry",
            "source": "nvidia-smi",
            "t": 12.5,
            "csv": "0, 32, 1290, 877, 57.44, 30123, 97, 0x0000000000000044\n1, 31, 1530, 877, [N/A], 5, 0, 0x1\n",
        }
    )
    parsed = parse_telemetry(line)
    assert parsed.samples == (
        Sample(12.5, 0, 32.0, 1290.0, 877.0, 57.44, 30123.0, 97.0, ("sw_power_cap", "hw_thermal_slowdown")),
        Sample(12.5, 1, 31.0, 1530.0, 877.0, None, 5.0, 0.0, ("idle",)),
    )
    summary = throttle_summary(parsed)
    assert summary["throttled"] is True and summary["started_at_s"] == 12.5
    assert summary["reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert summary["clock_drop"] is None  # GPU 1 is idle, GPU 0 has only one sample


# --------------------------------------------------------------------------- parser and summary


@pytest.mark.parametrize(
    "output,kind",
    [
        ("", "no-output"),
        ("Traceback (most recent call last):\n  File x", "no-output"),
        ("{not json", "no-output"),
        ('{"probe": "voltaforge-gpu", "source": "none"}', "no-output"),
        ('{"probe": "voltaforge-telemetry", "t": "soon", "gpu": 0}', "no-samples"),
        ('{"probe": "voltaforge-telemetry", "t": 1.0, "gpu": true}', "no-samples"),
        ('{"probe": "voltaforge-telemetry", "error": "x"}', "unknown"),
        (
            '{"probe": "voltaforge-telemetry", "source": "nvidia-smi", "t": 1, "csv": "NVIDIA-SMI has failed"}',
            "nvidia-smi-failed",
        ),
        ("sh: 1: /opt/py/bin/python: not found", "no-output"),
    ],
)
def test_parse_telemetry_garbage_is_an_error_value(output, kind):
    parsed = parse_telemetry(output)
    assert parsed.samples == () and parsed.error and parsed.kind == kind and parsed.source == "none"
    summary = throttle_summary(parsed)
    assert summary["throttled"] is False and summary["max_temperature_c"] is None
    assert summary["mean_power_w"] is None and summary["error"] == parsed.error


def test_parse_telemetry_keeps_samples_before_a_late_error_and_skips_noise():
    output = "\n".join(
        [
            "[HAMI-core Msg(1:2:libvgpu.c:836)]: Initializing.....",
            '{"probe": "voltaforge-telemetry", "source": "pynvml", "t": 0.0, "gpu": 0, "sm_clock_mhz": 1530,'
            ' "reasons": ["sw_power_cap"], "temperature_c": NaN}',
            '{"probe": "voltaforge-telemetry", "error": "NVML query failed: GPU is lost", "kind": "nvml-failed"}',
        ]
    )
    parsed = parse_telemetry(output)
    assert parsed.samples == (Sample(t=0.0, gpu=0, sm_clock_mhz=1530.0, reasons=("sw_power_cap",)),)
    assert parsed.kind == "nvml-failed" and parsed.source == "pynvml"


def test_clock_drop_ignores_idle_ramp_and_needs_more_than_ten_percent():
    def s(t, mhz, reasons=()):
        return Sample(t=t, gpu=0, sm_clock_mhz=mhz, reasons=reasons)

    ramp = Telemetry(samples=(s(0, 135, ("idle",)), s(1, 1530), s(2, 1380), s(3, 135, ("idle",))), source="pynvml")
    assert throttle_summary(ramp)["clock_drop"] is None  # 1380 is 9.8% below 1530
    assert throttle_summary(ramp)["min_sm_clock_mhz"] == 135
    dropped = Telemetry(samples=ramp.samples + (s(4, 1290),), source="pynvml")
    drop = throttle_summary(dropped)["clock_drop"]
    assert drop == {"gpu": 0, "at_s": 4, "from_mhz": 1530, "to_mhz": 1290, "drop_pct": 15.7, "reasons": []}
    assert throttle_summary(dropped)["throttled"] is False  # a drop with no cap reason shown


def test_telemetry_command_runs_the_probe_and_reports_a_missing_python():
    require_nvml_library_without_driver()  # what the probe meets here, with the real pynvml
    cmd = telemetry_command(sys.executable, str(TELEMETRY_PROBE), 0.5, 1)
    assert "--interval 0.5 --duration 1.0" in cmd
    run = subprocess.run(["/bin/sh", "-c", cmd], env=_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and parse_telemetry(run.stdout).kind == "no-driver"
    missing = telemetry_command("/nonexistent/py thon", "/tmp/p.py", 0.5, 10)
    run = subprocess.run(["/bin/sh", "-c", missing], capture_output=True, text=True)
    assert run.returncode == 0
    assert parse_telemetry(run.stdout).kind == "no-python"
    assert parse_telemetry(run.stdout).error == "/nonexistent/py thon not found"
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            telemetry_command("python3", "/tmp/p.py", bad, 10)
        with pytest.raises(ValueError):
            telemetry_command("python3", "/tmp/p.py", 0.5, bad)
    assert telemetry.TELEMETRY_PROBE_PATH == TELEMETRY_PROBE and TELEMETRY_PROBE.is_file()


# --------------------------------------------------------------------------- membw


def _numpy_importable():
    return importlib.util.find_spec("numpy") is not None


def test_membw_probe_runs_here():
    run = subprocess.run(
        [sys.executable, str(MEMBW_PROBE), "--mib", "64", "--repeats", "3"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stderr == ""
    result = read_membw(run.stdout)
    assert result.error is None
    assert result.copy_gb_s > 0.5
    assert result.method == ("numpy" if _numpy_importable() else "python")
    assert result.bytes == 2 * 64 * 2**20 and result.repeats == 3
    assert result.lower_bound is (result.method == "python")


def test_membw_probe_copies_with_every_core_by_default():
    # llama.cpp reads weights with every core; one thread's copy understated a lent H200 host
    # by half (20.7 GB/s against 41.6 GB/s of expert reads). The figure is printed, not judged.
    runs = {}
    for threads in ("1", None):
        extra = ["--threads", threads] if threads else []
        run = subprocess.run(
            [sys.executable, str(MEMBW_PROBE), "--mib", "128", "--repeats", "3", "--method", "numpy", *extra],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        runs[threads] = json.loads(run.stdout)
    assert runs["1"]["threads"] == 1 and runs[None]["threads"] == (os.cpu_count() or 1)
    assert runs["1"]["bytes"] == runs[None]["bytes"] == 2 * 128 * 2**20
    print(f"membw copy: 1 thread {runs['1']['copy_gb_s']} GB/s, {runs[None]['threads']} {runs[None]['copy_gb_s']} GB/s")


def test_membw_probe_python_fallback_is_a_lower_bound():
    run = subprocess.run(
        [sys.executable, str(MEMBW_PROBE), "--mib", "32", "--repeats", "2", "--method", "python"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = read_membw(run.stdout)
    assert result.method == "python" and result.lower_bound is True and result.copy_gb_s > 0.5


def test_membw_command_runs_and_reports_a_missing_python():
    cmd = membw_command(sys.executable, str(MEMBW_PROBE), mib=16)
    run = subprocess.run(["/bin/sh", "-c", cmd], env=_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and (read_membw(run.stdout).copy_gb_s or 0) > 0.5
    run = subprocess.run(
        ["/bin/sh", "-c", membw_command("/nonexistent/python3", "/tmp/m.py")], capture_output=True, text=True
    )
    assert read_membw(run.stdout) == Membw(copy_gb_s=None, error="/nonexistent/python3 not found", kind="no-python")
    for bad in (0, -5, 70000, 1.5, True, "256"):
        with pytest.raises(ValueError):
            membw_command("python3", "/tmp/m.py", bad)
    assert membw.MEMBW_PROBE_PATH == MEMBW_PROBE


@pytest.mark.parametrize(
    "output,kind",
    [
        ("", "no-output"),
        ("garbage\n", "no-output"),
        ("{oops", "no-output"),
        ('{"probe": "voltaforge-membw", "copy_gb_s": 0}', "bad-value"),
        ('{"probe": "voltaforge-membw", "copy_gb_s": "fast"}', "bad-value"),
        ('{"probe": "voltaforge-membw", "copy_gb_s": Infinity}', "bad-value"),
        ('{"probe": "voltaforge-membw", "error": "cannot allocate 2 x 256 MiB", "kind": "no-memory"}', "no-memory"),
        ('{"probe": "voltaforge-telemetry", "copy_gb_s": 20}', "no-output"),
    ],
)
def test_parse_membw_garbage_is_an_error_value(output, kind):
    result = read_membw(output)
    assert result.copy_gb_s is None and result.error and result.kind == kind


def test_membw_probe_bad_arguments_are_an_error_line():
    run = subprocess.run([sys.executable, str(MEMBW_PROBE), "--mib", "x"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == ""
    assert read_membw(run.stdout).kind == "bad-arguments"


def test_background_telemetry_runs_in_its_own_session_until_killed(tmp_path):
    # the bench's own command line, through bash as a host runs it (a real H200 host once
    # refused `setsid if ...`: setsid runs one program, the probe's `if` is shell syntax)
    h100 = _h100_reasons()
    used = int(re.search(r"FB Memory Usage\n(?:.*\n)*? +Used +: (\d+) MiB", h100).group(1))
    (tmp_path / "pynvml.py").write_text(
        _STANDIN_AS_CAPTURED.format(h100_used=used, h100_mask=_reasons_mask(h100), **_capture_format_values())
    )
    out = tmp_path / "tel out.jsonl"
    cmd = telemetry.background_telemetry_command(sys.executable, str(TELEMETRY_PROBE), str(out), 0.05, 3600)
    env = {**_env(), "PYTHONPATH": str(tmp_path)}
    started = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=30)
    pid = started.stdout.strip()
    assert started.returncode == 0 and pid.isdigit(), started.stderr
    time.sleep(1.0)
    assert os.getsid(int(pid)) == int(pid)  # its own session: the sweep never waits on it
    members = [p for p in os.listdir("/proc") if p.isdigit() and _sid(p) == int(pid)]
    assert len(members) >= 2  # the shell and the probe it runs
    subprocess.run(["bash", "-c", telemetry.stop_telemetry_command(pid)], check=True, timeout=30)
    parsed = parse_telemetry(out.read_text())
    assert parsed.error is None and parsed.source == "pynvml" and len(parsed.samples) >= 4
    # nothing of the session is left: killing the shell alone left the probe running an hour
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _sid(p) == int(pid)]


def _sid(pid: str) -> int | None:
    """The session of a live process (None: gone, or a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return None if state == "Z" else os.getsid(int(pid))
    except (OSError, IndexError):
        return None
