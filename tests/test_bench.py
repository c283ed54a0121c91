"""`invoke bench`'s arithmetic, and its client against real HTTP servers that misbehave: a
server that streams one token over and over (garbage), one that answers JSON instead of an
event stream (not OpenAI-shaped), one that never answers (timeout), one that dies mid-stream,
and no server at all. Each becomes an error or a failure on its level, never an exception."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from playbooks.config.recipe import RecipeError, load_recipe
from playbooks.steps.measure import bench, bench_client
from playbooks.steps.measure.bench_client import Sample
from tests.helpers import ROOT
from tests.testhosts import free_port


def _sample(tokens: int, per_token: float, ttft: float = 0.1, text: str = "a b c d", server: float | None = None):
    s = Sample(sent=0.0, chunks=[ttft + i * per_token for i in range(tokens)], text=text, completion_tokens=tokens)
    s.done = s.chunks[-1] + 0.001
    s.prompt_tokens = 128
    if server:
        s.timings = {"predicted_per_second": server, "prompt_per_second": 1000.0}
    return s


def test_percentiles_match_numpy_and_levels_add_up():
    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    for q in (50, 95, 99):
        assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    samples = [_sample(64, 0.02, server=50.0) for _ in range(4)]
    lv = bench.level_summary(2, samples, wall_s=2.56)
    assert lv["aggregate_tok_s"] == pytest.approx(4 * 64 / 2.56, rel=1e-3)
    assert lv["per_stream_decode_tok_s"] == pytest.approx(50.0, rel=1e-3)
    assert lv["crosscheck_ratio"] == pytest.approx(1.0, rel=1e-3) and lv["crosscheck"] is None
    assert lv["ttft_p50_s"] == pytest.approx(0.1) and lv["itl_p50_s"] == pytest.approx(0.02)
    # a spread of rates: the mean with its 95% interval (t with n - 1 degrees of freedom)
    # one stream: each request is a round
    spread = [_sample(64, 1 / rate, server=rate) for rate in (48.0, 50.0, 52.0, 50.0)]
    est = bench.level_summary(1, spread, wall_s=2.0)["decode"]
    sd = float(np.std([48.0, 50.0, 52.0, 50.0], ddof=1))
    assert est["n"] == 4 and est["mean"] == pytest.approx(50.0, rel=1e-3) and est["source"] == "client"
    assert est["stdev"] == pytest.approx(sd, rel=1e-3) and est["halfwidth"] == pytest.approx(3.182 * sd / 2, rel=1e-3)
    assert est["unit"] == "round"


def test_at_concurrency_a_round_is_one_observation_of_each_figure():
    """The streams of a round share every batch: four of them are one observation, not four
    (was: n = requests, so level 4's interval came from 2 rounds as if from 8 values)."""
    rates = [(48.0, 52.0, 49.0, 51.0), (40.0, 42.0, 41.0, 41.0), (45.0, 46.0, 44.0, 45.0)]
    rounds = [
        ([_sample(32, 1 / r, ttft=0.1 + 0.05 * i, server=r) for i, r in enumerate(rs)], 1.0 + k)
        for k, rs in enumerate(rates)
    ]
    lv = bench.level_summary(4, [s for got, _ in rounds for s in got], wall_s=6.0, rounds=rounds)
    means = [50.0, 41.0, 45.0]
    assert lv["rounds"] == 3 and lv["decode"]["n"] == 3
    assert lv["decode"]["mean"] == pytest.approx(statistics.fmean(means), rel=1e-3)
    assert lv["decode"]["stdev"] == pytest.approx(statistics.stdev(means), rel=1e-3)
    # the aggregate: each round's tokens over its own wall time
    aggs = [4 * 32 / 1.0, 4 * 32 / 2.0, 4 * 32 / 3.0]
    assert lv["aggregate"]["n"] == 3 and lv["aggregate"]["mean"] == pytest.approx(statistics.fmean(aggs), rel=1e-3)
    # the slowest stream's wait for its first token, once per round
    assert lv["ttft_worst"]["n"] == 3 and lv["ttft_worst"]["mean"] == pytest.approx(0.25, abs=1e-4)
    # one figure per quantity: the judged decode is the per-stream figure
    assert lv["per_stream_decode_tok_s"] == lv["decode"]["mean"]


def test_a_level_reports_speculations_acceptance_from_the_servers_own_counts():
    plain = [_sample(16, 0.01, server=100.0) for _ in range(2)]
    assert bench.level_summary(1, plain, wall_s=0.4)["speculation"] is None
    drafted = [_sample(16, 0.01, server=100.0) for _ in range(2)]
    drafted[0].timings |= {"draft_n": 30.0, "draft_n_accepted": 27.0}
    drafted[1].timings |= {"draft_n": 10.0, "draft_n_accepted": 1.0}
    spec = bench.level_summary(1, drafted, wall_s=0.4)["speculation"]
    assert spec == {"drafted": 40, "accepted": 28, "acceptance": 0.7}


def _bursty(tokens: int, per_read: int, read_every: float, server: float) -> Sample:
    """Tokens that arrive ``per_read`` at a time: within one read microseconds apart."""
    chunks = [0.1 + (i // per_read) * read_every + (i % per_read) * 2e-6 for i in range(tokens)]
    s = Sample(sent=0.0, chunks=chunks, text="a b", completion_tokens=tokens, prompt_tokens=64)
    s.done, s.timings = chunks[-1] + 0.001, {"predicted_per_second": server}
    return s


def test_whether_the_client_can_time_tokens_is_decided_by_their_arrival_times():
    # 6 ms per token, one per read: timed and cross-checked, whatever the rate (the fixed 10 ms
    # threshold refused exactly this: every 7B model on a V100, the H200 gate run)
    steady = bench.level_summary(1, [_sample(48, 0.006, server=166.0) for _ in range(4)], wall_s=1.2)
    assert steady["timing"]["timeable"] and steady["crosscheck"] is None
    assert steady["crosscheck_ratio"] == pytest.approx(1 / 0.006 / 166.0, rel=1e-3)
    # a tiny model at 2,800 tok/s read 8 tokens per read: not timeable, judged by the server's figure
    fast = bench.level_summary(1, [_bursty(64, 8, 0.003, 2800.0) for _ in range(2)], wall_s=0.1)
    assert fast["crosscheck_ratio"] is None and fast["crosscheck"].startswith("not resolvable: ")
    assert "arrived in bursts within one read" in fast["crosscheck"] and fast["timing"]["burst_share"] > 0.8
    assert fast["decode"]["source"] == "server" and bench.decode_figure(fast) == pytest.approx(2800.0)
    # a client descheduled now and then (two tokens in one read, 3 times in 48) still times them
    hiccup = _sample(48, 0.006, server=166.0)
    for i in (10, 20, 30):
        hiccup.chunks[i] = hiccup.chunks[i + 1] - 1e-6
    lv = bench.level_summary(1, [hiccup], wall_s=0.4)
    assert lv["timing"]["timeable"] and lv["timing"]["burst_share"] == pytest.approx(3 / 47, rel=1e-3)
    # several tokens in one chunk (fewer chunks than tokens): not timeable
    packed = _sample(24, 0.012, server=166.0)
    packed.completion_tokens = 48
    assert not bench.level_summary(1, [packed], wall_s=0.4)["timing"]["timeable"]


def test_a_stream_that_arrived_whole_within_one_read_lends_no_rate():
    """A client descheduled while the server made a whole stream reads every token at once: its
    gaps are all microseconds, so against its own mean gap none is a burst, and its first-to-last
    span (63 tokens in 0.126 ms) made a rate of 500,000 tok/s that outweighed fifteen true ones
    (the quick start's gate once said 23,515 tok/s single stream for a server at about 2,500;
    its samples are gone, but one such stream among sixteen does that).
    Such a stream is found against the server's own rate for it, or, where the server reports
    none (TabbyAPI), against the level's typical stream; it counts as bursts and lends no rate."""
    true = [_sample(64, 1 / 2500.0, server=2450.0) for _ in range(15)]
    whole = _bursty(64, 64, 0.003, 2450.0)
    lv = bench.level_summary(1, [*true, whole], wall_s=0.5)
    assert lv["timing"]["compressed_streams"] == 1
    assert lv["decode"]["source"] == "client" and lv["decode"]["n"] == 15
    assert bench.decode_figure(lv) == pytest.approx(2500.0, rel=1e-3)
    # no server rates: the level's typical stream is the reference
    for s in [*true, whole]:
        s.timings = {}
    bare = bench.level_summary(1, [*true, whole], wall_s=0.5)
    assert bare["timing"]["compressed_streams"] == 1 and bench.decode_figure(bare) == pytest.approx(2500.0, rel=1e-3)
    # more than MAX_BURST_SHARE of the streams whole: the level is not timeable, the server judges
    many = [_sample(64, 1 / 2500.0, server=2450.0) for _ in range(6)] + [
        _bursty(64, 64, 0.003, 2450.0) for _ in range(2)
    ]
    lv = bench.level_summary(1, many, wall_s=0.5)
    assert not lv["timing"]["timeable"] and "2 of 8 streams arrived whole within one read" in lv["timing"]["why_not"]
    assert lv["decode"]["source"] == "server" and bench.decode_figure(lv) == pytest.approx(2450.0, rel=1e-3)


def test_knee_and_scaling():
    def lv(c, agg, ttft=0.1):
        return {"concurrency": c, "aggregate_tok_s": agg, "ttft_p95_s": ttft}

    assert bench.find_knee([lv(1, 50), lv(2, 95), lv(4, 180), lv(8, 185)]) == {
        "concurrency": 4,
        "why": "aggregate rose 3% from 4 to 8",
    }
    assert bench.find_knee([lv(1, 50), lv(2, 100, 0.1), lv(4, 200, 0.5)])["why"].startswith("TTFT p95 grew 5.0x")
    assert bench.find_knee([lv(1, 50), lv(2, 100)]) is None
    assert bench.scaling([lv(1, 50), lv(8, 50)], "exllamav2", True).startswith("does not scale (ExLlamaV2 on V100")
    assert bench.scaling([lv(1, 50), lv(8, 300)], "llamacpp", True) == "scales"


def test_sanity_checks_what_means_something_for_the_weights():
    looped = [_sample(8, 0.01, text="the the the the the the")]
    real = bench.sanity(looped, random_weights=False)
    assert real["failures"] and "repeat one token" in real["failures"][0]
    assert bench.sanity(looped, random_weights=True) == {
        "checked": ["non_empty", "finite"],
        "skipped": {"not_one_token_repeated": "random test weights: a loop on one token means nothing"},
        "failures": [],
    }
    assert "were empty" in bench.sanity([_sample(8, 0.01, text="  ")], True)["failures"][0]
    assert "NaN/inf" in bench.sanity([_sample(8, 0.01, text="nan nan nan")], True)["failures"][0]


def _result(single=50.0, agg4=150.0, ttft=0.2, complete=True, errors=0):
    levels = [
        {"concurrency": 1, "requests": 4, "errors": errors, "error_samples": ["cannot connect"] if errors else [],
         "per_stream_decode_tok_s": single, "server_predicted_per_second": single, "crosscheck_ratio": 1.0,
         "aggregate_tok_s": single, "ttft_p95_s": ttft},
        {"concurrency": 4, "requests": 8, "errors": 0, "per_stream_decode_tok_s": 40.0,
         "server_predicted_per_second": 40.0, "crosscheck_ratio": 1.0, "aggregate_tok_s": agg4, "ttft_p95_s": 0.4},
    ]  # fmt: skip
    return {"complete": complete, "levels": levels, "mbu": single / 100, "roofline_tok_s": 100.0, "sanity": {}}


def test_the_gate_passes_below_reality_and_fails_above_it_with_reasons():
    th = {"min_tok_s": 40, "min_roofline_fraction": 0.4, "min_aggregate_tok_s": 100, "at_concurrency": 4,
          "max_ttft_ms": 500}  # fmt: skip
    assert bench.judge(_result(), th, {})["passed"]
    g = bench.judge(_result(single=30.0, agg4=90.0, ttft=0.9), th, {})
    assert not g["passed"]
    assert g["reasons"] == [
        "single-stream decode 30.0 tok/s is below the gate's 40",
        "decode reaches 30% of the roofline (100.0 tok/s), below the gate's 40%",
        "aggregate 90.0 tok/s at concurrency 4 is below the gate's 100",
        "single-stream TTFT p95 900 ms is above the gate's 500",
    ]
    failed = bench.judge(_result(errors=2), {}, {})
    assert failed["reasons"] == ["2 of 4 requests failed at concurrency 1: cannot connect"]
    incomplete = bench.judge(_result(complete=False) | {"error": "the server is down"}, {}, {})
    assert incomplete["reasons"][0] == "the server is down"
    seen = {"offloaded": [39, 41], "load_problems": ["no kernel image is available"]}
    telemetry = {"summary": {"throttled": True, "reasons": ["hw_thermal_slowdown"], "started_at_s": 42.0}}
    diagnosis = bench.judge(_result() | {"telemetry": telemetry}, {}, seen)["diagnosis"]
    assert diagnosis[0].startswith("layers on the CPU: the load log offloaded 39/41")
    assert "the GPU throttled (hw_thermal_slowdown) from 42 s into the run" in diagnosis


def test_prompts_are_seeded_and_sized_by_the_servers_own_count():
    text = " ".join(f"w{i}" for i in range(1000))
    a, b = bench.prompts_for(text, 50, 3, seed=7), bench.prompts_for(text, 50, 3, seed=7)
    assert a == b and len({*a}) == 3 and all(len(p.split()) == 50 for p in a)
    assert bench.words_for(128, probe_words=64, probe_tokens=256) == 32
    # cut from the shipped text, no prompt lands on a paragraph without spaces (a Chinese one
    # is hundreds of tokens in one "word"): 2,000 prompts of 8 words stay short
    shipped = (ROOT / "recipes" / "calibration" / "general.txt").read_text(encoding="utf-8")
    assert max(len(w) for w in shipped.split()) > 100  # the text does hold such runs
    prompts = bench.prompts_for(shipped, 8, 2000, seed=3)
    assert max(len(p) for p in prompts) <= 8 * 25


def test_workload_kinds_cut_their_own_texts():
    """gate.workload: chat cuts words of the general text joined by spaces (as the bench always
    did: the same prompts as before kinds existed); code cuts the shipped source with its line
    breaks and indentation; long lays the general text out and asks 2048-token prompts unless
    the recipe names a length, which must fit the slot."""
    from playbooks.steps.measure.bench_run import workload_text

    shipped = (ROOT / "recipes" / "calibration" / "general.txt").read_text(encoding="utf-8")
    chat = workload_text("chat")
    assert bench.prompts_for(chat, 40, 5, seed=9) == bench.prompts_for(shipped, 40, 5, seed=9)
    assert all("\n" not in p for p in bench.prompts_for(chat, 40, 50, seed=9))
    code = bench.prompts_for(workload_text("code"), 60, 50, seed=9)
    assert sum("\n    " in p for p in code) >= 35 and sum("def " in p or "return" in p for p in code) >= 25
    assert all(len(p.split()) == 60 for p in code)  # the words are the same count; layout kept
    long = bench.prompts_for(workload_text("long"), 300, 5, seed=9)
    assert all("\n" in p and len(p.split()) == 300 for p in long)
    assert load_recipe(_gate_recipe("workload: long", 4096)).recipe.gate.prompt_tokens == 2048
    assert load_recipe(_gate_recipe("workload: long\n  prompt_tokens: 512", 1024)).recipe.gate.prompt_tokens == 512
    with pytest.raises(RecipeError, match="a prompt of 2048 tokens and 64 out do not fit a slot of 1024 tokens"):
        load_recipe(_gate_recipe("workload: long", 1024))
    with pytest.raises(RecipeError, match="workload"):
        load_recipe(_gate_recipe("workload: poetry", 1024))


def _gate_recipe(gate: str, context: int) -> Path:
    import tempfile

    where = Path(tempfile.mkdtemp())
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    text = (ROOT / "recipes" / "tiny-cpu.yaml").read_text().replace("context: 512", f"context: {context}")
    text = text.replace("max_position_embeddings: 2048", "max_position_embeddings: 8192")
    text = text.replace("gate:\n", f"gate:\n  {gate}\n")
    (where / "r.yaml").write_text(text)
    return where / "r.yaml"


# ------------------------------------------------------------------------------------------
# the client against real HTTP servers that misbehave
# ------------------------------------------------------------------------------------------


class _Stub(BaseHTTPRequestHandler):
    mode = "repeat"
    served = 0

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        type(self).served += 1
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        if self.mode == "json":
            data = json.dumps({"choices": [{"text": "hi"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.mode == "hang":
            time.sleep(3)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            if self.mode == "die" and i == 3:
                self.connection.shutdown(socket.SHUT_RDWR)  # the server dies mid-stream
                return
            chunk = {"choices": [{"text": " the", "index": 0, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.005)
        usage = {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stub():
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def _level(url, mode, timeout=10.0):
    _Stub.mode = mode
    samples, wall = asyncio.run(bench_client.run_level(url, ["a b c"] * 4, 2, 16, 1, "llama-server", timeout))
    return samples, bench.level_summary(2, samples, wall)


def test_garbage_output_fails_the_sanity_check(stub):
    samples, lv = _level(stub, "repeat")
    assert lv["errors"] == 0 and lv["output_tokens"] == 64
    assert "repeat one token" in bench.sanity(samples, random_weights=False)["failures"][0]


@pytest.mark.parametrize(
    "mode,words",
    [
        ("json", "answered application/json, not an event stream: not OpenAI-shaped"),
        ("hang", "no answer within 1 s"),
        ("die", "the stream ended without usage"),
    ],
)
def test_a_server_that_misbehaves_is_an_error_on_its_level(stub, mode, words):
    samples, lv = _level(stub, mode, timeout=1.0)
    assert lv["errors"] == 4 and words in lv["error_samples"][0], lv["error_samples"]
    assert not bench.judge({"complete": True, "levels": [lv], "sanity": {}}, {}, {})["passed"]


def test_no_server_at_all():
    samples, lv = _level(f"http://127.0.0.1:{free_port()}", "repeat")
    assert lv["errors"] == 4 and lv["error_samples"][0].startswith("cannot connect")


def test_a_cross_check_beyond_5_percent_fails_a_gpu_gate_and_is_only_reported_for_a_cpu_server():
    off = _result()
    off["levels"][1] |= {"per_stream_decode_tok_s": 36.8, "crosscheck_ratio": 0.92}
    g = bench.judge(off, {}, {})
    assert g["reasons"] == [
        "at concurrency 4 the client's decode 36.8 tok/s and the server's own 40.0 differ by 8% (over 5%)"
    ]
    assert bench.judge(off, {"crosscheck_gates": 0}, {})["passed"]


def test_llama_bench_measures_the_served_configuration():
    from playbooks.config.recipe import load_recipe
    from playbooks.steps.measure.bench_ceilings import llama_bench_args

    moe = load_recipe("qwen3-30b-a3b-v100-16gb")
    args = llama_bench_args(moe, 7)
    assert args == ["-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0", "-ngl", "999", "-ncmoe", "7"]
    assert llama_bench_args(load_recipe("tiny-cpu"), 0) == ["-fa", "1", "-ctk", "f16", "-ctv", "f16"]


def test_llama_bench_is_not_run_where_a_second_copy_cannot_fit_beside_the_server(tmp_path):
    from playbooks.config.recipe import load_recipe
    from playbooks.steps.measure.bench_ceilings import no_room_for_llama_bench

    # a 16 GB V100 holds the served 14B (10.3 GiB) and not another 8 GiB of its weights
    assert "not run: its own copy of the model beside the server's needs 19.0 GiB of the 16 GiB card" == (
        no_room_for_llama_bench(load_recipe("qwen2.5-14b-v100-16gb"))
    )
    assert no_room_for_llama_bench(load_recipe("tiny-cpu")) is None  # host memory: the plan's budget is not the RAM
    # the same recipe on an H200 (where it ran beside the server: README, "On a real GPU")
    text = (ROOT / "recipes/qwen2.5-14b-v100-16gb.yaml").read_text().replace("gpu: v100-16gb", "gpu: h200")
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes/defaults.yaml").read_text())
    (tmp_path / "models").mkdir()
    cfg = "qwen2.5-14b-instruct.config.json"
    (tmp_path / "models" / cfg).write_text((ROOT / "recipes/models" / cfg).read_text())
    (tmp_path / "h200.yaml").write_text(text)
    assert no_room_for_llama_bench(load_recipe(tmp_path / "h200.yaml")) is None
