"""Load imbalance: ranks given unequal work in the same step, told apart from stragglers. Pure.

Design (docs/imbalance.md, "How the analysis separates the two"). Each step record may
carry the work its rank did (``work``: tokens, elements, what the loop noted). Per group of peers,
every timed phase ``y`` (data wait, forward, backward, optimizer, other) and busy time are fitted
with a two-way model with a slope per rank::

    y[s, r] = c[s] + g[r] + b[r] * work[s, r] + noise

``c`` takes what moves every rank in a step, ``g`` a rank's constant offset (a data straggler's
extra wait), ``b`` what one more unit of work costs on that rank (a compute straggler's is
larger: it is slow *per unit of work*). The slopes come from how each rank's time follows its own
work across steps, so a rank is never judged by the size of the batches it drew. The fit
(``workfit.py``) is alternating least squares in rounds over the steps and the ranks, with a refit
without outlying cells (stalls, spikes); every figure here is computed in the same rounds
(``rounds.py``), so the local engine and Ray give the same verdict.

The *healthy slope* of a phase is the median of its ranks' slopes (the lower median while no rank
is known healthy, since stragglers only raise slopes; then the median of the ranks never flagged).
Detection then compares work-adjusted times: ``y - b_healthy * (work - the step's median work)``,
what each rank would have taken for the step's typical batch. Heavy batches leave no excess; a
rank slow for the same work keeps its excess.

Cost (what-if, as for stragglers): had every rank of a group been given the step's mean work, a
rank's busy time would have been its fitted time at the mean work plus its deviation from the fit,
scaled by the ratio of its fitted times at the mean and at its own work as far as the ranks'
deviations grow with their fitted time (measured per rank, the median taken: :func:`_elasticity`;
spikes judged apart, pooled: :func:`_proportional`), and
the step would have ended when the slowest of those did. The imbalance cost is the sum over steps of
the largest busy time minus the largest of those (a step where the slowest rank drew a light batch
counts against it), and its slowdown is ``S = T / (T - cost)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis import workfit
from stragglerwatch.analysis.rounds import (
    Rounds,
    Whole,
    joined,
    nanmean_rows,
    on_threads,
    rowsum,
    slices,
    thinned,
)
from stragglerwatch.analysis.stages import Groups, nanmedian
from stragglerwatch.analysis.workfit import ADJUSTED, fit_every

__all__ = ["ADJUSTED", "Imbalance", "WorkModel", "adjust", "advice", "assess", "basis", "model"]
#: Steps with work on at least two ranks of a group needed to fit anything.
MIN_STEPS = 8
#: Binomial deviations above its fair share of steps a rank must draw the heaviest work in to be named.
HEAVY_Z = 4.0
#: Deviations from the work fit beyond this many robust standard deviations are spikes (the cost's
#: what-if keeps them as they were instead of scaling them with the work).
SPIKE = 8.0
MIN_SPIKES = 30


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
    ref: np.ndarray  # steps x groups: the group's median work in the step (times are adjusted to it)
    every: int = 1  # the fit took every ``every``-th step of the run (``workfit.Measured.every``)


#: The record's two counts of the work: what the loop counted, and the input's padded shape.
WORK_COLUMNS = ("work", "work_elements")


def usable(work: np.ndarray | None) -> bool:
    """Whether a run recorded work on enough steps to say anything."""
    return work is not None and work.size > 0 and int(np.sum(np.isfinite(work).sum(axis=1) >= 2)) >= MIN_STEPS


def recorded(values: dict[str, np.ndarray]) -> bool:
    """Whether either count of the work (``work``, ``work_elements``) is usable."""
    return usable(values.get("work")) or usable(values.get("work_elements"))


def uneven(values: dict[str, np.ndarray]) -> bool:
    """Whether in some step the ranks did different work (by either count): only then can work
    adjust anything (a job of fixed-shape batches records work that never differs)."""
    for name in WORK_COLUMNS:
        w = values.get(name)
        if usable(w):
            with ignoring():
                if bool(np.any(np.nanmax(w, axis=1) > np.nanmin(w, axis=1))):
                    return True
    return False


#: How much more of the busy spread the padded shape must explain than the counted work to be used.
SHAPE_MARGIN = 0.05


def steps_basis(values: dict[str, np.ndarray], rows: slice, cols: slice, every: int = 1) -> dict[str, np.ndarray]:
    """A step round: per step and count of the work, whether two ranks or more recorded it and whether the two
    counts agree; the terms of the squared correlation of busy time with it across the ranks, on the steps the
    work fit takes (every ``every``-th of the run; nil on the others)."""
    busy = values["busy_s"]
    out: dict[str, np.ndarray] = {}
    sub, _ = thinned(values, rows, every)
    taken = np.arange(rows.start, rows.stop) % every == 0
    for name in WORK_COLUMNS:
        w = values.get(name)
        out[f"{name}:usable"] = (np.isfinite(w).sum(axis=1) if w is not None else np.zeros(len(busy))) >= 2
        w = sub.get(name)
        if w is None:
            w = np.full(sub["busy_s"].shape, np.nan)
        ok = np.isfinite(sub["busy_s"]) & np.isfinite(w)
        with ignoring():
            b, x = np.where(ok, sub["busy_s"], np.nan), np.where(ok, w, np.nan)
            db, dx = b - nanmean_rows(b)[:, None], x - nanmean_rows(x)[:, None]
            for key, v in (("sxy", db * dx), ("sxx", dx * dx), ("syy", db * db)):
                out[f"{name}:{key}"] = np.zeros(len(busy))
                out[f"{name}:{key}"][taken] = rowsum(np.nan_to_num(v))
    w, e = values.get("work"), values.get("work_elements")
    same = np.isnan(w) & np.isnan(e) | (w == e) if w is not None and e is not None else np.zeros(busy.shape, bool)
    out["same"] = same.all(axis=1)
    return out


#: What :func:`basis` returns: the values with the fitted work as ``work``, its unit, its column.
Basis = tuple[dict[str, np.ndarray], str, str]


def choose(rows: dict[str, np.ndarray], unit: str) -> tuple[str, str] | None:
    """From :func:`steps_basis` over every step: the column the analysis fits and its unit, or None without
    any: the counted work, or the input's padded shape (``work_elements``) where busy time follows that
    clearly better (dynamic padding: the compute runs over the padding too)."""

    def follows(name: str) -> float:
        sxy, sxx, syy = (float(rows[f"{name}:{k}"].sum()) for k in ("sxy", "sxx", "syy"))
        return sxy * sxy / (sxx * syy) if sxx > 0 and syy > 0 else 0.0

    counted = int(rows["work:usable"].sum()) >= MIN_STEPS
    shape = int(rows["work_elements:usable"].sum()) >= MIN_STEPS and not (counted and bool(rows["same"].all()))
    if shape and (not counted or follows("work_elements") > follows("work") + SHAPE_MARGIN):
        return "work_elements", "padded tokens" if unit == "tokens" else "padded elements"
    return ("work", unit) if counted else None


def basis(values: dict[str, np.ndarray], unit: str) -> Basis | None:
    """:func:`choose` on a whole steps x ranks ``values``: the values with the chosen work as ``work``."""
    if not recorded(values):
        return None  # what ``choose`` would find, without the rest of its round
    chosen = choose(joined(Whole(values).by_steps(steps_basis, fit_every(len(values["busy_s"])))), unit)
    if chosen is None:
        return None
    column, unit = chosen
    return {**values, "work": values[column]}, unit, column


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def model(rounds: Rounds, groups: Groups, measured: workfit.Measured, healthy: np.ndarray | None = None
          ) -> WorkModel:  # fmt: skip
    """The work model: each rank's slope, and each group's healthy slope, the median of its ranks' (the lower
    median while no rank is known healthy, ``healthy`` None: stragglers only raise slopes; else the median
    of the ``healthy`` ranks'). A static group's slope is pooled over its healthy ranks (a step round)."""
    slopes = {c: v.copy() for c, v in measured.slopes.items()}
    healthy_slope = {c: np.zeros(len(groups.members)) for c in ADJUSTED}
    pick = np.ones(len(groups.index), dtype=bool) if healthy is None else healthy.astype(bool).copy()
    for idx in groups.members:
        if not pick[idx].any():
            pick[idx] = True
    static = workfit.pooled(rounds, groups, measured, pick) if measured.static.any() else {}
    for gi, idx in enumerate(groups.members):
        if not measured.fitted[gi]:
            continue
        for c in ADJUSTED:
            if measured.static[gi]:
                s = static[c][gi]
                slopes[c][idx] = s
                healthy_slope[c][gi] = s if np.isfinite(s) else 0.0
                continue
            beta = slopes[c][idx]
            known = np.sort(beta[pick[idx] & np.isfinite(beta)])
            if known.size:
                healthy_slope[c][gi] = known[(known.size - 1) // 2] if healthy is None else float(np.median(known))
    return WorkModel(slopes, healthy_slope, measured.steps, measured.ref, measured.every)


def same_busy(a: WorkModel, b: WorkModel) -> bool:
    """Whether two models adjust busy time alike (its healthy slopes equal, bit for bit): the flags, which read
    busy time alone of the adjusted columns, are then the same."""
    return np.array_equal(a.healthy["busy_s"], b.healthy["busy_s"])


def step_mean(w: np.ndarray, groups: Groups) -> np.ndarray:
    """Per step and rank, the mean of ``w`` over the rank's group in that step."""
    ref = np.full_like(w, np.nan)
    for idx in groups.members:
        ref[:, idx] = nanmean_rows(w[:, idx])[:, None]
    return ref


def adjust(values: dict[str, np.ndarray], model: WorkModel, groups: Groups, rows: slice = slice(None),
           cols: slice = slice(None), before: tuple[WorkModel, dict[str, np.ndarray]] | None = None
           ) -> dict[str, np.ndarray]:  # fmt: skip
    """``values`` (the run's ``rows`` and ``cols``; the fitted work as ``work``) with every :data:`ADJUSTED`
    column as it would be for the step's median work. ``before``: another model and what it adjusted the same
    ``values`` to; a column whose healthy slopes are the same in both is taken from it as it is."""
    gidx = groups.index[cols]
    ref = model.ref[rows]  # per step and group
    one = len(groups.members) == 1  # one group: its reference is one column, taken as it is
    out = dict(values)
    same_ref = before is not None and (before[0].ref is model.ref or np.array_equal(before[0].ref, model.ref))
    todo = []
    for c in ADJUSTED:
        if same_ref and np.array_equal(before[0].healthy[c], model.healthy[c]):  # type: ignore[index]
            out[c] = before[1][c]  # type: ignore[index]
        else:
            todo.append(c)
    if not todo:
        return out
    n, r = values["work"].shape
    made = {c: np.empty((n, r), order="F") for c in todo}

    def part(cs: slice) -> None:  # element by element: slices of ranks, each its temporaries in the caches
        dw = np.nan_to_num(values["work"][:, cs] - ref[:, slice(0, 1) if one else gidx[cs]], copy=False)
        for c in todo:
            col = made[c][:, cs]
            np.multiply(model.healthy[c][gidx[cs]][None, :], dw, out=col)
            np.subtract(values[c][:, cs], col, out=col, dtype=np.float64)  # in float64 whatever the column's type
            if c != "busy_s":
                np.maximum(col, 0.0, out=col)
            else:
                col[np.isnan(values[c][:, cs])] = np.nan

    on_threads([lambda cs=cs: part(cs) for cs in slices(r, n)])
    out.update(made)
    return out


def ranks_terms(values: dict[str, np.ndarray], rows: slice, cols: slice, slope: np.ndarray
                ) -> dict[str, np.ndarray]:  # fmt: skip
    """A rank round on the steps the work fit takes: per rank, the intercept of its fit (its median of
    ``busy - slope * work``), the bound of its typical deviations from the fit (``SPIKE`` robust deviations) and
    how far they grow with its fitted time (:func:`_elasticity`). Medians of a rank's own cells, as good from the
    fit's 2,048 steps as from every step (``workfit.FIT_STEPS``), and that much cheaper."""
    w, busy = values["work"], values["busy_s"]
    ok = np.isfinite(w) & np.isfinite(busy)
    b = slope[cols][None, :]
    with ignoring():
        intercept = nanmedian(np.where(ok, busy - b * w, np.nan), axis=0)
        own = intercept[None, :] + b * w
        dev = np.where(ok, busy - own, 0.0)
        bound = SPIKE * 1.4826 * nanmedian(np.where(ok, np.abs(dev), np.nan), axis=0)
        typical = np.clip(dev, -np.nan_to_num(bound), np.nan_to_num(bound))
    return {"intercept": intercept, "bound": bound, "share": _elasticity(np.abs(typical), own, ok)}


def ranks_spikes(values: dict[str, np.ndarray], rows: slice, cols: slice, slope: np.ndarray,
                 terms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # fmt: skip
    """A rank round on every step: the fitted time and size of each deviation beyond its rank's bound (a spike)."""
    w, busy = values["work"], values["busy_s"]
    ok = np.isfinite(w) & np.isfinite(busy)
    with ignoring():
        own = terms["intercept"][cols][None, :] + slope[cols][None, :] * w
        dev = np.where(ok, busy - own, 0.0)
        bound = np.nan_to_num(terms["bound"][cols])
        tail = dev - np.clip(dev, -bound, bound)
    spikes = ok & (tail != 0)
    return {"spike_own": own[spikes], "spike_size": np.abs(tail[spikes])}


def steps_cost(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups, slope: np.ndarray,
               terms: dict[str, np.ndarray], share: float, tail_share: float) -> dict[str, np.ndarray]:  # fmt: skip
    """A step round: per step, the busiest rank's busy time as it was and as it would have been with the
    step's mean work on every rank (:func:`_even_busy`); the terms of the share of the busy spread that work
    explains; the work's spread, its heaviest rank and its range."""
    w, busy = values["work"], values["busy_s"]
    ok = np.isfinite(w) & np.isfinite(busy)
    rows2 = ok.sum(axis=1) >= 2
    mean_w = step_mean(w, groups)
    b = slope[None, :]
    real = np.where(ok, busy, -np.inf)
    even = np.where(ok, _even_busy(busy, w, mean_w, b, ok, terms, share, tail_share), -np.inf)
    used = ok & rows2[:, None]
    dw = np.where(ok, w - mean_w, 0.0)
    bv = np.where(used, busy, np.nan)
    wv = np.where(used, w, np.nan)
    with ignoring():
        db = bv - step_mean(bv, groups)
        mean = nanmean_rows(wv)
        top_w, low_w = np.nanmax(wv, axis=1), np.nanmin(wv, axis=1)
    empty = np.zeros(len(busy))
    return {"real": real.max(axis=1) if busy.size else empty, "even": even.max(axis=1) if busy.size else empty,
            "rows": rows2, "total": rowsum(np.nan_to_num(db * db)),
            "resid": rowsum(np.nan_to_num((db - b * dw) ** 2 * used)),
            "spread": _ratio(top_w - mean, mean), "varies": top_w > low_w, "any": used.any(axis=1),
            "top": np.argmax(np.where(used, w, -np.inf), axis=1) if busy.size else empty.astype(np.int64),
            "max": np.where(used, w, -np.inf).max(axis=1) if busy.size else empty,
            "min": np.where(used, w, np.inf).min(axis=1) if busy.size else empty}  # fmt: skip


def assess(rounds: Rounds, model: WorkModel, groups: Groups, flagged: np.ndarray, ranks: np.ndarray,
           job_seconds: float, min_slowdown: float, unit: str = "", column: str = "work") -> Imbalance:  # fmt: skip
    """The imbalance verdict: its cost (what-if: equal work per step), the share of the busy spread work
    explains, the heaviest ranks. ``flagged``: per rank, a straggler somewhere (its own slope is used for
    it, the healthy one for the others). ``rounds`` reach the values, with the fitted work as ``work``."""
    own = model.slopes["busy_s"]
    slope = np.where(flagged & np.isfinite(own), own, model.healthy["busy_s"][groups.index])
    terms = joined(rounds.thin(model.every, ("work", "busy_s")).by_ranks(ranks_terms, slope))
    terms.update(joined(rounds.by_ranks(ranks_spikes, slope, terms)))
    known = terms["share"][np.isfinite(terms["share"])]
    share = float(np.median(known)) if known.size else 0.0
    n_spikes = terms["spike_own"].size
    tail_share = (_proportional(terms["spike_size"], terms["spike_own"], np.ones(n_spikes, dtype=bool))
                  if n_spikes >= MIN_SPIKES else 0.0)  # fmt: skip
    st = joined(rounds.by_steps(steps_cost, groups, slope, terms, share, tail_share))
    # per step it may be negative (the slowest rank drew a light batch: even work would have been slower)
    lost = max(0.0, float((st["real"] - st["even"])[st["rows"]].sum()))
    total = float(st["total"].sum())
    explained = min(1.0, max(0.0, 1.0 - float(st["resid"].sum()) / total)) if total > 0 else None
    per_unit = float(np.median(model.healthy["busy_s"]))
    spread, heaviest, top_share = _spread(st, ranks)
    slowdown = job_seconds / (job_seconds - lost) if job_seconds > lost > 0 else (1.0 if lost == 0 else None)
    detected = slowdown is not None and slowdown >= 1.0 + min_slowdown and per_unit > 0
    phases = {c.removesuffix("_s"): float(np.median(model.healthy[c])) for c in ADJUSTED if c != "busy_s"}
    seen = st["any"]
    varies = bool(seen.any() and st["max"][seen].max() > st["min"][seen].min())
    return Imbalance(unit=unit, steps=model.steps, detected=bool(detected), lost_seconds=lost,
                     slowdown=slowdown, explained=explained, seconds_per_unit=per_unit, work_spread=spread,
                     heaviest_ranks=heaviest, heaviest_share=top_share, phase_seconds_per_unit=phases,
                     column=column, varies=varies)  # fmt: skip


def _even_busy(busy: np.ndarray, w: np.ndarray, mean_w: np.ndarray, slope: np.ndarray, ok: np.ndarray,
               terms: dict[str, np.ndarray], share: float, tail_share: float) -> np.ndarray:  # fmt: skip
    """Per cell, a rank's busy time had it been given the step's mean work: its fitted time at the
    mean work (``intercept + slope * work``, the intercept its median of ``busy - slope * work``) plus
    its deviation from the fit, scaled as far as the ranks' deviations grow with their fitted time
    (``share``): noise that multiplies a rank's compute (a slow moment) scales with the work it would
    have had, noise that does not (an OS hiccup) stays. The part of a deviation beyond its rank's
    ``SPIKE`` robust deviations (a stall, a slow excursion) is judged the same way apart (``tail_share``,
    from those parts alone, pooled over the ranks; kept as it was with fewer than ``MIN_SPIKES`` of them)."""
    intercept, bound = terms["intercept"][None, :], terms["bound"][None, :]
    with ignoring():
        own, even = intercept + slope * w, intercept + slope * mean_w
        ratio = np.where(ok & (own > 0) & (even > 0), even / np.where(own > 0, own, 1.0), 1.0)
        ratio = np.clip(np.nan_to_num(ratio, nan=1.0), 0.0, 10.0)
        dev = np.where(ok, busy - own, 0.0)
        typical = np.clip(dev, -np.nan_to_num(bound), np.nan_to_num(bound))
    tail = dev - typical
    return even + typical * (1.0 + share * (ratio - 1.0)) + tail * (1.0 + tail_share * (ratio - 1.0))


def _elasticity(size: np.ndarray, own: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Per column (rank), :func:`_proportional` of its cells: NaN where its fitted time hardly varies (it
    cannot tell), 0 where its deviations are nil."""
    x, y = np.where(ok, own, np.nan), np.where(ok, size, np.nan)
    with ignoring():
        high = ok & (x > nanmedian(x, axis=0)[None, :])
        low = ok & ~high
        x_hi, x_lo = nanmedian(np.where(high, x, np.nan), axis=0), nanmedian(np.where(low, x, np.nan), axis=0)
        y_hi, y_lo = nanmedian(np.where(high, y, np.nan), axis=0), nanmedian(np.where(low, y, np.nan), axis=0)
        tells = (ok.sum(axis=0) >= 4) & high.any(axis=0) & low.any(axis=0) & (x_lo > 0) & (x_hi > 1.01 * x_lo)
        grows = (y_lo > 0) & (y_hi > 0)
        e = np.clip(np.log(y_hi / np.where(grows, y_lo, 1.0)) / np.log(x_hi / np.where(tells, x_lo, 1.0)), 0.0, 1.0)
    return np.where(tells, np.where(grows, e, 0.0), np.nan)


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


def _spread(st: dict[str, np.ndarray], ranks: np.ndarray) -> tuple[float | None, list[int], float | None]:
    """Median (heaviest - mean) / mean work per step; the ranks heaviest far more often than their share."""
    rows = st["any"]
    if not rows.any():
        return None, [], None
    ratios = st["spread"][rows]
    ratios = ratios[np.isfinite(ratios)]
    spread = float(np.median(ratios)) if ratios.size else None
    varies, top = st["varies"][rows], st["top"][rows]
    n, r = int(varies.sum()), len(ranks)
    counts = np.bincount(top[varies], minlength=r).astype(float)
    fair = 1.0 / max(r, 1)
    # heaviest more often than chance allows (HEAVY_Z binomial deviations) and by a margin
    z = (counts - n * fair) / max(np.sqrt(n * fair * (1.0 - fair)), 1e-12)
    shares = counts / max(n, 1)
    heavy = [int(ranks[j]) for j in np.argsort(-counts) if r >= 2 and z[j] > HEAVY_Z and shares[j] >= 1.5 * fair]
    return spread, heavy, float(shares.max()) if heavy else None


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
