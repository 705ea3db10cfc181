"""The gradient noise scale and Pollux's efficiency (hetpipe.plan.efficiency) against references: the
expectations of batch-gradient norms in closed form, and a population of per-sample gradients whose true
gradient and covariance are known."""

import math

import numpy as np
import pytest

from hetpipe.plan.efficiency import NoiseScale, efficiency, goodput, gradient_estimates, noise_scale_of


def test_the_estimates_are_exact_on_the_expected_norms():
    # E|g_B|^2 = |G|^2 + tr(Sigma) / B for the mean of B independent per-sample gradients.
    g2, trace = 3.0, 120.0
    for b_small, b_big in ((1, 8), (4, 32), (16, 17)):
        got = gradient_estimates(g2 + trace / b_small, g2 + trace / b_big, b_small, b_big)
        assert got == pytest.approx((g2, trace), rel=1e-12)


def test_the_noise_scale_of_sampled_gradients_is_trace_over_squared_gradient():
    """Per-sample gradients G + e, e ~ N(0, diag(s^2)): B_noise = sum(s^2) / |G|^2 = 40 samples here.
    4000 measurements of means over 2 and 16 samples; the estimator's spread at that count is ~1.5%."""
    rng = np.random.default_rng(7)
    dim = 50
    true = rng.normal(size=dim)
    s = np.sqrt(40.0 * (true @ true) / dim) * np.ones(dim)
    expected = float((s ** 2).sum() / (true @ true))
    assert expected == pytest.approx(40.0)

    def mean_of(b):
        return true + rng.normal(size=(b, dim)).mean(axis=0) * s

    acc = NoiseScale()
    for _ in range(4000):
        acc.add([mean_of(2)], mean_of(16), 2, 16)
    assert acc.count == 4000
    assert acc.value == pytest.approx(expected, rel=0.06)
    # The same from several small gradients per measurement (workers' own before the all-reduce).
    pairs = []
    for _ in range(1000):
        smalls = [mean_of(2) for _ in range(8)]
        pairs.append((smalls, np.mean(smalls, axis=0)))
    assert noise_scale_of(pairs, 2, 16) == pytest.approx(expected, rel=0.06)


def test_a_gradient_of_pure_noise_has_an_infinite_noise_scale():
    acc = NoiseScale()
    acc.add_norms(10.0, 1.0, 1, 10)        # |G|^2 estimate: (10 - 10) / 9 = 0
    assert acc.value == math.inf and efficiency(1000, acc.value, 1) == 1.0


def test_efficiency_is_pollux_s_ratio():
    assert efficiency(4, 40.0, 4) == 1.0
    assert efficiency(24, 40.0, 4) == pytest.approx(44 / 64)
    assert efficiency(400, 40.0, 4) == pytest.approx(44 / 440)
    assert efficiency(24, 0.0, 4) == pytest.approx(4 / 24)     # no noise: a sample buys only 1/batch of a step
    assert goodput(100.0, 24, 40.0, 4) == pytest.approx(100.0 * 44 / 64)


@pytest.mark.parametrize("call, says", [
    (lambda: gradient_estimates(1.0, 1.0, 8, 8), "0 < b_small < b_big"),
    (lambda: efficiency(0, 1.0, 4), "batch sizes must be positive"),
    (lambda: efficiency(4, -1.0, 4), "a noise scale is >= 0"),
    (lambda: NoiseScale().value, "no noise-scale measurement yet"),
    (lambda: NoiseScale().add([np.ones(3)], np.ones(4), 1, 2), "differ in size"),
])
def test_bad_input_is_refused_in_one_line(call, says):
    with pytest.raises(ValueError, match=says):
        call()
