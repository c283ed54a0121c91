"""The rules `invoke monitor` writes (steps/monitor/rules.py, issue 58), checked by Prometheus's
own tools: ``promtool check rules`` accepts the file, and ``promtool test rules`` evaluates each
alert on constructed series, firing where it should and not where it should not (a healthy
server beside the sick one, an idle card beside a throttled one, a down server before its
minute is up, a set's model asleep)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from playbooks.steps.monitor.rules import ServerFacts, render_rules

pytestmark = pytest.mark.skipif(not shutil.which("promtool"), reason="needs Debian's prometheus (promtool)")

GIB = 2**30
SICK = ServerFacts("gpu-01", "voltaforge-qwen", "qwen", floor_tok_s=20, roofline_tok_s=60.0, planned_gpu_bytes=15 * GIB)
HEALTHY = ServerFacts("gpu-02", "voltaforge-qwen", "qwen", floor_tok_s=20, roofline_tok_s=60.0,
                      planned_gpu_bytes=15 * GIB, slots=4, kv_tokens=4 * 8192)  # fmt: skip
ASLEEP = ServerFacts("gpu-03", "voltaforge-set-lab", "small", floor_tok_s=5, in_set=True)


def server(s: ServerFacts) -> str:
    return f'job="llama-server",host="{s.host}",service="{s.service}",model="{s.model}"'


def series() -> list[dict]:
    sick, healthy, asleep = server(SICK), server(HEALTHY), server(ASLEEP)
    return [
        # gpu-01 stops answering at 30 s; gpu-02 answers throughout; the set's model sleeps
        {"series": f"up{{{sick}}}", "values": "1 1 0x40"},
        {"series": f"up{{{healthy}}}", "values": "1x42"},
        {"series": f"up{{{asleep}}}", "values": "0x42"},
        # gpu-01 decodes 10 tok/s a stream (150 tokens over 15 s of generation every 15 s), below
        # its floor of 20; gpu-02 30 tok/s (450 tokens over 15 s)
        {"series": f"llamacpp:tokens_predicted_total{{{sick}}}", "values": "0+150x42"},
        {"series": f"llamacpp:tokens_predicted_seconds_total{{{sick}}}", "values": "0+15x42"},
        {"series": f"llamacpp:tokens_predicted_total{{{healthy}}}", "values": "0+450x42"},
        {"series": f"llamacpp:tokens_predicted_seconds_total{{{healthy}}}", "values": "0+15x42"},
        # requests wait at the edge for qwen from 30 s on; none for small
        {"series": 'haproxy_backend_current_queue{proxy="model_qwen"}', "values": "0 0 3x40"},
        {"series": 'haproxy_backend_current_queue{proxy="model_small"}', "values": "0x42"},
        # gpu-01's card held by heat; gpu-02's idle (a reason that is not a fault)
        {"series": 'voltaforge_gpu_clocks_event_reason{host="gpu-01",gpu="0",reason="hw_thermal_slowdown"}',
         "values": "1x42"},
        {"series": 'voltaforge_gpu_clocks_event_reason{host="gpu-02",gpu="0",reason="idle"}', "values": "1x42"},
        {"series": 'voltaforge_gpu_clocks_event_reason{host="gpu-02",gpu="0",reason="hw_thermal_slowdown"}',
         "values": "0x42"},
        # gpu-02's slots hold 8192 tokens (the slots exporter's reading of its /slots)
        {"series": 'voltaforge_kv_tokens{job="slots",host="gpu-02",service="voltaforge-qwen",model="qwen"}',
         "values": "8192x42"},
        # gpu-01's card holds 16 GiB against 15 planned; gpu-02's 14
        {"series": 'voltaforge_gpu_memory_used_bytes{host="gpu-01",gpu="0"}', "values": f"{16 * GIB}x42"},
        {"series": 'voltaforge_gpu_memory_used_bytes{host="gpu-02",gpu="0"}', "values": f"{14 * GIB}x42"},
    ]  # fmt: skip


def alert(name: str, at: str, labels: list[dict], annotations: list[dict] | None = None) -> dict:
    exp = [{"exp_labels": lab} | ({"exp_annotations": ann} if ann else {})
           for lab, ann in zip(labels, annotations or [None] * len(labels), strict=True)]  # fmt: skip
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


def test_the_rules_pass_promtools_check_and_each_alert_fires_only_where_it_should(tmp_path: Path):
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules([SICK, HEALTHY, ASLEEP]))
    r = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    sick = {"job": "llama-server", "host": "gpu-01", "service": "voltaforge-qwen", "model": "qwen"}
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": series(),
            "promql_expr_test": [
                {"expr": 'voltaforge:decode_tok_s:stream{host="gpu-02"}', "eval_time": "5m",
                 "exp_samples": [{"labels": 'voltaforge:decode_tok_s:stream{job="llama-server",host="gpu-02",'
                                  'service="voltaforge-qwen",model="qwen"}', "value": 30}]},
                {"expr": 'voltaforge:roofline_share{host="gpu-02"}', "eval_time": "5m",
                 "exp_samples": [{"labels": 'voltaforge:roofline_share{job="llama-server",host="gpu-02",'
                                  'service="voltaforge-qwen",model="qwen"}', "value": 0.5}]},
                # 8192 of the 4 x 8192 its plan gives it
                {"expr": "voltaforge:kv_use", "eval_time": "5m",
                 "exp_samples": [{"labels": 'voltaforge:kv_use{job="slots",host="gpu-02",'
                                  'service="voltaforge-qwen",model="qwen"}', "value": 0.25}]},
                # the slots its recipe gives it, a constant under its labels
                {"expr": 'voltaforge:slots{host="gpu-02"}', "eval_time": "5m",
                 "exp_samples": [{"labels": 'voltaforge:slots{host="gpu-02",service="voltaforge-qwen",model="qwen"}',
                                  "value": 4}]},
                {"expr": "voltaforge:decode_tok_s:model", "eval_time": "5m",
                 "exp_samples": [{"labels": 'voltaforge:decode_tok_s:model{model="qwen"}', "value": 40}]},
            ],
            "alert_rule_test": [
                # down at 30 s: pending under its minute, firing after; never for the sleeping model
                alert("VoltaforgeServerDown", "1m", []),
                alert("VoltaforgeServerDown", "2m", [sick | {"severity": "critical"}],
                      [{"summary": "gpu-01: voltaforge-qwen (qwen) does not answer its scrape"}]),
                alert("VoltaforgeDecodeBelowGate", "4m", []),
                alert("VoltaforgeDecodeBelowGate", "7m", [sick | {"severity": "warning"}],
                      [{"summary": "gpu-01: qwen decodes 10.0 tok/s a stream, below its gate's 20"}]),
                alert("VoltaforgeEdgeQueue", "1m", []),
                alert("VoltaforgeEdgeQueue", "2m", [{"proxy": "model_qwen", "severity": "warning"}],
                      [{"summary": "model_qwen: requests wait at the edge beyond every server's slots"}]),
                alert("VoltaforgeGpuThrottled", "4m", []),
                alert("VoltaforgeGpuThrottled", "6m",
                      [{"host": "gpu-01", "gpu": "0", "reason": "hw_thermal_slowdown", "severity": "warning"}],
                      [{"summary": "gpu-01: GPU 0 held down by hw_thermal_slowdown"}]),
                alert("VoltaforgeGpuMemoryAbovePlan", "6m", [{"host": "gpu-01", "severity": "warning"}],
                      [{"summary": "gpu-01: its GPUs hold more than the 15.00 GiB its servers' plans put there"}]),
            ],
        }],
    }  # fmt: skip
    test_file = tmp_path / "test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_rule_the_fleet_does_not_know_is_not_written():
    """No floor, no roofline, no plan on a GPU: no alert or record invented for them."""
    text = render_rules([ServerFacts("cpu-01", "voltaforge-tiny", "tiny")])
    assert "VoltaforgeDecodeBelowGate" not in text and "roofline_share" not in text
    assert "VoltaforgeGpuMemoryAbovePlan" not in text and "VoltaforgeServerDown" in text
    assert "voltaforge:kv_use" not in text  # no planned context: no share invented
    # a set's model: no "down" alert (its target is down while it sleeps)
    assert "VoltaforgeServerDown" not in render_rules([ASLEEP])
