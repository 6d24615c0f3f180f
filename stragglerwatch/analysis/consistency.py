"""When a rank's excess over its peers becomes a flag: the consistency rule of detection. Pure.

Input: per step and rank the relative excess ``e = busy / peers' median - 1`` (``detect.py``).
Two tests run side by side; a rank is flagged while either holds for ``confirm`` steps:

1. **Change** (fast, insensitive to a rank's fixed offset): one-sided CUSUMs of the rank's
   excess over its *own* baseline, the median of its excess over a trailing reference window
   (``level_window`` steps ending ``window`` steps ago, frozen while a change is suspected), shrunk
   toward the peers' level as far as the ranks show no lasting offsets (empirical Bayes). Each
   CUSUM tests H0 "a change of at most min_slowdown / 3" (drift, noise) against H1 "a change of
   min_slowdown" (the second one: of twice that): its reference value lies halfway, plus 1.5
   standard errors of the baseline; its alarm level ``h = decision * var / (H1 - H0)`` is the
   Gaussian CUSUM's for ``decision`` nats of log-likelihood ratio, ``var`` the variance of what it
   sums. Each step's excess is clipped to ``clip * noise`` (no spike decides) and the noise's own
   skew (its clipped mean over its median) is taken off. An alarm is a flag only when the change
   persists and is large: its mean since the CUSUM rose is at least ``0.75 * min_slowdown``, and
   the median of the last ``window`` steps at least ``min_slowdown / 2`` above the baseline and
   above the peers (a fast rank that became average is not a straggler).
2. **Level** (a rank slow from the start, or one that crept up): the median of ``e`` over the
   last ``level_window`` steps above ``max(min_slowdown, tolerance + z * its standard error)``.
   Ranks within ``tolerance`` of their peers for ever are healthy hardware variation.

A flag clears after ``confirm`` steps back near the rank's baseline (or near its peers); a step
a rank did not record is no evidence either way. ``noise`` is the per-step jitter of ``e``: per
rank, the median absolute step-to-step difference (robust to spikes, blind to offsets and
drift), and the median of that over the ranks.

**Rounds.** The ranks are processed in fixed blocks (:func:`rank_blocks`, a function of the
run's shape only) in three rounds with job-wide reductions between them: ``round1`` (rolling
medians, per-rank noise, medians and counts) -> ``combine1`` (noise, offset spread) ->
``round2`` (the clipped excess's moments, the block means' second differences) -> ``combine2``
(skew, variance, alarm levels) -> ``round3`` (the flags). Every reduction combines per-block
results in block order, so an engine that runs the blocks anywhere (``rayengine.py``) gets the
same flags, bit for bit, as :func:`flags` here.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import bottleneck as bn
import numpy as np

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.intermittent import (
    block_bar,
    block_costs,
    block_means,
    block_noise,
    block_stats,
    intermittent_flags,
)
from stragglerwatch.analysis.rounds import by_columns, colsum, on_threads, slices
from stragglerwatch.analysis.stages import nanmedian
from stragglerwatch.analysis.thresholds import Floors, classic_floors, floors

if TYPE_CHECKING:  # detect.py imports this module
    from stragglerwatch.analysis.thresholds import DetectConfig

#: Steps x ranks records of one rank block: it bounds a block's memory (about 10 arrays of it).
BLOCK_RECORDS = 1 << 24


def rank_blocks(n_ranks: int, n_steps: int) -> list[slice]:
    """The rank blocks of a run of this shape: column slices of at most ``BLOCK_RECORDS`` records."""
    size = max(1, min(max(n_ranks, 1), BLOCK_RECORDS // max(n_steps, 1)))
    return [slice(lo, min(lo + size, n_ranks)) for lo in range(0, n_ranks, size)]


def rank_nanmedian(x: np.ndarray) -> np.ndarray:
    """Per column (rank) median of the finite values; NaN for a column with none."""
    return nanmedian(x, axis=0) if x.size else np.full(x.shape[1], np.nan)


@dataclass
class BlockState:
    """A rank block's arrays (steps x its ranks), kept between the rounds."""

    e: np.ndarray
    costly: np.ndarray
    med: np.ndarray  # median of the last ``window`` steps
    level: np.ndarray  # median of the last ``level_window`` steps (from ``window`` steps on)
    counted: np.ndarray  # steps recorded in the last ``level_window``
    center: np.ndarray | None = None  # each rank's median excess over the run (round 1)


@dataclass
class Round1:
    noise: np.ndarray  # per rank: robust step-to-step jitter (NaN: fewer than two steps)
    center: np.ndarray  # per rank: median excess
    steps: np.ndarray  # per rank: steps recorded
    block_jitter: np.ndarray  # per rank: jitter of its block means (``intermittent.py``)
    block_level: np.ndarray  # per rank: the median of its block means


@dataclass
class Round2:
    n: int  # moments of the clipped excess over the rank's level
    total: float
    squares: float
    second_w: np.ndarray  # second differences of ``window``-step block means (finite ones)
    second_lw: np.ndarray  # the same for ``level_window``-step blocks
    bar: float  # lowest level bar at the last step
    bar_classic: float  # the same at the fixed floor


@dataclass(frozen=True)
class Scalars:
    """The job-wide quantities every block's flags use."""

    noise: float
    spread: float  # the ranks' lasting offsets (standard deviation); inf: no shrinkage
    skew: float = 0.0
    variance: float = 0.0
    bar: float = 0.0
    block_noise: float = np.inf  # the intermittent test's (``intermittent.block_noise``)
    ranks: int = 0  # ranks in the job
    floors: Floors = Floors(0.06, 0.05, 0.03)  # what the run's noise sets (``thresholds.floors``)
    classic: Floors = Floors(0.06, 0.05, 0.03)  # the fixed floor (``thresholds.classic_floors``)
    bar_classic: float = 0.0  # ``bar`` at the fixed floor

    def cap(self, cfg: DetectConfig) -> float:
        """The largest weight of one step in the CUSUM: ``clip`` noise units; at the noise floor, at least
        1.5 times the smallest change (on a quiet run ``clip`` noise units lie below the CUSUM's reference
        value, where no change could ever add up: only the level test, a 64-step median, would find it)."""
        wide = 1.5 * self.floors.slowdown if self.floors != self.classic else 0.0
        return max(cfg.clip * self.noise, wide)

    def two_floors(self) -> bool:
        """The run's noise floor lies below the fixed one: flags at each are found, and told apart."""
        return self.floors != self.classic

    def at_classic(self) -> Scalars:
        """These scalars at the fixed floor."""
        return replace(self, floors=self.classic, bar=self.bar_classic)


def _moving(fn, x: np.ndarray, window: int, min_count: int) -> np.ndarray:
    """``fn`` (a bottleneck moving statistic) over the last ``window`` rows, NaN below ``min_count``."""
    n = x.shape[0]
    if n < min_count:
        return np.full(x.shape, np.nan)
    return by_columns(lambda part: fn(part, min(window, n), min_count=min_count, axis=0), x, out_axis=1)


def block_state(e: np.ndarray, costly: np.ndarray, cfg: DetectConfig) -> BlockState:
    w, lw = cfg.window, cfg.level_window
    med = _moving(bn.move_median, e, w, w // 2 + 1)
    level = _moving(bn.move_median, e, lw, w)  # from ``window`` steps on, its bar higher while it has fewer
    if np.isfinite(e).all():  # every step recorded: the count is the window's length
        counted = np.broadcast_to(np.minimum(np.arange(1.0, len(e) + 1.0), float(lw))[:, None], e.shape)
    else:
        counted = _moving(bn.move_sum, np.isfinite(e).astype(float), lw, 1)
    return BlockState(e, costly, med, level, counted)


def round1(state: BlockState) -> Round1:
    """Each rank's own figures, on slices of the ranks in threads (each rank's are its own)."""
    e = state.e
    parts = on_threads([lambda cs=cs: _round1(e[:, cs]) for cs in slices(e.shape[1], e.shape[0])])
    out = Round1(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Round1)))
    state.center = out.center
    return out


def _round1(e: np.ndarray) -> Round1:
    noise = 1.4826 * rank_nanmedian(np.abs(np.diff(e, axis=0))) / np.sqrt(2.0)
    return Round1(noise, rank_nanmedian(e), np.sum(np.isfinite(e), axis=0).astype(float), *block_stats(e))


def combine1(parts: list[Round1], cfg: DetectConfig) -> Scalars:
    noise_r = np.concatenate([p.noise for p in parts]) if parts else np.zeros(0)
    noise_r = noise_r[np.isfinite(noise_r)]
    noise = max(float(np.median(noise_r)) if noise_r.size else 0.0, 0.002)
    centers = np.concatenate([p.center for p in parts]) if parts else np.zeros(0)
    steps = np.concatenate([p.steps for p in parts]) if parts else np.zeros(0)
    spread = _offset_spread(centers, steps, noise) if len(centers) >= 8 else np.inf
    jitter = np.concatenate([p.block_jitter for p in parts]) if parts else np.zeros(0)
    level = np.concatenate([p.block_level for p in parts]) if parts else np.zeros(0)
    return Scalars(noise=noise, spread=spread, block_noise=block_noise(jitter, level), ranks=len(centers),
                   floors=floors(noise, cfg), classic=classic_floors(cfg))  # fmt: skip


def _offset_spread(centers: np.ndarray, steps: np.ndarray, noise: float) -> float:
    """The spread (standard deviation) of the ranks' lasting offsets from their peers: the robust
    spread of their run medians, less the part the per-step noise alone gives them."""
    medians = centers[np.isfinite(centers)]
    if medians.size < 2:
        return np.inf
    observed = 1.4826 * float(np.median(np.abs(medians - np.median(medians))))
    n = max(1, int(np.median(steps)))
    return float(np.sqrt(max(0.0, observed**2 - (1.2533 * noise) ** 2 / n)))


#: The fewest block differences a long-run variance is estimated from: with fewer (a few ranks, a few
#: hundred steps), the one change of a straggler would raise its own alarm level by a third or more.
MIN_SECOND = 32


def _second_differences(dev: np.ndarray, block: int) -> np.ndarray:
    """Each ``block``-step mean's difference from its two neighbours' mean (finite ones, flat: rank after rank,
    so that ranks cut into slices give them in the same order)."""
    n = dev.shape[0] // block
    if n < 3:
        return np.zeros(0)
    with np.errstate(invalid="ignore"), ignoring():  # all-NaN blocks
        means = np.nanmean(dev[: n * block].reshape(n, block, -1), axis=1)
    second = (means[1:-1] - (means[:-2] + means[2:]) / 2.0).T  # variance 1.5 x a block mean's
    return second[np.isfinite(second)]


def _long_run_variance(second: np.ndarray, block: int) -> float:
    """Variance per step that sums of the clipped excess show over ``block`` steps: ``block`` x
    the variance of ``block``-step means, measured on each block's difference from its two
    neighbours (which takes out offsets and slow drift), winsorised at five robust standard
    deviations (so that a straggler's one change does not dominate). Above the per-step variance
    when slow excursions (a rank a bit slower for tens of steps, as on a shared host) are more
    than independent steps give. Fewer than :data:`MIN_SECOND` differences tell no excursion from one
    straggler's own change (a change is a pair of them as large as itself): no estimate (0)."""
    if second.size < MIN_SECOND:
        return 0.0
    robust = 1.4826 * float(np.median(np.abs(second - np.median(second))))
    # the tails count (they are the slow excursions), but one straggler's change does not dominate
    tails = np.clip(second, -5.0 * robust, 5.0 * robust)
    return block * float(np.mean(tails**2)) / 1.5


def round2(state: BlockState, sc: Scalars, cfg: DetectConfig) -> Round2:
    """The block's moments of the clipped excess and its block means' second differences, on slices of its
    ranks in threads (per rank, then summed over the block: no figure depends on where the slices were cut)."""
    cap = sc.cap(cfg)
    e = state.e
    center = state.center
    assert center is not None, "round 1 sets each rank's centre"
    parts = on_threads([lambda cs=cs: _round2(e[:, cs], state.level[:, cs], center[cs], cap, cfg)
                        for cs in slices(e.shape[1], e.shape[0])])  # fmt: skip
    n, total, squares, second_w, second_lw = (np.concatenate([p[i] for p in parts]) for i in range(5))
    bars = level_bars(state.counted[-1:], sc, cfg) if len(e) else np.zeros(0)
    classic = level_bars(state.counted[-1:], sc.at_classic(), cfg) if len(e) else np.zeros(0)
    return Round2(
        n=int(n.sum()),
        total=float(np.sum(total)),
        squares=float(np.sum(squares)),
        second_w=second_w,
        second_lw=second_lw,
        bar=float(bars.min()) if bars.size else sc.floors.slowdown,
        bar_classic=float(classic.min()) if classic.size else sc.classic.slowdown,
    )


def _round2(e: np.ndarray, level: np.ndarray, center: np.ndarray, cap: float, cfg: DetectConfig
            ) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Per rank of a slice: the count, sum and sum of squares of its clipped excess over its level; its second
    differences."""
    with np.errstate(invalid="ignore"):
        dev = np.clip(e - level, -cap, cap)
        around = np.clip(e - center, -cap, cap)
    finite = np.isfinite(dev)
    np.copyto(dev, 0.0, where=~finite)
    return (finite.sum(axis=0), colsum(dev), colsum(dev * dev), _second_differences(around, cfg.window),
            _second_differences(around, cfg.level_window))  # fmt: skip


def combine2(parts: list[Round2], sc: Scalars, cfg: DetectConfig) -> Scalars:
    n = sum(p.n for p in parts)
    skew = sum(p.total for p in parts) / n if n else 0.0
    plain = max(0.0, sum(p.squares for p in parts) / n - skew**2) if n else 0.0
    second_w = np.concatenate([p.second_w for p in parts]) if parts else np.zeros(0)
    second_lw = np.concatenate([p.second_lw for p in parts]) if parts else np.zeros(0)
    # the alarm levels need the variance of what the CUSUM sums (the clipped excess), which heavy
    # tails make larger than the robust ``noise`` says, and which slow excursions (a rank a bit
    # slower for tens of steps, as on a shared host) make larger still over the CUSUM's horizon:
    # the long-run variance, from the means of ``window``- and ``level_window``-step blocks
    variance = max(sc.noise**2, plain, _long_run_variance(second_w, cfg.window),
                   _long_run_variance(second_lw, cfg.level_window))  # fmt: skip
    bar = min((p.bar for p in parts), default=sc.floors.slowdown)
    bar_classic = min((p.bar_classic for p in parts), default=sc.classic.slowdown)
    return replace(sc, skew=skew, variance=variance, bar=bar, bar_classic=bar_classic)


def level_bars(counted: np.ndarray, sc: Scalars, cfg: DetectConfig) -> np.ndarray:
    """The level test's bar for a median of ``counted`` steps."""
    with np.errstate(divide="ignore"):
        f = sc.floors
        return np.maximum(f.slowdown, f.tolerance + cfg.z * 1.2533 * sc.noise / np.sqrt(counted))


def alarm_levels(sc: Scalars, cfg: DetectConfig) -> tuple[float, list[float], list[float]]:
    """H0's change, the CUSUMs' reference values and alarm levels (H1: a change of min_slowdown,
    and of twice that). Each reference value lies halfway between its H0 and H1; a CUSUM alarms
    at ``decision`` nats of log-likelihood ratio between its two hypotheses."""
    delta = sc.floors.slowdown
    c0 = delta / 3.0
    targets = (delta, 2.0 * delta)
    return c0, [(c0 + t) / 2.0 for t in targets], [cfg.decision * sc.variance / (t - c0) for t in targets]


_CHUNK = 1024  # steps whose baselines are computed at once (bounds round 3's memory)


def _baselines(state: BlockState, sc: Scalars, cfg: DetectConfig, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """For steps ``lo:hi``: each rank's baseline, its margin, and the level test's bar."""
    w, lw = cfg.window, cfg.level_window
    rows = np.arange(lo, hi) - w  # the baseline is the level median of ``window`` steps ago
    ok = rows >= 0
    src = np.maximum(rows, 0)
    counted = state.counted[src]
    # the level median where it had at least half its window (the same median, fewer NaNs)
    trailing = np.where(ok[:, None] & (counted >= lw // 2), state.level[src], np.nan)
    n_trailing = np.where(ok[:, None], np.maximum(1.0, counted), 1.0)
    # a rank's own baseline is uncertain (a median of at most ``lw`` steps); where the ranks show no
    # lasting offsets from one another, shrink it toward its peers' level (empirical Bayes), which
    # is known far better: ``spread`` is the ranks' true offset spread, their run medians' spread
    # less what noise alone gives
    se_base = 1.2533 * sc.noise / np.sqrt(n_trailing)
    weight = 1.0 if np.isinf(sc.spread) else sc.spread**2 / (sc.spread**2 + se_base**2)
    return trailing * weight, 1.5 * np.sqrt(weight) * se_base, level_bars(state.counted[lo:hi], sc, cfg)


@dataclass
class Carry:
    """The consistency rule's state per rank between one step and the next (round 3)."""

    cusum: np.ndarray  # the two CUSUMs
    run_n: np.ndarray  # steps since the CUSUM last left zero, and their (capped) excess
    run_sum: np.ndarray
    base: np.ndarray  # the baseline in use, and its margin
    unsure: np.ndarray
    on: np.ndarray  # flagged now
    run_on: np.ndarray  # steps in a row that were slow / back
    run_off: np.ndarray
    # the level GLR: the excess over the tolerance summed since that sum was last at its lowest, and its steps
    above: np.ndarray
    above_n: np.ndarray
    above_base: np.ndarray  # the rank's baseline when that run began

    @classmethod
    def fresh(cls, n_ranks: int) -> Carry:
        z = np.zeros(n_ranks)
        i = np.zeros(n_ranks, dtype=np.int32)
        return cls(np.zeros((2, n_ranks)), z.copy(), z.copy(), np.full(n_ranks, np.nan), z.copy(),
                   np.zeros(n_ranks, dtype=bool), i.copy(), i.copy(), z.copy(), z.copy(),
                   np.full(n_ranks, np.nan))  # fmt: skip

    def copy(self) -> Carry:
        return Carry(*(getattr(self, f).copy() for f in self.__dataclass_fields__))


#: Bits of :func:`round3`'s flags: flagged at the run's noise floor, at the fixed floor.
AT_NOISE, AT_CLASSIC = 1, 2


def round3(state: BlockState, sc: Scalars, cfg: DetectConfig) -> np.ndarray:
    """Steps x ranks uint8 flags of one block: :data:`AT_NOISE` | :data:`AT_CLASSIC` bits (0: not flagged)."""
    levels = floor_levels(sc)
    r = state.e.shape[1]
    both = advance(state, levels, cfg, Carry.fresh(r * len(levels)), 0, len(state.e))
    means, top = block_means(state.e), block_costs(state.costly)
    with np.errstate(invalid="ignore"):
        out = [both[:, i * r : (i + 1) * r] | intermittent_flags(len(state.e), means, top > x.floors.step_fraction,
                                                                 x.block_noise, x.floors, cfg, x.ranks)
               for i, x in enumerate(levels)]  # fmt: skip
    return bits(out[0], out[-1])


def floor_levels(sc: Scalars) -> list[Scalars]:
    """The scalars the rule runs at: the run's noise floor, and the fixed floor where that lies below it."""
    return [sc, sc.at_classic()] if sc.two_floors() else [sc]


def bits(at_noise: np.ndarray, at_classic: np.ndarray) -> np.ndarray:
    """The uint8 flags of :func:`round3` from the bool flags at each floor."""
    return at_noise.astype(np.uint8) * AT_NOISE | at_classic.astype(np.uint8) * AT_CLASSIC


def costly(cost: np.ndarray, sc: Scalars) -> np.ndarray:
    """Where an excess costs at least the run's floor share of its step (``stages.step_stage``'s cost)."""
    with np.errstate(invalid="ignore"):
        return cost > sc.floors.step_fraction


@dataclass
class _Levels:
    """What the rule's step needs of each floor level, one value per column of the levels side by side (the
    columns of level ``i`` are ``i * ranks ... (i + 1) * ranks - 1``): the floors' arithmetic is the same,
    element for element, as one level's alone."""

    delta: np.ndarray
    fraction: np.ndarray
    tolerance: np.ndarray
    k: np.ndarray  # (2, columns): the CUSUMs' reference values
    h: np.ndarray  # (2, columns): their alarm levels
    cap: np.ndarray
    persist: np.ndarray
    glr: np.ndarray  # columns where the level GLR runs (``_level_glr``)
    glr_any: bool

    @classmethod
    def of(cls, levels: list[Scalars], cfg: DetectConfig, r: int, cost_dtype: np.dtype) -> _Levels:
        def each(values: list[float]) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.float64), r)

        delta = [x.floors.slowdown for x in levels]
        kh = [alarm_levels(x, cfg) for x in levels]
        # the short median must be clearly above the baseline: half the smallest change, or two of its
        # standard errors where noise makes that larger
        persist = [max(d / 2.0, 2.0 * 1.2533 * x.noise / np.sqrt(cfg.window))
                   for d, x in zip(delta, levels, strict=True)]  # fmt: skip
        glr = each([float(x.noise >= x.floors.slowdown) for x in levels]) > 0
        fraction = each([x.floors.step_fraction for x in levels]).astype(cost_dtype)  # compared as one level's
        return cls(each(delta), fraction,
                   each([x.floors.tolerance for x in levels]),
                   np.stack([each([ks[i] for _, ks, _ in kh]) for i in range(2)]),
                   np.stack([each([hs[i] for _, _, hs in kh]) for i in range(2)]),
                   each([x.cap(cfg) for x in levels]), each(persist), glr, bool(glr.any()))  # fmt: skip


def advance(
    state: BlockState,
    levels: list[Scalars],
    cfg: DetectConfig,
    carry: Carry,
    start: int,
    stop: int,
    checkpoints: dict[int, Carry] | None = None,
    every: int = 256,
) -> np.ndarray:
    """Flags of steps ``start:stop`` at each of ``levels`` (:func:`floor_levels`), side by side: steps x
    (levels x ranks), level after level, from ``carry`` (the state after step ``start - 1``, as many columns,
    updated in place); with ``checkpoints``, a copy of the state before each step that is a multiple of
    ``every`` (where a followed run resumes from). The levels run in one pass: a step costs the same few
    dozen array operations for both."""
    n_ranks, n_levels = state.e.shape[1], len(levels)
    sc = levels[0]  # noise, skew and variance are the run's, whatever the floor
    p = _Levels.of(levels, cfg, n_ranks, state.costly.dtype)
    delta, cap, skew = p.delta, p.cap, sc.skew
    size_bar, off = 0.75 * delta, delta * cfg.off_ratio
    h0_half, low = p.h[0] / 2, -cap
    glr_var = 2.0 * cfg.decision * max(sc.variance, sc.noise**2)
    out = np.zeros((max(0, stop - start), n_ranks * n_levels), dtype=bool)
    c = carry
    lo = start
    chunks = _Chunks(state, levels, p, cfg, start, stop)
    with np.errstate(invalid="ignore", divide="ignore"), chunks:
        for s in range(start, stop):
            if checkpoints is not None and s % every == 0:
                checkpoints[s] = c.copy()
            if s == start or s % _CHUNK == 0:
                lo, ch = s, chunks.at(s)
            i = s - lo
            e_s, m, lev, trailing = ch.e[i], ch.m[i], ch.lev[i], ch.trailing[i]
            # (each operation below is a plain ufunc where it can be: on a row of ranks their dispatch is the
            # cost, and ``np.where``, ``np.clip`` and the ``where=`` forms cost two to four of them)
            fresh = ~((c.on | (c.cusum[0] > h0_half)) & np.isfinite(c.base))
            c.base = np.where(fresh, trailing, c.base)
            c.unsure = np.where(fresh, ch.margin[i], c.unsure)
            score = np.minimum(np.maximum(e_s - c.base, low), cap)
            score -= skew
            seen = np.isfinite(score)
            step = score - p.k
            step -= c.unsure
            grown = np.maximum(c.cusum + step, 0.0)
            all_seen = seen.all()
            c.cusum = grown if all_seen else np.where(seen, grown, c.cusum)
            alarm = (c.cusum[0] >= p.h[0]) | (c.cusum[1] >= p.h[1])
            restart = seen & (c.cusum[0] == 0.0)
            c.run_n = (c.run_n + seen) * ~restart
            c.run_sum = (c.run_sum + (score if all_seen else np.where(seen, score, 0.0))) * ~restart
            # the change's size: its mean since the CUSUM rose (the maximum-likelihood estimate), and
            # the median of the last ``window`` steps (persistence: most recent steps are slow)
            above_base = m - c.base
            change = alarm & (c.run_sum / c.run_n >= size_bar) & (above_base >= p.persist) & ch.m_half[i]
            slow = (change & ch.costly[i]) | ch.level_slow[i]
            if p.glr_any:
                certain = _level_glr(c, e_s, lev, trailing, p, skew, glr_var)
                slow |= certain & (m >= delta) & ch.costly[i]
            near = (above_base < off) | ch.m_off[i]
            back = np.where(np.isfinite(c.base), near, ch.m_level_off[i]) & ch.not_level_off[i]
            on = (c.run_on + 1) * slow
            off_ = (c.run_off + 1) * back
            if ch.gaps[i]:  # too few steps in the window (a rank missing rows): no evidence either way
                on, off_ = np.where(ch.gap[i], c.run_on, on), np.where(ch.gap[i], c.run_off, off_)
            c.run_on, c.run_off = on, off_
            cleared = c.on & (c.run_off >= cfg.confirm)
            rising = ~c.on & (c.run_on >= cfg.confirm)
            c.on = (c.on & ~cleared) | rising
            # a flag the level GLR raised, long after the onset: the baseline to come back to is the one from
            # before its run of excess began (the recent one holds the change itself)
            if p.glr_any:
                c.base = np.where(rising & certain & (c.above_base < c.base), c.above_base, c.base)
            if cleared.any():
                c.cusum[:, cleared] = 0.0
                c.above[cleared], c.above_n[cleared] = 0.0, 0.0
            out[s - start] = c.on
    return out


class _Chunks:
    """The :class:`_Chunk` of each :data:`_CHUNK` steps of ``start:stop``, the next one made on a thread of its own
    while the rule steps through this one (the rule's loop is numpy's call overhead on one core; a chunk is
    numpy's loops over a thousand steps at once, which leave the interpreter lock to it)."""

    def __init__(self, state: BlockState, levels: list[Scalars], p: _Levels, cfg: DetectConfig, start: int,
                 stop: int) -> None:  # fmt: skip
        self.args, self.stop = (state, levels, p, cfg), stop
        self.pool = ThreadPoolExecutor(1) if stop - start > _CHUNK else None
        self.next: Future[_Chunk] | None = None

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def _make(self, lo: int) -> _Chunk:
        with np.errstate(invalid="ignore", divide="ignore"):
            return _chunk(*self.args, lo, min((lo // _CHUNK + 1) * _CHUNK, self.stop))

    def at(self, lo: int) -> _Chunk:
        """The chunk from step ``lo`` (the start of the range, or of a chunk) to the end of its chunk."""
        made = self.next.result() if self.next is not None else self._make(lo)
        after = (lo // _CHUNK + 1) * _CHUNK
        self.next = self.pool.submit(self._make, after) if self.pool is not None and after < self.stop else None
        return made


@dataclass
class _Chunk:
    """What :func:`advance` needs of steps ``lo:hi`` that no state changes, for every step of them at once (steps
    x (levels x ranks)): the level test, the comparisons of the short median with fixed bars."""

    e: np.ndarray
    m: np.ndarray
    lev: np.ndarray
    trailing: np.ndarray  # each rank's baseline, its margin (``_baselines``)
    margin: np.ndarray
    costly: np.ndarray  # the excess costs at least the floor's share of its step
    level_slow: np.ndarray  # the level test: the level median at its bar, and costly
    m_half: np.ndarray  # the short median at least half the smallest change
    m_off: np.ndarray  # the short median below where a flag clears
    m_level_off: np.ndarray  # below where a level flag clears, and the level median below that too
    not_level_off: np.ndarray
    gap: np.ndarray  # no short median (too few steps)
    gaps: list[bool]  # per step: some rank has a gap


def _chunk(state: BlockState, levels: list[Scalars], p: _Levels, cfg: DetectConfig, lo: int, hi: int) -> _Chunk:
    base = [_baselines(state, x, cfg, lo, hi) for x in levels]
    trailing, margin, bars = (np.concatenate([b[i] for b in base], axis=1) for i in range(3))
    n = len(levels)
    e, m, lev, cost = (np.tile(a[lo:hi], (1, n)) for a in (state.e, state.med, state.level, state.costly))
    level_off = (p.tolerance + bars) / 2.0  # below it, a level flag clears (hysteresis)
    costly, gap = cost > p.fraction, np.isnan(m)
    return _Chunk(e, m, lev, trailing, margin, costly, (lev >= bars) & costly, m >= p.delta / 2.0,
                  m < p.delta * cfg.off_ratio, m < level_off, ~(lev >= level_off), gap,
                  gap.any(axis=1).tolist())  # fmt: skip


def _level_glr(c: Carry, e: np.ndarray, lev: np.ndarray, base: np.ndarray, p: _Levels, skew: float,
               glr_var: float) -> np.ndarray:  # fmt: skip
    """The level test of a change of any size (a generalised likelihood ratio; ``c`` updated in place): the
    excess over the tolerance, summed since that sum was last at its lowest, is ``decision`` nats certain to
    be above it, and its mean is at least the smallest change (a flag also needs the last ``window`` steps
    that slow). ``base``: each rank's baseline now, kept where a run begins.
    Where the per-step noise is larger than the smallest change (a few ranks with variable work on a shared
    host), the CUSUMs, tuned to that change and held back by a rank's uncertain own baseline, take hundreds of
    steps to find a change several times larger, which this test, against the peers, finds as soon as it is
    certain. Below that noise it is not used (``p.glr`` false): the CUSUMs are quick there, and this test
    would add flags on ranks that drift a little above the tolerance for a while."""
    with np.errstate(invalid="ignore", divide="ignore"):
        x = np.clip(e, -p.cap, p.cap) - skew - p.tolerance
        seen = np.isfinite(x) & np.isfinite(lev) & p.glr  # from the level median's first steps on, as the level test
        c.above = np.where(seen, np.maximum(0.0, c.above + np.where(seen, x, 0.0)), c.above)
        c.above_n = np.where(seen, np.where(c.above > 0.0, c.above_n + 1.0, 0.0), c.above_n)
        c.above_base = np.where((c.above_n == 1.0) & p.glr, base, c.above_base)
        certain = c.above**2 >= glr_var * c.above_n
        return (c.above_n > 0) & p.glr & certain & (c.above / c.above_n + p.tolerance >= p.delta)


def thresholds(sc: Scalars, cfg: DetectConfig) -> dict[str, float]:
    """What the run's noise gave; the floors as slowdown ratios (1.06: 6 % busier than the peers), as every
    setting and report says a slowdown."""
    _, _, hs = alarm_levels(sc, cfg)
    bar = block_bar(sc.block_noise, sc.floors, cfg)
    return {"noise": sc.noise, "skew": sc.skew, "cusum_h": hs[0], "level_bar": sc.bar,
            "block_bar": bar if np.isfinite(bar) else None, "min_slowdown": 1.0 + sc.floors.slowdown,
            "tolerance": 1.0 + sc.floors.tolerance, "min_step_fraction": sc.floors.step_fraction,
            "fixed_min_slowdown": 1.0 + sc.classic.slowdown, "min_cost_share": cfg.min_cost_share}  # fmt: skip


def flags(e: np.ndarray, costly: np.ndarray, cfg: DetectConfig) -> tuple[np.ndarray, dict[str, float]]:
    """Steps x ranks uint8 flags (:func:`round3`) for the excess ``e``; ``costly``: steps x ranks, the share
    of its step the excess is (``stages.step_stage``). Returns the flags and the thresholds used. The
    rounds run here, block after block; ``rayengine.py`` runs the same rounds on a cluster."""
    blocks = rank_blocks(e.shape[1], e.shape[0])
    states = [block_state(np.ascontiguousarray(e[:, b]), np.ascontiguousarray(costly[:, b]), cfg) for b in blocks]
    sc = combine1([round1(s) for s in states], cfg)
    sc = combine2([round2(s, sc, cfg) for s in states], sc, cfg)
    out = np.zeros(e.shape, dtype=np.uint8)
    for b, state in zip(blocks, states, strict=True):
        out[:, b] = round3(state, sc, cfg)
    return out, thresholds(sc, cfg)
