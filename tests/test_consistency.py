"""The consistency rule's step loop (``analysis/consistency.advance``): both floor levels run side by side in one
pass, and a followed run resumes from a checkpoint; neither may change a flag."""

from __future__ import annotations

import numpy as np

from stragglerwatch.analysis import consistency as cons
from stragglerwatch.analysis.thresholds import DetectConfig


def _state(noise: float, seed: int) -> tuple[cons.BlockState, cons.Scalars]:
    """Excess of 48 ranks over 1,500 steps with heavy tails, a step change, a spell, an offset and missing rows."""
    cfg = DetectConfig()
    rng = np.random.default_rng(seed)
    e = rng.normal(0.0, noise, (1500, 48)) + rng.standard_t(3, (1500, 48)) * noise * 0.3
    e[500:, 5] += 0.08
    e[700:1000, 7] += 0.05
    e[:, 9] += 0.04
    e[100:140, 11] = np.nan
    state = cons.block_state(e, (np.abs(e) * 0.5).astype(np.float32), cfg)
    sc = cons.combine1([cons.round1(state)], cfg)
    return state, cons.combine2([cons.round2(state, sc, cfg)], sc, cfg)


def test_levels_side_by_side_flag_as_each_level_alone() -> None:
    cfg = DetectConfig()
    for noise, seed in ((0.004, 0), (0.01, 1), (0.1, 2)):  # two floors; one; one with the level GLR
        state, sc = _state(noise, seed)
        levels = cons.floor_levels(sc)
        r = state.e.shape[1]
        both = cons.advance(state, levels, cfg, cons.Carry.fresh(r * len(levels)), 0, len(state.e))
        for i, level in enumerate(levels):
            alone = cons.advance(state, [level], cfg, cons.Carry.fresh(r), 0, len(state.e))
            assert np.array_equal(both[:, i * r : (i + 1) * r], alone)
        assert both[:, 5].sum() > 500 and not both[:300, 5].any()  # the rule runs: rank 5 flagged after its change
    assert len(cons.floor_levels(_state(0.004, 0)[1])) == 2 and cons.floor_levels(_state(0.1, 2)[1])[0].noise >= 0.06


def test_resuming_from_a_checkpoint_gives_the_same_flags() -> None:
    cfg = DetectConfig()
    state, sc = _state(0.004, 3)
    levels = cons.floor_levels(sc)
    width = state.e.shape[1] * len(levels)
    saved: dict[int, cons.Carry] = {}
    whole = cons.advance(state, levels, cfg, cons.Carry.fresh(width), 0, len(state.e), saved)
    assert sorted(saved) == list(range(0, len(state.e), 256))
    rest = cons.advance(state, levels, cfg, saved[768].copy(), 768, len(state.e))
    assert np.array_equal(rest, whole[768:])
