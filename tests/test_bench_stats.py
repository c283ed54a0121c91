"""The bench's statistics: Student's t against scipy-free references, the stopping rule, and
when two results differ beyond their noise."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from playbooks.steps.measure import bench_stats


@pytest.mark.parametrize(
    ("df", "exact"),
    # t_{0.975} from the standard tables (R: qt(0.975, df))
    [(1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (30, 2.0423), (31, 2.0395), (40, 2.0211),
     (60, 2.0003), (120, 1.9799), (1000, 1.9623)],
)  # fmt: skip
def test_t_quantiles(df, exact):
    assert bench_stats.t975(df) == pytest.approx(exact, abs=2e-4)


def test_t_refuses_no_degrees_of_freedom():
    with pytest.raises(ValueError):
        bench_stats.t975(0)


def test_the_interval_covers_the_true_mean_95_percent_of_the_time():
    """Coverage, by simulation: what a 95% interval claims (normal rates, n = 6, 2,000 runs)."""
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        est = bench_stats.estimate([rng.gauss(100.0, 5.0) for _ in range(6)])
        assert est is not None
        hits += abs(est.mean - 100.0) <= est.halfwidth
    assert 0.93 <= hits / 2000 <= 0.97


def test_estimate_and_the_stopping_rule():
    assert bench_stats.estimate([]) is None
    one = bench_stats.estimate([50.0])
    assert one is not None and one.n == 1 and math.isinf(one.halfwidth) and one.as_dict()["halfwidth"] is None
    values = [100.0, 101.0, 99.0, 100.5, 99.5]
    est = bench_stats.estimate(values)
    assert est is not None and est.stdev == pytest.approx(statistics.stdev(values))
    assert est.rel_halfwidth == pytest.approx(2.776 * statistics.stdev(values) / math.sqrt(5) / 100, rel=1e-3)
    # tight enough (0.98%) once there are enough values; not before the fewest; always at the cap
    assert bench_stats.settled(est, 4, 16, 0.02) and not bench_stats.settled(est, 6, 16, 0.02)
    noisy = bench_stats.estimate([80.0, 120.0, 95.0, 105.0])
    assert not bench_stats.settled(noisy, 4, 16, 0.02) and bench_stats.settled(noisy, 4, 4, 0.02)


def test_the_exact_t_distribution_gives_the_table():
    """The series of t_two_sided and the bisection of t_quantile reproduce the table the bench
    has used (so the table and the exact distribution cannot drift apart)."""
    for df in range(1, 31):
        assert bench_stats.t_quantile(0.95, df) == pytest.approx(bench_stats.t975(df), abs=1e-4)
    # other coverages, from the standard tables (R: qt(0.995, 4), qt(0.9, 10), qt(0.999, 8))
    assert bench_stats.t_quantile(0.99, 4) == pytest.approx(4.6041, abs=1e-4)
    assert bench_stats.t_quantile(0.80, 10) == pytest.approx(1.3722, abs=1e-4)
    assert bench_stats.t_quantile(0.998, 8) == pytest.approx(4.5008, abs=1e-3)
    # a fractional df rounds down: wider, never narrower
    assert bench_stats.t_quantile(0.95, 4.9) == bench_stats.t_quantile(0.95, 4)


def _est(mean, sd, n):
    return {"mean": mean, "stdev": sd, "n": n}


def test_two_results_differ_only_beyond_their_noise():
    a = _est(163.0, 4.0, 8)
    assert bench_stats.distinct(a, _est(165.0, 4.0, 8)) is False
    assert bench_stats.distinct(a, _est(2 * 163.0, 4.0, 8)) is True
    assert bench_stats.distinct(a, {"mean": 175.0, "halfwidth": None}) is None
    assert bench_stats.distinct(None, a) is None


def test_the_test_is_welchs_t_with_the_between_run_term_as_documented():
    """The difference's variance: each side's stdev^2/n plus (RUN_NOISE x mean)^2; df by
    Welch-Satterthwaite with the run term counted as the spread it was estimated from (the run
    effect plus a run's own error: the whole variance) at RUN_NOISE_DF; t at 1 - alpha/2m."""
    a, b = _est(100.0, 3.0, 6), _est(104.0, 5.0, 9)
    d = bench_stats.difference(a, b)
    r = bench_stats.RUN_NOISE
    sa, sb, run = 9 / 6, 25 / 9, r**2 * (100.0**2 + 104.0**2)
    var = sa + sb + run
    df = var**2 / (sa**2 / 5 + sb**2 / 8 + var**2 / bench_stats.RUN_NOISE_DF)
    assert d is not None and d.diff == 4.0 and d.se == pytest.approx(math.sqrt(var))
    assert d.df == pytest.approx(df) and d.halfwidth == pytest.approx(bench_stats.t_quantile(0.95, df) * math.sqrt(var))
    # three comparisons at once: each at 5%/3
    d3 = bench_stats.difference(a, b, comparisons=3)
    assert d3 is not None and d3.halfwidth == pytest.approx(bench_stats.t_quantile(1 - 0.05 / 3, df) * math.sqrt(var))
    # within one time window (blocks interleaved): no run term, plain Welch
    d0 = bench_stats.difference(a, b, run_noise=0.0)
    assert d0 is not None and d0.se == pytest.approx(math.sqrt(sa + sb))
    assert d0.df == pytest.approx((sa + sb) ** 2 / (sa**2 / 5 + sb**2 / 8))


def test_the_band_where_overlap_and_the_old_rule_disagree():
    """100 ± 2 and 103.5 ± 2 (n = 16 each): the intervals overlap (the README's old words: a tie)
    while the old rule |d| > hypot(2, 2) = 2.83 called them different. Within one window the
    test calls them different, as Welch's t does; across runs the between-run noise makes
    them a tie. 100 vs 104.5 (no overlap) is still a tie across runs: overlap was never the rule."""
    sd = 2.0 / bench_stats.t975(15) * 4  # a half-width of 2 from 16 rounds
    a, b = _est(100.0, sd, 16), _est(103.5, sd, 16)
    assert abs(103.5 - 100.0) < 2 + 2  # the intervals overlap
    assert bench_stats.distinct(a, b, run_noise=0.0) is True
    assert bench_stats.distinct(a, b) is False
    assert bench_stats.distinct(a, _est(104.5, sd, 16)) is False


def test_an_old_record_without_its_stdev_is_read_through_its_half_width():
    old = {"mean": 100.0, "halfwidth": 2.0, "n": 16}
    new = _est(100.0, 2.0 / bench_stats.t975(15) * 4, 16)
    assert bench_stats.difference(old, old) == bench_stats.difference(new, new)


def test_the_detectable_change_is_the_power_the_test_leaves():
    """detectable_change: the change flagged 80% of the time. Checked by simulation: a change of
    that size, drawn with the same noise, is flagged 75-85% of 2,000 times."""
    rng = random.Random(11)
    sd, n, r = 3.0, 8, bench_stats.RUN_NOISE
    base = _est(100.0, sd, n)
    delta = bench_stats.detectable_change(base)
    assert delta is not None and 0.05 < delta < 1.0
    flagged = 0
    for _ in range(2000):

        def run(true):
            level = true * (1 + rng.gauss(0, r))
            return bench_stats.estimate([rng.gauss(level, sd) for _ in range(n)]).as_dict(6)

        flagged += bool(bench_stats.distinct(run(100.0), run(100.0 * (1 + delta))))
    assert 0.75 <= flagged / 2000 <= 0.85


def test_the_cap_is_said_next_to_the_interval():
    assert bench_stats.halfwidth_text({"mean": 137.7, "halfwidth": 6.5, "rel_halfwidth": 0.0472, "capped": True}) == (
        " ± 6.5 (4.7%, cap reached)"
    )
    assert bench_stats.halfwidth_text({"mean": 137.7, "halfwidth": 2.1, "rel_halfwidth": 0.015}) == " ± 2.1"
    assert bench_stats.halfwidth_text({"mean": 1.0, "halfwidth": None}) == ""


def test_a_pooled_reference_is_the_mean_of_its_runs_with_the_run_term_divided_over_them():
    """pooled: k runs' estimates as one (mean of means, squared standard error the sum of theirs
    over k^2); difference divides the between-run term of a pooled side by k, so its standard
    error is below a single run's; detectable_change measures the other side as one typical
    run. Checked by simulation: a reference of four runs and a new run raised by the stated
    detectable change are told apart 75-90% of 2,000 times (above 80%: the simulated noise is
    known exactly, while the power is stated with the t quantile of a noise estimated on
    RUN_NOISE_DF degrees of freedom, an overstatement of the change needed, never an
    understatement)."""
    runs = [_est(m, 3.0, 8) for m in (98.0, 101.0, 100.0, 101.0)]
    p = bench_stats.pooled([*runs, None, {"mean": 99.0}])  # no interval: left out
    assert p is not None and p["runs"] == 4 and p["mean"] == pytest.approx(100.0)
    assert p["se2"] == pytest.approx(4 * (9 / 8) / 16) and p["df"] == 28
    assert (p["run_se2"], p["run_df"]) == (pytest.approx(9 / 8), 7)
    new = _est(110.0, 3.0, 8)
    one, four = bench_stats.difference(runs[-1], new), bench_stats.difference(p, new)
    assert one is not None and four is not None and four.se < one.se
    r = bench_stats.RUN_NOISE
    assert four.se**2 == pytest.approx(p["se2"] + 9 / 8 + r**2 * (100.0**2 / 4 + 110.0**2))
    delta = bench_stats.detectable_change(p)
    single = bench_stats.detectable_change(_est(100.0, 3.0, 8))
    assert delta is not None and single is not None and delta < single
    assert bench_stats.pooled([None, {"mean": 1.0}]) is None

    rng = random.Random(13)

    def run(true: float) -> dict:
        level = true * (1 + rng.gauss(0, r))
        return bench_stats.estimate([rng.gauss(level, 3.0) for _ in range(8)]).as_dict(6)

    flagged = 0
    for _ in range(2000):
        ref = bench_stats.pooled([run(100.0) for _ in range(4)])
        flagged += bool(bench_stats.distinct(ref, run(100.0 * (1 + delta))))
    assert 0.75 <= flagged / 2000 <= 0.90, flagged / 2000


def test_no_change_is_detectable_where_the_noise_grows_as_fast_as_the_rise():
    """The run term grows with the raised mean: at 25% run noise on 5 degrees of freedom (this
    VM's one-stream figure on a bad afternoon) no rise is flagged 80% of the time, and the
    answer is infinity, not the 20th step of a fixed point that never settles (the sample once
    said "a change of 1408% or more")."""
    a = _est(100.0, 3.0, 8)
    assert bench_stats.detectable_change(a, 0.25, comparisons=2, noise_df=5) == math.inf
    found = bench_stats.detectable_change(a, 0.05, comparisons=2, noise_df=5)
    assert found is not None and 0.1 < found < 0.5
