"""GPU facts against real captured nvidia-smi / probe outputs (tests/fixtures, see headers).

The GPU probe runs with the REAL nvidia-ml-py package (a test extra; tests/nvml_env.py) for the
paths this machine can show without a GPU (pynvml absent, no driver, no library), and its result
must equal the captured fixtures of the same runs. Stand-in pynvml modules remain only where GPU
VALUES are needed (the NVML branch with a GPU) and for an install that is broken on purpose."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from playbooks.facts import gpu
from playbooks.facts.gpu import (
    QUERY_FIELDS,
    QUERY_FIELDS_LEGACY,
    GpuFacts,
    compute_capability_from_name,
    decode_clocks_event_reasons,
    parse_gpu_probe_json,
    parse_nvidia_smi_csv,
)
from tests.helpers import fixture_body as fixture_text
from tests.nvidia_smi_text import parse_nvidia_smi_q, parse_nvidia_smi_table
from tests.nvml_env import (
    WHICH_ERROR,
    clean_env,
    real_pynvml_version,
    require_nvml_library_without_driver,
    without_nvml_library,
)

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "playbooks" / "facts" / "probes" / "gpu_probe.py"


# --------------------------------------------------------------------------- table


def test_table_driver570_new_layout_truncated_after_gpu1_row2():
    facts = parse_nvidia_smi_table(fixture_text("nvidia-smi-v100-sxm2-16gb-2gpu-driver570-newlayout.txt"))
    assert facts.available and facts.source == "nvidia-smi"
    assert facts.driver_version == "570.211.01"
    assert facts.cuda_driver_version == (12, 8)
    assert facts.truncated is True  # source excerpt ends inside GPU 1's block
    assert [g.index for g in facts.gpus] == [0, 1]
    g0, g1 = facts.gpus
    assert g0.name == "Tesla V100-SXM2-16GB" and not g0.name_truncated
    assert g0.compute_capability == (7, 0) and g0.is_volta
    assert g0.persistence_mode is True
    assert g0.pci_bus_id == "00000000:07:00.0"
    assert (g0.temperature_c, g0.power_draw_w, g0.power_limit_w) == (31, 43.0, 300.0)
    assert (g0.memory_used_mib, g0.memory_total_mib, g0.memory_free_mib) == (5, 16384, 16379)
    assert g0.driver_version == "570.211.01"
    assert g1.pci_bus_id == "00000000:08:00.0"
    assert (g1.temperature_c, g1.power_draw_w) == (30, 41.0)
    assert g1.memory_total_mib == 16384
    assert g0.clocks_event_reasons is None  # the table does not show them
    assert facts.gpus and all(g.is_volta for g in facts.gpus)


def test_table_driver580_cuda13_persistence_off_truncated():
    facts = parse_nvidia_smi_table(fixture_text("nvidia-smi-v100-sxm2-16gb-2gpu-driver580-cuda13.txt"))
    assert facts.driver_version == "580.126.09"
    assert facts.cuda_driver_version == (13, 0)
    assert facts.truncated is True
    assert facts.gpu_count == 2
    g0, g1 = facts.gpus
    assert g0.persistence_mode is False and g1.persistence_mode is False
    assert (g0.pci_bus_id, g0.temperature_c, g0.power_draw_w) == ("00000000:03:00.0", 40, 41.0)
    assert (g1.pci_bus_id, g1.temperature_c, g1.power_draw_w) == ("00000000:06:00.0", 41, 40.0)
    assert all(g.compute_capability == (7, 0) for g in facts.gpus)


def test_table_driver525_aws_p3_with_prompt_and_timestamp_lines():
    facts = parse_nvidia_smi_table(fixture_text("nvidia-smi-v100-sxm2-16gb-aws-p3-driver525.txt"))
    assert facts.available
    assert facts.driver_version == "525.85.12"
    assert facts.cuda_driver_version == (12, 0)
    assert facts.truncated is False  # GPU block closed; the cut is in the Processes part
    (g,) = facts.gpus
    assert g.name == "Tesla V100-SXM2" and g.name_truncated is True
    assert g.compute_capability == (7, 0)
    assert g.pci_bus_id == "00000000:00:1E.0"
    assert (g.temperature_c, g.power_draw_w, g.power_limit_w) == (35, 23.0, 300.0)
    assert (g.memory_used_mib, g.memory_total_mib, g.memory_free_mib) == (0, 16384, 16384)
    assert g.persistence_mode is True


def test_table_dgx1_driver384_eight_gpus_old_layout():
    facts = parse_nvidia_smi_table(fixture_text("nvidia-smi-v100-sxm2-32gb-8gpu-dgx1-driver384.txt"))
    assert facts.driver_version == "384.183"
    assert facts.cuda_driver_version == (9, 0)
    assert facts.truncated is False
    assert [g.index for g in facts.gpus] == list(range(8))
    assert [g.pci_bus_id[9:11] for g in facts.gpus] == ["06", "07", "0A", "0B", "85", "86", "89", "8A"]
    assert [g.temperature_c for g in facts.gpus] == [37, 39, 39, 37, 37, 38, 38, 37]
    assert [g.power_draw_w for g in facts.gpus] == [41.0, 43.0, 44.0, 45.0, 42.0, 43.0, 43.0, 42.0]
    assert {g.memory_total_mib for g in facts.gpus} == {32502}
    assert {g.memory_used_mib for g in facts.gpus} == {10}
    assert all(g.name == "Tesla V100-SXM2" and g.name_truncated for g in facts.gpus)
    assert facts.gpus and all(g.is_volta for g in facts.gpus)


def test_table_driver525_32gb_empty_process_list():
    facts = parse_nvidia_smi_table(fixture_text("nvidia-smi-v100-sxm2-32gb-driver525.txt"))
    assert facts.driver_version == "525.105.17"
    assert facts.cuda_driver_version == (12, 0)
    assert not facts.truncated
    (g,) = facts.gpus
    assert g.pci_bus_id == "00000000:00:09.0"
    assert (g.memory_used_mib, g.memory_total_mib, g.memory_free_mib) == (308, 32768, 32460)
    assert (g.temperature_c, g.power_draw_w, g.power_limit_w) == (38, 38.0, 300.0)


# --------------------------------------------------------------------------- CSV


def test_csv_driver470_rejects_compute_cap_asks_for_legacy_query():
    facts = parse_nvidia_smi_csv(fixture_text("nvidia-smi-csv-compute-cap-invalid-field-driver470.txt"))
    assert facts.available is False
    assert facts.needs_legacy_query is True
    assert facts.invalid_field == "compute_cap"
    assert facts.reason == 'Field "compute_cap" is not a valid field to query.'
    assert "compute_cap" in QUERY_FIELDS and "compute_cap" not in QUERY_FIELDS_LEGACY
    assert "compute_cap" not in gpu.NVIDIA_SMI_CSV_LEGACY_COMMAND
    assert "compute_cap" in gpu.NVIDIA_SMI_CSV_COMMAND


def test_csv_with_header_titan_v_and_ada():
    text = fixture_text("nvidia-smi-csv-compute-cap-titanv-volta-driver570.txt")
    facts = parse_nvidia_smi_csv(text, fields=None)
    assert facts.available and facts.driver_version == "570.86.15"
    titan, ada = facts.gpus
    assert (titan.index, titan.name, titan.compute_capability) == (0, "NVIDIA TITAN V", (7, 0))
    assert titan.is_volta
    assert (ada.index, ada.name, ada.compute_capability) == (1, "NVIDIA RTX 5880 Ada Generation", (8, 9))
    assert not ada.is_volta
    # the echoed '$ nvidia-smi --query-gpu=...' prompt line is skipped, not mistaken for a GPU
    assert len(facts.warnings) == 1 and facts.warnings[0].startswith("ignored line: $ nvidia-smi")
    # the header wins over the (different) default field list
    assert parse_nvidia_smi_csv(text).gpus == facts.gpus


def test_csv_noheader_nounits_full_query_constructed():
    # CONSTRUCTED, not captured (no V100 CSV capture exists): one row in QUERY_FIELDS order,
    # values taken from the V100 fixtures, with nvidia-smi's '[N/A]'/'[Not Supported]' markers.
    row = (
        "0, Tesla V100-SXM2-16GB, GPU-3a6ec8f0-24eb-1905-1f17-7bdb4e850ffa, 00000000:07:00.0, "
        "7.0, 570.211.01, 16384, 5, 16379, 31, 43.12, 300.00, 1290, 1530, 877, 877, Enabled, "
        "[N/A], [Not Supported], 0x0000000000000005"
    )
    facts = parse_nvidia_smi_csv(row + "\n")
    (g,) = facts.gpus
    assert facts.driver_version == "570.211.01" and not facts.warnings
    assert (g.index, g.name, g.compute_capability) == (0, "Tesla V100-SXM2-16GB", (7, 0))
    assert (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (16384, 5, 16379)
    assert (g.power_draw_w, g.power_limit_w) == (43.12, 300.0)
    assert (g.sm_clock_mhz, g.max_sm_clock_mhz, g.mem_clock_mhz, g.max_mem_clock_mhz) == (1290, 1530, 877, 877)
    assert g.persistence_mode is True
    assert (g.pcie_gen, g.pcie_width) == (None, None)
    assert g.clocks_event_reasons == ("idle", "sw_power_cap")
    # the legacy query (no compute_cap) infers the capability from the name
    legacy = row.replace("00000000:07:00.0, 7.0,", "00000000:07:00.0,")
    (lg,) = parse_nvidia_smi_csv(legacy, QUERY_FIELDS_LEGACY).gpus
    assert lg.compute_capability == (7, 0) and lg.memory_total_mib == 16384


def test_csv_command_output_without_nvidia_smi_is_absent():
    facts = parse_nvidia_smi_csv(fixture_text("thishost-nvidia-smi-csv-absent.txt"))
    assert facts == GpuFacts(available=False, source="none", reason="nvidia-smi not found")


def test_commands_run_clean_without_nvidia_smi():
    """Every command the product runs exits 0 and parses to 'absent' on a host with no nvidia-smi."""
    env = {"PATH": "/nonexistent-voltaforge-bin"}
    for command, parser in (
        (gpu.NVIDIA_SMI_CSV_COMMAND, parse_nvidia_smi_csv),
        (gpu.NVIDIA_SMI_CSV_LEGACY_COMMAND, lambda t: parse_nvidia_smi_csv(t, QUERY_FIELDS_LEGACY)),
    ):
        run = subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, text=True)
        assert run.returncode == 0
        facts = parser(run.stdout)
        assert facts.available is False and facts.reason == "nvidia-smi not found"


def test_empty_output_is_absent_for_every_parser():
    for parser in (parse_nvidia_smi_csv, parse_nvidia_smi_table, parse_nvidia_smi_q):
        facts = parser("")
        assert facts.available is False and facts.reason == "nvidia-smi printed nothing"
    assert parse_gpu_probe_json("").reason == "GPU probe printed nothing"


# --------------------------------------------------------------------------- nvidia-smi -q


def test_q_v100_pcie_header_with_hami_shim_line():
    facts = parse_nvidia_smi_q(fixture_text("nvidia-smi-q-v100-pcie-16gb-header-driver535.txt"))
    assert facts.available and facts.source == "nvidia-smi"
    assert facts.driver_version == "535.86.10"
    assert facts.cuda_driver_version == (12, 2)  # read despite the injected shim line before it
    (g,) = facts.gpus
    assert g.index == 0
    assert g.name == "Tesla V100-PCIE-16GB"
    assert g.architecture == "Volta"
    assert g.compute_capability == (7, 0)
    assert g.pci_bus_id == "00000000:AF:00.0"
    assert g.uuid == "GPU-3a6ec8f0-24eb-1905-1f17-7bdb4e850ffa"
    assert g.persistence_mode is False
    assert g.driver_version == "535.86.10"
    assert g.memory_total_mib is None  # excerpt ends at VBIOS Version
    assert len(facts.warnings) == 1
    assert facts.warnings[0].startswith("HAMi vGPU shim line")
    assert "[HAMI-core Msg(571:140025334466368:libvgpu.c:836)]: Initializing....." in facts.warnings[0]


def test_q_v100_sxm2_temperature_power_clocks_excerpt():
    facts = parse_nvidia_smi_q(fixture_text("nvidia-smi-q-v100-sxm2-32gb-temp-power-clocks.txt"))
    (g,) = facts.gpus
    assert g.temperature_c == 32
    assert g.power_draw_w == 57.44
    assert g.power_limit_w == 300.0
    assert (g.power_min_limit_w, g.power_max_limit_w) == (150.0, 300.0)
    assert (g.sm_clock_mhz, g.max_sm_clock_mhz) == (1290, 1530)
    assert (g.mem_clock_mhz, g.max_mem_clock_mhz) == (877, 877)
    assert g.name is None and g.compute_capability is None  # not in the excerpt
    assert g.clocks_event_reasons is None  # section not in the excerpt: unknown, not "none"
    assert facts.warnings == ("no 'GPU <bus id>' line: read as an excerpt of one GPU",)


def test_q_clocks_event_reasons_h100_idle_only():
    facts = parse_nvidia_smi_q(fixture_text("nvidia-smi-q-clocks-event-reasons-newdriver-h100.txt"))
    (g,) = facts.gpus
    assert g.clocks_event_reasons == ("idle",)
    assert g.throttling == ()
    assert (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (81559, 1, 80995)


def test_q_clocks_event_reasons_with_counters_block_h200():
    facts = parse_nvidia_smi_q(fixture_text("nvidia-smi-q-clocks-event-reasons-counters-h200.txt"))
    (g,) = facts.gpus
    # the 'Clocks Event Reasons Counters' block ('0 us') is not read as reasons
    assert g.clocks_event_reasons == ("idle",)
    assert (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (143771, 87, 143071)


def test_q_old_throttle_section_name_and_active_reasons():
    # Same layout as the H100 fixture with the pre-R535 section name and two reasons active.
    text = fixture_text("nvidia-smi-q-clocks-event-reasons-newdriver-h100.txt")
    text = text.replace("Clocks Event Reasons", "Clocks Throttle Reasons")
    text = text.replace("Idle                              : Active", "Idle                              : Not Active")
    text = text.replace("SW Power Cap                      : Not Active", "SW Power Cap                      : Active")
    text = text.replace("HW Thermal Slowdown           : Not Active", "HW Thermal Slowdown           : Active")
    (g,) = parse_nvidia_smi_q(text).gpus
    assert g.clocks_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert g.throttling == ("sw_power_cap", "hw_thermal_slowdown")


# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "name,cc",
    [
        ("Tesla V100-SXM2-16GB", (7, 0)),
        ("Tesla V100-SXM2...", (7, 0)),
        ("Tesla V100S-PCIE-32GB", (7, 0)),
        ("NVIDIA TITAN V", (7, 0)),
        ("Tesla P100-PCIE-16GB", (6, 0)),
        ("Tesla P40", (6, 1)),
        ("Tesla T4", (7, 5)),
        ("NVIDIA A100-SXM4-80GB", (8, 0)),
        ("NVIDIA H100 80GB HBM3", (9, 0)),
        ("NVIDIA H200", (9, 0)),
        ("NVIDIA GeForce RTX 3090", (8, 6)),
        ("NVIDIA GeForce RTX 4090", (8, 9)),
        ("NVIDIA TITAN RTX", None),
        ("NVIDIA RTX 5880 Ada Generation", None),
        (None, None),
    ],
)
def test_compute_capability_from_name(name, cc):
    assert compute_capability_from_name(name) == cc


def test_decode_clocks_event_reasons_bitmask():
    assert decode_clocks_event_reasons(0x0) == ()
    assert decode_clocks_event_reasons(0x1) == ("idle",)
    assert decode_clocks_event_reasons(0x4 | 0x40) == ("sw_power_cap", "hw_thermal_slowdown")
    assert decode_clocks_event_reasons(0x1000) == ("bit_0x1000",)


# --------------------------------------------------------------------------- probe


@pytest.mark.parametrize(
    "name,reason",
    [
        ("thishost-gpu-probe-no-pynvml.json", "pynvml not importable: No module named 'pynvml'"),
        (
            "thishost-gpu-probe-nvml-driver-not-loaded.json",
            "NVML init failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED)",
        ),
        (
            "thishost-gpu-probe-nvml-library-not-found.json",
            "NVML init failed: NVML Shared Library Not Found (NVML_ERROR_LIBRARY_NOT_FOUND)",
        ),
    ],
)
def test_probe_json_none_cases_from_real_runs(name, reason):
    facts = parse_gpu_probe_json(fixture_text(name))
    assert facts == GpuFacts(available=False, source="none", reason=reason)


def test_probe_json_garbage_is_absent_not_an_exception():
    assert parse_gpu_probe_json("Traceback (most recent call last):").available is False
    assert "not JSON" in parse_gpu_probe_json("{not json").reason


def _run_probe(extra_path=None, no_site=False, wrap=list):
    """The probe under this python; no_site: without site-packages (-S), so the installed pynvml
    is not importable; wrap: a function of the argv (tests/nvml_env.without_nvml_library)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    python = [sys.executable, "-S"] if no_site else [sys.executable]
    return subprocess.run(wrap([*python, str(PROBE)]), env=env, capture_output=True, text=True, timeout=60)


def test_probe_runs_here_and_prints_one_json_object():
    run = _run_probe()
    assert run.returncode == 0
    assert "Traceback" not in run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["probe"] == "voltaforge-gpu" and data["source"] in ("nvml", "none")
    facts = parse_gpu_probe_json(run.stdout)
    if data["source"] == "none":  # no GPU (or no pynvml) on this test machine
        assert facts.available is False and facts.reason


def _none_case(run, fixture):
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    facts = parse_gpu_probe_json(run.stdout)
    assert facts == parse_gpu_probe_json(fixture_text(fixture))  # the captured run of the same case
    return facts


def test_probe_without_pynvml_here():
    """pynvml really absent: this python without its site-packages (-S)."""
    facts = _none_case(_run_probe(no_site=True), "thishost-gpu-probe-no-pynvml.json")
    assert facts.reason == "pynvml not importable: No module named 'pynvml'"


def test_probe_with_the_real_nvml_package_and_no_driver():
    """The REAL nvidia-ml-py, libnvidia-ml.so.1 installed, no driver loaded (this machine): the
    package raises NVMLError_DriverNotLoaded (checked first) and the probe reports it. No stand-in."""
    require_nvml_library_without_driver()
    real_pynvml_version()
    which = subprocess.run([sys.executable, "-c", WHICH_ERROR], env=clean_env(), capture_output=True, text=True)
    assert which.stdout.split() == ["NVMLError_DriverNotLoaded", "9"], (which.stdout, which.stderr)
    facts = _none_case(_run_probe(), "thishost-gpu-probe-nvml-driver-not-loaded.json")
    assert facts.reason == "NVML init failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED)"


def test_probe_with_the_real_nvml_package_and_no_library():
    """The REAL nvidia-ml-py with libnvidia-ml.so.1 hidden (tests/nvml_env.py): its own CDLL fails,
    it raises NVMLError_LibraryNotFound (checked first, in the same namespace), and that is the
    probe's reason. No stand-in."""
    real_pynvml_version()
    which = subprocess.run(
        without_nvml_library([sys.executable, "-c", WHICH_ERROR]), env=clean_env(), capture_output=True, text=True
    )
    assert which.stdout.split() == ["NVMLError_LibraryNotFound", "12"], (which.stdout, which.stderr)
    facts = _none_case(_run_probe(wrap=without_nvml_library), "thishost-gpu-probe-nvml-library-not-found.json")
    assert facts.reason == "NVML init failed: NVML Shared Library Not Found (NVML_ERROR_LIBRARY_NOT_FOUND)"


_FAKE_PYNVML = '''
"""FAKE pynvml for tests: exercises the probe's NVML branch without a GPU. Values invented."""
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_FEATURE_ENABLED = 1
NVML_ERROR_NOT_SUPPORTED = 3

class NVMLError(Exception):
    def __init__(self, value):
        self.value = value
    def __str__(self):
        return "Not Supported"

class _Mem:
    total = 16 * 2**30
    used = 5 * 2**20
    free = 16 * 2**30 - 5 * 2**20

class _Pci:
    busId = b"00000000:07:00.0"

def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlSystemGetDriverVersion(): return b"570.211.01"
def nvmlSystemGetCudaDriverVersion(): return 12080
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetName(h): return b"Tesla V100-SXM2-16GB"
def nvmlDeviceGetUUID(h): return "GPU-fake"
def nvmlDeviceGetPciInfo(h): return _Pci()
def nvmlDeviceGetCudaComputeCapability(h): return (7, 0)
def nvmlDeviceGetMemoryInfo(h): return _Mem()
def nvmlDeviceGetTemperature(h, sensor): return 31
def nvmlDeviceGetPowerUsage(h): return 43000
def nvmlDeviceGetEnforcedPowerLimit(h): return 300000
def nvmlDeviceGetPowerManagementLimitConstraints(h): return (150000, 300000)
def nvmlDeviceGetClockInfo(h, c): return 1290 if c == NVML_CLOCK_SM else 877
def nvmlDeviceGetMaxClockInfo(h, c): return 1530 if c == NVML_CLOCK_SM else 877
def nvmlDeviceGetPersistenceMode(h): return 1
def nvmlDeviceGetCurrPcieLinkGeneration(h): raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
def nvmlDeviceGetCurrPcieLinkWidth(h): return 16
def nvmlDeviceGetCurrentClocksThrottleReasons(h): return 0x4 | 0x1
'''


def test_probe_nvml_branch_with_fake_pynvml(tmp_path):
    """A stand-in pynvml, only because a GPU's VALUES are needed and there is no GPU here (the
    paths without one run the real package above)."""
    (tmp_path / "pynvml.py").write_text(textwrap.dedent(_FAKE_PYNVML))
    run = _run_probe(tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    facts = parse_gpu_probe_json(run.stdout)
    assert facts.available and facts.source == "nvml"
    assert facts.driver_version == "570.211.01"
    assert facts.cuda_driver_version == (12, 8)
    (g,) = facts.gpus
    assert (g.index, g.name, g.compute_capability) == (0, "Tesla V100-SXM2-16GB", (7, 0))
    assert g.pci_bus_id == "00000000:07:00.0"
    assert (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (16384, 5, 16379)
    assert (g.power_draw_w, g.power_limit_w, g.power_min_limit_w) == (43.0, 300.0, 150.0)
    assert (g.sm_clock_mhz, g.max_sm_clock_mhz, g.mem_clock_mhz) == (1290, 1530, 877)
    assert g.persistence_mode is True
    assert (g.pcie_gen, g.pcie_width) == (None, 16)  # the unsupported query is None, not a crash
    assert g.clocks_event_reasons == ("idle", "sw_power_cap")
    assert g.throttling == ("sw_power_cap",)
    assert facts.warnings == ("GPU 0: pcie_gen: Not Supported",)


# nvml.h's nvmlClocksEventReason* bits, keyed by the label nvidia-smi -q prints for each
# (written out here, not taken from playbooks/facts/gpu.py, so the test is an independent check).
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

_NEWER_PYNVML = '''
"""STAND-IN pynvml written by tests/test_facts_gpu.py: a newer NVML binding, which has
nvmlDeviceGetCurrentClocksEventReasons. Its answers are a real capture's (nvidia-smi -q of an
H100-class GPU on an R535+ driver); what the capture does not show is not invented: those
queries raise NVML_ERROR_NOT_SUPPORTED."""
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_FEATURE_ENABLED = 1
NVML_ERROR_NOT_SUPPORTED = 3
MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return "Not Supported"


def _not_supported(*args):
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)


class _Memory:
    total = {total} * MIB
    used = {used} * MIB
    free = {free} * MIB


def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetMemoryInfo(h): return _Memory()
def nvmlDeviceGetCurrentClocksEventReasons(h): return {mask}
def nvmlDeviceGetCurrentClocksThrottleReasons(h):
    raise AssertionError("the deprecated name was called although the new one exists")

nvmlSystemGetDriverVersion = nvmlSystemGetCudaDriverVersion = _not_supported
nvmlDeviceGetName = nvmlDeviceGetUUID = nvmlDeviceGetPciInfo = _not_supported
nvmlDeviceGetCudaComputeCapability = nvmlDeviceGetTemperature = nvmlDeviceGetPowerUsage = _not_supported
nvmlDeviceGetEnforcedPowerLimit = nvmlDeviceGetPowerManagementLimitConstraints = _not_supported
nvmlDeviceGetClockInfo = nvmlDeviceGetMaxClockInfo = nvmlDeviceGetPersistenceMode = _not_supported
nvmlDeviceGetCurrPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkWidth = _not_supported
'''


def _capture_values(text):
    """From nvidia-smi -q text, read by the test itself: the active reasons' bitmask and the
    FB memory numbers (MiB)."""
    block = re.search(r"^( *)Clocks Event Reasons\n((?:\1 +.*\n)+)", text, re.M).group(2)
    mask = 0
    for label, state in re.findall(r"^ +(.+?)\s+: (Active|Not Active)$", block, re.M):
        mask |= NVML_EVENT_REASON_BITS[label] if state == "Active" else 0
    fb = re.search(
        r"FB Memory Usage\n(?:.*\n)*? +Total +: (\d+) MiB\n(?:.*\n)*? +Used +: (\d+) MiB\n +Free +: (\d+) MiB", text
    ).groups()
    return mask, tuple(int(x) for x in fb)


@pytest.mark.parametrize("variant", ["as captured", "sw power cap and hw thermal slowdown active"])
def test_probe_newer_nvml_clocks_event_reasons_branch(tmp_path, variant):
    """The probe's branch for newer NVML bindings (nvmlDeviceGetCurrentClocksEventReasons),
    with no GPU here: the real probe script runs in a subprocess with a STAND-IN `pynvml`
    module on PYTHONPATH that exposes the newer function (and a deprecated name that must not
    be called). The stand-in answers with values taken from the captured real output in
    tests/fixtures/nvidia-smi-q-clocks-event-reasons-newdriver-h100.txt ('Idle' active, FB
    memory 81559/1/80995 MiB); the second variant edits that capture the way
    test_q_old_throttle_section_name_and_active_reasons does. What the probe reports must equal
    what voltaforge's nvidia-smi -q parser reads from the same text."""
    text = fixture_text("nvidia-smi-q-clocks-event-reasons-newdriver-h100.txt")
    if variant != "as captured":
        text = text.replace(
            "Idle                              : Active", "Idle                              : Not Active"
        )
        text = text.replace(
            "SW Power Cap                      : Not Active", "SW Power Cap                      : Active"
        )
        text = text.replace("HW Thermal Slowdown           : Not Active", "HW Thermal Slowdown           : Active")
    mask, (total, used, free) = _capture_values(text)
    assert mask == (0x1 if variant == "as captured" else 0x4 | 0x40)
    (tmp_path / "pynvml.py").write_text(_NEWER_PYNVML.format(mask=mask, total=total, used=used, free=free))

    run = _run_probe(tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    raw = json.loads(run.stdout)["gpus"][0]
    assert raw["clocks_event_reasons_mask"] == mask and "clocks_event_reasons_mask" not in raw["errors"]
    facts = parse_gpu_probe_json(run.stdout)
    (g,) = facts.gpus
    (q,) = parse_nvidia_smi_q(text).gpus
    assert g.clocks_event_reasons == q.clocks_event_reasons
    assert g.throttling == q.throttling
    assert (
        (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib)
        == (q.memory_total_mib, q.memory_used_mib, q.memory_free_mib)
        == (total, used, free)
    )
    assert g.name is None and "GPU 0: name: Not Supported" in facts.warnings  # not invented


def test_probe_with_broken_pynvml_import_still_prints_json(tmp_path):
    """A module broken on purpose (it raises on import), which the real package cannot show."""
    (tmp_path / "pynvml.py").write_text("raise RuntimeError('broken install')\n")
    run = _run_probe(tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    facts = parse_gpu_probe_json(run.stdout)
    assert facts.reason == "pynvml not importable: broken install"


def test_probe_commands_fall_back_when_python3_is_missing():
    env = {"PATH": "/nonexistent-voltaforge-bin"}
    for command in (gpu.GPU_PROBE_STDIN_COMMAND,):
        run = subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, text=True)
        assert run.returncode == 0
        assert parse_gpu_probe_json(run.stdout).reason == "python3 not found"
    assert gpu.GPU_PROBE_PATH == PROBE and PROBE.is_file()
