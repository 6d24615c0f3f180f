"""The jitter tax as the job grows (``analysis/jittertax.py``), checked against the simulator at known scales."""

from __future__ import annotations

import numpy as np
import pytest

from stragglerwatch.analysis.detect import detect
from stragglerwatch.analysis.jittertax import expected_max, expected_maxes, project
from stragglerwatch.record.simulate import SimConfig, to_frame

NOISE = dict(step_ms=250.0, comm_ms=10.0, noise=0.01, drift=0.002, spike_prob=0.0, offset=0.002, host_noise=0.004,
             ranks_per_host=8)  # fmt: skip


def test_expected_max_of_draws_from_sorted_values() -> None:
    values = np.sort(np.arange(10.0))
    assert expected_max(values, 1) == pytest.approx(4.5)  # one draw: the mean
    assert expected_max(values, 2) == pytest.approx(sum(x * ((x + 1) ** 2 - x**2) for x in range(10)) / 100)
    assert expected_max(values, 10_000) == pytest.approx(9.0, abs=1e-6)  # many: the largest


@pytest.mark.parametrize("n", [7, 5000, 300_000])
def test_expected_maxes_of_a_resample_look_only_at_the_top_and_lose_nothing(n: int) -> None:
    """A resample's counts (zeros among them) on a heavy-tailed pool: the expected maxima from the top of the
    pool equal the textbook sum over every value, for a few draws (most of the pool counts) and many."""
    rng = np.random.default_rng(n)
    values = np.sort(np.abs(rng.standard_t(3, n)))
    counts = rng.poisson(1.0, n)
    share = np.cumsum(counts) / counts.sum()
    for draws in (1.0, 3.0, 40.0, 5000.0):
        every = float(np.dot(share**draws - np.concatenate(([0.0], share[:-1])) ** draws, values))
        assert expected_maxes(values, counts, [draws])[0] == pytest.approx(every, rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_projection_from_16_ranks_matches_a_simulated_job_of_128(seed: int) -> None:
    """The same noise (per-rank jitter, a host's shared jitter, tiny offsets): the tax projected from 16 ranks
    at 8x is what a 128-rank job of that noise loses to jitter (within 15%), and it grows with the ranks."""
    small = detect(to_frame(SimConfig(ranks=16, steps=600, seed=seed, **NOISE)))
    tax = project(small.slowdown, np.array([str(r // 8) for r in range(16)]), 1.0)
    at = {p.ranks: p for p in tax.projections}
    assert sorted(at) == [16, 32, 128, 1024] and tax.hosts == 2 and tax.note is None
    assert at[16].share == pytest.approx(small.lost_seconds / small.job_seconds, rel=0.15)
    big = detect(to_frame(SimConfig(ranks=128, steps=600, seed=seed + 100, **NOISE)))
    assert at[128].share == pytest.approx(big.lost_seconds / big.job_seconds, rel=0.15)
    assert at[16].share < at[32].share < at[128].share < at[1024].share
    assert all(p.low <= p.share <= p.high for p in tax.projections)


def test_too_little_data_is_said_not_guessed() -> None:
    tax = project(np.ones((10, 4)), np.array(["a"] * 4), 1.0)
    assert tax.projections == [] and tax.note
