"""The staged analyses (``rounds.py``) give the same figures whatever slices their rounds run on: the work fit
and the imbalance verdict on the whole matrix against the same on uneven step parts and rank blocks, the fit
taking every k-th step across the parts' edges."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import pytest

from stragglerwatch.analysis import imbalance as imb
from stragglerwatch.analysis import workfit
from stragglerwatch.analysis.detect import detect, to_matrix
from stragglerwatch.analysis.rounds import Whole, slices, thinned
from stragglerwatch.analysis.stages import Groups
from stragglerwatch.record.simulate import Injection, SimConfig, to_frame


@dataclass
class Sliced:
    """Rounds on uneven slices of a whole matrix, in order (as the Ray engine's tasks, in one process)."""

    values: dict[str, np.ndarray]
    row_cuts: list[int]
    col_cuts: list[int]
    every: int = 1

    def thin(self, every: int, columns: tuple[str, ...] = ()) -> Sliced:
        return Sliced(self.values, self.row_cuts, self.col_cuts, every)

    def _slices(self, cuts: list[int], n: int) -> list[slice]:
        edges = [0, *[c for c in cuts if 0 < c < n], n]
        return [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]

    def by_steps(self, fn, *args):
        s, r = self.values["busy_s"].shape
        out = []
        for rows in self._slices(self.row_cuts, s):
            part, at = thinned({c: np.ascontiguousarray(v[rows]) for c, v in self.values.items()}, rows, self.every)
            out.append(fn(part, at, slice(0, r), *args))
        return out

    def by_ranks(self, fn, *args):
        s, r = self.values["busy_s"].shape
        out = []
        for cols in self._slices(self.col_cuts, r):
            part, at = thinned({c: np.ascontiguousarray(v[:, cols]) for c, v in self.values.items()}, slice(0, s),
                               self.every)  # fmt: skip
            out.append(fn(part, at, cols, *args))
        return out


@pytest.mark.parametrize("every", [1, 3])
def test_the_work_fit_and_the_imbalance_do_not_depend_on_the_slices(monkeypatch, every: int) -> None:
    monkeypatch.setattr(workfit, "FIT_STEPS", 300 // every)
    cfg = SimConfig(ranks=12, steps=300, seed=8, tokens=4096, groups=2,
                    injections=[Injection(3, 0.25, 100, "compute"), Injection(8, 0.2, 50, "data")])  # fmt: skip
    mat = to_matrix(to_frame(cfg))
    values, unit, column = imb.basis(mat.values, mat.work_unit)
    groups = Groups.of(mat.ranks, {int(r): str(int(r) % 2) for r in mat.ranks})
    # the local engine's arrays are column-major (as read), the slices' row-major (as the Ray engine joins them)
    whole = Whole({c: np.asfortranarray(v) for c, v in values.items()})
    sliced = Sliced(values, [7, 100, 101, 250], [1, 5, 6])
    a, b = workfit.measure(whole, groups), workfit.measure(sliced, groups)
    assert a.every == b.every == every
    for c in workfit.ADJUSTED:
        np.testing.assert_array_equal(a.slopes[c], b.slopes[c])
    healthy = np.ones(len(mat.ranks), dtype=bool)
    healthy[3] = False
    model_a, model_b = imb.model(whole, groups, a, healthy), imb.model(sliced, groups, b, healthy)
    flagged = ~healthy
    im_a = imb.assess(whole, model_a, groups, flagged, mat.ranks, 100.0, 0.02, unit, column)
    im_b = imb.assess(sliced, model_b, groups, flagged, mat.ranks, 100.0, 0.02, unit, column)
    assert im_a == im_b and im_a.detected


def test_whole_cuts_a_large_round_into_cache_sized_slices_with_the_same_results(monkeypatch) -> None:
    """The local engine cuts a large round into slices of about ``SLICE_CELLS`` cells, more than it has threads
    (so that each slice's temporaries stay in the caches), and gets what one piece gives."""
    from stragglerwatch.analysis import rounds

    cfg = SimConfig(ranks=12, steps=300, seed=8, tokens=4096, groups=2,
                    injections=[Injection(3, 0.25, 100, "compute"), Injection(8, 0.2, 50, "data")])  # fmt: skip
    mat = to_matrix(to_frame(cfg))
    values, unit, column = imb.basis(mat.values, mat.work_unit)
    values = {c: np.asfortranarray(v) for c, v in values.items()}
    groups = Groups.of(mat.ranks, {int(r): str(int(r) % 2) for r in mat.ranks})
    flagged = np.isin(mat.ranks, [3])

    def verdict() -> tuple[workfit.Measured, imb.Imbalance]:
        whole = Whole(values, threads=2)
        measured = workfit.measure(whole, groups)
        model = imb.model(whole, groups, measured, ~flagged)
        return measured, imb.assess(whole, model, groups, flagged, mat.ranks, 100.0, 0.02, unit, column)

    monkeypatch.setattr(rounds, "ROUND_CELLS", 1 << 40)
    assert len(slices(300, 12, 2)) == 1
    one, im_one = verdict()
    monkeypatch.setattr(rounds, "ROUND_CELLS", 256)
    monkeypatch.setattr(rounds, "SLICE_CELLS", 400)
    cut = slices(300, 12, 2)
    assert len(cut) == 9 and all(p.stop - p.start >= rounds.SLICE_MIN for p in cut)  # 3,600 cells, ~400 a slice
    assert len(slices(12, 300, 2)) == 2  # 12 ranks: no slice narrower than SLICE_MIN, one a thread at least
    many, im_many = verdict()
    for c in workfit.ADJUSTED:
        np.testing.assert_array_equal(one.slopes[c], many.slopes[c])
    assert im_one == im_many and im_one.detected


def test_the_fit_on_every_kth_step_flags_what_the_whole_fit_flags(monkeypatch) -> None:
    """Taking every 4th step for the fit moves the verdict by nothing but a little of the imbalance's cost."""
    cfg = SimConfig(ranks=16, steps=800, seed=3, tokens=4096,
                    injections=[Injection(5, 0.12, 300, "compute"), Injection(11, 0.1, 200, "data")])  # fmt: skip
    mat = to_matrix(to_frame(cfg))
    full = detect(mat)
    monkeypatch.setattr(workfit, "FIT_STEPS", 200)
    thin = detect(mat)
    assert [(s.rank, s.cause, s.first_step) for s in thin.stragglers] == [
        (s.rank, s.cause, s.first_step) for s in full.stragglers]  # fmt: skip
    assert {s.rank for s in full.stragglers} == {5, 11}
    assert thin.imbalance.lost_seconds == pytest.approx(full.imbalance.lost_seconds, rel=0.03)


def test_large_reductions_run_in_threads_and_give_the_same_bits(monkeypatch) -> None:
    import bottleneck as bn

    from stragglerwatch.analysis import consistency, rounds, stages

    monkeypatch.setattr(rounds, "workers", lambda: 3)
    monkeypatch.setattr(rounds, "PARALLEL_CELLS", 1000)
    rng = np.random.default_rng(1)
    a = rng.normal(size=(700, 90))
    a[rng.random(a.shape) < 0.05] = np.nan
    calls = []
    real = rounds.ThreadPoolExecutor
    monkeypatch.setattr(rounds, "ThreadPoolExecutor", lambda k: calls.append(k) or real(k))
    for axis in (0, 1):
        np.testing.assert_array_equal(stages.nanmedian(a, axis=axis), bn.nanmedian(a, axis=axis))
    np.testing.assert_array_equal(consistency._moving(bn.move_median, a, 64, 16),
                                  bn.move_median(a, 64, min_count=16, axis=0))  # fmt: skip
    assert calls == [3, 3, 3], "each of them was cut into chunks for threads"


def test_rounds_in_threads_leave_the_warning_filters_as_they_were() -> None:
    """The work fit's rounds, on slices in threads, each silencing numpy's empty-slice warnings: the process's
    warning filters are the same after every fit (with ``catch_warnings`` blocks in the rounds and no wrapper in
    ``on_threads``, 17 fits of 20 left them changed)."""
    import warnings

    rng = np.random.default_rng(0)
    values = {c: rng.random((3000, 200)) for c in (*workfit.ADJUSTED, "work")}
    values["busy_s"][:, 3] = np.nan  # a rank with no busy time: numpy's empty-slice warnings in the rounds
    rounds = Whole(values, threads=2)
    assert len(slices(3000, 200, rounds.threads)) >= 2, "the rounds do not run in threads: the test proves nothing"
    before = list(warnings.filters)
    for _ in range(10):
        workfit.measure(rounds, Groups.of(np.arange(200), None))
        assert warnings.filters == before


def test_warnings_ignored_in_threads_at_once_are_shown_again_after_the_last() -> None:
    """``ignoring`` in several threads at once, entered and left in every order: inside, the category is
    ignored in every thread until the last one leaves; after, the filters are those from before (two
    ``catch_warnings`` blocks at once can put back each other's filters and leave warnings hidden for good)."""
    import threading
    import warnings

    from stragglerwatch._quiet import ignoring

    before = list(warnings.filters)
    unguarded: list[int] = []  # times a thread inside found no filter ignoring the category
    start = threading.Barrier(4)
    ignore = ("ignore", None, RuntimeWarning, None, 0)

    def churn(seed: int) -> None:
        rng = np.random.default_rng(seed)
        start.wait(timeout=30)
        for _ in range(2000):
            with ignoring():
                if rng.random() < 0.05:
                    time.sleep(0.0002)
                if ignore not in list(warnings.filters):
                    unguarded.append(seed)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert unguarded == [] and warnings.filters == before
    with ignoring():
        outer = list(warnings.filters)
        with ignoring():  # a nested block, or another thread's: one filter, kept until the outer one leaves
            assert warnings.filters == outer
        assert warnings.filters == outer and outer[0][2] is RuntimeWarning and outer[0][0] == "ignore"
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        warnings.warn("after", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["after"]


@pytest.mark.parametrize(("dtype", "cells"), [(np.float64, 1 << 22), (np.float32, 1 << 22), (np.float64, 500)])
def test_the_sorted_median_is_bottlenecks_bit_for_bit(monkeypatch, dtype: type, cells: int) -> None:
    import bottleneck as bn

    from stragglerwatch.analysis import rounds
    from stragglerwatch.analysis.rounds import sorted_nanmedian

    monkeypatch.setattr(rounds, "SORT_CELLS", cells)  # 500: the lanes sorted a few at a time

    rng = np.random.default_rng(7)
    shapes = ((1, 1), (1, 6), (6, 1), (2, 2), (9, 4), (10, 7), (301, 64), (64, 301))
    # gaps: lanes of many counts of finite values (sorted), of one or of a few (selected count by count)
    for shape, gaps in itertools.product(shapes, ("scattered", "none", "whole rows")):
        a = rng.lognormal(size=shape).astype(dtype) * dtype(0.01)
        if gaps == "scattered":
            a[rng.random(shape) < 0.2] = np.nan  # lanes of odd and even counts of finite values
        elif gaps == "whole rows" and shape[0] > 4:
            a[3:5, :] = np.nan  # every column two short, and below, one column three short
            a[5, 2 % shape[1]] = np.nan
        a[rng.random(shape) < 0.05] = a.flat[0]  # ties
        if shape[0] > 2:
            if gaps != "none":
                a[0, :] = np.nan  # a lane (row) with none
            a[1, 0], a[2, 0] = np.inf, -np.inf
        if shape[1] > 2 and gaps != "none":
            a[:, 1] = np.nan  # a column with none
        for order in ("C", "F"):
            x = np.asarray(a, order=order)
            for axis in (0, 1):
                got, want = sorted_nanmedian(x, axis), bn.nanmedian(x, axis=axis)
                assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True), (shape, gaps, order, axis)
                assert np.array_equal(x, a, equal_nan=True), "the input is left as it was (a copy is sorted)"
