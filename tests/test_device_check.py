"""scripts/device_check.py writes each phase's figures as result files (playbooks/results.py).

No GPU here: each phase's result writer is fed what the phase returns, built from captured
output (the two H200 load logs kept as fixtures, a realistic bench result, llama-bench rows
with the README's sweep figures), and must write valid files under the names and keys the
README's markers use, so a new run's files replace the transcribed ones in reports/h200/."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys

import pytest

from playbooks.facts import membw
from playbooks.plan.model_config import load_config_file
from playbooks.plan.moe import expert_layout
from playbooks.results import MEASURED_HERE, load_result
from tests.helpers import ROOT, docs_text, fixture_body
from tests.test_readme_figures import MARK

spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
assert spec is not None and spec.loader is not None
device_check = importlib.util.module_from_spec(spec)
sys.modules["device_check"] = device_check  # dataclasses look their module up while it executes
spec.loader.exec_module(device_check)

DENSE_LOG = "llamacpp-load-h200-qwen2.5-14b-q4km-full-offload.log"
MOE_LOG = "llamacpp-load-h200-qwen3-30b-a3b-q4km-n-cpu-moe-24.log"
SWEEP = {0: 299.6, 12: 110.1, 24: 65.9, 36: 44.1, 48: 38.0}  # the H200's, as the README shows them


@pytest.fixture
def run(tmp_path):
    return device_check.Run(tmp_path / "reports" / "h200", "e5dfcb1", "NVIDIA H200 143771 MiB (driver 580)", "cmd")


def _facts():
    line = json.dumps(
        {"probe": "voltaforge-membw", "copy_gb_s": 41.3, "method": "numpy", "bytes": 2 * 2**30, "threads": 16}
    )
    # no H200 device copy was ever captured: the probe's line is written here in its real shape
    # with a figure of its own (what it proves: the writer's keys and units, not a speed)
    d2d = json.dumps({"probe": "voltaforge-membw", "copy_gb_s": 3900.0, "method": "torch-cuda", "device": "cuda"})
    return {
        "gpus": [],
        "membw": membw.read_membw(line).__dict__,
        "device_copy": membw.read_membw(d2d).__dict__,
        "datasheet_gb_s": 4800.0,
        "toolkits": [],
    }


def _build():
    changed = [{"step": f"op {i}", "status": "changed", "why": ""} for i in range(6)]
    ok = [{"step": f"op {i}", "status": "ok", "why": ""} for i in range(6)]
    return {
        "release": "13.0",
        "arch": "90",
        "toolkits": ["/usr/local/cuda-13.0/bin/nvcc"],
        "first": {"seconds": 258.9, "changes": changed},
        "again": {"seconds": 0.1, "changes": ok},
    }


def _gate():
    bench = json.loads((ROOT / "tests" / "data" / "bench-result-example.json").read_text())
    bench["telemetry"] = {
        "source": "nvml",
        "error": None,
        "summary": {
            "throttled": False,
            "min_sm_clock_mhz": 1980,
            "max_sm_clock_mhz": 1980,
            "max_temperature_c": 43,
            "mean_power_w": 312.4,
        },
    }
    return {
        "argv": ["llama-server", "--model", "m.gguf"],
        "load_log": device_check.load_log_dict(fixture_body(DENSE_LOG)),
        "planned": {"kv_mib": 1632.0},
        "gate": bench,
    }


def _moe():
    layout = expert_layout(load_config_file(ROOT / "recipes/models/qwen3-30b-a3b.config.json"), "Q4_K_M")
    return {
        "config": "qwen3-30b-a3b.config.json",
        "per_token_bytes": {str(n): list(layout.per_token(n)) for n in SWEEP},
        "gpu_gb_s": 4800,
        "sweep": {
            "command": "llama-bench -ncmoe 0,12,24,36,48",
            "rc": 0,
            "rows": [{"n_cpu_moe": n, "tg_tok_s": t, "stddev": 0.1} for n, t in SWEEP.items()],
        },
        "server": {
            "argv": ["llama-server", "--n-cpu-moe", "24"],
            "n_cpu_moe": 24,
            "load_log": device_check.load_log_dict(fixture_body(MOE_LOG)),
        },
    }


CAPTURED = {"facts": _facts, "build": _build, "gate": _gate, "moe": _moe}
WRITES = {
    "facts": ["membw", "gpu-copy"],
    "build": ["build"],
    "gate": ["gate", "gate-load"],
    "moe": ["moe-sweep", "moe-load"],
}


@pytest.mark.parametrize("phase", sorted(CAPTURED))
def test_each_phase_writes_valid_result_files(phase, run):
    paths = device_check.RESULTS[phase](CAPTURED[phase](), run)
    assert [p.name for p in paths] == [f"{n}.json" for n in WRITES[phase]]
    for p in paths:
        r = load_result(p)
        assert p.parent == run.reports
        assert (r.source, r.commit, r.machine) == (MEASURED_HERE, "e5dfcb1", "NVIDIA H200 143771 MiB (driver 580)")
        assert r.figures and r.command


def test_the_load_files_from_the_fixtures_are_the_transcribed_ones(run):
    """The writer reads the same figures out of the kept H200 logs as reports/h200/ holds."""
    for phase, name in (("gate", "gate-load"), ("moe", "moe-load")):
        (path,) = [p for p in device_check.RESULTS[phase](CAPTURED[phase](), run) if p.stem == name]
        assert load_result(path).figures == load_result(ROOT / "reports" / "h200" / f"{name}.json").figures


def test_the_figures_are_the_phases_own(run):
    build = load_result(device_check.build_results(_build(), run)[0]).figures
    assert build == {"first_run_s": 258.9, "first_run_changed": 6, "second_run_s": 0.1, "second_run_ok": 6}
    gate = load_result(device_check.gate_results(_gate(), run)[0]).figures
    level = _gate()["gate"]["levels"][0]
    assert gate["single_stream_tok_s"] == level["per_stream_decode_tok_s"]
    assert gate["server_tok_s"] == level["server_predicted_per_second"]
    assert gate["ttft_p50_ms"] == level["ttft_p50_s"] * 1000 and gate["roofline_pct"] == 50
    assert (gate["llama_bench_tg64_tok_s"], gate["llama_bench_pp128_tok_s"]) == (62.0, 900.0)
    assert (gate["min_sm_clock_mhz"], gate["max_temperature_c"], gate["mean_power_w"]) == (1980, 43, 312.4)
    sweep = load_result(device_check.moe_results(_moe(), run)[0]).figures
    assert {n: sweep[f"tg_tok_s_n{n}"] for n in SWEEP} == SWEEP
    # the README's derived figures, from the rounded tok/s: within the rounding
    readme = load_result(ROOT / "reports" / "h200" / "moe-sweep.json").figures
    for n in (12, 24, 36, 48):
        assert sweep[f"host_gb_s_n{n}"] == pytest.approx(readme[f"host_gb_s_n{n}"], abs=0.15)
    assert round(sweep["gpu_roofline_pct_n0"]) == readme["gpu_roofline_pct_n0"]
    assert load_result(device_check.facts_results(_facts(), run)[0]).figures == {"copy_gb_s": 41.3, "threads": 16}
    copy_file = load_result(device_check.facts_results(_facts(), run)[1])
    assert copy_file.figures == {"d2d_copy_gb_s": 3900.0, "datasheet_gb_s": 4800.0}


def test_the_readmes_h200_markers_name_figures_a_new_run_writes(run):
    """A fresh run's files keep the README's markers readable (only the membw probe changed
    meaning since: one thread then, every core now)."""
    written = {}
    for phase in CAPTURED:
        for p in device_check.RESULTS[phase](CAPTURED[phase](), run):
            written[f"reports/h200/{p.name}"] = set(load_result(p).figures)
    readme = docs_text()
    for m in MARK.finditer(readme):
        if m["file"].startswith("reports/h200/") and m["file"] != "reports/h200/membw.json":
            assert set(m["keys"].split()) <= written[m["file"]], m[0]


def test_the_facts_phase_here_says_why_there_is_no_device_copy(tmp_path):
    """Run for real on this machine (no GPU, no torch in the venv): the device copy is an error
    line, and no gpu-copy file is written, the host's membw file is."""
    import argparse

    data = device_check.phase_facts(argparse.Namespace(), tmp_path)
    assert data["device_copy"]["copy_gb_s"] is None and data["device_copy"]["kind"] in ("no-torch", "no-cuda")
    assert data["datasheet_gb_s"] is None
    run = device_check.Run(tmp_path / "reports", "e5dfcb1", "this machine", "cmd")
    membw_file, copy_file = device_check.facts_results(data, run)
    assert membw_file is not None and copy_file is None


def test_a_failed_phase_writes_no_file(run):
    for phase in CAPTURED:
        assert device_check.RESULTS[phase]({"error": "RuntimeError: boom"}, run) == [None] * len(WRITES[phase])
    assert not run.reports.exists()
    # a part missing leaves out its figures, not the file
    data = _gate()
    data["gate"] = copy.deepcopy(data["gate"]) | {"llama_bench": {"error": "no room"}, "telemetry": None}
    figures = load_result(device_check.gate_results(data, run)[0]).figures
    assert "llama_bench_tg64_tok_s" not in figures and "mean_power_w" not in figures
    assert figures["single_stream_tok_s"] > 0


def test_the_commit_comes_from_git_or_the_sessions_stamp(monkeypatch, tmp_path):
    assert (
        device_check.run_commit()
        == subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    monkeypatch.setattr(device_check, "checkout_commit", lambda where=None: None)
    monkeypatch.setattr(device_check, "ROOT", tmp_path)
    with pytest.raises(RuntimeError, match="no commit"):
        device_check.run_commit()
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "commit").write_text("E5DFCB1A2B3C4D5E6F\n")
    assert device_check.run_commit() == "e5dfcb1a2b3c"


def test_the_machine_line_says_when_no_gpu_is_seen():
    assert device_check.machine_line().startswith(("no GPU seen by nvidia-smi; ", "NVIDIA"))


def test_the_driver_scripts_parse():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device_check.sh")]).returncode == 0
