"""`invoke bench` for real: a generated Llama large enough to be memory-bound on this CPU (12 layers,
hidden 1024, Q8_0: about 155 MB, random BF16 weights, made like the tiny one), deployed by `invoke
deploy` on a host without systemd (a private sshd: the managed process), served on one thread (the
client needs a core of its own: _recipe), measured through the SSH port forward. The sweep runs; the
client's decode agrees with the server's own within 5% at every level; llama-bench runs beside it;
the three reports are written and the PNG is a real image; the gate passes below reality and fails
above it; `bench --noise` gives the host its own run-to-run noise, which `--compare` then counts: an
unchanged server is not called changed, and the model a third as deep (a third of the bytes and the
work a token costs) is; the same two judged in one run, interleaved (`bench --against`): the same
recipe beside the deployed server measured within 40% (one process per side: a process's own effect
is not told from a change), the shallow one called; a server that is down fails the gate in one line
and leaves the history as it was."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from playbooks.cli.bench import run_bench, run_bench_against, run_bench_noise
from playbooks.cli.deploy import run_deploy, run_stop
from playbooks.conduct.settings import Settings
from playbooks.host import connect
from playbooks.steps.measure.bench_run import bench_dir, bench_health
from tests import llamacpp_tools
from tests.helpers import ROOT, inventory_for, spec_for, stage_served_model
from tests.testhosts import free_port

pytestmark = pytest.mark.slow
BIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
       "num_key_value_heads": 8}  # fmt: skip


@pytest.fixture(scope="module")
def membound(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("bench-model")
    config = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"] | BIG
    f16 = llamacpp_tools.tiny_f16(work, config)
    return llamacpp_tools.quantize(f16, work / "m-Q8_0.gguf", "Q8_0")


SHALLOW = BIG | {"num_hidden_layers": 4}


@pytest.fixture(scope="module")
def shallow(tmp_path_factory) -> Path:
    """The same shape a third as deep, at the same quant: a third of the bytes a token reads and of
    the work it does, so the single stream is faster whether memory or the cores bound it. A
    change of quant is not that: Q4_K_M reads 0.57x Q8_0's bytes but costs more to unpack (+49.7%
    on an Intel Xeon VM whose cache held the model, +5.9% on a CI machine where the cores bound
    it). Why a change this large: on these shared VMs a compare does not yet resolve 30-50%
    reliably (issue 53, open; docs/bench.md gives the proof's figures), and a suite test asserts
    what holds on every run, so this one proves the mechanism (an unchanged server not called, a
    large real change called), not the power."""
    work = tmp_path_factory.mktemp("bench-shallow")
    config = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())["model"]["config"] | SHALLOW
    return llamacpp_tools.quantize(llamacpp_tools.tiny_f16(work, config), work / "m-Q8_0.gguf", "Q8_0")


def _single_streams(history: Path) -> list[tuple[str, float | None]]:
    """Each run's single-stream decode mean and whose clock timed it, from the bench history."""
    runs = [json.loads(line) for line in history.read_text().splitlines()]
    ones = [lv.get("decode") or {} for r in runs for lv in r["levels"] if lv["concurrency"] == 1]
    return [(d.get("source"), d.get("mean")) for d in ones]


def _recipe(tmp_path: Path, port: int, quant: str = "Q8_0", shape: dict = BIG, **gate) -> Path:
    data = yaml.safe_load((ROOT / "recipes/tiny-cpu.yaml").read_text())
    data["model"]["config"] |= shape
    # one thread: the bench's client, the SSH forward and the server share these two cores, and
    # a server on both (llama.cpp's default) starved the client: in cold run 87 and once here,
    # 2 of 6 single streams came whole in one read, so their decode was the server's own rate,
    # which a compare does not judge against the client's (no verdict at all); with one thread,
    # 0 of 21 in three runs here, and the noise the compare counted 3.4-8.9% (11.1% with both)
    data |= {"quant": quant, "parallel": 4, "service": {"port": port}, "threads": 1}
    # three levels: a sweep (rising concurrency, each checked); 8 streams would only cost time
    data["gate"] = {"levels": [1, 2, 4], "prompt_tokens": 64, "max_tokens": 48} | gate
    where = tmp_path / str(abs(hash(json.dumps([quant, shape, gate], sort_keys=True))))
    where.mkdir(exist_ok=True)
    (where / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = where / "bench-cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("cpu_quiet")  # tests/helpers.cpu_quiet: a measurement, the cores to itself
def test_bench_sweep_reports_gate_and_a_server_that_is_down(
    sshd_host, membound, shallow, tmp_path, monkeypatch, capsys
):
    port = free_port()
    prefix = str(sshd_host.prefix / "vf")
    settings = Settings(inventory=inventory_for(tmp_path, "box", sshd_host, prefix=prefix))
    passing = _recipe(tmp_path, port, min_tok_s=1.0)
    with connect(spec_for(sshd_host)) as host:
        stage_served_model(host, prefix, passing, membound, "Q8_0")
    # reports and history in the test's own cache (after staging: the test tools live in the real one)
    monkeypatch.setenv("VOLTAFORGE_CACHE", str(tmp_path / "cache"))
    assert run_deploy("box", str(passing), settings=settings) == 0, capsys.readouterr().out[-3000:]
    capsys.readouterr()
    history = bench_dir() / "history.jsonl"
    try:
        assert run_bench("box", str(passing), as_json=True, settings=settings) == 0
        result = json.loads(capsys.readouterr().out)
        levels = result["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2, 4] and result["complete"]
        for lv in levels:
            c = lv["concurrency"]
            assert lv["errors"] == 0 and lv["output_tokens"] == lv["requests"] * 48 and lv["short_completions"] == 0
            # a warm-up round left out, then whole rounds until the interval is tight or the cap
            assert lv["warmup_requests"] == c and lv["requests"] == lv["rounds"] * c
            # a round is one observation (its streams share every batch): n counts rounds, at least 4
            d = lv["decode"]
            assert d["n"] == lv["rounds"] >= 4 and d["unit"] == "round", lv
            assert d["mean"] > 0 and d["stdev"] >= 0 and d["halfwidth"] >= 0
            assert lv["aggregate"]["n"] == lv["rounds"] and lv["ttft_worst"]["n"] == lv["rounds"]
            # the target reached, or the cap (16 requests' worth of rounds, 8 x c) and said so
            assert d["rel_halfwidth"] <= 0.02 or (d["capped"] and lv["rounds"] == max(16 // c, 8)), lv
            # whether the client could time the tokens comes from their arrival times, whatever
            # the machine's speed; where it could, its decode and the server's own agree within 5%
            if lv["timing"]["timeable"]:
                assert lv["crosscheck"] is None and abs(lv["crosscheck_ratio"] - 1) <= 0.05, lv
            else:
                assert lv["crosscheck"].startswith("not resolvable: ") and d["source"] == "server", lv
            assert lv["ttft_p50_s"] > 0 and lv["itl_p95_s"] >= lv["itl_p50_s"] > 0
        # the headline single stream, one token per read at several ms a token, is cross-checked
        assert levels[0]["timing"]["timeable"] and levels[0]["crosscheck_ratio"] is not None, levels[0]
        # the host's python3 has numpy (ci/install-system-deps.sh; a provisioned host's toolchain
        # venv has it): without it the copy rate is a pure-Python lower bound, refused as a ceiling
        assert result["membw"]["probe"]["method"] == "numpy", result["membw"]
        assert result["membw"]["source"].startswith("measured ") and len(result["membw"]["probe"]["trials"]) == 10
        assert result["client_on_served_host"] and result["client_cpu"]["cores"] > 0
        assert levels[0]["prompt_tokens"] == pytest.approx(64, rel=0.25)  # sized by the server's own count
        # the ceiling beside the figures: a measured copy rate over the bytes a token streams, a
        # bound where those bytes do not fit the host's last-level cache (this one's 155 MB do not
        # fit a 32 MiB L3); where they do, no DRAM ceiling binds and there is no MBU
        llc = result["facts"]["last_level_cache"]
        if result["cache_resident"]:
            assert result["roofline_basis"].startswith("cache-resident: ") and result["roofline_tok_s"] is None
            assert result["mbu"] is None and result["mbu_note"].startswith("none: cache-resident: ")
        else:
            assert result["roofline_basis"].startswith("measured CPU copy") and 0 < result["mbu"] <= 1, result
            assert result["mbu_note"] is None
            assert not llc["available"] or "last-level cache holds)" in result["roofline_basis"], llc
        assert result["llama_bench"]["tg_tok_s"] > 0 and result["llama_bench"]["pp_tok_s"] > 0
        assert result["gate"]["passed"] and result["gate"]["reasons"] == []
        # the load log of a CPU recipe says "offloaded 0/9 layers to GPU" by design: no diagnosis
        assert not any("PCIe" in d or "layers on the CPU" in d for d in result["gate"]["diagnosis"]), result["gate"]
        assert result["sanity"]["skipped"] == {
            "not_one_token_repeated": "random test weights: a loop on one token means nothing"
        }
        reports = next((bench_dir() / "box" / "bench-cpu").iterdir())
        assert json.loads((reports / "bench.json").read_text())["levels"] == levels
        md = (reports / "bench.md").read_text()
        assert all(re.search(rf"^\|\s*{c}\s*\|", md, re.M) for c in (1, 2, 4)), md
        import matplotlib.image

        assert matplotlib.image.imread(reports / "bench.png").shape == (600, 1000, 4)
        assert len(history.read_text().splitlines()) == 1

        # a threshold above reality: a run fails the gate, exit 1, saying which (one level: the
        # sweep is proven above; its other levels would only cost time)
        # (24 tokens a request from here: the reduced proof below starts 64 processes and times 256
        # requests, and issue 53 gives it 3 minutes; a single stream's decode is 23 intervals)
        failing = _recipe(tmp_path, port, min_tok_s=1e6, levels=[1], max_tokens=24)
        smaller = _recipe(tmp_path, port, shape=SHALLOW, min_tok_s=1e6, levels=[1], max_tokens=24)
        assert run_bench("box", str(failing), settings=settings) == 1
        out = capsys.readouterr().out
        assert "FAILED" in out and "is below the gate's 1e+06" in out, out[-2000:]
        assert len(history.read_text().splitlines()) == 2  # a complete run, failed gate: recorded
        # the second run reads the host's stored bandwidth: the same ceiling, not a new draw
        second = json.loads(max((bench_dir() / "box" / "bench-cpu").glob("*/bench.json")).read_text())
        assert second["membw"]["source"].startswith("stored, measured ")
        assert second["roofline_tok_s"] == result["roofline_tok_s"] and second["membw_gb_s"] == result["membw_gb_s"]
        assert second["facts"]["last_level_cache"] == llc and second["cache_resident"] == result["cache_resident"]

        # the host's own run-to-run noise (issue 53): three more runs of that unchanged recipe make
        # four, the figure's least (3 degrees of freedom); then --compare counts it and says so
        assert run_bench_noise("box", 3, str(failing), as_json=True, settings=settings) == 1  # the gate fails
        noise = json.loads(capsys.readouterr().out)
        own = noise["host_noise"]
        assert len(noise["runs"]) == 3 and (own["runs"], own["df"], own["groups"]) == (4, 3, 1), own
        assert 0 <= own["rsd"] < 1 and own["oldest"] < own["newest"]
        assert run_bench("box", str(failing), show_compare=True, settings=settings) == 1
        out = " ".join(capsys.readouterr().out.split())
        assert "noise between runs: " in out and "(4 runs, 3 degrees of freedom, " in out, out[-2000:]
        assert "box's own history" in out
        # the reduced proof (scripts/bench_proof.py makes the whole): the unchanged server is not
        # called changed against the last configuration (its four runs, pooled) or the best run;
        # the family's rate is at most 5% a compare (simulated: tests/test_bench_noise.py), so a
        # call is met with one more compare, and two in a row (0.25% by that rate) fail
        # (the last configuration's runs pool where they were timed by this run's clock,
        # bench_compare._last_members: "the last 3 runs" where one of four was the server's; a
        # reference with only the other clock's figure is "no verdict: ...", not counted here)
        verdict = r"concurrency 1: per-stream decode ([+-][\d.]+)% against the (last run|last [2-4] runs|best run), "
        verdict += r"(outside|within)"
        assert 1 <= len(re.findall(verdict, out)) <= 2, out[-2000:]
        if any(v == "outside" for _, _, v in re.findall(verdict, out)):
            assert run_bench("box", str(failing), show_compare=True, settings=settings) == 1
            again = " ".join(capsys.readouterr().out.split())
            verdict = verdict.replace("[2-4]", "[2-5]")
            verdicts = [v for _, _, v in re.findall(verdict, again)]
            assert verdicts and set(verdicts) == {"within"}, (out[-1500:], again[-1500:])
        # then a change that sizes a token's bytes and work alike: the model a third as deep
        with connect(spec_for(sshd_host)) as host:
            stage_served_model(host, prefix, smaller, shallow, "Q8_0", tools=False)
        # in one run, interleaved (bench --against, issue 53), each cycle on fresh processes beside
        # the deployed server: the same recipe measures about alike, the shallow one is called
        # changed by far more; the scratch servers are gone after each. "About alike" and not "not
        # called": a run may call an unchanged pair at up to 5% (the design's rate; the proof,
        # scripts/bench_proof.py, counts it over 18 verdicts), too often for a suite to assert
        unchanged = tmp_path / "same" / "bench-cpu-same.yaml"
        unchanged.parent.mkdir()
        unchanged.write_text(failing.read_text())
        (unchanged.parent / "defaults.yaml").write_text((failing.parent / "defaults.yaml").read_text())
        against, before = [], len(history.read_text().splitlines())
        t0 = time.monotonic()
        assert run_bench_against("box", str(unchanged), str(failing), as_json=True, settings=settings) == 0
        against.append(json.loads(capsys.readouterr().out))
        # the second as a user reads it: the table, a verdict per level, the design and the file
        assert run_bench_against("box", str(smaller), str(failing), settings=settings) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert "design: 8 cycles of A B B A, each block on a fresh process (32 in all, " in shown, shown[-2000:]
        assert "a change called only when its interval lies beyond 2%" in shown
        assert re.search(r"concurrency 1: per-stream decode \+[\d.]+% \(95% over 1 level: ", shown), shown[-2000:]
        assert "result: " in shown and "against.json" in shown.replace(" ", "")
        kept_at = max((bench_dir() / "box").glob("*/against-*/against.json"), key=lambda f: f.stat().st_mtime)
        against.append(json.loads(kept_at.read_text()))
        # the reduced proof's share of this test (issue 53 allows it 3 minutes): `pytest -s` shows it
        with capsys.disabled():
            print(f"reduced proof: two --against runs in {time.monotonic() - t0:.1f} s")
        same, deeper = (a["levels"][0]["change"] for a in against)
        assert abs(same["change"]) < 0.4, same
        # a third of the layers: up to three times the speed by its bytes (the embeddings and the
        # output layer stay), far beyond a process's own effect
        assert deeper["distinct"] and deeper["change"] > 0.6 and deeper["low"] > 0.3, deeper
        assert [lv["concurrency"] for lv in against[0]["levels"]] == [1]  # A's gate's levels
        assert against[0]["levels"][0]["requests"] == {"a": 4 * 2 * 8, "b": 4 * 2 * 8}  # 8 cycles, 2 blocks of 4
        assert against[0]["design"]["processes"] == 4 * 8  # every block its own: A, B, B, A per cycle
        assert against[1]["b"]["recipe"] == "bench-cpu" and against[1]["b"]["port"] == port + 100
        assert against[1]["a"]["port"] == port + 101 and against[1]["a"]["live_port"] == port
        with connect(spec_for(sshd_host)) as host:
            # nothing of the scratch servers left, the deployed one answering as before
            assert bench_health(host, port + 100) == bench_health(host, port + 101) == 0
            assert bench_health(host, port) == 200
            assert not host.exists(f"{prefix}/deploy/voltaforge-tune-a") and not host.exists(
                f"{prefix}/serve/voltaforge-tune"
            )
        assert len(history.read_text().splitlines()) == before  # a comparison is no gate run: none kept
        # and across runs (bench --compare): the shallow model deployed, against the deep one's runs
        assert run_deploy("box", str(smaller), settings=settings) == 0, capsys.readouterr().out[-3000:]
        capsys.readouterr()
        assert run_bench("box", str(smaller), show_compare=True, settings=settings) == 1
        out = " ".join(capsys.readouterr().out.split())
        across = r"concurrency 1: per-stream decode ([+-][\d.]+)% against the last (?:run|\d runs), (\w+)"
        changed = re.search(across, out)
        # on a failure, each run's single-stream decode beside the verdict (read only then): a
        # drift among the unchanged runs (cold run 86: 168 to 83 tok/s in 15 s) is a co-tenant
        assert changed and float(changed[1]) > 20 and changed[2] == "outside", (out[-2000:], _single_streams(history))
        assert ", recipe changed since" in out
        kept = len(history.read_text().splitlines())
        assert kept in (7, 8)  # 6 runs before, the retry if there was one, the shallow run
    finally:
        assert run_stop("box", str(passing), settings=settings) == 0
    capsys.readouterr()
    # the server is down: one line in the report, a failed gate, no history entry
    assert run_bench("box", str(passing), as_json=True, settings=settings) == 1
    down = json.loads(capsys.readouterr().out)
    assert not down["complete"] and "does not answer: nothing listens there (is it stopped?)" in down["error"]
    assert down["gate"]["reasons"][0] == down["error"] and "\n" not in down["error"]
    assert len(history.read_text().splitlines()) == kept
