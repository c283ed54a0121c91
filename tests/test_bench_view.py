"""Prometheus's view of a bench run (steps/monitor/bench_view.py, conduct/bench_view.py): the
window's arithmetic on raw samples, what the view says, and its bad inputs (no monitor: no view;
no Prometheus where the monitor should be: one line, the bench's reports still written).

Shown for real elsewhere: the counters half against two real llama-servers scraped by a real
Prometheus in tests/test_monitor_real.py (the tokens Prometheus saw equal those the bench
received), the GPU half against the V100-fed exporter in tests/test_top.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from playbooks.conduct.bench_view import add_prometheus_views
from playbooks.conduct.settings import Settings
from playbooks.steps.measure.bench_render import write_reports
from playbooks.steps.monitor.bench_view import (
    parse_matrix,
    raw_query,
    rise,
    run_view,
    server_selector,
    span_for,
    view_markdown,
    view_rows,
)
from tests.testhosts import free_port

SCRAPES = [(100.0, 10.0), (115.0, 10.0), (130.0, 50.0), (145.0, 80.0), (160.0, 80.0)]


def test_a_counter_rises_between_the_scrape_before_and_the_first_after():
    # the run from 116 to 140: the last scrape before is 115's, the first after is 145's
    assert rise(SCRAPES, 116, 140) == (70.0, (115.0, 145.0), None)
    assert rise(SCRAPES, 115, 145) == (70.0, (115.0, 145.0), None)  # a scrape at an edge counts
    restarted = [(100.0, 10.0), (115.0, 50.0), (130.0, 5.0), (145.0, 20.0)]
    assert rise(restarted, 101, 140)[2] == "its counters fell during the run: the server restarted"
    assert rise(SCRAPES, 90, 140)[2] == (
        "Prometheus has no sample of it from before the run (its first scrape came after)"
    )
    assert rise(SCRAPES, 116, 161)[2] == "Prometheus has not scraped it since the run ended"


def test_the_selector_and_the_span_name_the_run():
    result = {"host": "v100-01", "server": {"service": "voltaforge-qwen", "model": 'q"wen'}}
    sel = server_selector(result)
    assert sel == '{job="llama-server",host="v100-01",service="voltaforge-qwen",model="q\\"wen"}'
    assert raw_query("tokens", sel, 47) == f"llamacpp:tokens_predicted_total{sel}[47s]"
    # 30 s of run before now, 15 s scrapes: two intervals and slack reach a scrape before it
    assert span_for(1000.0, 1030.4, 15) == 62


def test_the_view_beside_the_bench():
    result = {
        "host": "h",
        "server": {"service": "s", "model": "m"},
        "sent": {"from": 116.0, "to": 140.0, "requests": 9, "completion_tokens": 70},
        "levels": [{"concurrency": 1, "decode": {"mean": 41.25}}],
    }
    decode = [(100.0, 1.0), (115.0, 1.0), (145.0, 3.0)]
    gpu = {"host": "h", "gpu": "0"}
    answers = {
        "deferred": [({}, 0.0)],
        "busy": [({}, 2.0)],
        "sm": [(gpu, 1.29e9)],
        "temp": [(gpu, 71.0)],
        "power": [(gpu, 250.4)],
        "held": [({**gpu, "reason": "sw_power_cap"}, 1.0)],
        "gpus": [({"host": "h"}, 1.0)],
    }
    view = run_view(result, {"tokens": SCRAPES, "decode_s": decode}, answers, "Prometheus on m at 127.0.0.1:9090")
    assert view["tokens_predicted"] == 70 and view["sent_tokens"] == 70 and view["decode_tok_s"] == 35.0
    assert view["window"] == {"from": 115.0, "to": 145.0, "span_s": 30.0}
    assert view["gpus"] == [{"gpu": "0", "sm_min_mhz": 1290.0, "temp_max_c": 71.0, "power_max_w": 250.4,
                             "held": ["sw_power_cap"]}]  # fmt: skip
    rows = view_rows(view, 41.25)
    assert rows[0] == ("tokens generated", "70 (equal)", "70 received in 9 requests (probe and warm-ups included)")
    assert rows[1][1:] == ("35.0 (the server's timing, every request)", "41.2 (single stream)")
    assert rows[-1] == ("GPU 0", "1290 MHz SM lowest, 71 C highest, 250 W highest, held by sw_power_cap", "")
    more = run_view({**result, "sent": {**result["sent"], "completion_tokens": 64}}, {"tokens": SCRAPES}, {}, "p")
    assert view_rows(more, None)[0][1] == "70 (6 more: other clients were served during the run)"
    md = view_markdown(view, 41.25)
    assert md[0] == "## Prometheus's view of the run" and "| tokens generated | 70 (equal) |" in md[6]
    none = run_view({**result, "sent": {**result["sent"], "from": 90.0}}, {"tokens": SCRAPES}, {}, "p")
    assert view_rows(none, None) == [("Prometheus's view", none["error"], "")]


def test_a_range_answer_is_read_or_named():
    answer = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"model": "m"}, "values": [[115.0, "10"], [130, "50"]]}]}}  # fmt: skip
    assert parse_matrix(answer) == [[(115.0, 10.0), (130.0, 50.0)]]
    refused = {"status": "error", "errorType": "bad_data", "error": "parse error"}
    for bad, said in ((refused, "bad_data: parse error"), ({"status": "success", "data": {"resultType": "vector"}},
                                                          "not a range vector: vector")):  # fmt: skip
        try:
            parse_matrix(bad)
        except ValueError as exc:
            assert said in str(exc)
        else:
            raise AssertionError(bad)


def _run(tmp_path: Path) -> tuple[dict, dict[str, Path], list]:
    result = {
        "version": 1, "complete": True, "at": "2026-12-07T08:00:00Z", "host": "local", "recipe": "tiny-cpu",
        "server": {"service": "voltaforge-tiny-cpu", "model": "tiny"}, "levels": [],
        "sent": {"from": 1.0, "to": 2.0, "requests": 1, "completion_tokens": 2},
    }  # fmt: skip
    return result, write_reports(result, tmp_path / "report"), []


def test_no_monitor_no_view_and_no_prometheus_one_line(tmp_path):
    run = _run(tmp_path)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {}}))
    add_prometheus_views(Settings(inventory=inv), [run])
    assert "prometheus" not in run[0] and "Prometheus" not in run[1]["markdown"].read_text()

    port = free_port()  # nothing listens there
    inv.write_text(yaml.safe_dump({"hosts": {}, "monitor": {"host": "local", "port": port}}))
    add_prometheus_views(Settings(inventory=inv), [run])
    error = "no Prometheus answers there: run `invoke monitor --host local`"
    assert run[0]["prometheus"] == {"source": "Prometheus on local at 127.0.0.1:" + str(port), "error": error}
    # the reports are written again with it; the bench's own figures as they were
    assert json.loads(run[1]["json"].read_text())["prometheus"]["error"] == error
    md = run[1]["markdown"].read_text()
    assert f"- Prometheus on local at 127.0.0.1:{port}: {error}" in md
