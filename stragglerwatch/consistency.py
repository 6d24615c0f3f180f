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
a rank did not record is no evidence either way. ``noise`` is the per-step jitter of ``e``, from
the median absolute step-to-step difference (robust to spikes, blind to offsets and drift).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # detect.py imports this module
    from .detect import DetectConfig


def step_noise(e: np.ndarray) -> float:
    """Robust per-step jitter of ``e`` (steps x ranks): 1.4826 MAD of step-to-step differences / sqrt 2."""
    d = np.abs(np.diff(e, axis=0))
    d = d[np.isfinite(d)]
    return float(1.4826 * np.median(d) / np.sqrt(2.0)) if d.size else 0.0


def _offset_spread(e: np.ndarray, noise: float) -> float:
    """The spread (standard deviation) of the ranks' lasting offsets from their peers: the robust
    spread of their run medians, less the part the per-step noise alone gives them."""
    medians = np.nanmedian(e, axis=0)
    medians = medians[np.isfinite(medians)]
    if medians.size < 2:
        return np.inf
    observed = 1.4826 * float(np.median(np.abs(medians - np.median(medians))))
    steps = max(1, int(np.median(np.sum(np.isfinite(e), axis=0))))
    return float(np.sqrt(max(0.0, observed**2 - (1.2533 * noise) ** 2 / steps)))


def _long_run_variance(dev: np.ndarray, block: int) -> float:
    """Variance per step that sums of ``dev`` (steps x ranks, clipped excess) show over ``block``
    steps: ``block`` x the variance of ``block``-step means, measured on each block's difference
    from its two neighbours (which takes out offsets and slow drift), winsorised at five robust
    standard deviations (so that a straggler's one change does not dominate). Above the per-step
    variance when slow excursions (a rank a bit slower for tens of steps, as on a shared host) are
    more than independent steps give."""
    n = dev.shape[0] // block
    if n < 3 or not np.isfinite(dev).any():
        return 0.0
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN blocks
        means = np.nanmean(dev[: n * block].reshape(n, block, -1), axis=1)
    second = means[1:-1] - (means[:-2] + means[2:]) / 2.0  # variance 1.5 x a block mean's
    second = second[np.isfinite(second)]
    if not second.size:
        return 0.0
    robust = 1.4826 * float(np.median(np.abs(second - np.median(second))))
    # the tails count (they are the slow excursions), but one straggler's change does not dominate
    tails = np.clip(second, -5.0 * robust, 5.0 * robust)
    return block * float(np.mean(tails**2)) / 1.5


def rolling_median(x: np.ndarray, window: int, min_periods: int | None = None) -> np.ndarray:
    frame = pd.DataFrame(x)
    return frame.rolling(window, min_periods=min_periods or window).median().to_numpy()


def flags(e: np.ndarray, costly: np.ndarray, rule: DetectConfig) -> tuple[np.ndarray, dict[str, float]]:
    """Steps x ranks bool flags for the excess ``e``; ``costly``: steps x ranks, the excess is worth
    reporting (a noticeable part of the step). Returns the flags and the thresholds used."""
    n_steps, n_ranks = e.shape
    noise = max(step_noise(e), 0.002)
    delta = rule.min_slowdown
    w, lw = rule.window, rule.level_window
    # H0: a change of at most delta / 3 (slow drift, noise); H1: a change of delta (and a second
    # CUSUM for 2 delta, faster on clear stragglers). Each one's reference value lies halfway
    # between its H0 and H1, plus the baseline's own uncertainty (``margin``) so that a baseline
    # drawn low does not turn noise into evidence; it alarms at ``decision`` nats of
    # log-likelihood ratio between its two hypotheses.
    c0 = delta / 3.0
    targets = (delta, 2.0 * delta)
    ks = [(c0 + t) / 2.0 for t in targets]
    cap = rule.clip * noise
    # the short median must be clearly above the baseline: half the smallest change, or two of its
    # standard errors where noise makes that larger
    persist = max(delta / 2.0, 2.0 * 1.2533 * noise / np.sqrt(w))
    med = rolling_median(e, w, w // 2 + 1)
    level = rolling_median(e, lw, w)  # from ``window`` steps on, its bar higher while it has fewer
    counted = pd.DataFrame(np.isfinite(e).astype(float)).rolling(lw, min_periods=1).sum().to_numpy()
    # skewed noise (a step can be much slower than usual, hardly much faster) has a mean above its
    # median: the CUSUM sums (clipped) excesses but centres them on a median, so it subtracts the
    # noise's own clipped mean-minus-median, measured over the whole run
    with np.errstate(invalid="ignore"):
        dev = np.clip(e - level, -cap, cap)
    skew = float(np.nanmean(dev)) if np.isfinite(dev).any() else 0.0
    # the alarm levels need the variance of what the CUSUM sums (the clipped excess), which heavy
    # tails make larger than the robust ``noise`` says, and which slow excursions (a rank a bit
    # slower for tens of steps, as on a shared host) make larger still over the CUSUM's horizon:
    # the long-run variance, from the means of ``window``- and ``level_window``-step blocks
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank with no step
        around = np.clip(e - np.nanmedian(e, axis=0), -cap, cap)
    plain = float(np.nanvar(dev)) if np.isfinite(dev).any() else 0.0
    variance = max(noise**2, plain, _long_run_variance(around, w), _long_run_variance(around, lw))
    hs = [rule.decision * variance / (t - c0) for t in targets]
    h = hs[0]
    trailing = np.full_like(e, np.nan)
    n_trailing = np.ones_like(e)
    if n_steps > w:
        # the level median where it had at least half its window (the same median, fewer NaNs)
        trailing[w:] = np.where(counted >= lw // 2, level, np.nan)[:-w]
        n_trailing[w:] = np.maximum(1.0, counted[:-w])
    # a rank's own baseline is uncertain (a median of at most ``lw`` steps); where the ranks show no
    # lasting offsets from one another, shrink it toward its peers' level (empirical Bayes), which
    # is known far better: ``spread`` is the ranks' true offset spread, their run medians' spread
    # less what noise alone gives
    se_base = 1.2533 * noise / np.sqrt(n_trailing)
    spread = _offset_spread(e, noise) if n_ranks >= 8 else np.inf
    weight = 1.0 if np.isinf(spread) else spread**2 / (spread**2 + se_base**2)
    trailing = trailing * weight
    margin = 1.5 * np.sqrt(weight) * se_base
    with np.errstate(divide="ignore"):
        bars = np.maximum(delta, rule.tolerance + rule.z * 1.2533 * noise / np.sqrt(counted))
    bar = float(bars[-1].min()) if n_steps else delta

    out = np.zeros((n_steps, n_ranks), dtype=bool)
    cusum = np.zeros((len(targets), n_ranks))
    run_n = np.zeros(n_ranks)  # steps since the CUSUM last left zero, and their (capped) excess
    run_sum = np.zeros(n_ranks)
    base = np.full(n_ranks, np.nan)
    unsure = np.zeros(n_ranks)  # the margin of the baseline in use
    on = np.zeros(n_ranks, dtype=bool)
    run_on = np.zeros(n_ranks, dtype=np.int32)
    run_off = np.zeros(n_ranks, dtype=np.int32)
    for s in range(n_steps):
        frozen = on | (cusum[0] > h / 2)
        fresh = ~(frozen & np.isfinite(base))
        base = np.where(fresh, trailing[s], base)
        unsure = np.where(fresh, margin[s], unsure)
        score = np.clip(e[s] - base, -cap, cap) - skew
        seen = np.isfinite(score)
        alarm = np.zeros(n_ranks, dtype=bool)
        for i, (k, hi) in enumerate(zip(ks, hs, strict=True)):
            cusum[i] = np.where(seen, np.maximum(0.0, cusum[i] + np.nan_to_num(score - k - unsure)), cusum[i])
            alarm |= cusum[i] >= hi
        restart = seen & (cusum[0] == 0.0)
        run_n = np.where(restart, 0.0, run_n + seen)
        run_sum = np.where(restart, 0.0, run_sum + np.where(seen, np.nan_to_num(score), 0.0))
        m, lev, lev_bar = med[s], level[s], bars[s]
        level_off = (rule.tolerance + lev_bar) / 2.0  # below it, a level flag clears (hysteresis)
        with np.errstate(invalid="ignore", divide="ignore"):
            # the change's size: its mean since the CUSUM rose (the maximum-likelihood estimate), and
            # the median of the last ``window`` steps (persistence: most recent steps are slow)
            size = run_sum / run_n
            change = alarm & (size >= 0.75 * delta) & (m - base >= persist) & (m >= delta / 2)
            slow = (change | (lev >= lev_bar)) & costly[s]
            near = (m - base < delta * rule.off_ratio) | (m < delta * rule.off_ratio)
            back = np.where(np.isfinite(base), near, m < level_off) & ~(lev >= level_off)
        gap = np.isnan(m)  # too few steps in the window (a rank missing rows): no evidence either way
        run_on = np.where(gap, run_on, np.where(slow, run_on + 1, 0))
        run_off = np.where(gap, run_off, np.where(back, run_off + 1, 0))
        cleared = on & (run_off >= rule.confirm)
        on = (on & ~cleared) | (~on & (run_on >= rule.confirm))
        cusum[:, cleared] = 0.0
        out[s] = on
    thresholds = {"noise": noise, "skew": skew, "cusum_h": h, "level_bar": bar, "min_slowdown": delta,
                  "tolerance": rule.tolerance}  # fmt: skip
    return out, thresholds
