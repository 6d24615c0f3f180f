"""How a staged analysis reaches the run's data: by step rows or by rank columns. Pure.

The analyses that need both every rank of a step and every step of a rank (the work fit, the imbalance
cost) are written as rounds: a *step round* calls a function on a slice of the steps with every rank
(``fn(values, rows, cols, *args)``, ``cols`` all ranks), a *rank round* on a slice of the ranks with every
step. A result of a step round depends only on its rows, one of a rank round only on its columns, and the
driver code between rounds combines them in order, so whatever the slices the results are the same.

:class:`Whole` runs a round on the whole run in one piece (the local engine, the live path);
``rayengine`` runs each slice as a Ray task over its step parts and rank blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from stragglerwatch._quiet import ignoring

Values = dict[str, np.ndarray]


class Rounds(Protocol):
    """Runs a round over the slices of a run, and returns the slices' results in step or rank order."""

    def by_steps(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...

    def by_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...

    def thin(self, every: int, columns: tuple[str, ...] = ()) -> Rounds:
        """The same rounds over every ``every``-th step of the run only (by the steps' index in the run), and
        the ``columns`` only where given (what the rounds read)."""
        ...


def thinned(values: Values, rows: slice, every: int) -> tuple[Values, slice]:
    """The steps of ``rows`` whose index in the run is a multiple of ``every``, as views, and where they lie
    among those steps of the run."""
    if every == 1:
        return values, rows
    first = -(-rows.start // every)
    last = -(-rows.stop // every)
    offset = first * every - rows.start
    return {c: v[offset::every] for c, v in values.items()}, slice(first, last)


#: A round on at least this many cells runs on slices in threads (:class:`Whole`).
ROUND_CELLS = 1 << 18
#: Cells of a slice of a round cut for threads, about (1 MB of float64: a temporary stays in the caches); and the
#: rows (or columns) of a slice at least (each slice costs a call of the round's numpy operations).
SLICE_CELLS, SLICE_MIN = 1 << 17, 16


@dataclass
class Whole:
    """Every round on a steps x ranks ``values`` in this process: on the whole at once, or, where it is large, on
    one slice of the steps (or the ranks) per core, in threads (numpy's loops release the interpreter lock). A
    round's results depend on its slice alone, so the slices change nothing of them (as on Ray)."""

    values: Values
    threads: int = 0  # at most; 0: :func:`workers`

    def _all(self) -> tuple[slice, slice]:
        s, r = self.values["busy_s"].shape
        return slice(0, s), slice(0, r)

    def _cut(self, axis: int, part: slice) -> Values:
        n = self.values["busy_s"].shape[axis]
        return {c: (v[part] if axis == 0 else v[:, part]) if v.ndim == 2 and v.shape[axis] == n else v
                for c, v in self.values.items()}  # fmt: skip

    def by_steps(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        rows, cols = self._all()
        parts = slices(rows.stop, cols.stop, self.threads)
        if len(parts) == 1:
            return [fn(self.values, rows, cols, *args)]
        return on_threads([lambda p=p: fn(self._cut(0, p), p, cols, *args) for p in parts], self.threads)

    def by_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        rows, cols = self._all()
        parts = slices(cols.stop, rows.stop, self.threads)
        if len(parts) == 1:
            return [fn(self.values, rows, cols, *args)]
        return on_threads([lambda p=p: fn(self._cut(1, p), rows, p, *args) for p in parts], self.threads)

    def thin(self, every: int, columns: tuple[str, ...] = ()) -> Whole:
        if every == 1:
            return self
        kept = {c: v for c, v in self.values.items() if not columns or c in columns}
        rows = thinned(kept, slice(0, len(kept["busy_s"])), every)[0]
        return Whole(thin_copy(rows))


def thin_copy(rows: Values) -> Values:
    """Contiguous float64 copies of thinned columns (the fit's rounds read each column many times, in float64)."""
    return {c: np.ascontiguousarray(v, dtype=np.float64 if v.dtype.kind == "f" else None) for c, v in rows.items()}


def joined(parts: list[Any]) -> Any:
    """The slices' results as one: their arrays (per step, or per rank, first) concatenated, dicts and tuples
    of them element by element. Rounds return per-step or per-rank arrays, never sums over their slice: the
    driver sums the whole array, so that no figure depends on where the slices were cut."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: joined([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(joined([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)


# Sums whose order of additions is fixed by the row (or column) alone, whatever slice of the run holds it:
# numpy adds a contiguous row pairwise, and down the columns of a row-major array one row after the other;
# a round's sums are taken so (over a row-major copy where the array is not).


def rowsum(x: np.ndarray) -> np.ndarray:
    """Per row (step), the sum of ``x`` (pairwise along the row)."""
    return np.ascontiguousarray(x).sum(axis=1)


def colsum(x: np.ndarray) -> np.ndarray:
    """Per column (rank), the sum of ``x`` (one row after the other)."""
    if x.ndim == 2 and x.shape[1] == 1:  # a lone column is contiguous: numpy would add it pairwise
        return np.cumsum(x[:, 0])[-1:] if len(x) else np.zeros(1, dtype=x.dtype)
    if x.ndim == 2 and x.strides[1] != x.itemsize:  # not row-major
        x = np.ascontiguousarray(x)
    return x.sum(axis=0)


def nanmean_rows(x: np.ndarray) -> np.ndarray:
    """Per row, the mean of the finite values (NaN where there are none)."""
    c = np.ascontiguousarray(x)
    n = np.isfinite(c).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(c, axis=1) / np.maximum(n, 1), np.nan)


def nanvar_rows(x: np.ndarray) -> np.ndarray:
    """Per row, the variance of the finite values (NaN where there are none)."""
    d = x - nanmean_rows(x)[:, None]
    return nanmean_rows(d * d)


def sorted_nanmedian(x: np.ndarray, axis: int) -> np.ndarray:
    """Per row (``axis=1``) or column (``axis=0``) of a 2-D float array, the median of its finite values (NaN where
    there are none), as bottleneck's ``nanmedian`` gives it, bit for bit: the middle value, or half the sum of the
    two. Found in a copy laid out along ``axis`` by numpy's vectorised selection (``partition``: the lanes with
    as many finite values, a few such counts at most) or sort (NaN last), two to four times faster than
    bottleneck's selection, which the analysis spent a fifth of its time in. The copy is made
    :data:`SORT_CELLS` cells at a time (so that a median of a large run holds no second copy of it)."""
    n_lanes = x.shape[1 - axis]
    step = max(1, SORT_CELLS // max(x.shape[axis], 1))
    if n_lanes > step:
        parts = [x[lo : lo + step] if axis == 1 else x[:, lo : lo + step] for lo in range(0, n_lanes, step)]
        return np.concatenate([_lanes_median(part, axis) for part in parts])
    return _lanes_median(x, axis)


#: Cells of a copy :func:`sorted_nanmedian` sorts at a time (32 MiB of float64).
SORT_CELLS = 1 << 22
#: Lanes with at most this many different counts of finite values are selected, count by count; more are sorted.
SELECT_COUNTS = 4


def _lanes_median(x: np.ndarray, axis: int) -> np.ndarray:
    lanes = np.array(x, order="C" if axis == 1 else "F")  # a copy, each lane contiguous
    n = lanes.shape[axis]
    if n == 0:
        return np.full(lanes.shape[1 - axis], np.nan, dtype=x.dtype)
    counts = n - np.count_nonzero(np.isnan(lanes), axis=axis)
    kinds = np.unique(counts)
    if len(kinds) > SELECT_COUNTS:
        return _sorted_median(lanes, axis, counts)
    if len(kinds) == 1:
        return _selected_median(lanes, axis, int(kinds[0]))
    out = np.empty(lanes.shape[1 - axis], dtype=x.dtype)
    for k in kinds.tolist():
        at = np.flatnonzero(counts == k)
        part = lanes[at] if axis == 1 else np.asfortranarray(lanes[:, at])
        out[at] = _selected_median(part, axis, k)
    return out


def _selected_median(lanes: np.ndarray, axis: int, k: int) -> np.ndarray:
    """The median of lanes that each hold ``k`` finite values (the rest NaN, which order last), in place: the
    ``k // 2``-th value put where it goes (every one before it is no larger), and for an even ``k`` the largest
    of those before it, the other middle value."""
    if k == 0:
        return np.full(lanes.shape[1 - axis], np.nan, dtype=lanes.dtype)
    hi = k // 2
    lanes.partition(hi, axis=axis)
    b = lanes[:, hi] if axis == 1 else lanes[hi]
    if k % 2:
        return b.copy()
    a = (lanes[:, :hi] if axis == 1 else lanes[:hi]).max(axis=axis)
    with np.errstate(invalid="ignore", over="ignore"):
        return (a + b) * lanes.dtype.type(0.5)


def _sorted_median(lanes: np.ndarray, axis: int, counts: np.ndarray) -> np.ndarray:
    """The median of each lane of a copy (sorted in place, NaN last) holding ``counts`` finite values."""
    lanes.sort(axis=axis)
    at = np.arange(lanes.shape[1 - axis])
    lo, hi = np.maximum(counts - 1, 0) // 2, np.minimum(counts // 2, max(lanes.shape[axis] - 1, 0))
    a, b = (lanes[at, lo], lanes[at, hi]) if axis == 1 else (lanes[lo, at], lanes[hi, at])
    with np.errstate(invalid="ignore", over="ignore"):
        mid = np.where(lo == hi, a, (a + b) * lanes.dtype.type(0.5))
    return np.where(counts > 0, mid, np.nan).astype(lanes.dtype, copy=False)


def nanvar_cols(x: np.ndarray) -> np.ndarray:
    """Per column, the variance of the finite values (NaN where there are none)."""
    ok = np.isfinite(x)
    n = ok.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, colsum(np.where(ok, x, 0.0)) / np.maximum(n, 1), np.nan)
        d = np.where(ok, x - mean, 0.0)
        return np.where(n > 0, colsum(d * d) / np.maximum(n, 1), np.nan)


#: Arrays of at least this many cells are cut into chunks that threads reduce at once: bottleneck's and numpy's
#: loops release the interpreter lock, so the chunks run on every core (each result is its row's or column's own,
#: so the chunks change nothing of it).
PARALLEL_CELLS = 1 << 21


def workers() -> int:
    """Threads a large reduction uses: the cores this process may run on, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def slices(n: int, other: int, threads: int = 0) -> list[slice]:
    """``n`` rows (or columns) of ``other`` each, cut where they are at least :data:`ROUND_CELLS` cells into slices
    of about :data:`SLICE_CELLS` cells (at least :data:`SLICE_MIN` rows each, and one per thread at least:
    ``threads``, 0: :func:`workers`), else one slice. A round's temporaries then stay in the caches: on a slice of
    the run per thread they were tens of MB each, written out to memory and mapped anew every time."""
    k = threads or workers()
    if n * other < ROUND_CELLS or n < 2 * k:
        return [slice(0, n)]
    count = max(k, min(n // SLICE_MIN, -(-n * other // SLICE_CELLS)))
    edges = np.linspace(0, n, count + 1).astype(int)
    return [slice(int(a), int(b)) for a, b in zip(edges, edges[1:], strict=False)]


def on_threads(calls: list[Callable[[], Any]], threads: int = 0) -> list[Any]:
    """The calls' results, in order, on ``threads`` threads (0: :func:`workers`; one call: here). numpy's runtime
    warnings (an empty slice's mean) are not shown meanwhile, as a round on the whole would not show them."""
    if len(calls) == 1:
        return [calls[0]()]
    with ignoring(), ThreadPoolExecutor(min(len(calls), threads or workers())) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _in_chunks(fn: Callable[[np.ndarray], np.ndarray], a: np.ndarray, along: int, out_axis: int) -> np.ndarray:
    """``fn`` of ``a`` on chunks cut ``along`` an axis, in threads; their results joined along ``out_axis``."""
    k = workers()
    if a.ndim != 2 or a.size < PARALLEL_CELLS or k < 2 or a.shape[along] < 2 * k:
        return fn(a)
    edges = np.linspace(0, a.shape[along], k + 1).astype(int)
    chunks = [a[lo:hi] if along == 0 else a[:, lo:hi] for lo, hi in zip(edges, edges[1:], strict=False)]
    with ThreadPoolExecutor(k) as pool:
        return np.concatenate(list(pool.map(fn, chunks)), axis=out_axis)


def by_columns(fn: Callable[[np.ndarray], np.ndarray], a: np.ndarray, out_axis: int = 0) -> np.ndarray:
    """``fn`` of a 2-D array whose results are each column's own (a reduction over rows, a moving statistic
    down the columns), on column chunks in threads; the chunks' results joined along ``out_axis``."""
    return _in_chunks(fn, a, 1, out_axis)


def by_rows(fn: Callable[[np.ndarray], np.ndarray], a: np.ndarray) -> np.ndarray:
    """``fn`` of a 2-D array whose results are each row's own (a reduction over columns), on row chunks in
    threads."""
    return _in_chunks(fn, a, 0, 0)
