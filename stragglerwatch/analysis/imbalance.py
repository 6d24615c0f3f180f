"""Load imbalance: ranks given unequal work in the same step, told apart from stragglers. Pure.

Design (docs/imbalance.md, "How the analysis separates the two"). Each step record may
carry the work its rank did (``work``: tokens, elements, what the loop noted). Per group of peers,
every timed phase ``y`` (data wait, forward, backward, optimizer, other) and busy time are fitted
with a two-way model with a slope per rank::

    y[s, r] = c[s] + g[r] + b[r] * work[s, r] + noise

``c`` takes what moves every rank in a step, ``g`` a rank's constant offset (a data straggler's
extra wait), ``b`` what one more unit of work costs on that rank (a compute straggler's is
larger: it is slow *per unit of work*). The slopes come from how each rank's time follows its own
work across steps, so a rank is never judged by the size of the batches it drew. The fit is
alternating least squares, with one round that drops outlying cells (stalls, spikes).

The *healthy slope* of a phase is the median of its ranks' slopes (the lower median while no rank
is known healthy, since stragglers only raise slopes; then the median of the ranks never flagged).
Detection then compares work-adjusted times: ``y - b_healthy * (work - the step's median work)``,
what each rank would have taken for the step's typical batch. Heavy batches leave no excess; a
rank slow for the same work keeps its excess.

Cost (what-if, as for stragglers): had every rank of a group been given the step's mean work, a
rank's busy time would have been its fitted time at the mean work plus its deviation from the fit,
scaled by the ratio of its fitted times at the mean and at its own work as far as the run's
deviations grow with the fitted time (measured: :func:`_proportional`; spikes judged apart), and
the step would have ended when the slowest of those did. The imbalance cost is the sum over steps of
the largest busy time minus the largest of those (a step where the slowest rank drew a light batch
counts against it), and its slowdown is ``S = T / (T - cost)``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from stragglerwatch.analysis.stages import Groups, nanmedian

#: The columns adjusted for work: the phases busy time is made of, then busy time itself.
ADJUSTED = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s", "busy_s")
#: Steps with work on at least two ranks of a group needed to fit anything.
MIN_STEPS = 8
#: Binomial deviations above its fair share of steps a rank must draw the heaviest work in to be named.
HEAVY_Z = 4.0
#: Deviations from the work fit beyond this many robust standard deviations are spikes (the cost's
#: what-if keeps them as they were instead of scaling them with the work).
SPIKE = 8.0
MIN_SPIKES = 30
#: A rank whose work varies across steps by less than this fraction of the spread across ranks
#: tells nothing by its own slope (a static heavy shard): the slopes then come from across ranks.
STATIC = 0.1


@dataclass
class Imbalance:
    """The verdict on load imbalance (``detect``'s ``Verdict.imbalance``)."""

    unit: str
    steps: int  # steps with work on at least two ranks of a group
    detected: bool
    lost_seconds: float | None
    slowdown: float | None  # S that imbalance alone causes
    explained: float | None  # share of the spread of busy time across ranks that work explains
    seconds_per_unit: float | None  # a healthy rank's busy seconds per unit of work
    work_spread: float | None  # median over steps of (heaviest - mean) / mean work
    heaviest_ranks: list[int] = field(default_factory=list)  # drew the heaviest work far more often than their share
    heaviest_share: float | None = None  # of the steps, for the first of ``heaviest_ranks``
    phase_seconds_per_unit: dict[str, float] = field(default_factory=dict)  # healthy slope of each phase
    column: str = "work"  # the record's column fitted: ``work``, or ``work_elements`` (the padded shape)
    varies: bool = True  # the work differs between ranks or steps (False: the same batch every time)


@dataclass
class WorkModel:
    """Per column of :data:`ADJUSTED`: each rank's slope, and the healthy slope of each group."""

    slopes: dict[str, np.ndarray]  # column -> per rank (NaN: not identified)
    healthy: dict[str, np.ndarray]  # column -> per group
    steps: int


def usable(work: np.ndarray | None) -> bool:
    """Whether a run recorded work on enough steps to say anything."""
    return work is not None and work.size > 0 and int(np.sum(np.isfinite(work).sum(axis=1) >= 2)) >= MIN_STEPS


def recorded(values: dict[str, np.ndarray]) -> bool:
    """Whether either count of the work (``work``, ``work_elements``) is usable."""
    return usable(values.get("work")) or usable(values.get("work_elements"))


def uneven(values: dict[str, np.ndarray]) -> bool:
    """Whether in some step the ranks did different work (by either count): only then can work
    adjust anything (a job of fixed-shape batches records work that never differs)."""
    for name in ("work", "work_elements"):
        w = values.get(name)
        if usable(w):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                if bool(np.any(np.nanmax(w, axis=1) > np.nanmin(w, axis=1))):
                    return True
    return False


#: How much more of the busy spread the padded shape must explain than the counted work to be used.
SHAPE_MARGIN = 0.05


def _follows(busy: np.ndarray, w: np.ndarray) -> float:
    """Squared correlation of busy time with work across the ranks of each step (pooled)."""
    ok = np.isfinite(busy) & np.isfinite(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        b, x = np.where(ok, busy, np.nan), np.where(ok, w, np.nan)
        db, dx = b - np.nanmean(b, axis=1)[:, None], x - np.nanmean(x, axis=1)[:, None]
    sxy, sxx, syy = (float(np.nansum(a)) for a in (db * dx, dx * dx, db * db))
    return sxy * sxy / (sxx * syy) if sxx > 0 and syy > 0 else 0.0


#: What :func:`basis` returns: the values with the fitted work as ``work``, its unit, its column.
Basis = tuple[dict[str, np.ndarray], str, str]


def basis(values: dict[str, np.ndarray], unit: str) -> Basis | None:
    """The work the analysis fits (``values`` with it as ``work``), its unit and the record's column
    it came from, or None without any: the counted work, or the input's padded shape
    (``work_elements``) where busy time follows that clearly better (dynamic padding: the compute
    runs over the padding too)."""
    work, shape = values.get("work"), values.get("work_elements")
    counted = usable(work)
    if shape is not None and usable(shape) and not (counted and np.array_equal(work, shape, equal_nan=True)):
        busy = values["busy_s"]
        if not counted or _follows(busy, shape) > _follows(busy, work) + SHAPE_MARGIN:
            padded = "padded tokens" if unit == "tokens" else "padded elements"
            return {**values, "work": shape}, padded, "work_elements"
    return (values, unit, "work") if counted else None


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def _rank_slopes(y: np.ndarray, w: np.ndarray, ok: np.ndarray, iters: int = 40) -> np.ndarray:
    """Each column's slope of ``y`` on ``w`` in the two-way model, over the cells ``ok``."""
    yz, wz, m = np.where(ok, y, 0.0), np.where(ok, w, 0.0), ok.astype(float)
    n = m.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.nan_to_num(nanmedian(np.where(ok, y, np.nan), axis=1))
        wm = wz.sum(axis=0) / n
        dw = (wz - wm) * m
        sxx = (dw * dw).sum(axis=0)
        beta = np.full(y.shape[1], np.nan)
        for _ in range(iters):
            r = (yz - c[:, None]) * m
            rm = r.sum(axis=0) / n
            new = np.where(sxx > 0, (dw * (r - rm)).sum(axis=0) / np.where(sxx > 0, sxx, 1.0), np.nan)
            b = np.where(np.isfinite(new), new, np.nanmedian(new) if np.isfinite(new).any() else 0.0)
            g = np.nan_to_num(rm - b * wm)
            per_step = m.sum(axis=1)
            c_new = np.where(per_step > 0, ((yz - g - b * wz) * m).sum(axis=1) / np.maximum(per_step, 1), c)
            done = np.allclose(new, beta, rtol=1e-4, atol=1e-15, equal_nan=True)
            beta, c = new, c_new
            if done:
                break
    return beta


def _robust_slopes(y: np.ndarray, w: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """:func:`_rank_slopes`, then again without the cells far off the fit (stalls, spikes)."""
    beta = _rank_slopes(y, w, ok)
    b = np.nan_to_num(beta, nan=float(np.nanmedian(beta)) if np.isfinite(beta).any() else 0.0)
    r = np.where(ok, y - b * w, np.nan)
    r = r - nanmedian(r, axis=1)[:, None]
    r = r - nanmedian(r, axis=0)[None, :]
    mad = float(np.nanmedian(np.abs(r))) if np.isfinite(r).any() else 0.0
    if mad > 0:
        keep = ok & (np.abs(np.nan_to_num(r)) <= 6.0 * 1.4826 * mad)
        if keep.sum() >= 0.5 * ok.sum():
            beta = _rank_slopes(y, w, keep)
    return beta


def _pooled_slope(y: np.ndarray, w: np.ndarray, ok: np.ndarray) -> float:
    """One slope from the differences across ranks within each step (step effects only)."""
    yc = np.where(ok, y, np.nan)
    wc = np.where(ok, w, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dy = yc - np.nanmean(yc, axis=1)[:, None]
        dw = wc - np.nanmean(wc, axis=1)[:, None]
    sxx = float(np.nansum(dw * dw))
    return float(np.nansum(dw * dy)) / sxx if sxx > 0 else float("nan")


def _is_static(w: np.ndarray, ok: np.ndarray) -> bool:
    """Work hardly varies within each rank across steps, compared with across ranks."""
    wc = np.where(ok, w, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        within = float(np.nanmean(np.nanvar(wc, axis=0)))
        across = float(np.nanmean(np.nanvar(wc, axis=1)))
    return not within > STATIC * across and across > 0


def fit(values: dict[str, np.ndarray], groups: Groups, healthy: np.ndarray | None = None) -> WorkModel:
    """The work model of every :data:`ADJUSTED` column. ``healthy``: per rank, known healthy (None:
    none known yet, the lower median of the slopes is the healthy one)."""
    w = values["work"]
    ok_all = np.isfinite(w) & np.isfinite(values["busy_s"])
    ok_all &= (ok_all.sum(axis=1) >= 2)[:, None]
    steps = int(ok_all.any(axis=1).sum())
    slopes = {c: np.full(w.shape[1], np.nan) for c in ADJUSTED}
    healthy_slope = {c: np.zeros(len(groups.members)) for c in ADJUSTED}
    for gi, idx in enumerate(groups.members):
        if len(idx) < 2:
            continue
        ok, wg = ok_all[:, idx], w[:, idx]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if not np.any(np.nanmax(np.where(ok, wg, np.nan), axis=1) > np.nanmin(np.where(ok, wg, np.nan), axis=1)):
                continue  # the same work on every rank of every step: nothing to fit, no imbalance
        group_static = _is_static(wg, ok)
        chosen = idx if healthy is None else [j for j in idx if healthy[j]] or list(idx)
        pick = np.isin(idx, chosen)
        for c in ADJUSTED:
            y = np.nan_to_num(values[c][:, idx].astype(np.float64)) if c != "busy_s" else values[c][:, idx]
            cell_ok = ok & np.isfinite(y)
            if group_static:
                s = _pooled_slope(y, wg, cell_ok & pick[None, :])
                slopes[c][idx] = s
                healthy_slope[c][gi] = s if np.isfinite(s) else 0.0
                continue
            beta = _robust_slopes(y, wg, cell_ok)
            slopes[c][idx] = beta
            known = np.sort(beta[pick][np.isfinite(beta[pick])])
            if known.size:
                healthy_slope[c][gi] = known[(known.size - 1) // 2] if healthy is None else float(np.median(known))
    return WorkModel(slopes, healthy_slope, steps)


def step_reference(w: np.ndarray, groups: Groups, how: str = "median") -> np.ndarray:
    """Per step and rank, the median (or mean) work of the rank's group in that step."""
    ref = np.full_like(w, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for idx in groups.members:
            col = nanmedian(w[:, idx], axis=1) if how == "median" else np.nanmean(w[:, idx], axis=1)
            ref[:, idx] = col[:, None]
    return ref


def adjust(values: dict[str, np.ndarray], model: WorkModel, groups: Groups) -> dict[str, np.ndarray]:
    """``values`` with every :data:`ADJUSTED` column as it would be for the step's median work."""
    w = values["work"]
    dw = np.nan_to_num(w - step_reference(w, groups))
    out = dict(values)
    for c in ADJUSTED:
        slope = model.healthy[c][groups.index][None, :]
        col = values[c].astype(np.float64) - slope * dw
        out[c] = np.maximum(col, 0.0) if c != "busy_s" else np.where(np.isnan(values[c]), np.nan, col)
    return out


def assess(values: dict[str, np.ndarray], model: WorkModel, groups: Groups, flagged: np.ndarray, ranks: np.ndarray,
           job_seconds: float, min_slowdown: float, unit: str = "", column: str = "work") -> Imbalance:  # fmt: skip
    """The imbalance verdict: its cost (what-if: equal work per step), the share of the busy spread
    work explains, the heaviest ranks. ``flagged``: per rank, a straggler somewhere (its own slope
    is used for it, the healthy one for the others)."""
    w, busy = values["work"], values["busy_s"]
    ok = np.isfinite(w) & np.isfinite(busy)
    healthy = model.healthy["busy_s"][groups.index]
    own = model.slopes["busy_s"]
    slope = np.where(flagged & np.isfinite(own), own, healthy)[None, :]
    mean_w = step_reference(w, groups, "mean")
    dw = np.where(ok, w - mean_w, 0.0)
    real = np.where(ok, busy, -np.inf)
    even = np.where(ok, _even_busy(busy, w, mean_w, slope, ok), -np.inf)
    rows = ok.sum(axis=1) >= 2
    # per step it may be negative (the slowest rank drew a light batch: even work would have been slower)
    cost = real.max(axis=1) - even.max(axis=1) if busy.size else np.zeros(0)
    lost = max(0.0, float(cost[rows].sum()))
    explained = _explained(busy, dw, slope, ok & rows[:, None], groups)
    per_unit = float(np.median(model.healthy["busy_s"]))
    spread, heaviest, share = _spread(w, ok & rows[:, None], ranks)
    slowdown = job_seconds / (job_seconds - lost) if job_seconds > lost > 0 else (1.0 if lost == 0 else None)
    detected = slowdown is not None and slowdown >= 1.0 + min_slowdown and per_unit > 0
    phases = {c.removesuffix("_s"): float(np.median(model.healthy[c])) for c in ADJUSTED if c != "busy_s"}
    return Imbalance(unit=unit, steps=model.steps, detected=bool(detected), lost_seconds=lost,
                     slowdown=slowdown, explained=explained, seconds_per_unit=per_unit, work_spread=spread,
                     heaviest_ranks=heaviest, heaviest_share=share, phase_seconds_per_unit=phases,
                     column=column,
                     varies=bool(ok.any() and np.nanmax(w[ok]) > np.nanmin(w[ok])))  # fmt: skip


def _even_busy(busy: np.ndarray, w: np.ndarray, mean_w: np.ndarray, slope: np.ndarray, ok: np.ndarray
               ) -> np.ndarray:  # fmt: skip
    """Per cell, a rank's busy time had it been given the step's mean work: its fitted time at the
    mean work (``intercept + slope * work``, the intercept its median of ``busy - slope * work``) plus
    its deviation from the fit, scaled as far as the run's deviations grow with the fitted time
    (:func:`_proportional`): noise that multiplies a rank's compute (a slow moment) scales with the
    work it would have had, noise that does not (an OS hiccup) stays. The part of a deviation beyond
    ``SPIKE`` robust deviations of its rank (a stall, a slow excursion) is judged the same way apart,
    from those parts alone (kept as it was with fewer than ``MIN_SPIKES`` of them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        intercept = np.nanmedian(np.where(ok, busy - slope * w, np.nan), axis=0)[None, :]
        own, even = intercept + slope * w, intercept + slope * mean_w
        ratio = np.where(ok & (own > 0) & (even > 0), even / np.where(own > 0, own, 1.0), 1.0)
        ratio = np.clip(np.nan_to_num(ratio, nan=1.0), 0.0, 10.0)
        dev = np.where(ok, busy - own, 0.0)
        bound = SPIKE * 1.4826 * np.nanmedian(np.where(ok, np.abs(dev), np.nan), axis=0)[None, :]
        typical = np.clip(dev, -np.nan_to_num(bound), np.nan_to_num(bound))
    tail = dev - typical
    share = _proportional(np.abs(typical), own, ok)
    spikes = ok & (tail != 0)
    tail_share = _proportional(np.abs(tail), own, spikes) if int(spikes.sum()) >= MIN_SPIKES else 0.0
    return even + typical * (1.0 + share * (ratio - 1.0)) + tail * (1.0 + tail_share * (ratio - 1.0))


def _proportional(size: np.ndarray, own: np.ndarray, ok: np.ndarray) -> float:
    """How far (0..1) deviations grow in proportion with the fitted time: the elasticity of their
    median size between the cells above and below the median fitted time (1: they double as it
    doubles, noise that multiplies the compute; 0: they stay, noise that adds to it). Medians, so
    that a few huge deviations decide nothing."""
    x, y = own[ok], size[ok]
    if x.size < 4 or not np.isfinite(x).all():
        return 0.0
    high = x > np.median(x)
    if not high.any() or high.all():
        return 0.0
    x_hi, x_lo, y_hi, y_lo = (float(np.median(v)) for v in (x[high], x[~high], y[high], y[~high]))
    if not (x_lo > 0 and x_hi > 1.01 * x_lo and y_lo > 0 and y_hi > 0):
        return 0.0
    return float(np.clip(np.log(y_hi / y_lo) / np.log(x_hi / x_lo), 0.0, 1.0))


def _explained(busy: np.ndarray, dw: np.ndarray, slope: np.ndarray, ok: np.ndarray, groups: Groups) -> float | None:
    """1 - residual / total spread of busy time across the ranks of each step."""
    b = np.where(ok, busy, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        db = b - step_reference(b, groups, "mean")
    total = float(np.nansum(db * db))
    if not total > 0:
        return None
    resid = float(np.nansum((db - slope * dw) ** 2 * ok))
    return float(min(1.0, max(0.0, 1.0 - resid / total)))


def _spread(w: np.ndarray, ok: np.ndarray, ranks: np.ndarray) -> tuple[float | None, list[int], float | None]:
    """Median (heaviest - mean) / mean work per step; the ranks heaviest far more often than their share."""
    rows = ok.any(axis=1)
    if not rows.any():
        return None, [], None
    wv = np.where(ok, w, np.nan)[rows]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(wv, axis=1)
        spread = float(np.nanmedian(_ratio(np.nanmax(wv, axis=1) - mean, mean)))
    top = np.argmax(np.where(np.isfinite(wv), wv, -np.inf), axis=1)
    varies = np.nanmax(wv, axis=1) > np.nanmin(wv, axis=1)
    n, r = int(varies.sum()), w.shape[1]
    counts = np.bincount(top[varies], minlength=r).astype(float)
    fair = 1.0 / max(r, 1)
    # heaviest more often than chance allows (HEAVY_Z binomial deviations) and by a margin
    z = (counts - n * fair) / max(np.sqrt(n * fair * (1.0 - fair)), 1e-12)
    shares = counts / max(n, 1)
    heavy = [int(ranks[j]) for j in np.argsort(-counts) if r >= 2 and z[j] > HEAVY_Z and shares[j] >= 1.5 * fair]
    share = float(shares.max()) if heavy else None
    return (spread if np.isfinite(spread) else None), heavy, share


def advice(im: Imbalance) -> list[str]:
    """What to try against a detected imbalance, from what was measured (none when not detected)."""
    if not im.detected or im.lost_seconds is None:
        return []
    unit = im.unit or "units of work"
    lines = []
    if im.heaviest_ranks:
        who = ", ".join(str(r) for r in im.heaviest_ranks[:4])
        lines.append(f"rank(s) {who} drew the heaviest batch in {im.heaviest_share:.0%} of the steps, more than "
                     f"chance gives: their data shard holds more {unit}; shard or shuffle so that every rank "
                     f"gets the same {unit} per step")
    if im.unit.startswith("padded"):
        lines.append("busy time follows the padded shape of the batches, not their real tokens: each rank "
                     "computes over its batch's padding; bucket batches by length (less padding, similar "
                     "shapes on every rank), pad to one fixed length, or pack sequences")
    elif im.unit == "tokens":
        lines.append("the heaviest batch holds the other ranks up each step: pad and mask to a fixed length or "
                     "bucket batches by length; pack sequences into a fixed token budget per batch; or sample so "
                     "that every rank gets the same number of tokens per step (token-balanced sampling)")
    else:
        lines.append(f"the heaviest batch holds the other ranks up each step: pad to fixed shapes or bucket "
                     f"batches by shape so that every rank's batch holds the same {unit}; where {unit} are not "
                     "what costs time, count the real work with watch.note_work(n, unit)")
    data = im.phase_seconds_per_unit.get("data_wait", 0.0)
    if im.seconds_per_unit and data >= 0.3 * im.seconds_per_unit:
        lines.append(f"the data wait grows with the work too ({data / im.seconds_per_unit:.0%} of the cost of a unit): "
                     "the loader's cost per sample is exposed; pre-tokenise, cache or add loader workers")
    return lines
