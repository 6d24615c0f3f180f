"""Intermittent stragglers: slow every few steps, consistently. Pure.

A rank whose DataLoader workers cannot keep up is slow in bursts: the loader hands out its
workers' batches in turn, so with N workers one step in N waits for all of them and the others
wait for nothing. Per step, such a rank is slow in one step of N only; the per-step tests of
``consistency.py`` see a rank whose excess jumps by several times the step every other step,
take that for noise and flag nothing, although the rank costs the job a large share of its time.

This test looks at blocks of :data:`BLOCK` consecutive steps instead: a rank's block excess is the
mean of its per-step excess ``e`` over the block. Periods that divide the block (1, 2, 4, 8 steps)
leave it steady, others nearly so, and a one-step spike is diluted eightfold. The block noise is a
job-wide scalar, reduced like ``consistency``'s (:func:`block_stats` per rank): the median
block-to-block jitter of the ranks whose block excess is at most the median rank's. A slow rank's
own jitter grows with its excess (jitter is relative), so it is left out, also in a job of two
ranks, where the other rank, its mirror image, is steady. A rank is flagged from the last step
of :data:`CONFIRM_BLOCKS` consecutive blocks whose excess is above :func:`block_bar` (``max(min_slowdown,
tolerance + z * block noise)``) and which hold a costly step (its excess a noticeable part of the
step) (when the test knows; the onset is estimated as for every flag, ``stages.describe``), until
the end of ``confirm`` (3) consecutive blocks back below ``off_ratio`` of that bar.
``consistency.round3`` OR-s these flags with the per-step tests', so every engine flags alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from stragglerwatch._quiet import ignoring

if TYPE_CHECKING:
    from stragglerwatch.analysis.thresholds import DetectConfig, Floors

#: Steps of a block: the periods it makes steady (the common numbers of loader workers).
BLOCK = 8
#: Consecutive slow blocks that flag a rank (48 steps). A healthy rank's block is slow by chance
#: when a transient spike of a whole step falls into it (a few percent of blocks at 0.5% of steps
#: spiking): six in a row are that unlikely (below 1e-8), three are not.
CONFIRM_BLOCKS = 6


def block_means(e: np.ndarray) -> np.ndarray:
    """Per block and rank, the mean excess (NaN for a block with fewer than half its steps recorded)."""
    n, r = e.shape
    b = e[: (n // BLOCK) * BLOCK].reshape(n // BLOCK, BLOCK, r)
    ok = np.isfinite(b)
    count = ok.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count >= BLOCK // 2, np.where(ok, b, 0.0).sum(axis=1) / count, np.nan)


def block_stats(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the robust block-to-block jitter of its block means and their median (NaN: fewer
    than two blocks)."""
    means = block_means(e)
    if means.shape[0] < 2:
        return np.full(e.shape[1], np.nan), np.full(e.shape[1], np.nan)
    with ignoring():  # ranks without two finite blocks
        jitter = 1.4826 * np.nanmedian(np.abs(np.diff(means, axis=0)), axis=0) / np.sqrt(2.0)
        return jitter, np.nanmedian(means, axis=0)


def block_noise(jitter: np.ndarray, level: np.ndarray) -> float:
    """The job's block noise from every rank's :func:`block_stats`: the median jitter of the ranks
    at or below the median level (inf: not known)."""
    known = np.isfinite(jitter) & np.isfinite(level)
    if not known.any():
        return np.inf
    jitter, level = jitter[known], level[known]
    calm = jitter[level <= np.median(level)]
    return max(float(np.median(calm)), 0.002)


def block_bar(noise: float, floors: Floors, cfg: DetectConfig) -> float:
    """The block excess above which a block is slow (``floors``: the run's, ``thresholds.floors``)."""
    return max(floors.slowdown, floors.tolerance + cfg.z * noise)


def block_costs(cost: np.ndarray) -> np.ndarray:
    """Per block and rank, the largest share of its step an excess was (``stages.step_stage``'s cost; NaN: none
    known): a block holds a costly step where this is above the floor's share."""
    n, r = cost.shape
    return np.fmax.reduce(cost[: (n // BLOCK) * BLOCK].reshape(n // BLOCK, BLOCK, r), axis=1)


def intermittent_flags(n: int, means: np.ndarray, held: np.ndarray, noise: float, floors: Floors, cfg: DetectConfig,
                       ranks: int) -> np.ndarray:  # fmt: skip
    """Steps x ranks bool (``n`` steps): the steps of each rank's flagged block stretches (:func:`stretches`)."""
    return mark(np.zeros((n, means.shape[1]), dtype=bool), stretches(n, means, held, noise, floors, cfg, ranks))


def stretches(n: int, means: np.ndarray, held: np.ndarray, noise: float, floors: Floors, cfg: DetectConfig,
              ranks: int) -> list[tuple[int, int, int]]:  # fmt: skip
    """Each rank's flagged block stretches of ``n`` steps, as ``(column, first step, step after the last)``.
    ``means``: the whole blocks' :func:`block_means`; ``held``: whether each block holds a costly step (its excess
    a noticeable share of the step: :func:`block_costs` above the floor's share). ``ranks``: the job's (a job of
    one rank has no peers). Few ranks have any: a live update ORs them into the flags it holds, not a matrix of
    every step and rank."""
    found: list[tuple[int, int, int]] = []
    bar = block_bar(noise, floors, cfg)
    if ranks < 2 or n // BLOCK < CONFIRM_BLOCKS or not np.isfinite(bar):
        return found
    r, nb = means.shape[1], means.shape[0]
    with np.errstate(invalid="ignore"):
        above = (means > bar) & held
        below = ~(means > bar * cfg.off_ratio)  # NaN (too few steps) counts as no evidence of slowness
    # only a rank above the bar in CONFIRM_BLOCKS blocks in a row can be flagged: the others are not looked at
    runs = np.cumsum(np.vstack([np.zeros((1, r), dtype=np.int64), above]), axis=0)
    for j in np.flatnonzero((runs[CONFIRM_BLOCKS:] - runs[:-CONFIRM_BLOCKS] >= CONFIRM_BLOCKS).any(axis=0)).tolist():
        on, run, start = False, 0, 0
        for k in range(nb):
            if not on:
                run = run + 1 if above[k, j] else 0
                if run >= CONFIRM_BLOCKS:  # known at the last step of this block: the flag rises there
                    on, start, run = True, (k + 1) * BLOCK - 1, 0
            else:
                run = run + 1 if below[k, j] else 0
                if run >= cfg.confirm:  # cleared at the end of this block
                    found.append((j, start, (k + 1) * BLOCK))
                    on, run = False, 0
        if on:
            found.append((j, start, n))  # still slow at the end (the steps after the last block too)
    return found


def mark(out: np.ndarray, found: list[tuple[int, int, int]]) -> np.ndarray:
    """``out`` (steps x ranks bool) with the steps of the stretches ``found`` (:func:`stretches`) set."""
    for j, start, stop in found:
        out[start:stop, j] = True
    return out


def within(found: list[tuple[int, int, int]], j: int, a: int, b: int | None) -> bool:
    """Whether a stretch of column ``j`` among ``found`` covers a step of ``a:b`` (``b`` None: to the end)."""
    return any(c == j and (b is None or start < b) and a < stop for c, start, stop in found)
