"""The parts of detection that look across ranks at each step, and across steps at one rank, as
pure functions over slices of a run: a step part (some steps, every rank) or a rank block (every
step, some ranks). ``detect.py`` runs them on a whole matrix; ``rayengine.py`` on a cluster, on
parts and blocks of a run that fits no single machine. Each result of a step depends only on that
step's row, and each result of a rank only on that rank's column, so both give the same verdict.

Order: :func:`step_stage` (peer reference, excess, per-step figures) -> ``consistency`` rounds per
rank block (flags) -> :func:`healthy_stage` (reference of the unflagged ranks, peers' phases) ->
:func:`describe` per flagged stretch (onset, end, cause, cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import bottleneck as bn
import numpy as np

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.cost import TOP_K, top_k
from stragglerwatch.analysis.intermittent import BLOCK
from stragglerwatch.analysis.rounds import by_columns, by_rows, sorted_nanmedian
from stragglerwatch.analysis.thresholds import floors
from stragglerwatch.record.schema import GAP_COLUMNS, GAP_TEXT, GAPS

if TYPE_CHECKING:
    from stragglerwatch.analysis.thresholds import DetectConfig

#: The cause a phase's excess is blamed on, and the phases (columns) it sums.
CAUSES = {
    "data": ("data_wait_s",),
    "compute": ("forward_s", "backward_s"),
    "optimizer": ("optimizer_s",),
    "other": ("other_s",),
}


#: numpy sorts and selects floats with vector instructions (AVX2, AVX-512) from 2.0 on: then faster than bottleneck's
#: selection.
SIMD_SORT = np.lib.NumpyVersion(np.__version__) >= "2.0.0"


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """The median of the finite values along ``axis`` (NaN where there are none), without numpy's warnings: of
    a 2-D float array by numpy's selection or sort (:func:`~stragglerwatch.analysis.rounds.sorted_nanmedian`, the
    same bits) where numpy runs them with vector instructions, else bottleneck's selection, several times faster
    than numpy's median."""
    if a.size == 0:
        return np.full(a.shape[1 - axis] if a.ndim == 2 else 0, np.nan)
    if a.ndim == 2:  # large ones in threads, a chunk of the rows (or columns) each
        sort = a.dtype.kind == "f" and SIMD_SORT
        return (by_rows if axis == 1 else by_columns)(
            lambda x: sorted_nanmedian(x, axis) if sort else bn.nanmedian(x, axis=axis), a)  # fmt: skip
    return bn.nanmedian(a, axis=axis)


def lower_median(a: np.ndarray) -> np.ndarray:
    """Per row, the lower median of the finite values (NaN where there are none)."""
    n = a.shape[0]
    if a.shape[1] == 1:
        return a[:, 0].astype(np.float64)
    ordered = np.sort(a, axis=1)  # NaN last
    k = np.isfinite(a).sum(axis=1)
    out = ordered[np.arange(n), np.maximum((k - 1) // 2, 0)].astype(np.float64)
    out[k == 0] = np.nan
    return out


@dataclass
class Groups:
    """The ranks' peer groups (roles, e.g. pipeline stages): the columns of each, in name order."""

    names: list[str]
    members: list[np.ndarray]
    index: np.ndarray  # per rank (column): its group's position in ``names``

    @classmethod
    def of(cls, ranks: np.ndarray, groups: dict[int, str] | None) -> Groups:
        if not groups:  # one group of every rank (a live update asks again for thousands of ranks)
            return cls([""], [np.arange(len(ranks))], np.zeros(len(ranks), dtype=np.int64))
        group_of = [str(groups.get(r, "")) for r in np.asarray(ranks).tolist()]
        names = sorted(set(group_of)) or [""]
        at = {name: i for i, name in enumerate(names)}
        index = np.array([at[g] for g in group_of], dtype=np.int64)
        return cls(names, [np.flatnonzero(index == i) for i in range(len(names))], index)

    def paired(self) -> np.ndarray:
        """Per rank (column): whether it has a peer. A rank alone in its group (a pipeline stage of one rank)
        is compared with nobody: it is never flagged, and its jitter is not measured."""
        sizes = np.array([len(m) for m in self.members], dtype=np.int64)
        return sizes[self.index] >= 2 if len(self.index) else np.zeros(0, dtype=bool)


_P = TypeVar("_P", bound="_StepParts")


class _StepParts:
    """Figures per step of a step part (every field's first axis the part's steps)."""

    @classmethod
    def joined(cls: type[_P], parts: list[_P]) -> _P:
        """The figures of consecutive step parts, as one part's."""
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__))  # type: ignore[attr-defined]


@dataclass
class StepStats(_StepParts):
    """Per step of a step part: the figures of the job that need every rank."""

    step_med: np.ndarray  # median step time
    least_wait: np.ndarray  # the least exposed communication of any rank
    top1: np.ndarray  # the largest busy time (-inf: none), its rank's column, the second largest
    top1_at: np.ndarray
    top2: np.ndarray
    group_med: np.ndarray  # steps x groups: each group's median busy time
    top_v: np.ndarray  # steps x groups x ``cost.TOP_K``: each group's busiest busy times (descending), and
    top_c: np.ndarray  # their columns


def peer_reference(busy: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Per step and rank, the median busy time of the rank's peers (``members``: column
    indices of one group). Leave-one-out for groups of up to 8, else the group median."""
    sub = busy[:, members]
    ref = np.empty_like(sub)
    n = len(members)
    if n == 1:
        return sub.copy()
    if n <= 8:
        for j in range(n):
            ref[:, j] = nanmedian(np.delete(sub, j, axis=1), axis=1)
    else:
        ref[:] = nanmedian(sub, axis=1)[:, None]
    return ref


def step_stage(
    busy: np.ndarray, step_s: np.ndarray, comm_wait: np.ndarray, groups: Groups, cfg: DetectConfig
) -> tuple[np.ndarray, np.ndarray, StepStats]:
    """The excess ``e = busy / peers' median - 1``, its ``cost``: the share of the step it is (float32;
    ``consistency`` compares it with the run's floor), and the step's figures. Arrays: steps x ranks of one
    step part."""
    ref = np.full_like(busy, np.nan)
    for idx in groups.members:
        if len(idx):
            ref[:, idx] = peer_reference(busy, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = busy / ref - 1.0
    step_med = nanmedian(step_s, axis=1)
    with np.errstate(invalid="ignore"):
        costly = (excess * ref / step_med[:, None]).astype(np.float32)
    del ref
    n, r = busy.shape
    filled = np.where(np.isnan(busy), -np.inf, busy)
    top1_at = np.argmax(filled, axis=1) if r else np.zeros(n, dtype=np.int64)
    top1 = filled[np.arange(n), top1_at] if r else np.full(n, -np.inf)
    if r >= 2:
        filled[np.arange(n), top1_at] = -np.inf
        top2 = filled.max(axis=1)
    else:
        top2 = np.full(n, -np.inf)
    with ignoring():  # all-NaN steps
        least = np.nanmin(comm_wait, axis=1) if r else np.full(n, np.nan)
    # each group's lower median busy time, for the imbalance between groups (there is none with one): the
    # lower one of an even group's middle pair, so that one straggler in a group of two is not its group's
    # imbalance (a whole slow group is slow in every member)
    group_med = (np.column_stack([lower_median(busy[:, idx]) for idx in groups.members])
                 if len(groups.members) > 1 else np.zeros((n, 1)))  # fmt: skip
    filled = np.where(np.isnan(busy), -np.inf, busy)
    tops = [top_k(filled[:, idx]) for idx in groups.members]  # the busiest of each group, columns job-wide
    top_v = np.stack([v for v, _ in tops], axis=1) if tops else np.full((n, 0, TOP_K), -np.inf)
    top_c = (np.stack([np.where(c >= 0, np.asarray(idx)[np.maximum(c, 0)], -1) for (_, c), idx in
                       zip(tops, groups.members, strict=True)], axis=1)
             if tops else np.full((n, 0, TOP_K), -1, dtype=np.int64))  # fmt: skip
    return excess, costly, StepStats(step_med, least, top1, top1_at.astype(np.int64), top2, group_med, top_v, top_c)


@dataclass
class HealthyStats(_StepParts):
    """Per step of a step part, once the flags are known."""

    ref_h: np.ndarray  # steps x groups: median busy time of the group's unflagged ranks
    ref_job: np.ndarray  # median over every rank of its group's ``ref_h``
    peer_phase: np.ndarray  # steps x causes: the healthy ranks' median time of each cause's phases


def cause_phases(values: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each cause's time (the sum of its phases, float32) per step and rank, then each gap's
    (:data:`~stragglerwatch.record.schema.GAPS`: where the untimed time lies; NaN where not recorded)."""
    causes = [sum((values[c].astype(np.float32) for c in cols), np.zeros((), np.float32)) for cols in CAUSES.values()]
    shape = causes[0].shape
    return causes + [values[c].astype(np.float32) if c in values else np.full(shape, np.nan, np.float32)
                     for c in GAP_COLUMNS]  # fmt: skip


#: Share of a cause's excess a gap's excess must hold to be named as where it lies.
WHERE_SHARE = 0.5


def where_excess(cause: str, excess_ms: dict[str, float], gap_ms: dict[str, float]) -> str | None:
    """Where in the step a straggler's ``other`` excess lies (a gap holding most of it), or that
    its ``data`` excess is the gap before the forward (no fetch timed); None otherwise. Pure."""
    total = excess_ms.get(cause, 0.0)
    if cause not in ("other", "data") or not total > 0:
        return None
    known = {g: v for g, v in gap_ms.items() if v == v}  # NaN: not recorded (an older log)
    if cause == "data":
        return GAP_TEXT["before_forward"] if known.get("before_forward", 0.0) >= WHERE_SHARE * total else None
    if not known:
        return None
    gap = max(known, key=known.__getitem__)
    return GAP_TEXT[gap] if known[gap] >= WHERE_SHARE * total else None


def healthy_stage(
    busy: np.ndarray, phases: list[np.ndarray], flags: np.ndarray, never_flagged: np.ndarray, groups: Groups
) -> HealthyStats:
    """The healthy reference and the peers' phases of a step part. ``never_flagged``: per rank,
    no flag anywhere in the run: the peers a straggler's phases are compared with (every rank
    unflagged at that step where all were flagged some time)."""
    healthy = np.where(flags, np.nan, busy)
    ref_h = np.empty((busy.shape[0], len(groups.members)))
    for g, idx in enumerate(groups.members):
        if not len(idx):
            ref_h[:, g] = np.nan
            continue
        with np.errstate(all="ignore"):
            col = nanmedian(healthy[:, idx], axis=1) if len(idx) > 1 else busy[:, idx[0]]
        ref_h[:, g] = _or_else(col, lambda idx=idx: nanmedian(busy[:, idx], axis=1))
    del healthy
    # one group: every rank's reference is the group's, and so is their median
    ref_job = nanmedian(ref_h[:, groups.index], axis=1) if len(groups.members) > 1 else ref_h[:, 0].copy()
    peers = never_flagged[None, :] if never_flagged.any() else ~flags
    peer_phase = np.empty((busy.shape[0], len(phases)))
    for c, phase in enumerate(phases):
        col = nanmedian(phase if peers.all() else np.where(peers, phase, np.nan), axis=1)
        peer_phase[:, c] = _or_else(col, lambda phase=phase: nanmedian(phase, axis=1))
    return HealthyStats(ref_h, ref_job, peer_phase)


def _or_else(col: np.ndarray, fallback: Callable[[], np.ndarray]) -> np.ndarray:
    """``col``, with ``fallback()``'s values where it is NaN (computed only when it is)."""
    missing = np.isnan(col)
    return np.where(missing, fallback(), col) if missing.any() else col


def intervals(flag: np.ndarray, cuts: np.ndarray | None = None, series: np.ndarray | None = None,
              carry: int = 0) -> list[tuple[int, int | None, int]]:  # fmt: skip
    """(index where a flag rose, index where it cleared or None, index where the one before it cleared or 0:
    the earliest its onset may lie) for one rank. ``cuts``: indices where a new world of the run begins
    (``attempts.world_cuts``): a flagged stretch is split there, and no onset lies before its world's start.
    Of a stretch that ran on across a cut, the piece in the new world stands only where it lasts longer than
    ``carry`` steps (the most a flag outlasts its cause, :func:`outlasts`): a shorter one is the old world's
    flag clearing. A piece where the rank's ``series`` has no value (it left the job) is no stretch."""
    edges = np.diff(np.concatenate(([0], flag.astype(np.int8), [0])))
    rises = np.flatnonzero(edges == 1)
    falls = np.flatnonzero(edges == -1)
    ends = [int(f) if f < len(flag) else None for f in falls]
    out = [(int(r), f, int(ends[k - 1] or 0) if k else 0) for k, (r, f) in enumerate(zip(rises, ends, strict=True))]
    if cuts is None or not len(cuts):
        return out
    split = []
    for a, b, after in out:
        stop = len(flag) if b is None else b
        inside = [int(c) for c in cuts if a < c < stop]
        starts, floor = [a, *inside], max(after, int(cuts[cuts <= a].max()) if (cuts <= a).any() else 0)
        for k, first in enumerate(starts):
            last = inside[k] if k < len(inside) else b
            if k and (len(flag) if last is None else last) - first <= carry:
                continue
            if series is None or np.isfinite(series[first : len(flag) if last is None else last]).any():
                split.append((first, last, floor if k == 0 else first))
    return split


def outlasts(cfg: DetectConfig) -> int:
    """The most steps a rank's flag can stay up after its excess ended: its level and short windows, and the
    steps a clearing must hold."""
    return cfg.level_window + cfg.window + cfg.confirm


#: The furthest an onset is looked for before the step a flag rose, in level windows.
LOOK_BACK = 8


def _look(e: np.ndarray, cfg: DetectConfig) -> int:
    """The most steps a flag in the series ``e`` can rise after its onset: the level median's window; or, where
    the noise is many times the smallest change, the steps the level GLR (``consistency``) needs to be certain
    of that change, ``2 x decision x (noise / change)^2`` (at most :data:`LOOK_BACK` level windows)."""
    base = cfg.level_window + cfg.window + cfg.confirm
    d = np.abs(np.diff(e[np.isfinite(e)]))
    if not d.size:
        return base
    noise = 1.4826 * float(np.median(d)) / np.sqrt(2.0)
    need = 2.0 * cfg.decision * (noise / floors(noise, cfg).slowdown) ** 2 + cfg.window + cfg.confirm
    return int(min(LOOK_BACK * cfg.level_window, max(base, need)))


def change_point(e: np.ndarray, lo: int, hi: int, level: float, onset: bool,
                 added: tuple[np.ndarray, float] | None = None) -> int:  # fmt: skip
    """Index in [lo, hi] that best splits healthy from slow steps (sign CUSUM): a step is slow where its
    excess ``e`` is over half its ``level``, or where ``added`` (a second measure and its level) is.

    Two measures, because a slowdown can be a share of the step or a time added to it. The excess is a
    share of the peers' time: it stays when a slower GPU's work grows or shrinks, and it shrinks when
    the peers' own time does (a loaded host, a busier stretch), though the rank's added time stays. A
    data wait of 20 ms, added while the host was busy, read as less than half the share it read once
    the host was quiet, and put the onset eight steps late. The time added over the peers stays there,
    and shrinks when the work does. A step slow by either is slow."""
    seg = e[lo : hi + 1]
    slow = seg > level / 2
    if added is not None and added[1] > 0:
        slow |= added[0][lo : hi + 1] > added[1] / 2
    signs = np.where(np.isnan(seg), 0.0, np.where(slow, 1.0, -1.0))
    if onset:  # slow from c on: maximise the sum over [c, hi]
        scores = np.cumsum(signs[::-1])[::-1]
    else:  # slow until c: maximise the sum over [lo, c]
        scores = np.cumsum(signs)
    return lo + int(np.argmax(scores))


@dataclass
class RankSeries:
    """One rank's columns over every step, and what it is compared with at each step."""

    e: np.ndarray
    busy: np.ndarray
    phases: list[np.ndarray]  # per cause (float32)
    ref_h: np.ndarray  # its group's healthy reference
    other_max: np.ndarray  # the largest busy time of any other rank
    peer_phase: np.ndarray  # steps x causes


def other_max(top_v: np.ndarray, top_c: np.ndarray, group: int, column: int) -> np.ndarray:
    """Per step, the largest busy time of another rank of the column's peer group (``StepStats.top_v``/``top_c``):
    what the step would wait for without the rank's excess. A rank is costed within its group: a pipeline's
    stages run one after the other, so a slow stage holds the step by its excess over its own stage's ranks,
    whatever the other stages take (with one group, the busiest other rank of the job)."""
    return np.where(top_c[:, group, 0] == column, top_v[:, group, 1], top_v[:, group, 0])


def describe(series: RankSeries, start: int, end: int | None, cfg: DetectConfig, after: int = 0) -> dict:
    """Onset, end, slowdown, cost and cause of one flagged stretch [start, end) of a rank; its onset lies at or
    after ``after`` (where the rank's stretch before it ended)."""
    e = series.e
    stop = (end if end is not None else len(e)) - 1
    level = float(np.nanmedian(e[start : stop + 1]))
    mean = _winsorised_mean(e[start : stop + 1])
    intermittent = level < 0.5 * mean  # slow in one step of a few (``intermittent.py``): its onset and
    added = None
    if intermittent:  # end are where its mean over a few steps changes
        e, level = _centred_mean(e, BLOCK), mean
    else:  # the time it adds over its peers (``e`` is busy / theirs - 1): for a delay added on a busy host
        with np.errstate(divide="ignore", invalid="ignore"):
            over = series.busy * e / (1.0 + e)
        added = (over, float(np.nanmedian(over[start : stop + 1])))
    first = change_point(e, max(after, start - _look(e, cfg)), start, level, onset=True, added=added)
    look = outlasts(cfg)
    last = (None if end is None else
            min(end - 1, change_point(e, max(first, end - look), end, level, onset=False, added=added)))  # fmt: skip
    span = slice(first, (last if last is not None else stop) + 1)
    if intermittent:  # its busy time over its peers' in all (its median step is not a slow one)
        ok = np.isfinite(series.busy[span]) & np.isfinite(series.ref_h[span])
        slowdown = float(np.sum(series.busy[span][ok]) / max(float(np.sum(series.ref_h[span][ok])), 1e-12))
    else:
        slowdown = float(np.nanmedian(series.busy[span] / series.ref_h[span]))
    # what-if: the step without this rank's excess is set by the reference or the busiest other rank
    lost = np.clip(series.busy[span] - np.maximum(series.ref_h[span], series.other_max[span]), 0.0, None)
    excess_ms, gap_ms = {}, {}
    with ignoring():  # gaps of an older log: all NaN
        # slow in one step of a few (an intermittent straggler): its median step is not a slow one,
        # so each cause's excess is its mean over the span, winsorised (a stall inside moves it not)
        excess = series.busy[span] - series.ref_h[span]
        typical = np.nanmedian if np.nanmedian(excess) >= 0.5 * _winsorised_mean(excess) else _winsorised_mean
        for c, name in enumerate((*CAUSES, *GAPS)):
            diff = series.phases[c][span] - series.peer_phase[span, c]
            value = round(float(typical(diff)) * 1000.0, 3)
            if c < len(CAUSES):
                excess_ms[name] = value
            elif value == value:  # a gap an older log did not record is left out
                gap_ms[name] = value
    cause = max(excess_ms, key=excess_ms.__getitem__)
    return {
        "cause": cause,
        "where": where_excess(cause, excess_ms, gap_ms),
        "gap_ms": gap_ms,
        "slowdown": round(slowdown, 4),
        "first": first,
        "last": last,
        "lost_seconds": float(np.nansum(lost)),
        "excess_ms": excess_ms,
    }


def _centred_mean(e: np.ndarray, width: int) -> np.ndarray:
    """The mean of the finite values of ``e`` over ``width`` steps centred on each step."""
    ok = np.isfinite(e)
    kernel = np.ones(width)
    total = np.convolve(np.where(ok, e, 0.0), kernel, mode="same")
    count = np.convolve(ok.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def _winsorised_mean(x: np.ndarray, upper: float = 90.0) -> float:
    """Mean of the finite values with those above the ``upper`` percentile set to it (NaN: none)."""
    x = x[np.isfinite(x)]
    if not x.size:
        return float("nan")
    return float(np.mean(np.minimum(x, np.percentile(x, upper))))


def rank_medians(values: dict[str, np.ndarray], columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Per rank (column) median of each column, in milliseconds."""
    return {c: nanmedian(values[c], axis=0).astype(np.float64) * 1000.0 for c in columns}


def last_rows(busy: np.ndarray) -> np.ndarray:
    """Per rank, the last row with a record (-1: none)."""
    seen = ~np.isnan(busy)
    n = busy.shape[0]
    last = n - 1 - np.argmax(seen[::-1], axis=0) if n else np.zeros(busy.shape[1], dtype=np.int64)
    return np.where(seen.any(axis=0), last, -1)
