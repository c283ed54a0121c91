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


def test_two_results_differ_only_beyond_their_noise():
    a = {"mean": 163.0, "halfwidth": 3.0}
    assert bench_stats.distinct(a, {"mean": 165.0, "halfwidth": 3.0}) is False
    assert bench_stats.distinct(a, {"mean": 175.0, "halfwidth": 3.0}) is True
    assert bench_stats.distinct(a, {"mean": 175.0, "halfwidth": None}) is None
    assert bench_stats.distinct(None, a) is None
