"""scripts/exporter_vs_smi.py, the comparison device_check's ``exporter`` phase runs on a lent
card (issue 57), before any card.

What this proves and what it does not: the exporter here answers through the STAND-IN NVML of
tests/test_monitor.py (captured V100 values), and nvidia-smi's side is transcribed from the
same captures in nvidia-smi's own units (MHz, W, MiB, %, a hex reason mask). So it proves the
comparison's mapping and scales on a real card's numbers, and that a wrong scale is caught. It
says nothing of whether pynvml and nvidia-smi agree on a real driver: that is the device run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers import ROOT
from tests.test_monitor import _exporter, _v100_q, _v100_table, needs_exporter_deps, v100_standin
from tests.test_telemetry import _h100_reasons, _reasons_mask, _v100_capture

spec = importlib.util.spec_from_file_location("exporter_vs_smi", ROOT / "scripts" / "exporter_vs_smi.py")
assert spec is not None and spec.loader is not None
evs = importlib.util.module_from_spec(spec)
sys.modules["exporter_vs_smi"] = evs  # dataclasses look their module up while it executes
spec.loader.exec_module(evs)

sys.path.insert(0, str(ROOT / "playbooks" / "facts" / "probes"))
from telemetry_probe import CLOCKS_EVENT_REASON_BITS  # noqa: E402

sys.path.pop(0)


def _smi_from_captures() -> tuple[list[str], str]:
    """The fields the captures show, and one `--format=csv,noheader,nounits` line of them."""
    cap, table, q = _v100_capture(), _v100_table(), _v100_q()
    mask = _reasons_mask(_h100_reasons(idle=False, hw_thermal=True))  # the stand-in's reasons
    values = {
        "index": "0",
        "name": "Tesla V100-SXM2-32GB",
        "clocks.sm": f"{cap['sm']:g}",
        "clocks.mem": f"{cap['mem']:g}",
        "temperature.gpu": f"{cap['temp']:g}",
        "power.draw": f"{cap['power_w']:.2f}",
        "enforced.power.limit": f"{q['limit_w']:.2f}",
        "memory.used": str(table["used_mib"]),
        "memory.total": str(table["total_mib"]),
        "utilization.gpu": str(table["util"]),
        "ecc.errors.uncorrected.aggregate.total": str(table["uncorrected"]),
        "retired_pages.double_bit.count": str(q["double_bit"]),
        "retired_pages.pending": "Yes" if q["pending"] else "No",
        "clocks_event_reasons.active": f"0x{mask:016x}",
    }
    fields = evs.query_fields(list(values))
    return fields, ", ".join(values[f] for f in fields)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    proc, url = _exporter(tmp_path_factory.mktemp("evs"), v100_standin())
    try:
        return httpx.get(url, timeout=10).text
    finally:
        proc.terminate()
        proc.wait(10)


@needs_exporter_deps
def test_the_exporter_agrees_with_nvidia_smi_on_a_v100_s_captured_values(scraped):
    fields, line = _smi_from_captures()
    smi = evs.parse_smi(line, fields)
    rows = evs.compare(smi, scraped, smi, CLOCKS_EVENT_REASON_BITS)
    assert [r for r in rows if not r.agrees] == []
    assert {r.smi for r in rows} == set(fields) - {"index"}  # every field the captures show, compared
    sm = next(r for r in rows if r.smi == "clocks.sm")
    assert (sm.before, sm.exported, sm.verdict) == (1290, 1290, "equal")


@needs_exporter_deps
def test_a_wrong_scale_is_caught(scraped, monkeypatch):
    wrong = tuple(dataclasses.replace(f, to_smi=1e-3) if f.smi == "clocks.mem" else f for f in evs.FIELDS)
    monkeypatch.setattr(evs, "FIELDS", wrong)  # as if the exporter exported kHz as Hz
    fields, line = _smi_from_captures()
    smi = evs.parse_smi(line, fields)
    rows = evs.compare(smi, scraped, smi, CLOCKS_EVENT_REASON_BITS)
    assert [(r.smi, r.verdict) for r in rows if not r.agrees] == [("clocks.mem", "differs")]
    assert evs.summary(rows)["differing"] == ["clocks.mem (differs: by +876123)"]


EXPORTED = """\
voltaforge_gpu_info{gpu="0",name="NVIDIA H200",uuid="GPU-1"} 1.0
voltaforge_gpu_sm_clock_hertz{gpu="0"} 1.98e+09
voltaforge_gpu_memory_used_bytes{gpu="0"} 5.9768832e+08
voltaforge_gpu_power_watts{gpu="0"} 120.0
"""


def test_a_moving_value_is_judged_between_the_reads_around_the_scrape():
    fields = ["index", "name", "clocks.sm", "power.draw", "memory.used", "memory.reserved"]
    fields.append("ecc.errors.corrected.aggregate.total")
    before = evs.parse_smi("0, NVIDIA H200, 1980, 110.50, 0, 570, [N/A]", fields)
    after = evs.parse_smi("0, NVIDIA H200, 1980, 130.25, 0, 570, [Not Supported]", fields)
    rows = {r.smi: r for r in evs.compare(before, EXPORTED, after, CLOCKS_EVENT_REASON_BITS)}
    assert rows["power.draw"].verdict == "between"  # 120 W between 110.50 and 130.25
    assert rows["clocks.sm"].verdict == "equal"
    assert rows["ecc.errors.corrected.aggregate.total"].verdict == "neither answers"
    # NVML's v1 used counts the reserved 570 MiB nvidia-smi shows apart: named as that
    used = rows["memory.used"]
    assert (used.verdict, used.note) == ("differs", "equals nvidia-smi's used + reserved (570 MiB)")
    after = evs.parse_smi("0, NVIDIA H200, 1980, 140.00, 0, 570, 3", fields)
    rows = {r.smi: r for r in evs.compare(after, EXPORTED, after, CLOCKS_EVENT_REASON_BITS)}
    assert rows["power.draw"].verdict == "differs"  # moved past both reads
    assert rows["ecc.errors.corrected.aggregate.total"].verdict == "only nvidia-smi"


def test_nvidia_smi_answering_another_count_of_values_is_one_clear_error():
    with pytest.raises(ValueError, match="answered 2 values for 3 fields"):
        evs.parse_smi("0, 1980", ["index", "clocks.sm", "power.draw"])


FAKE_SMI = """#!/usr/bin/env python3
import sys
VALUES = {values!r}
asked = next(a for a in sys.argv if a.startswith("--query-gpu=")).split("=", 1)[1].split(",")
unknown = [f for f in asked if f not in VALUES]
if unknown:  # as a driver answers a field it does not know
    print(f'Field "{{unknown[0]}}" is not a valid field to query.')
    sys.exit(2)
print(", ".join(VALUES[f] for f in asked))
"""


@needs_exporter_deps
def test_the_device_phase_runs_end_to_end_before_a_card(tmp_path):
    """device_check.py's exporter phase, rehearsed: a STAND-IN nvidia-smi answering the captured
    values (and refusing any other field, as a driver does), the exporter on the stand-in NVML.
    It proves the phase's path (field discovery, the exporter started and scraped five times,
    the result file) so a lent card's minutes go to the comparison, not to this code's bugs."""
    fields, line = _smi_from_captures()
    bin_dir, nvml = tmp_path / "bin", tmp_path / "nvml"
    bin_dir.mkdir()
    nvml.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(values=dict(zip(fields, line.split(", "), strict=True))))
    (bin_dir / "nvidia-smi").chmod(0o755)
    (nvml / "pynvml.py").write_text(v100_standin())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(nvml)}
    out = tmp_path / "out" / "r"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "exporter", f"--out={out}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((out / "exporter.json").read_text())
    assert data["fields_asked"] == fields
    per_round = len(fields) - 1  # index is the key, not compared
    assert data["summary"] == {"compared": 5 * per_round, "agree": 5 * per_round, "differ": 0, "differing": []}
    result = json.loads((tmp_path / "out" / "reports" / "h200" / "gpu-exporter.json").read_text())
    assert result["figures"] == {"compared": 5 * per_round, "agree": 5 * per_round, "differ": 0, "rounds": 5}
