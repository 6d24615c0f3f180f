"""Interval arithmetic of the step anatomy: who gets each instant of a step. Pure.

A step's marks are intervals in layers of decreasing rank (communication, evaluation, data,
forward, backward, optimizer, the inferred data gap). :func:`carve` gives every instant of
``[lo, hi]`` to the first layer that covers it; :func:`carve_and_untimed` also lists the
stretches no timed layer covers.

Three implementations of the same definition, chosen by :func:`carve_and_untimed`:

- plain Python for the common step (a handful of intervals), where it is fastest;
- :func:`_carve_regions` for a step whose many intervals are one layer's sorted, disjoint ones
  (the collectives of an FSDP step, hundreds of them): the work in Python is bounded by the
  other marks, the collectives are only summed, in numpy;
- a numpy sweep over all endpoints for anything else with many intervals.

They give the same seconds to within float rounding (``tests/test_timing.py`` checks them against
the Python one on random marks); ``benchmarks/logthread_cost.py`` measures what they cost.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import chain

import numpy as np

Interval = tuple[float, float]
Layer = tuple[str, Sequence[Sequence[float]]]
#: An untimed stretch (start, end) and the untimed seconds in it (its length, or less where
#: collectives inside it were counted without splitting it).
Stretch = tuple[float, float, float]
#: Seconds per label, and the untimed stretches.
Carved = tuple[dict[str, float], list[Stretch]]

#: Up to this many intervals in a step (or besides its one big layer), the Python carve does it all.
PYTHON_UP_TO = 24


def union(intervals: Sequence[Sequence[float]], lo: float, hi: float) -> list[Interval]:
    """Sorted disjoint union of the intervals, clipped to [lo, hi]."""
    if len(intervals) == 1:  # most layers of a step: one forward, one backward, one optimizer step
        ((a, b),) = intervals
        a, b = max(a, lo), min(b, hi)
        return [(a, b)] if b > a else []
    out: list[Interval] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _uncovered(union_: list[Interval], covered: list[Interval]) -> float:
    """Length of ``union_`` outside ``covered`` (both sorted and disjoint)."""
    total, j = 0.0, 0
    for a, b in union_:
        length = b - a
        while j < len(covered) and covered[j][1] <= a:
            j += 1
        k = j
        while k < len(covered) and covered[k][0] < b:
            length -= min(b, covered[k][1]) - max(a, covered[k][0])
            k += 1
        total += length
    return total


def complement(union_: list[Interval], lo: float, hi: float) -> list[Interval]:
    """[lo, hi] minus a sorted disjoint union."""
    out, at = [], lo
    for a, b in union_:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if hi > at:
        out.append((at, hi))
    return out


def carve(layers: Sequence[Layer], lo: float, hi: float) -> dict[str, float]:
    """Seconds of [lo, hi] per label: each layer gets what no earlier layer covered (a label may
    name several layers; it gets their sum). Labels whose intervals are all empty are absent."""
    return _carve_python(layers, 0, lo, hi)[0]


def _carve_python(layers: Sequence[Layer], timed: int, lo: float, hi: float) -> Carved:
    covered: list[Interval] = []
    timed_cover: list[Interval] = []
    out: dict[str, float] = {}
    for k, (label, intervals) in enumerate(layers):
        if k == timed:
            timed_cover = covered
        if not intervals:
            continue
        u = union(intervals, lo, hi)
        if u:
            out[label] = out.get(label, 0.0) + (_uncovered(u, covered) if covered else sum(b - a for a, b in u))
            covered = union([*covered, *u], lo, hi) if covered else u
    if timed >= len(layers):
        timed_cover = covered
    return out, [(a, b, b - a) for a, b in complement(timed_cover, lo, hi)]


def _carve_sweep(layers: Sequence[Layer], timed: int, lo: float, hi: float) -> Carved:
    """The numpy sweep: the elementary segments between all endpoints, the first layer covering
    each (a cumulative sum of +1 at starts and -1 at ends, per layer), their lengths summed per
    layer; the segments covered by none of the first ``timed`` layers, merged, are the untimed
    stretches."""
    counts = [len(intervals) for _, intervals in layers]
    total = sum(counts)
    if not total:
        return {}, ([(lo, hi, hi - lo)] if hi > lo else [])
    flat = chain.from_iterable(chain.from_iterable(intervals for _, intervals in layers))
    pairs = np.fromiter(flat, dtype=float, count=2 * total).reshape(-1, 2)
    starts, ends = np.maximum(pairs[:, 0], lo), np.minimum(pairs[:, 1], hi)
    keep = ends > starts
    rows = [k for k, c in enumerate(counts) if c]  # the layers with intervals: one row each below
    row = np.repeat(np.arange(len(rows)), [counts[k] for k in rows])[keep]
    n = len(row)
    endpoints = np.concatenate((starts[keep], ends[keep], (lo, hi)))
    order = np.argsort(endpoints)  # repeated points make empty segments: harmless
    points = endpoints[order]
    n_points, n_rows = len(points), len(rows)
    position = np.empty(n_points, dtype=np.intp)
    position[order] = np.arange(n_points)
    at = row * n_points
    size = n_rows * n_points
    delta = np.bincount(at + position[:n], minlength=size) - np.bincount(at + position[n : 2 * n], minlength=size)
    cover = np.cumsum(delta.reshape(n_rows, n_points), axis=1)[:, :-1] > 0
    lengths = np.diff(points)
    any_cover = cover.any(axis=0)
    first = cover.argmax(axis=0)
    seconds = np.bincount(first[any_cover], weights=lengths[any_cover], minlength=n_rows)
    present = np.bincount(row, minlength=n_rows) > 0
    out: dict[str, float] = {}
    for i, k in enumerate(rows):
        if present[i]:
            label = layers[k][0]
            out[label] = out.get(label, 0.0) + float(seconds[i])
    timed_rows = sum(1 for k in rows if k < timed)  # rows keep the layers' order
    free = ~cover[:timed_rows].any(axis=0) & (lengths > 0)
    a, b = points[:-1][free], points[1:][free]
    if not len(a):
        return out, []
    cut = np.flatnonzero(a[1:] != b[:-1]) + 1  # where one untimed stretch ends and the next begins
    firsts, lasts = np.concatenate(([0], cut)), np.concatenate((cut - 1, [len(a) - 1]))
    return out, [(x, y, y - x) for x, y in zip(a[firsts].tolist(), b[lasts].tolist(), strict=True)]


def _owner(layers: Sequence[Layer], skip: int, t: float) -> int | None:
    """The first layer but ``skip`` with an interval around ``t`` (t is no endpoint of theirs)."""
    for k, (_, intervals) in enumerate(layers):
        if k != skip and any(a < t < b for a, b in intervals):
            return k
    return None


def _carve_regions(layers: Sequence[Layer], big: int, timed: int, lo: float, hi: float,
                   anchors: Sequence[float]) -> Carved | None:  # fmt: skip
    """Bounded work for one layer of many sorted, disjoint intervals (collectives): the other
    layers' endpoints and the anchors cut [lo, hi] into regions inside which every other layer
    either covers all or nothing. The big layer's intervals that lie inside one region are only
    summed per region (in numpy); the few that cross a boundary are carved with the rest in
    Python. Each region's sum is then given to the big layer and taken from the layer that owns
    that region, or from the untimed stretch around it. ``None`` where the preconditions fail
    (overlapping intervals; an anchor inside an untimed stretch, where a split would rename a
    gap): the caller sweeps instead."""
    intervals = layers[big][1]
    flat = np.fromiter(chain.from_iterable(intervals), dtype=float, count=2 * len(intervals))
    if not (flat[1:] >= flat[:-1]).all():  # start <= end <= next start: sorted and disjoint
        return None
    if flat[0] < lo or flat[-1] > hi:  # what lies outside becomes empty, and empty is harmless
        flat = np.clip(flat, lo, hi)
    starts, ends = flat[0::2], flat[1::2]
    bounds, timed_ends = {lo, hi}, set()
    for k, (_, ivs) in enumerate(layers):
        if k != big:
            for a, b in ivs:
                a, b = max(a, lo), min(b, hi)
                if b > a:
                    (timed_ends if k < timed else bounds).update((a, b))
    odd = [t for t in anchors if lo < t < hi and t not in timed_ends]  # may lie inside an untimed stretch
    bounds.update(timed_ends, odd)
    cuts = np.array(sorted(bounds))
    first, last = np.searchsorted(cuts, starts, "right"), np.searchsorted(cuts, ends, "left")
    inside = first == last  # within one region: (cuts[k - 1], cuts[k])
    label = layers[big][0]
    rest = list(layers)
    if inside.all():  # the common case: no collective spans another mark
        rest[big] = (label, [])
    else:
        cross = ~inside
        rest[big] = (label, list(zip(starts[cross].tolist(), ends[cross].tolist(), strict=True)))
        starts, ends, first = starts[inside], ends[inside], first[inside]
    sec, stretches = _carve_python(rest, timed, lo, hi)
    if any(a < t < b for t in odd for a, b, _ in stretches):
        return None
    if len(starts) or rest[big][1]:
        sec.setdefault(label, 0.0)
    if not len(first):
        return sec, stretches
    sums = np.bincount(first, weights=ends - starts)
    taken = np.flatnonzero(sums)
    at = starts[np.searchsorted(first, taken)]  # an instant of each region's collectives
    lefts = [a for a, _, _ in stretches]
    less = [0.0] * len(stretches)
    for k, seconds, t in zip(taken.tolist(), sums[taken].tolist(), at.tolist(), strict=True):
        owner = _owner(layers, big, (cuts[k - 1] + cuts[k]) / 2)
        if owner is not None and owner < big:
            continue  # a layer above the big one has these instants
        sec[label] += seconds
        if owner is not None:
            name = layers[owner][0]
            sec[name] = max(0.0, sec[name] - seconds)
        if owner is None or owner >= timed:
            i = bisect.bisect_right(lefts, t) - 1
            less[i] += seconds
    return sec, [(a, b, max(0.0, n - d)) for (a, b, n), d in zip(stretches, less, strict=True)]


def carve_and_untimed(layers: Sequence[Layer], timed: int, lo: float, hi: float,
                      anchors: Sequence[float] = ()) -> Carved:  # fmt: skip
    """:func:`carve` of ``layers`` over [lo, hi], and the stretches that none of the first
    ``timed`` layers covers (sorted, disjoint), by whichever implementation is cheapest for the
    number of intervals. ``anchors``: instants at which an untimed stretch changes its name
    (:func:`~stragglerwatch.runtime.capture.timing.gaps`)."""
    counts = [len(iv) for _, iv in layers]
    total = sum(counts)
    if total <= PYTHON_UP_TO:
        return _carve_python(layers, timed, lo, hi)
    big = max(range(len(counts)), key=counts.__getitem__)
    if total - counts[big] <= PYTHON_UP_TO:
        carved = _carve_regions(layers, big, timed, lo, hi, anchors)
        if carved is not None:
            return carved
    return _carve_sweep(layers, timed, lo, hi)
