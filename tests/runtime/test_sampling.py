"""The numpy samplers: greedy is argmax, temperature follows softmax, top_p keeps the nucleus, a seed repeats."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.sampling import Sampler, greedy, make_sampler

LOGITS = np.log(np.array([[0.6, 0.25, 0.1, 0.05], [0.05, 0.1, 0.25, 0.6]]))  # (B=2, V=4), softmax = these


def test_temperature_zero_is_greedy():
    assert make_sampler(0.0) is greedy
    assert greedy(LOGITS).tolist() == [0, 3]


def test_sampling_at_temperature_one_follows_the_softmax():
    draws = Sampler(1.0, seed=0)(np.repeat(LOGITS[:1], 20000, 0))  # (20000,): row 0, drawn 20000 times
    freq = np.bincount(draws, minlength=4) / draws.size
    assert np.allclose(freq, [0.6, 0.25, 0.1, 0.05], atol=0.015)


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    rows = np.repeat(LOGITS, 5000, 0)  # (10000, 4)
    draws = Sampler(1.0, top_p=0.8, seed=1)(rows).reshape(2, 5000)  # 0.6 + 0.25 reaches 0.8: two tokens kept
    assert set(draws[0].tolist()) == {0, 1} and set(draws[1].tolist()) == {3, 2}
    assert abs((draws[0] == 0).mean() - 0.6 / 0.85) < 0.03  # renormalised over the nucleus
    assert set(Sampler(1.0, top_p=0.5, seed=2)(rows).tolist()) == {0, 3}  # the top token alone


def test_a_seed_repeats_its_draws_and_a_low_temperature_sharpens():
    rows = np.repeat(LOGITS, 100, 0)
    assert (Sampler(1.3, seed=5)(rows) == Sampler(1.3, seed=5)(rows)).all()
    assert not (Sampler(1.3, seed=5)(rows) == Sampler(1.3, seed=6)(rows)).all()
    assert (Sampler(0.05, seed=0)(rows) == greedy(rows)).mean() > 0.99


@pytest.mark.parametrize("temperature,top_p", [(-0.5, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_out_of_range_settings_are_refused(temperature, top_p):
    with pytest.raises(ValueError):
        Sampler(temperature, top_p)
