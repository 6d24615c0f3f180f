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


def test_round2_gives_the_same_bits_however_its_ranks_are_sliced(monkeypatch) -> None:
    """Round 2 runs on slices of a block's ranks in threads, as many as the machine's cores make; its moments and
    second differences (the alarm levels of every flag) may not depend on where the slices were cut."""
    from stragglerwatch.analysis import rounds

    cfg = DetectConfig()
    state, sc0 = _state(0.01, 4)
    sc = cons.combine1([cons.round1(state)], cfg)
    monkeypatch.setattr(rounds, "ROUND_CELLS", 1 << 40)
    assert len(rounds.slices(48, 1500)) == 1
    one = cons.round2(state, sc, cfg)
    monkeypatch.setattr(rounds, "ROUND_CELLS", 256)
    monkeypatch.setattr(rounds, "SLICE_CELLS", 5000)
    monkeypatch.setattr(rounds, "SLICE_MIN", 1)
    for threads in (2, 3):
        monkeypatch.setattr(rounds, "workers", lambda threads=threads: threads)
        assert len(rounds.slices(48, 1500)) > threads  # slices of 3 ranks
        many = cons.round2(state, sc, cfg)
        assert (one.n, one.total, one.squares, one.bar, one.bar_classic) == (
            many.n, many.total, many.squares, many.bar, many.bar_classic)  # fmt: skip
        np.testing.assert_array_equal(one.second_w, many.second_w)
        np.testing.assert_array_equal(one.second_lw, many.second_lw)
    assert one.n == np.isfinite(state.e - state.level).sum() and one.second_w.size > cons.MIN_SECOND
    assert cons.combine2([one], sc, cfg) == sc0  # what ``_state`` found with the round in one piece
