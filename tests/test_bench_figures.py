"""One figure per quantity, and ceilings that bound (issue 34, items 6 and 7), pure.

- A level stored before the client's figure lost its rate's name: level 1 of `invoke bench
  --host local --json` on the embedded default, where the client's tokens "arrived in bursts
  within one read" (``crosscheck`` not resolvable) and ``per_stream_decode_tok_s`` still held the
  client's 30,886 tok/s beside the judged 1,732 ± 244 (the server's own) and a 14,531 tok/s
  roofline. The Markdown, the chart, the history and compare show 1,732 and its 12%; the
  untimeable 30,886 nowhere.
- A cache-resident model (the tiny recipe: 2.3 MB per token in this machine's 32 MiB L3) has no
  DRAM roofline: said so, no percentage anywhere, the gate's roofline fraction not judged.
- An MBU above 1 is reported as a ceiling or measurement error, never as "102%".
"""

from __future__ import annotations

import copy
import io
import json
import math

import pytest

from playbooks.cli.render import console
from playbooks.config.recipe import load_recipe
from playbooks.facts import system
from playbooks.steps.measure import (
    bench,
    bench_compare,
    bench_figures,
    bench_history,
    bench_render,
    roofline,
    tune_report,
)
from playbooks.steps.measure.bench_ceilings import ceilings
from playbooks.steps.measure.gate import figures_line, gate_figures
from tests.helpers import ROOT, fixture_body

EXAMPLE = ROOT / "tests" / "data" / "bench-result-example.json"
WHY = "not resolvable: tokens arrived in bursts within one read; judged by the server's own rate"


def _untimeable_level() -> dict:
    """Level 1 as the bench wrote it before the judged figure took the rate's name."""
    return {
        "concurrency": 1,
        "requests": 16,
        "errors": 0,
        "aggregate_tok_s": 1290.4,
        "per_stream_decode_tok_s": 30886.0,  # the client's, from tokens it could not time
        "decode": {"mean": 1732.0, "halfwidth": 244.0, "n": 16, "stdev": 458.0, "source": "server"},
        "server_predicted_per_second": 1731.6,
        "crosscheck_ratio": None,
        "crosscheck": WHY,
        "ttft_p50_s": 0.004,
        "ttft_p95_s": 0.006,
        "ttft_p99_s": 0.007,
    }


@pytest.fixture
def old() -> dict:
    """The example result with that level 1 and the 14,531 tok/s roofline (MBU 0.1192)."""
    r = json.loads(EXAMPLE.read_text())
    r["levels"][0] = _untimeable_level()
    r |= {"roofline_tok_s": 14531.0, "mbu": 0.1192, "llama_bench": {"tg_tok_s": 1800.0, "pp_tok_s": 9000.0}}
    return r


def _text(render, *args) -> str:
    buf = io.StringIO()
    render(*args, console(file=buf, width=200))
    return buf.getvalue()


# ------------------------------------------------------------------------------------------
# one figure per quantity
# ------------------------------------------------------------------------------------------


def test_the_one_per_stream_figure_is_the_judged_one_in_old_levels_too():
    level = _untimeable_level()
    assert bench.decode_figure(level) == 1732.0
    # older still: no estimate, only the crosscheck saying the client could not time the tokens
    older = {k: v for k, v in level.items() if k != "decode"}
    assert bench.decode_figure(older) == 1731.6 and bench_figures.per_stream(older) == 1731.6
    # a level with no figure at all (every request failed): none, not 0 tok/s
    assert bench_figures.per_stream({"concurrency": 1, "per_stream_decode_tok_s": None}) is None


def test_markdown_shows_the_judged_figure_and_its_share(old):
    md = bench_render.render_markdown(old)
    assert "| 1 | 1290.4 (9%) | 1732.0 ± 244.0 (12%)* | 1731.6 (12%) | not timeable |" in md
    assert "30886" not in md and "213%" not in md  # 30,886 / 14,531: the share the old report showed
    assert "- MBU: 12%" in md
    # llama-bench beside the sweep: the judged figure again
    assert "| decode (tg) tok/s | 1800.0 (12%) | 1732.0 (12%) | 0.96 |" in md
    # a level stored before the estimates, untimeable: the server's own, marked as such
    older = copy.deepcopy(old)
    del older["levels"][0]["decode"]
    assert "| 1 | 1290.4 (9%) | 1731.6 (12%)* | 1731.6 (12%) | not timeable |" in bench_render.render_markdown(older)


def test_the_chart_draws_the_judged_figure(old):
    series = bench_render.chart_series(old)
    assert series["per_stream_decode_tok_s"][0] == 1732.0
    assert series["per_stream_decode_tok_s"][1:] == [lv["per_stream_decode_tok_s"] for lv in old["levels"][1:]]
    gone = copy.deepcopy(old)
    gone["levels"][1] |= {"per_stream_decode_tok_s": None, "decode": None, "server_predicted_per_second": None}
    assert math.isnan(bench_render.chart_series(gone)["per_stream_decode_tok_s"][1])
    assert bench_render.chart_png(old).startswith(b"\x89PNG")


def test_history_and_compare_read_the_judged_figure_from_old_lines(old, tmp_path):
    # a history line the old code wrote: the client's 30,886 under the rate's name, the estimate beside it
    line = bench_history.history_summary(old)
    line["levels"][0]["per_stream_decode_tok_s"] = 30886.0
    line["at"] = "2026-11-01T10:00:00Z"
    history = tmp_path / "history.jsonl"
    history.write_text(json.dumps(line) + "\n")
    assert bench_history.history_summary(old)["levels"][0]["per_stream_decode_tok_s"] == 1732.0  # what is written now
    now = copy.deepcopy(old)
    now["levels"][0]["decode"] = dict(old["levels"][0]["decode"], mean=1800.0)
    rows = bench_compare.compare(now, bench_history.read_history(history))
    one = rows[0]
    assert one["now"]["per_stream_decode_tok_s"] == 1800.0
    assert one["last"]["values"]["per_stream_decode_tok_s"] == 1732.0
    assert one["last"]["change_pct"]["per_stream_decode_tok_s"] == pytest.approx(3.93, abs=0.01)
    out = _text(bench_compare.render_compare, rows)
    assert "30886" not in out and "1732.0" in out and "1800.0" in out
    # a line from before the estimates: its per_stream_decode_tok_s is the figure it has
    plain = {"concurrency": 1, "aggregate_tok_s": 60.1, "per_stream_decode_tok_s": 60.3, "ttft_p95_s": 0.2}
    assert bench_history.tracked(plain) == {"aggregate_tok_s": 60.1, "per_stream_decode_tok_s": 60.3, "ttft_p95_s": 0.2}


def test_the_client_figure_has_its_own_name_in_the_crosscheck():
    level = {"concurrency": 1, "requests": 8, "errors": 0, "per_stream_decode_tok_s": 50.0, "ttft_p95_s": 0.1}
    level |= {"client_decode_tok_s": 46.0, "server_predicted_per_second": 50.0, "crosscheck_ratio": 0.92}
    result = {"complete": True, "levels": [level], "sanity": {}}
    assert bench.judge(result, {}, {})["reasons"] == [
        "at concurrency 1 the client's decode 46.0 tok/s and the server's own 50.0 differ by 8% (over 5%)"
    ]
    assert bench_figures.crosscheck_ratio({"client_decode_tok_s": 46.0, "per_stream_decode_tok_s": 50.0,
                                "server_predicted_per_second": 50.0}) == pytest.approx(0.92)  # fmt: skip
    assert bench_figures.crosscheck_ratio({"client_decode_tok_s": None, "per_stream_decode_tok_s": 50.0,
                                "server_predicted_per_second": 50.0}) is None  # fmt: skip


def test_the_gate_and_the_device_check_read_the_same_figure(old):
    figures = gate_figures(old)
    assert figures["single_tok_s"] == 1732.0 and figures["single_halfwidth"] == 244.0
    # the figure with the 95% half-width it was measured with
    assert figures_line(figures).startswith("1732 ± 244 tok/s single stream (12% of the 14531 tok/s roofline)")
    # a stored verdict from before the half-width: the figure alone
    assert figures_line(figures | {"single_halfwidth": None}).startswith("1732 tok/s single stream (12%")


# ------------------------------------------------------------------------------------------
# ceilings that bound
# ------------------------------------------------------------------------------------------


def test_a_model_that_fits_the_last_level_cache_has_no_dram_roofline():
    tiny = load_recipe("tiny-cpu")
    llc = system.parse_llc(fixture_body("thishost-llc-sysfs-cacheinfo.txt")).size_bytes  # this machine's L3
    resident = ceilings(tiny, 47.9, llc)
    assert resident["roofline_tok_s"] is None
    assert resident["roofline_basis"] == (
        "cache-resident: 2.3 MB per token fits the 32 MiB last-level cache, the DRAM ceiling does not bind "
        "(the measured CPU copy 47.9 GB/s would put it at 20467.0 tok/s)"
    )
    assert resident["cache_resident"] == {
        "bytes_per_token": 2340352,
        "llc_bytes": 32 * 2**20,
        "dram_roofline_tok_s": 20467.01,
    }
    # a cache smaller than a token's bytes: the DRAM roofline binds, as before
    bound = ceilings(tiny, 47.9, 2**20)
    assert bound["roofline_tok_s"] == 20467.01 and bound["cache_resident"] is None
    assert bound["roofline_basis"].startswith("measured CPU copy 47.9 GB/s / 2.3 MB per token")
    # no cache size read (a host without sysfs cacheinfo): the DRAM roofline, as before
    assert ceilings(tiny, 47.9)["roofline_tok_s"] == 20467.01


def _resident(old: dict) -> dict:
    r = copy.deepcopy(old)
    r |= ceilings(load_recipe("tiny-cpu"), 47.9, 32 * 2**20)
    r["mbu"] = None
    return r


def test_a_cache_resident_result_prints_no_percentage(old):
    r = _resident(old)
    md = bench_render.render_markdown(r)
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table and not [line for line in table if "%" in line and "MBU" not in line], table
    assert "- roofline: none (cache-resident: 2.3 MB per token fits the 32 MiB last-level cache" in md
    assert "- MBU: none: cache-resident: 2.3 MB per token fits the 32 MiB last-level cache" in md
    assert "% of" not in md and "(12%)" not in md
    terminal = _text(bench_render.render_sweep_table, r)
    assert "no roofline, rates without a share: cache-resident" in terminal and "(12%)" not in terminal
    line = figures_line(gate_figures(r))
    assert line.startswith("1732 ± 244 tok/s single stream (cache-resident: the DRAM ceiling does not bind)")
    assert "%" not in line


def test_the_gate_does_not_judge_a_roofline_fraction_of_a_ceiling_that_does_not_bind(old):
    r = _resident(old)
    verdict = bench.judge(r, {"min_roofline_fraction": 0.4}, {})
    assert verdict["passed"], verdict["reasons"]
    assert verdict["diagnosis"][0].startswith("cache-resident: 2.3 MB per token fits the 32 MiB last-level cache")
    assert verdict["diagnosis"][-1] == (
        "the gate's min_roofline_fraction 40% is not judged: the DRAM ceiling does not bind"
    )
    # no roofline at all (the bandwidth could not be measured): a gate asking for a share fails, saying why
    unknown = copy.deepcopy(old) | {
        "roofline_tok_s": None,
        "mbu": None,
        "roofline_basis": "the host's memory bandwidth could not be measured",
    }
    assert bench.judge(unknown, {"min_roofline_fraction": 0.4}, {})["reasons"] == [
        "no roofline to judge the gate's 40% of it against: the host's memory bandwidth could not be measured"
    ]


def _above(old: dict) -> dict:
    r = copy.deepcopy(old)
    r["levels"][0]["decode"] = dict(r["levels"][0]["decode"], mean=14822.0, halfwidth=300.0)
    r["mbu"] = round(14822.0 / 14531.0, 4)  # 1.02
    return r


def test_an_mbu_above_one_is_reported_as_a_ceiling_or_measurement_error(old):
    r = _above(old)
    assert roofline.mbu_note(r) == "above the ceiling: a ceiling or measurement error"
    md = bench_render.render_markdown(r)
    assert "- MBU: above the ceiling: a ceiling or measurement error (decode 1.02x the 14531.0 tok/s roofline)" in md
    assert "| 1 | 1290.4 (9%) | 14822.0 ± 300.0 (above the ceiling)* |" in md
    assert "above the ceiling = a per-stream rate over it: a ceiling or measurement error" in md
    assert "102%" not in md
    # the gate: not failed on it, not passed on it either; the diagnosis leads with it
    verdict = bench.judge(r, {"min_roofline_fraction": 0.4}, {})
    assert verdict["passed"]
    assert verdict["diagnosis"][0].startswith("decode at 1.02x the bandwidth roofline (14531.0 tok/s")
    assert verdict["diagnosis"][0].endswith(": above the ceiling: a ceiling or measurement error")
    assert verdict["diagnosis"][-1] == (
        "the gate's min_roofline_fraction 40% is not judged: above the ceiling: a ceiling or measurement error"
    )
    line = figures_line(gate_figures(r))
    assert line.startswith(
        "14822 ± 300 tok/s single stream "
        "(above the ceiling: a ceiling or measurement error: 1.02x the 14531 tok/s roofline)"
    )
    assert "102%" not in line
    # an aggregate above the single-stream roofline is batching, not an error: still a share
    assert bench_figures.of_roofline(20000.0, 14531.0, bounded=False) == "20000.0 (138%)"


def test_the_device_check_gives_no_percentage_above_the_ceiling(old, tmp_path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("device_check_figures", ROOT / "scripts" / "device_check.py")
    assert spec and spec.loader
    dc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = dc
    spec.loader.exec_module(dc)
    run = dc.Run(reports=tmp_path, command="test", machine="this machine", commit="0" * 7)
    from playbooks.results import load_result

    below = load_result(dc.gate_results({"gate": old}, run)[0])
    assert below.figures["roofline_pct"] == 11.92 and below.figures["single_stream_tok_s"] == 1732.0
    above = load_result(dc.gate_results({"gate": _above(old)}, run)[0])
    assert "roofline_pct" not in above.figures
    assert above.extra["mbu_note"] == "above the ceiling: a ceiling or measurement error"


def test_tunes_table_says_above_the_ceiling():
    row = {"label": "Q4_K_M", "winner": False, "predicted": 100.0, "measured": 120.0, "halfwidth": 2.0}
    row |= {"reused": False, "error": None, "roofline_share": 1.2, "bpw": 4.8, "vram_gib": 1.0, "rung": 0}
    row |= {"pareto": False, "note": "", "spec_type": None}
    assert tune_report.table_cells(row)[3] == "above the ceiling"
    assert tune_report.table_cells(row | {"roofline_share": 0.51})[3] == "51%"
