"""`invoke bench`'s reports from a realistic result (tests/data/bench-result-example.json): the
three files written atomically and readable back (JSON, Markdown, a PNG matplotlib decodes at
the promised size, the same bytes twice); a failed gate shows its reasons; an incomplete run
never reaches the history; compare picks the last and the best run and gets the % right."""

from __future__ import annotations

import copy
import json
import os

import matplotlib.image
import pytest

from playbooks import errors
from playbooks.steps.measure import atomic_files, bench_history
from playbooks.steps.measure.bench_compare import compare, render_compare
from playbooks.steps.measure.bench_history import append_history, read_history
from playbooks.steps.measure.bench_render import chart_png, render_markdown, render_sweep_table, write_reports
from tests.helpers import ROOT, rich_text

EXAMPLE = ROOT / "tests" / "data" / "bench-result-example.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def result() -> dict:
    return json.loads(EXAMPLE.read_text())


def failed(result: dict) -> dict:
    r = copy.deepcopy(result)
    r["gate"] = {
        "passed": False,
        "reasons": ["aggregate 4.1 tok/s < min_tok_s 5", "TTFT p95 2.6 s > max_ttft_p95_s 2.0 | at concurrency 8"],
        "diagnosis": ["MBU 3% at concurrency 1: the model is on the CPU (n_gpu_layers 0?)"],
        "thresholds": {"min_tok_s": 5, "max_ttft_p95_s": 2.0},
    }
    return r


def run_at(result: dict, at: str, scale: float) -> dict:
    """The example measured at another time, every throughput times ``scale``, TTFT divided by it."""
    r = copy.deepcopy(result)
    r["at"] = at
    for lv in r["levels"]:
        lv["aggregate_tok_s"] = round(lv["aggregate_tok_s"] * scale, 3)
        lv["per_stream_decode_tok_s"] = round(lv["per_stream_decode_tok_s"] * scale, 3)
        lv["ttft_p95_s"] = round(lv["ttft_p95_s"] / scale, 4)
    return r


# ------------------------------------------------------------------------------------------
# the example itself: the keys the other half of `invoke bench` produces
# ------------------------------------------------------------------------------------------


def test_example_has_the_agreed_keys_and_consistent_numbers(result):
    assert set(result) == {
        *("version", "complete", "at", "host", "recipe", "recipe_sha256", "server", "facts", "workload"),
        *("roofline_tok_s", "roofline_basis", "prefill_ceiling_tok_s", "prefill_basis", "mbu", "levels"),
        *("knee", "scaling", "telemetry", "llama_bench", "sanity", "gate"),
    }
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2, 4, 8]
    one = result["levels"][0]
    # a tiny CPU model: roofline ~120 tok/s, one stream ~60, so MBU ~0.5
    assert one["per_stream_decode_tok_s"] / result["roofline_tok_s"] == pytest.approx(result["mbu"], abs=0.01)
    for lv in result["levels"]:
        ratio = lv["per_stream_decode_tok_s"] / lv["server_predicted_per_second"]
        assert lv["crosscheck_ratio"] == pytest.approx(ratio, abs=0.01)
        assert lv["ttft_p50_s"] <= lv["ttft_p95_s"] <= lv["ttft_p99_s"]


# ------------------------------------------------------------------------------------------
# the three files
# ------------------------------------------------------------------------------------------


def test_write_reports_writes_three_readable_files_and_nothing_else(result, tmp_path):
    out = tmp_path / "reports" / "run-1"  # made if missing
    paths = write_reports(result, out)

    assert paths == {"json": out / "bench.json", "markdown": out / "bench.md", "png": out / "bench.png"}
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]  # no temp files

    text = paths["json"].read_text()
    assert json.loads(text) == result
    assert text == json.dumps(result, indent=2, sort_keys=True) + "\n"

    md = paths["markdown"].read_text()
    assert "| concurrency | aggregate tok/s | per-stream decode tok/s ± 95% (MBU) | server predicted tok/s |" in md
    assert "| 1 | 60.1 (50%) | 60.3 (50%) | 61.0 (51%) | 0.99 | 150/200/210 | 16.0/20.0 | 0/8 |" in md
    assert "| 2 | 96.4 (80%) | 48.5 (40%) | 49.2 (41%) | 0.99 | 220/310/330 | 20.0/26.0 | 0/8 |" in md
    assert "| 4 | 131.8 (109%) | 33.4 (28%) | 34.0 (28%) | 0.98 | 410/620/660 | 29.0/41.0 | 0/8 |" in md
    assert "| 8 | 135.7 (113%) | 17.2 (14%) | 17.6 (15%) | 0.98 | 950/1480/1550 | 55.0/81.0 | 0/8 |" in md
    assert md.startswith("# Benchmark: tiny-cpu on local, 2026-11-30T17:20:00Z\n")
    assert "**PASSED**" in md
    assert "120.5 tok/s (measured CPU copy 11.2 GB/s / 93.0 MB per token)" in md
    assert "knee: concurrency 4: aggregate rose 3% from 4 to 8" in md

    png = paths["png"].read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(paths["png"])
    assert image.shape == (600, 1000, 4)  # CHART_FIGSIZE_IN x CHART_DPI, RGBA
    assert (paths["png"].stat().st_mode & 0o777) == 0o644


def test_the_markdown_shows_each_decode_with_its_interval_and_leaves_no_field_unfilled(result, tmp_path):
    """A result with the repeats' statistics (the example predates them): ``163.2 ± 3.1``, the
    server's own figure starred where the client could not time the tokens, the workload's
    repeats, where the client ran and what CPU it took; no ``None`` anywhere."""
    result["levels"][0]["decode"] = {"mean": 60.3, "stdev": 1.2, "n": 8, "halfwidth": 1.0, "source": "client"}
    result["levels"][1]["decode"] = {"mean": 49.2, "stdev": 0.4, "n": 8, "halfwidth": 0.3, "source": "server"}
    result["levels"][1]["crosscheck"] = "not resolvable: 40% of the tokens arrived in bursts within one read"
    result["workload"] |= {"requests_per_level": {"1": [4, 16], "2": [4, 16]}, "ci_target": 0.02}
    result["client"] = "this machine"
    result["client_cpu"] = {"on_served_host": True, "cpu_s": 3.1, "cores": 0.42, "host_cpus": 2}
    result["membw"] = {
        "gb_s": 11.2,
        "source": "stored, measured 2026-11-30T17:00:00Z",
        "probe": {"trials": [9.0, 11.2]},
    }
    md = write_reports(result, tmp_path)["markdown"].read_text()
    assert "| 1 | 60.1 (50%) | 60.3 ± 1.0 (50%) | 61.0 (51%) | 0.99 |" in md
    assert "| 2 | 96.4 (80%) | 49.2 ± 0.3 (41%)* | 49.2 (41%) | not timeable |" in md
    assert "requests per level (concurrency: fewest-most) 1: 4-16, 2: 4-16 until the 95% half-width is within 2%" in md
    assert "- client: this machine, on the served host (it competes with the server for CPU: it took 0.42 of" in md
    assert "- host memory bandwidth: 11.2 GB/s (best of 2, trials 9.0-11.2 GB/s; stored, measured 2026-11-30" in md
    assert "None" not in md
    del result["server"]["build"]
    assert "build not recorded" in write_reports(result, tmp_path)["markdown"].read_text()


def test_write_reports_replaces_an_earlier_report(result, tmp_path):
    write_reports(failed(result), tmp_path)
    write_reports(result, tmp_path)
    assert "**PASSED**" in (tmp_path / "bench.md").read_text()
    assert json.loads((tmp_path / "bench.json").read_text())["gate"]["passed"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md", "bench.png"]


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(result, tmp_path, monkeypatch):
    write_reports(result, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_files.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_reports(failed(result), tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_chart_is_deterministic_and_carries_no_software_stamp(result, tmp_path):
    first = chart_png(result)
    second = chart_png(result)
    assert first == second
    assert b"Software" not in first and b"atplotlib" not in first
    assert chart_png(run_at(result, result["at"], 0.5)) != first  # the data is really drawn


def test_the_chart_draws_a_server_that_reports_no_ttft_and_no_roofline(result, tmp_path):
    r = copy.deepcopy(result)
    r["roofline_tok_s"] = None
    for lv in r["levels"]:
        lv["ttft_p95_s"] = None
        lv["server_predicted_per_second"] = None
    path = tmp_path / "bench.png"
    path.write_bytes(chart_png(r))
    assert matplotlib.image.imread(path).shape == (600, 1000, 4)
    md = render_markdown(r)
    assert "| 1 | 60.1 | 60.3 | - | 0.99 |" in md  # crosscheck_ratio given; no % without a roofline


# ------------------------------------------------------------------------------------------
# markdown and terminal
# ------------------------------------------------------------------------------------------


def test_a_failed_gate_shows_its_reasons_and_diagnosis(result):
    r = failed(result)
    md = render_markdown(r)
    assert "**FAILED**" in md and "**PASSED**" not in md
    assert "- aggregate 4.1 tok/s < min_tok_s 5" in md
    assert r"- TTFT p95 2.6 s > max_ttft_p95_s 2.0 \| at concurrency 8" in md  # a pipe is data, not a cell
    assert "- MBU 3% at concurrency 1: the model is on the CPU (n_gpu_layers 0?)" in md

    out = rich_text(render_sweep_table, r)
    assert "gate: FAILED: aggregate 4.1 tok/s < min_tok_s 5; TTFT p95 2.6 s > max_ttft_p95_s 2.0" in out
    assert "diagnosis: MBU 3% at concurrency 1" in out


def test_the_terminal_table_has_the_markdown_columns_every_level_and_the_gate(result):
    out = rich_text(render_sweep_table, result)
    for row in (
        ["1", "60.1 (50%)", "60.3 (50%)", "61.0 (51%)", "0.99", "150/200/210", "16.0/20.0", "0/8"],
        ["8", "135.7 (113%)", "17.2 (14%)", "17.6 (15%)", "0.98", "950/1480/1550", "55.0/81.0", "0/8"],
    ):
        line = next(line for line in out.splitlines() if line.startswith(f"│ {row[0]} "))
        assert [c.strip() for c in line.strip("│").split("│")] == row
    assert "gate: PASSED" in out
    assert "knee: concurrency 4" in out
    assert max(len(line) for line in out.splitlines()) <= 120


def test_telemetry_llama_bench_and_errors_appear_only_when_present(result):
    md = render_markdown(result)
    assert "## Telemetry" not in md
    assert "| decode (tg) tok/s | 62.0 (51%) | 60.3 (50%) | 0.97 |" in md
    assert "| prefill (pp) tok/s | 900.0 (95%) | 800.0 (84%) | 0.89 |" in md

    r = copy.deepcopy(result)
    r["llama_bench"] = None
    r["telemetry"] = {
        "source": "pynvml",
        "summary": {
            "throttled": True,
            "started_at_s": 42.5,
            "reasons": ["hw_thermal_slowdown", "sw_power_cap"],
            "max_temperature_c": 86,
            "min_sm_clock_mhz": 1125,
            "max_sm_clock_mhz": 1530,
            "mean_power_w": 249.6,
        },
    }
    r["levels"][3].update(errors=2, error_samples=["HTTP 503: no free slot", "timeout after 120 s"])
    r["knee"] = None
    md = render_markdown(r)
    assert "## llama-bench cross-check" not in md
    assert "**throttled** from 42.5 s into the sweep: hw_thermal_slowdown, sw_power_cap" in md
    assert "max temperature: 86 C" in md and "SM clock: 1125 to 1530 MHz" in md and "mean power: 250 W" in md
    assert "| 2/8 |" in md
    assert "errors at concurrency 8: HTTP 503: no free slot; timeout after 120 s" in md
    assert "no knee within the sweep" in md


def test_an_incomplete_result_says_so_in_its_reports(result):
    r = copy.deepcopy(result)
    r["complete"] = False
    assert "**INCOMPLETE RUN**" in render_markdown(r)
    assert "incomplete run" in rich_text(render_sweep_table, r)
    assert "INCOMPLETE" not in render_markdown(result)


# ------------------------------------------------------------------------------------------
# history
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("complete", [False, None, "yes"])
def test_an_incomplete_result_is_never_appended(result, tmp_path, complete):
    history = tmp_path / "history.jsonl"
    append_history(result, history)
    before = history.read_bytes()
    r = copy.deepcopy(result)
    if complete is None:
        del r["complete"]
    else:
        r["complete"] = complete
    with pytest.raises(ValueError, match="incomplete"):
        append_history(r, history)
    assert history.read_bytes() == before
    with pytest.raises(ValueError):
        append_history(r, tmp_path / "fresh.jsonl")
    assert not (tmp_path / "fresh.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl"]


def test_history_lines_are_the_summary(result, tmp_path):
    history = tmp_path / "state" / "bench-history.jsonl"
    append_history(result, history)
    lines = history.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == {
        "at": "2026-11-30T17:20:00Z",
        "host": "local",
        "recipe": "tiny-cpu",
        "recipe_sha256": result["recipe_sha256"],
        "build": "1 (0c1e570)",
        "gate_passed": True,
        "roofline_tok_s": 120.5,
        "mbu": 0.5,
        "levels": [
            {"concurrency": 1, "aggregate_tok_s": 60.1, "per_stream_decode_tok_s": 60.3, "ttft_p95_s": 0.2},
            {"concurrency": 2, "aggregate_tok_s": 96.4, "per_stream_decode_tok_s": 48.5, "ttft_p95_s": 0.31},
            {"concurrency": 4, "aggregate_tok_s": 131.8, "per_stream_decode_tok_s": 33.4, "ttft_p95_s": 0.62},
            {"concurrency": 8, "aggregate_tok_s": 135.7, "per_stream_decode_tok_s": 17.2, "ttft_p95_s": 1.48},
        ],
    }


def test_history_append_read_and_compare_pick_last_and_best(result, tmp_path):
    history = tmp_path / "bench-history.jsonl"
    best = run_at(result, "2026-11-01T10:00:00Z", 1.25)  # older, faster
    last = run_at(result, "2026-11-15T10:00:00Z", 1.0)  # newer, slower
    other_host = run_at(result, "2026-11-20T10:00:00Z", 3.0)
    other_host["host"] = "v100-a"
    other_recipe = run_at(result, "2026-11-21T10:00:00Z", 3.0)
    other_recipe["recipe"] = "llama3-8b-q4"
    for r in (best, last, other_host, other_recipe):
        append_history(r, history)
    assert len(history.read_text().splitlines()) == 4
    assert [r["at"] for r in read_history(history, host="local", recipe="tiny-cpu")] == [best["at"], last["at"]]
    assert [r["host"] for r in read_history(history, host="v100-a")] == ["v100-a"]
    assert len(read_history(history, recipe="tiny-cpu")) == 3
    assert read_history(tmp_path / "none.jsonl") == []

    now = run_at(result, "2026-11-30T17:20:00Z", 1.1)
    append_history(now, history)  # this run in the history too: compare must not use it against itself
    rows = compare(now, read_history(history))
    assert [r["concurrency"] for r in rows] == [1, 2, 4, 8]
    one = rows[0]
    assert one["now"]["aggregate_tok_s"] == pytest.approx(66.11)
    assert one["last"]["at"] == last["at"] and one["best"]["at"] == best["at"]
    assert one["last"]["values"]["aggregate_tok_s"] == pytest.approx(60.1)
    assert one["best"]["values"]["aggregate_tok_s"] == pytest.approx(75.125)
    assert one["last"]["change_pct"]["aggregate_tok_s"] == pytest.approx(10.0, abs=0.01)
    assert one["best"]["change_pct"]["aggregate_tok_s"] == pytest.approx(-12.0, abs=0.01)  # 1.1 / 1.25 - 1
    assert one["last"]["change_pct"]["ttft_p95_s"] == pytest.approx((0.2 / 1.1 - 0.2) / 0.2 * 100, abs=0.05)
    assert one["last"]["recipe_changed"] is False

    out = rich_text(render_compare, rows)
    assert "+10.0%" in out and "-12.0%" in out
    assert f"last: run at {last['at']}, build 1 (0c1e570)" in out
    assert f"best: run at {best['at']}" in out


def test_compare_per_level_best_and_a_level_never_measured(result):
    a = bench_history.history_summary(run_at(result, "2026-11-01T10:00:00Z", 1.0))
    b = bench_history.history_summary(run_at(result, "2026-11-02T10:00:00Z", 1.0))
    a["levels"][0]["aggregate_tok_s"] = 90.0  # a is best at concurrency 1 only
    b["levels"] = b["levels"][:2]  # an older sweep that stopped at concurrency 2
    b["recipe_sha256"] = "0" * 64
    r = copy.deepcopy(result)
    r["levels"].append(dict(r["levels"][-1], concurrency=16))
    rows = {row["concurrency"]: row for row in compare(r, [b, a])}  # order of lines does not matter
    assert rows[1]["best"]["at"] == a["at"] and rows[1]["last"]["at"] == b["at"]
    assert rows[1]["last"]["recipe_changed"] is True
    assert rows[2]["best"]["at"] == a["at"]  # equal aggregates: the first max
    assert rows[4]["last"]["at"] == a["at"]  # b never measured 4
    assert rows[16]["last"] is None and rows[16]["best"] is None
    empty = compare(result, [])
    assert [(r["concurrency"], r["last"], r["best"]) for r in empty] == [(c, None, None) for c in (1, 2, 4, 8)]
    assert empty[3]["now"] == {"aggregate_tok_s": 135.7, "per_stream_decode_tok_s": 17.2, "ttft_p95_s": 1.48}
    assert "no earlier run" in rich_text(render_compare, compare(result, []))


def test_compare_says_whether_a_decode_change_is_outside_the_noise(result):
    """Two runs with intervals: 60.3 ± 1.0 then 61.0 ± 1.0 is within the noise (+1.2%); 100.0 ±
    1.0 is outside it, 66.0 (+9.5%) is not, on a host whose own history says two runs of one
    unchanged server differ by more than that (9%, this 2-core VM's: bench_stats.RUN_NOISE). A
    run from before the repeats (no interval) gets the plain % change."""

    def with_decode(run: dict, mean: float, source: str = "client") -> dict:
        run = copy.deepcopy(run)
        run["levels"][0]["decode"] = {"mean": mean, "halfwidth": 1.0, "n": 8, "stdev": 1.4, "source": source}
        run["levels"][0]["per_stream_decode_tok_s"] = mean
        run["host_noise"] = {"rsd": 0.09, "df": 7, "runs": 8, "groups": 1, "oldest": None, "newest": None}
        return run

    then = bench_history.history_summary(with_decode(run_at(result, "2026-11-01T10:00:00Z", 1.0), 60.3))
    near, far = with_decode(result, 61.0), with_decode(result, 100.0)
    assert compare(near, [then])[0]["last"]["decode_outside_noise"] is False
    assert compare(with_decode(result, 66.0), [then])[0]["last"]["decode_outside_noise"] is False
    assert compare(far, [then])[0]["last"]["decode_outside_noise"] is True
    out = rich_text(render_compare, compare(near, [then]))
    detectable = compare(near, [then])[0]["last"]["detectable_pct"]
    assert 10 < detectable < 90
    assert (
        "concurrency 1: per-stream decode +1.2% against the last run, within the noise: no change shown "
        f"(a change of {detectable:.0f}% or more would show 80% of the time)"
    ) in " ".join(out.split())
    out = rich_text(render_compare, compare(far, [then]))
    assert "concurrency 1: per-stream decode +65.8% against the last run, outside the noise: a real change" in out
    # the client's figure against the server's own: not the same measurement, no verdict
    assert compare(with_decode(result, 66.0, "server"), [then])[0]["last"]["decode_outside_noise"] is None
    old = bench_history.history_summary(run_at(result, "2026-11-01T10:00:00Z", 1.0))
    assert compare(far, [old])[0]["last"]["decode_outside_noise"] is None


def test_a_corrupt_history_line_names_the_file_and_line(result, tmp_path):
    history = tmp_path / "h.jsonl"
    append_history(result, history)
    with history.open("a") as f:
        f.write("{not json\n")
    with pytest.raises(errors.VoltaforgeError, match=r"h\.jsonl:2: not a JSON line"):
        read_history(history)


def test_append_survives_a_history_without_a_final_newline(result, tmp_path):
    history = tmp_path / "h.jsonl"
    history.write_text(json.dumps(bench_history.history_summary(run_at(result, "2026-01-01T00:00:00Z", 1.0))))
    append_history(result, history)
    assert [r["at"] for r in read_history(history)] == ["2026-01-01T00:00:00Z", result["at"]]
    assert not [p for p in os.listdir(tmp_path) if p != "h.jsonl"]


def test_paths_are_accepted_as_strings(result, tmp_path):
    paths = write_reports(result, str(tmp_path))  # type: ignore[arg-type]
    assert all(p.exists() for p in paths.values())


def test_a_run_without_levels_still_gets_its_chart(tmp_path):
    """A server that was down: no level measured; the reports are written all the same."""
    result = json.loads(EXAMPLE.read_text()) | {"levels": [], "complete": False, "error": "cannot connect"}
    files = write_reports(result, tmp_path)
    assert files["png"].read_bytes().startswith(b"\x89PNG")
