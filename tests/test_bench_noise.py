"""A host's run-to-run noise as its own fact (issue 53): pooled from its bench history by
bench_noise, counted by `bench --compare` and tune in place of the 2-core VM's 9%, and, on a
host without enough unchanged runs, no verdict and the command that gets one."""

from __future__ import annotations

import json
import random

import pytest

from playbooks.steps.measure import bench_compare, bench_noise
from tests import noise_sim
from tests.helpers import ROOT, rich_text

NOISE = json.loads((ROOT / "reports" / "bench" / "noise.json").read_text())


def _line(at: str, decode: dict, recipe: str = "r", sha: str = "s1", build: str = "b1", c: int = 1) -> dict:
    """A history line (bench_history.history_summary's shape) with one level's decode."""
    level = {"concurrency": c, "aggregate_tok_s": decode["mean"], "decode": decode}
    return {"at": at, "host": "box", "recipe": recipe, "recipe_sha256": sha, "build": build, "levels": [level]}


def test_a_known_run_effect_is_recovered_from_unchanged_runs():
    """Runs of a simulated machine whose run effect is 5% (rounds 10% apart, the bench's own
    stopping rule): forty runs in ten unchanged configurations give the 5% back within a
    percentage point, with 30 degrees of freedom."""
    rng = random.Random(7)
    machine = noise_sim.Machine(run_sd=0.05, round_sd=0.10)
    history = []
    for g in range(10):
        rate = 50.0 + 20 * g  # each configuration its own rate: the figure is relative
        for i in range(4):
            history.append(_line(f"2026-12-0{1 + i}T00:00:0{g}Z", noise_sim.run(rng, machine, rate, i), sha=f"s{g}"))
    found = bench_noise.host_noise(history)
    assert found is not None and found.df == 30 and found.runs == 40 and found.groups == 10
    assert found.rsd == pytest.approx(0.05, abs=0.01)
    assert (found.oldest, found.newest) == ("2026-12-01T00:00:00Z", "2026-12-04T00:00:09Z")


def test_the_measured_idle_set_gives_its_recorded_figure():
    """The eight idle runs of reports/bench/noise.json (real runs of one unchanged server on this
    machine, measured before this code existed) as one host's history: the pooled figure is
    the root mean square of the set's own per-level run noise (8.1% at one stream, 10.5% at two,
    computed there by scripts/bench_noise.py), with 7 degrees of freedom."""
    history = []
    for run in NOISE["extra"]["sets"]["idle"]:
        levels = [{"concurrency": int(c), "decode": lv["decode"]} for c, lv in run["levels"].items()]
        history.append(
            {"at": run["at"], "host": "vm", "recipe": "r", "recipe_sha256": "s", "build": "b", "levels": levels}
        )
    found = bench_noise.host_noise(history)
    f = NOISE["figures"]
    want = ((f["idle_c1_run_noise_pct"] ** 2 + f["idle_c2_run_noise_pct"] ** 2) / 2) ** 0.5 / 100
    assert found is not None and found.df == 7 and found.runs == 8
    assert found.rsd == pytest.approx(want, rel=0.03)
    # and each level its own, as scripts/bench_noise.py computed it there
    for c in ("1", "2"):
        rsd, df = found.levels[c]
        assert rsd == pytest.approx(f[f"idle_c{c}_run_noise_pct"] / 100, rel=0.03) and df == 7


def test_changed_runs_are_not_noise_and_runs_without_intervals_do_not_count():
    """A recipe edit or a new build starts another group: its faster runs are a change, not the
    host's noise. Lines from before the repeats (no decode interval) are left out."""
    same = {"stdev": 2.0, "n": 8}
    history = [_line("a", {"mean": m, **same}) for m in (100.0, 101.0, 99.0)]
    history += [_line("b", {"mean": m, **same}, sha="s2") for m in (150.0, 151.0)]  # the recipe edited
    history += [_line("c", {"mean": 120.0})]  # no interval: an old line
    found = bench_noise.host_noise(history)
    assert found is not None and found.groups == 2 and found.df == 3 and found.runs == 5
    assert found.rsd < 0.01  # the runs moved by about their own errors: no run effect beyond them
    assert bench_noise.host_noise([_line("a", {"mean": 100.0, **same})]) is None  # one run: nothing to pool


def _result(noise: dict | None, run_noise: float | None = None, mean: float = 130.0) -> dict:
    decode = {"mean": mean, "stdev": 4.0, "n": 8, "source": "client"}
    return {
        "at": "now", "host": "box", "recipe": "r", "recipe_sha256": "s1", "workload": {"run_noise": run_noise},
        "host_noise": noise, "levels": [{"concurrency": 1, "aggregate_tok_s": mean, "decode": decode}],
    }  # fmt: skip


def test_compare_counts_the_hosts_own_noise_and_without_one_gives_no_verdict():
    """The same +30% change against the last run: called on a host whose history says its runs
    move by 2%, not called with the 2-core VM's 9% (what the recipe can still set), and with no
    figure at all: no verdict, and the line names the command that measures one."""
    then = [_line("t", {"mean": 100.0, "stdev": 4.0, "n": 8, "source": "client"})]
    quiet = bench_noise.HostNoise(0.02, 9, 12, 3, "2026-12-01T00:00:00Z", "2026-12-05T00:00:00Z").as_dict()
    [row] = bench_compare.compare(_result(quiet), then)
    assert row["last"]["decode_outside_noise"] is True and row["last"]["run_noise"] == 0.02
    assert bench_compare.noise_line(_result(quiet)) == (
        "noise between runs: 2.0% between runs (12 runs, 9 degrees of freedom, 2026-12-01 to 2026-12-05), "
        "box's own history"
    )
    [row] = bench_compare.compare(_result(quiet, run_noise=0.09), then)  # the recipe's own figure wins
    assert row["last"]["decode_outside_noise"] is False and row["last"]["detectable_pct"] > 30
    few = bench_noise.HostNoise(0.02, 2, 3, 1, "a", "b").as_dict()
    for noise in (None, few):
        [row] = bench_compare.compare(_result(noise), then)
        assert (
            row["last"]["decode_outside_noise"] is None and row["last"]["change_pct"]["per_stream_decode_tok_s"] == 30
        )
        line = bench_compare.noise_line(_result(noise))
        assert "box has no run-to-run noise figure of its own" in line, line
        assert "run `invoke bench --host box --noise 6` against the unchanged server" in line
        assert line.endswith("the changes are shown without a verdict")
        # said once, by the noise line, not beside every level's change
        assert row["last"]["no_verdict"] == "no figure for the noise between runs"
        out = " ".join(rich_text(bench_compare.render_compare, [row], width=200).split())
        assert "+30.0% against the last run" not in out and "no verdict" not in out
    assert "(3 unchanged runs (2 degrees of freedom)" in bench_compare.noise_line(_result(few))


def test_compare_pools_the_last_configurations_recent_runs_as_its_reference():
    """The "last" reference is the last configuration (the latest run's recipe and build): its POOL_RUNS most
    recent runs with an interval, whatever ran between them, their mean the reference and the
    run term divided over them; another build or a run without an interval stays out. Against
    the pooled reference the same +30% is told with a narrower detectable change than against
    the last run alone (``pool_runs=1``)."""
    d = {"stdev": 4.0, "n": 8, "source": "client"}
    history = [_line(f"2026-12-01T00:0{i}:00Z", {"mean": m, **d}) for i, m in enumerate((98.0, 102.0, 100.0))]
    history.append(_line("2026-12-01T00:04:00Z", {"mean": 140.0, **d}, sha="s2"))  # another recipe between
    history.append(_line("2026-12-01T00:05:00Z", {"mean": 96.0, **d}, build="b0"))  # another build
    history.append(_line("2026-12-01T00:06:00Z", {"mean": 90.0}))  # no interval: an old line
    history.append(_line("2026-12-01T00:07:00Z", {"mean": 104.0, **d}))
    noise = bench_noise.HostNoise(0.04, 5, 6, 1, "2026-12-01T00:00:00Z", "2026-12-01T00:07:00Z").as_dict()
    now = _result(noise, mean=130.0) | {"recipe_sha256": "s9"}
    [row] = bench_compare.compare(now, history)
    last = row["last"]
    assert (last["runs"], last["first_at"], last["at"]) == (4, "2026-12-01T00:00:00Z", "2026-12-01T00:07:00Z")
    assert last["values"]["per_stream_decode_tok_s"] == pytest.approx(101.0)  # 98, 102, 100, 104
    assert last["change_pct"]["per_stream_decode_tok_s"] == pytest.approx(29 / 101 * 100)
    assert last["recipe_changed"] and last["decode_outside_noise"] is True
    [alone] = bench_compare.compare(now, history, pool_runs=1)
    assert alone["last"]["runs"] == 1 and alone["last"]["values"]["per_stream_decode_tok_s"] == 104.0
    assert last["detectable_pct"] < alone["last"]["detectable_pct"]
    [two] = bench_compare.compare(now, history, pool_runs=2)
    assert two["last"]["runs"] == 2 and two["last"]["first_at"] == "2026-12-01T00:02:00Z"
    out = " ".join(rich_text(bench_compare.render_compare, [row], width=200).split())
    assert "concurrency 1: per-stream decode +28.7% against the last 4 runs, outside the noise: a real change" in out
    assert "last: 4 runs of one configuration, 2026-12-01T00:00:00Z to 2026-12-01T00:07:00Z, build b1" in out
    # the latest run without an interval (one round): the configuration's runs that have one
    history.append(_line("2026-12-01T00:08:00Z", {"mean": 100.0, "source": "client"}))
    [row] = bench_compare.compare(now, history)
    assert (row["last"]["runs"], row["last"]["at"]) == (4, "2026-12-01T00:07:00Z")
    assert row["last"]["decode_outside_noise"] is True and row["last"]["no_verdict"] is None
    # none of the configuration's runs has one: the latest alone, no verdict, and why
    bare = [_line(f"2026-12-01T00:1{i}:00Z", {"mean": 100.0, "source": "client"}) for i in range(3)]
    [row] = bench_compare.compare(now, bare)
    assert row["last"]["runs"] == 1 and row["last"]["decode_outside_noise"] is None
    out = " ".join(rich_text(bench_compare.render_compare, [row], width=200).split())
    assert "+30.0% against the last run, no verdict: a run has no interval (one round, or stored before" in out


def test_a_compare_pools_the_runs_timed_by_this_runs_clock_and_says_why_it_cannot_judge():
    """Cold run 87: a run whose tokens came whole in one read is timed by the server's own
    figure, and two clocks are not one measurement. The last configuration's runs timed as this
    run was pool, though the latest was timed by the other clock; where the reference has only
    the other clock's figure (here the best run), the change is shown with no verdict and a line
    says why, rather than nothing."""
    client = {"stdev": 4.0, "n": 8, "source": "client"}
    history = [_line(f"2026-12-01T00:0{i}:00Z", {"mean": m, **client}) for i, m in enumerate((98.0, 102.0, 100.0))]
    history.append(_line("2026-12-01T00:03:00Z", {"mean": 150.0, **client, "source": "server"}))
    history[-1]["levels"][0]["aggregate_tok_s"] = 200.0  # the best run, by its aggregate
    noise = bench_noise.HostNoise(0.04, 5, 6, 1, "2026-12-01T00:00:00Z", "2026-12-01T00:03:00Z").as_dict()
    [row] = bench_compare.compare(_result(noise, mean=130.0), history)
    last, best = row["last"], row["best"]
    assert (last["runs"], last["at"], last["values"]["per_stream_decode_tok_s"]) == (3, "2026-12-01T00:02:00Z", 100.0)
    assert last["decode_outside_noise"] is True and last["no_verdict"] is None
    assert best["at"] == "2026-12-01T00:03:00Z" and best["decode_outside_noise"] is None
    assert best["no_verdict"] == (
        "this run's decode is timed by the client, the reference's the server's own figure: not one measurement"
    )
    out = " ".join(rich_text(bench_compare.render_compare, [row], width=200).split())
    assert "concurrency 1: per-stream decode +30.0% against the last 3 runs, outside the noise: a real change" in out
    assert "per-stream decode -13.3% against the best run, no verdict: this run's decode is timed by the client," in out
    # a run timed by the server pools with the server's runs: here the one
    server = _result(noise, mean=130.0)
    server["levels"][0]["decode"]["source"] = "server"
    [row] = bench_compare.compare(server, history)
    assert row["last"]["runs"] == 1 and row["last"]["at"] == "2026-12-01T00:03:00Z"
    assert row["last"]["decode_outside_noise"] is False and row["last"]["no_verdict"] is None


def test_the_compare_as_the_proof_makes_it_resolves_a_30pct_change_by_simulation():
    """The procedure of scripts/bench_proof.py (`bench --noise 6`, an unchanged compare, then a
    change) run through the product's own host_noise and compare on a simulated machine whose
    runs move by 3.6% (the proof's measured figure, reports/bench/proof.json) and whose rounds
    scatter by 10%: an unchanged run is called changed against the last or the best at most 5%
    of the time (the family's rate), and a 30% change is called against the last configuration
    at least 90% of the time, more often than against the last run alone."""
    machine = noise_sim.Machine(run_sd=0.036, round_sd=0.10)
    pooled = noise_sim.compare_verdicts(machine, 400, noise_runs=bench_noise.NOISE_RUNS)
    alone = noise_sim.compare_verdicts(machine, 400, noise_runs=bench_noise.NOISE_RUNS, pool_runs=1)
    assert pooled["false"] <= 0.05 and alone["false"] <= 0.05, (pooled, alone)
    assert pooled["power"] >= 0.90 and pooled["power"] > alone["power"], (pooled, alone)
    # four runs leave the noise figure on 3 degrees of freedom: the same change is missed more
    assert noise_sim.compare_verdicts(machine, 400, noise_runs=4)["power"] < pooled["power"]


def test_each_level_is_judged_by_its_own_noise():
    """Measured on this machine (the bench proof's history of 2026-12-05): one stream moved
    within 3% run to run while two streams jumped between 61 and 95 tok/s. Each level's verdict
    counts its own level's figure: +15% at one stream is a change, +15% at two is not; with
    the two levels' mean figure both would be "within the noise"."""
    runs = [(129.9, 64.2), (128.5, 65.8), (131.2, 60.7), (125.7, 95.0), (127.9, 91.6), (122.5, 60.6)]
    d = {"stdev": 3.0, "n": 8, "source": "client"}
    history = []
    for i, (one, two) in enumerate(runs):
        line = _line(f"2026-12-05T16:4{i}:00Z", {"mean": one, **d})
        line["levels"].append({"concurrency": 2, "aggregate_tok_s": 2 * two, "decode": {"mean": two, **d}})
        history.append(line)
    found = bench_noise.host_noise(history)
    assert found is not None and set(found.levels) == {"1", "2"} and found.levels["1"][1] == 5
    one, two = found.levels["1"][0], found.levels["2"][0]
    assert one < 0.03 < 0.15 < two and one < found.rsd < two
    assert "; by concurrency: 1: " in bench_noise.noise_text(found)
    now = _result(found.as_dict(), mean=127.8 * 1.15)
    now["levels"].append({"concurrency": 2, "aggregate_tok_s": 1.0, "decode": {"mean": 73.0 * 1.15, **d}})
    rows = {r["concurrency"]: r for r in bench_compare.compare(now, history)}
    assert rows[1]["last"]["decode_outside_noise"] is True and rows[2]["last"]["decode_outside_noise"] is False
    assert rows[1]["last"]["run_noise"] == pytest.approx(one, abs=1e-4)
    assert rows[2]["last"]["run_noise"] == pytest.approx(two, abs=1e-4)
    # without the levels' own figures (a history line from before them) the mean figure judges both
    mean_only = {k: v for k, v in found.as_dict().items() if k != "levels"}
    rows = {r["concurrency"]: r for r in bench_compare.compare(_result(mean_only, mean=127.8 * 1.15), history)}
    assert rows[1]["last"]["run_noise"] == pytest.approx(found.rsd, abs=1e-4)


def test_a_compare_at_a_noise_no_change_overcomes_says_so():
    """Where the host's runs move by 25% (five degrees of freedom), "within the noise" says that
    no change would show 80% of the time, rather than a size (bench_stats.detectable_change)."""
    d = {"stdev": 4.0, "n": 8, "source": "client"}
    history = [_line(f"2026-12-01T00:0{i}:00Z", {"mean": 100.0, **d}) for i in range(6)]
    noisy = bench_noise.HostNoise(0.25, 5, 6, 1, "2026-12-01T00:00:00Z", "2026-12-01T00:05:00Z").as_dict()
    [row] = bench_compare.compare(_result(noisy, mean=110.0), history)
    assert row["last"]["decode_outside_noise"] is False and row["last"]["detectable_pct"] is None
    out = " ".join(rich_text(bench_compare.render_compare, [row], width=200).split())
    assert "against the last 6 runs, within the noise: no change shown (at this noise no change would show 80%" in out
