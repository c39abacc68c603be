"""runtime.engine.latency.percentile: the one definition of the decode gate's p95 and the server's p50/p99."""

from runtime.engine.latency import percentile


def test_percentile_is_the_sorted_sample_at_floor_n_q_over_100():
    values = [float(v) for v in range(20, 0, -1)]  # 20 .. 1, unsorted
    assert percentile(values, 50) == 11.0  # index 10 of 1 .. 20
    assert percentile(values, 95) == 20.0  # index 19: floor(20 * 0.95)
    assert percentile(values, 94) == 19.0  # index 18: floor(18.8)
    assert percentile(values, 100) == 20.0  # clamped to the last sample
    assert percentile([3.0], 99) == 3.0


def test_percentile_of_no_values_is_none():
    assert percentile([], 99) is None
