"""The work fit, in rounds (``rounds.py``): what one more unit of work costs each rank. Pure.

Per group of peers, every column ``y`` of :data:`ADJUSTED` is fitted with a two-way model with a slope
per rank (docs/imbalance.md)::

    y[s, r] = c[s] + g[r] + b[r] * work[s, r] + noise

by alternating least squares: the step levels ``c`` in a step round (every rank of a step), each rank's
offset ``g`` and slope ``b`` in a rank round (every step of a rank), until the slopes settle (relative
change under 1e-4, at most :data:`ITERATIONS` rounds). Then once more without the cells far off the fit
(stalls, spikes): beyond :data:`OUTLIER` robust deviations of the rank's own residuals, once the step's
and the rank's medians are taken out.

A group whose work hardly varies within each rank across steps, compared with across ranks (a static
heavy shard), tells nothing by a rank's own slope: its slope is pooled over the group's healthy ranks from
the differences across ranks within each step.

The fit takes every ``k``-th step, ``k`` the least that leaves at most :data:`FIT_STEPS` (a rank's slope
from 2,048 steps is as good as it gets; the fit's cost then stops growing with the run's length); the
steps it takes are fixed by their index in the run, so every engine takes the same.

Every figure of a round depends only on its slice's rows (step rounds) or columns (rank rounds), and every
sum over the run is taken by the driver code here over the joined per-step or per-rank arrays: the local
engine (one slice) and Ray (many) fit the same slopes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.rounds import Rounds, colsum, joined, nanvar_cols, nanvar_rows, rowsum
from stragglerwatch.analysis.stages import Groups, nanmedian

#: The columns adjusted for work: the phases busy time is made of, then busy time itself.
ADJUSTED = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s", "busy_s")
#: Steps the fit takes at most (every k-th step of the run).
FIT_STEPS = 2048
#: Rounds of the alternating fit at most (each a step round and a rank round).
ITERATIONS = 40
RTOL = 1e-4
#: Cells further off the fit than this many robust standard deviations of their rank are left out of the refit.
OUTLIER = 6.0
#: A group whose work varies within its ranks across steps by less than this fraction of its spread across
#: ranks is static: its slopes come from across ranks.
STATIC = 0.1


@dataclass
class Cut:
    """The cells the refit keeps (per column): within ``bound`` of ``y - b0 * work - rowmed - colmed``."""

    b0: dict[str, np.ndarray]  # per rank
    rowmed: dict[str, np.ndarray]  # steps x groups
    colmed: dict[str, np.ndarray]  # per rank
    bound: dict[str, np.ndarray]  # per rank (inf: every cell kept)
    # the cells of each column and slice once found (every round of the refit asks again for the same ones):
    # keyed by the slice and where its work lies in memory (a slice is a new view at every round), whose array is
    # held so that the memory stays its own
    kept: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False, compare=False)

    def cells(self, values: dict[str, np.ndarray], column: str, ok: np.ndarray, rows: slice, cols: slice,
              gidx: np.ndarray) -> np.ndarray:  # fmt: skip
        w = values["work"]
        key = (column, w.__array_interface__["data"][0], w.shape, w.strides, rows.start, rows.stop, cols.start,
               cols.stop)  # fmt: skip
        if key in self.kept:
            return self.kept[key][1]
        r = y_of(values, column) - self.b0[column][cols] * w - self.rowmed[column][rows][:, gidx]
        with np.errstate(invalid="ignore"):
            m = ok & (np.abs(r - self.colmed[column][cols]) <= self.bound[column][cols])
        self.kept[key] = (w, m)
        return m

    def __getstate__(self) -> dict:  # a copy sent elsewhere (a Ray task) finds its own cells
        return {**self.__dict__, "kept": {}}


@dataclass
class Measured:
    """What the rounds measured of the work; the model follows from it and the healthy ranks alone."""

    slopes: dict[str, np.ndarray]  # column -> per rank (NaN: not identified, or its group not fitted)
    fitted: np.ndarray  # per group: at least two ranks and work that differs between them in some step
    static: np.ndarray  # per group
    rows_ok: np.ndarray  # per step: work and busy time on at least two ranks
    every: int  # the fit took every ``every``-th step
    ref: np.ndarray  # steps x groups: the group's median work in the step (what times are adjusted to)
    steps: int


def y_of(values: dict[str, np.ndarray], column: str) -> np.ndarray:
    """A column as the fit takes it: phases a source does not time are zeros, busy time stays NaN where missing."""
    y = np.asarray(values[column], dtype=np.float64)
    return y if column == "busy_s" or not np.isnan(y).any() else np.nan_to_num(y)


def _ok(values: dict[str, np.ndarray], rows: slice, rows_ok: np.ndarray) -> np.ndarray:
    return np.isfinite(values["work"]) & np.isfinite(values["busy_s"]) & rows_ok[rows][:, None]


def _cells(values: dict[str, np.ndarray], column: str, ok: np.ndarray, rows: slice, cols: slice, gidx: np.ndarray,
           cut: Cut | None) -> np.ndarray:  # fmt: skip
    return ok if cut is None else cut.cells(values, column, ok, rows, cols, gidx)


# -- step rounds (every rank of a slice of the steps) -----------------------------------------------


def steps_start(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups) -> dict[str, np.ndarray]:
    """Per step: whether it has work and busy time on two ranks or more; per step and group: the spread of
    work across ranks (variance), whether it differs at all, and the median work (the adjustment's
    reference)."""
    w = values["work"]
    ok = np.isfinite(w) & np.isfinite(values["busy_s"])
    rows_ok = ok.sum(axis=1) >= 2
    ok &= rows_ok[:, None]
    n_g = len(groups.members)
    across, varies = np.full((len(w), n_g), np.nan), np.full((len(w), n_g), np.nan)
    with ignoring():
        for gi, idx in enumerate(groups.members):
            wg = np.where(ok[:, idx], w[:, idx], np.nan)
            across[:, gi] = nanvar_rows(wg)
            varies[:, gi] = np.nanmax(wg, axis=1) > np.nanmin(wg, axis=1)
    return {"rows_ok": rows_ok, "across": across, "varies": varies == 1, "ref": group_medians(w, groups)}


def group_medians(w: np.ndarray, groups: Groups) -> np.ndarray:
    """Steps x groups: each group's median work in each step (what times are adjusted to)."""
    return np.stack([nanmedian(w[:, idx], axis=1) for idx in groups.members], axis=1)


def steps_level(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups,
rows_ok: np.ndarray,
                cut: Cut | None, gb: dict[str, tuple[np.ndarray, np.ndarray]] | None
                ) -> dict[str, np.ndarray]:  # fmt: skip
    """Per column, each group's step level ``c``: the median of its cells (``gb`` None: the start), else the
    mean of ``y - g - b * work`` over them."""
    ok, w = _ok(values, rows, rows_ok), values["work"]
    out = {}
    for column in ADJUSTED:
        m = _cells(values, column, ok, rows, cols, groups.index, cut)
        y = y_of(values, column)
        c = np.zeros((len(y), len(groups.members)))
        for gi, idx in enumerate(groups.members):
            whole = len(idx) == len(groups.index)  # one group: no copies of its columns
            mg, yg = (m, y) if whole else (m[:, idx], y[:, idx])
            if gb is None:
                c[:, gi] = np.nan_to_num(nanmedian(np.where(mg, yg, np.nan), axis=1))
                continue
            g, b = gb[column]
            z = (w if whole else w[:, idx]) * b[idx]
            np.subtract(yg, z, out=z)
            z -= g[idx]
            np.copyto(z, 0.0, where=~mg)
            n = mg.sum(axis=1)
            c[:, gi] = np.where(n > 0, rowsum(z) / np.maximum(n, 1), 0.0)
        out[column] = c
    return out


def steps_rowmed(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups,
rows_ok: np.ndarray,
                b0: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # fmt: skip
    """Per column, each group's median of ``y - b0 * work`` in each step (the refit's row centre)."""
    ok, w = _ok(values, rows, rows_ok), values["work"]
    out = {}
    for column in ADJUSTED:
        r = np.where(ok, y_of(values, column) - b0[column] * w, np.nan)
        out[column] = np.stack([nanmedian(r[:, idx], axis=1) for idx in groups.members], axis=1)
    return out


def steps_pooled(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups,
rows_ok: np.ndarray,
                pick: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """Per column, step and group: the cross products of work and ``y`` about the step's means over the
    ``pick``ed ranks' cells (the pooled slope's terms)."""
    ok = _ok(values, rows, rows_ok) & pick[None, :]
    w = np.where(ok, values["work"], 0.0)
    n_g = len(groups.members)
    out = {}
    for column in ADJUSTED:
        y = np.where(ok, y_of(values, column), 0.0)
        sxy, sxx = np.zeros((len(w), n_g)), np.zeros((len(w), n_g))
        for gi, idx in enumerate(groups.members):
            n = ok[:, idx].sum(axis=1)
            sw, sy = rowsum(w[:, idx]), rowsum(y[:, idx])
            with np.errstate(invalid="ignore", divide="ignore"):
                sxy[:, gi] = np.where(n > 0, rowsum(w[:, idx] * y[:, idx]) - sw * sy / np.maximum(n, 1), 0.0)
                sxx[:, gi] = np.where(n > 0, rowsum(w[:, idx] ** 2) - sw * sw / np.maximum(n, 1), 0.0)
        out[column] = (sxy, sxx)
    return out


# -- rank rounds (every step of a slice of the ranks) -----------------------------------------------


def ranks_slope(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups,
rows_ok: np.ndarray,
                cut: Cut | None, c: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, ...]]:  # fmt: skip
    """Per column and rank, given the step levels ``c``: the slope of ``y - c`` on work (NaN where work never
    varied), the mean of ``y - c`` and the mean work (the offset follows from them)."""
    ok, w = _ok(values, rows, rows_ok), values["work"]
    gidx = groups.index[cols]
    one = len(groups.members) == 1
    out, shared = {}, None
    for column in ADJUSTED:
        m = _cells(values, column, ok, rows, cols, gidx, cut)
        if cut is not None or shared is None:  # the same cells for every column unless a cut left some out
            n = m.sum(axis=0)
            with np.errstate(invalid="ignore", divide="ignore"):
                wm = colsum(np.where(m, w, 0.0)) / n
                dw = np.where(m, w - wm, 0.0)
                shared = (n, wm, dw, colsum(dw * dw))
        n, wm, dw, sxx = shared
        r = y_of(values, column) - (c[column][:, :1] if one else c[column][:, gidx])
        np.copyto(r, 0.0, where=~m)
        with np.errstate(invalid="ignore", divide="ignore"):
            rm = colsum(r) / n
            r *= dw  # the cells' deviations of work sum to nil: the slope needs no centring of r
            new = np.where(sxx > 0, colsum(r) / np.where(sxx > 0, sxx, 1.0), np.nan)
        out[column] = (new, rm, wm)
    return out


def ranks_cut(values: dict[str, np.ndarray], rows: slice, cols: slice, groups: Groups,
rows_ok: np.ndarray,
                b0: dict[str, np.ndarray], rowmed: dict[str, np.ndarray]
              ) -> dict[str, tuple[np.ndarray, ...]]:  # fmt: skip
    """Per column and rank: the median residual, the bound beyond which a cell is left out of the refit
    (inf: none is), and how many cells it keeps of how many."""
    ok, w = _ok(values, rows, rows_ok), values["work"]
    gidx = groups.index[cols]
    out = {}
    for column in ADJUSTED:
        r = np.where(ok, y_of(values, column) - b0[column][cols] * w - rowmed[column][:, gidx], np.nan)
        colmed = nanmedian(r, axis=0)
        dev = np.abs(r - colmed)
        mad = nanmedian(dev, axis=0)
        bound = np.where(np.isfinite(mad) & (mad > 0), OUTLIER * 1.4826 * np.nan_to_num(mad), np.inf)
        with np.errstate(invalid="ignore"):
            kept = (ok & (dev <= bound)).sum(axis=0)
        out[column] = (colmed, bound, kept, ok.sum(axis=0))
    return out


def ranks_within(values: dict[str, np.ndarray], rows: slice, cols: slice, rows_ok: np.ndarray) -> np.ndarray:
    """Per rank: the variance of its work across steps."""
    ok = _ok(values, rows, rows_ok)
    with ignoring():
        return nanvar_cols(np.where(ok, values["work"], np.nan))


# -- the driver -----------------------------------------------------------------------------------------


def _fill(new: np.ndarray, groups: Groups) -> np.ndarray:
    """Slopes not identified take their group's median slope (0 where none is)."""
    b = new.copy()
    for idx in groups.members:
        v = new[idx]
        fin = np.isfinite(v)
        b[idx] = np.where(fin, v, float(np.median(v[fin])) if fin.any() else 0.0)
    return b


def _als(rounds: Rounds, groups: Groups, rows_ok: np.ndarray, fitted: np.ndarray, cut: Cut | None
         ) -> dict[str, np.ndarray]:  # fmt: skip
    c = joined(rounds.by_steps(steps_level, groups, rows_ok, cut, None))
    beta = {column: np.full(len(groups.index), np.nan) for column in ADJUSTED}
    watched = [idx for gi, idx in enumerate(groups.members) if fitted[gi]]
    for _ in range(ITERATIONS):
        got = joined(rounds.by_ranks(ranks_slope, groups, rows_ok, cut, c))
        gb, settled = {}, True
        for column in ADJUSTED:
            new, rm, wm = got[column]
            b = _fill(new, groups)
            settled &= all(np.allclose(new[idx], beta[column][idx], rtol=RTOL, atol=1e-15, equal_nan=True)
                           for idx in watched)  # fmt: skip
            beta[column] = new
            gb[column] = (np.nan_to_num(rm - b * wm), b)
        if settled:
            break
        c = joined(rounds.by_steps(steps_level, groups, rows_ok, cut, gb))
    return beta


def fit_every(n_steps: int) -> int:
    """The fit takes every k-th step of a run of ``n_steps``: the least k that leaves at most :data:`FIT_STEPS`."""
    return max(1, -(-n_steps // FIT_STEPS))


def measure(rounds: Rounds, groups: Groups) -> Measured:
    """Fit every rank's slopes (``rounds`` reach the run's values, with the fitted work as ``work``; the fit's
    rounds reach every k-th step, :meth:`Rounds.thin`)."""
    start = joined(rounds.by_steps(steps_start, groups))
    every = fit_every(len(start["rows_ok"]))
    rows_ok = start["rows_ok"][::every]  # of the steps the fit takes
    rounds = rounds.thin(every, (*ADJUSTED, "work"))
    n_g = len(groups.members)
    sizes = np.array([len(m) for m in groups.members])
    fitted = (sizes >= 2) & (start["varies"].any(axis=0) if len(rows_ok) else np.zeros(n_g, dtype=bool))
    within = joined(rounds.by_ranks(ranks_within, rows_ok))
    with ignoring():
        across = np.nanmean(start["across"], axis=0) if len(rows_ok) else np.full(n_g, np.nan)
        inside = np.array([np.nanmean(within[idx]) if len(idx) else np.nan for idx in groups.members])
    static = fitted & ~(inside > STATIC * across) & (across > 0)
    slopes = {column: np.full(len(groups.index), np.nan) for column in ADJUSTED}
    if (fitted & ~static).any():
        beta = _als(rounds, groups, rows_ok, fitted & ~static, None)
        b0 = {column: _fill(beta[column], groups) for column in ADJUSTED}
        rowmed = joined(rounds.by_steps(steps_rowmed, groups, rows_ok, b0))
        cuts = joined(rounds.by_ranks(ranks_cut, groups, rows_ok, b0, rowmed))
        refit = np.zeros((len(ADJUSTED), n_g), dtype=bool)
        for k, column in enumerate(ADJUSTED):
            _, bound, kept, n = cuts[column]
            for gi, idx in enumerate(groups.members):
                refit[k, gi] = fitted[gi] and not static[gi] and kept[idx].sum() >= 0.5 * n[idx].sum()
                if not refit[k, gi]:
                    bound[idx] = np.inf
        if refit.any():
            cut = Cut(b0, rowmed, {k: v[0] for k, v in cuts.items()}, {k: v[1] for k, v in cuts.items()})
            again = _als(rounds, groups, rows_ok, refit.any(axis=0), cut)
            for k, column in enumerate(ADJUSTED):
                for gi, idx in enumerate(groups.members):
                    if refit[k, gi]:
                        beta[column][idx] = again[column][idx]
        for column in ADJUSTED:
            for gi, idx in enumerate(groups.members):
                if fitted[gi] and not static[gi]:
                    slopes[column][idx] = beta[column][idx]
    return Measured(slopes, fitted, static, rows_ok, every, start["ref"], int(start["rows_ok"].sum()))


def pooled(rounds: Rounds, groups: Groups, measured: Measured, pick: np.ndarray) -> dict[str, np.ndarray]:
    """Per column and group: the slope pooled over the ``pick``ed ranks (NaN where it is not identified)."""
    fit = rounds.thin(measured.every, (*ADJUSTED, "work"))
    sums = joined(fit.by_steps(steps_pooled, groups, measured.rows_ok, pick))
    out = {}
    for column in ADJUSTED:
        sxy, sxx = (v.sum(axis=0) for v in sums[column])
        out[column] = np.where(sxx > 0, sxy / np.where(sxx > 0, sxx, 1.0), np.nan)
    return out
