"""Straggler detection: pure functions over per-rank step timings, no I/O, no torch.

Design (DESIGN.md, "Peers, consistency, cause, cost"):

1. Matrix: ``busy_s`` (and the phases) as steps x ranks arrays.
2. Per step, each rank's relative excess over its peers' robust reference:
   ``e = busy / median(peers' busy) - 1``; peers are the ranks of the same group
   (role, e.g. pipeline stage); leave-one-out medians for small groups.
3. Consistency (``consistency.py``): a rank is flagged when a change of its excess over its own
   baseline (a CUSUM, at least ``min_slowdown``) or its level over its peers (above
   ``tolerance`` plus a noise margin) persists for ``confirm`` steps, and cleared when it is
   back as long (hysteresis: a spike moves no median, a flag never flaps).
4. Onset/end: a sign-CUSUM change point inside the detection window.
5. Cause: the phase (data, compute = forward + backward, optimizer, other)
   whose excess over the healthy peers is largest during the flagged steps.
6. Cost (what-if): without rank k's excess, step s would have taken
   ``step - (busy_k - max(reference, busiest other rank))``; the job's ideal
   time removes ``busy_max - reference`` from every step: ``S = T_actual / T_ideal``.
7. Communication-bound: even the rank that waits least (the bottleneck) spends
   most of its step in exposed communication. Group imbalance: a whole group's busy time above the others'.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from .consistency import flags as consistency_flags
from .schema import PHASE_COLUMNS

CAUSES = {
    "data": ("data_wait_s",),
    "compute": ("forward_s", "backward_s"),
    "optimizer": ("optimizer_s",),
    "other": ("other_s",),
}
MATRIX_COLUMNS = ("busy_s", "step_s", "comm_wait_s", *PHASE_COLUMNS)


@dataclass(frozen=True)
class DetectConfig:
    window: int = 16  # steps of the short median a flag needs to persist over
    level_window: int = 64  # steps of the level median and of a rank's own baseline
    confirm: int = 3  # consecutive steps a test must hold to flag (and fail to clear)
    min_slowdown: float = 0.06  # smallest change of a rank's busy time that is flagged
    tolerance: float = 0.05  # a rank up to this much slower than its peers for ever is healthy
    z: float = 5.0  # noise margin of the level test, in standard errors of its median
    decision: float = 14.0  # CUSUM alarm level in nats (log-likelihood ratio of a 6% change to a 2% one)
    clip: float = 4.0  # largest weight of one step in the CUSUM, in noise units
    off_ratio: float = 0.5  # a flag clears below this fraction of its threshold
    min_step_fraction: float = 0.03  # excess must also cost at least this fraction of the step
    comm_bound_fraction: float = 0.5  # bottleneck rank waiting this much of its step: comm-bound
    group_min_slowdown: float = 0.10  # a group this much busier than the others: imbalance


@dataclass
class Straggler:
    rank: int
    cause: str
    slowdown: float  # median busy / healthy reference over the flagged steps
    first_step: int  # estimated onset
    last_step: int | None  # estimated end; None while still slow at the end of the data
    detected_step: int  # step at which the consistency rule fired
    lost_seconds: float
    excess_ms: dict[str, float] = field(default_factory=dict)  # median excess per cause
    # (first_step, last_step) of each flagged stretch when a short pause (a stall, a gap in the
    # data, a few healthy steps) interrupted it: one straggler, several episodes
    episodes: list[tuple[int, int | None]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _merge_episodes(found: list[Straggler], steps: np.ndarray, gap: int) -> list[Straggler]:
    """One verdict per rank for flagged stretches at most ``gap`` steps apart (in step order)."""
    out: list[Straggler] = []
    position = {int(s): i for i, s in enumerate(steps)}
    for s in sorted(found, key=lambda x: (x.rank, x.first_step)):
        prev = out[-1] if out and out[-1].rank == s.rank else None
        if prev is not None and prev.last_step is not None and position[s.first_step] - position[prev.last_step] <= gap:
            n_prev = position[prev.last_step] - position[prev.first_step] + 1
            n_new = (position[s.last_step] if s.last_step is not None else len(steps) - 1) - position[s.first_step] + 1
            main = prev if prev.lost_seconds >= s.lost_seconds else s
            out[-1] = Straggler(
                rank=s.rank,
                cause=main.cause,
                slowdown=round((prev.slowdown * n_prev + s.slowdown * n_new) / (n_prev + n_new), 4),
                first_step=prev.first_step,
                last_step=s.last_step,
                detected_step=prev.detected_step,
                lost_seconds=prev.lost_seconds + s.lost_seconds,
                excess_ms=main.excess_ms,
                episodes=[*prev.episodes, (s.first_step, s.last_step)],
            )
        else:
            s.episodes = [(s.first_step, s.last_step)]
            out.append(s)
    return out


@dataclass
class GroupImbalance:
    group: str
    ranks: list[int]
    slowdown: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Verdict:
    ranks: np.ndarray
    steps: np.ndarray
    stragglers: list[Straggler]
    groups: list[GroupImbalance]
    job_seconds: float
    ideal_seconds: float
    lost_seconds: float
    communication_bound: bool
    comm_fraction: float  # median over steps of the bottleneck rank's exposed wait / step
    thresholds: dict[str, float]
    slowdown: np.ndarray  # steps x ranks: busy / reference (1.0 = like its peers)
    flags: np.ndarray  # steps x ranks bool

    @property
    def job_slowdown(self) -> float:
        return self.job_seconds / self.ideal_seconds if self.ideal_seconds > 0 else 1.0


@dataclass
class StepMatrix:
    ranks: np.ndarray
    steps: np.ndarray
    values: dict[str, np.ndarray]  # column -> steps x ranks (NaN where a rank has no row)


def _column(frame: pd.DataFrame, col: str) -> np.ndarray:
    if col in frame:
        return frame[col].to_numpy(dtype=float)
    if col == "comm_wait_s":  # a frame without it: everything that is not busy was communication
        return (frame["step_s"] - frame["busy_s"]).to_numpy(dtype=float)
    return np.zeros(len(frame))  # a phase the frame's source does not measure


def to_matrix(frame: pd.DataFrame) -> StepMatrix:
    """Pivot a ``load_run`` frame into steps x ranks arrays."""
    return matrix_from_columns(
        frame["rank"].to_numpy(), frame["step"].to_numpy(), {c: _column(frame, c) for c in MATRIX_COLUMNS}
    )


def matrix_from_columns(
    rank: np.ndarray | list[np.ndarray], step: np.ndarray | list[np.ndarray], columns: dict[str, list | np.ndarray]
) -> StepMatrix:
    """Steps x ranks arrays from row-aligned columns (arrays, or lists of chunks read per file)."""
    rank_chunks = rank if isinstance(rank, list) else [rank]
    step_chunks = step if isinstance(step, list) else [step]
    ranks = np.unique(np.concatenate(rank_chunks)) if rank_chunks else np.zeros(0, dtype=int)
    steps = np.unique(np.concatenate(step_chunks)) if step_chunks else np.zeros(0, dtype=int)
    values = {col: np.full((len(steps), len(ranks)), np.nan) for col in MATRIX_COLUMNS}
    for k, (r, s) in enumerate(zip(rank_chunks, step_chunks, strict=True)):
        ri, si = np.searchsorted(ranks, r), np.searchsorted(steps, s)
        for col in MATRIX_COLUMNS:
            chunk = columns[col] if isinstance(columns[col], np.ndarray) else columns[col][k]
            values[col][si, ri] = chunk
    return StepMatrix(ranks, steps, values)


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


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.nanmedian`` without its slow per-row fallback when NaNs are present."""
    if a.size == 0:
        return np.full(a.shape[1 - axis] if a.ndim == 2 else 0, np.nan)
    if not np.isnan(a).any():
        return np.median(a, axis=axis)
    ordered = np.sort(a, axis=axis)  # NaNs sort last
    n = np.sum(~np.isnan(a), axis=axis)
    lo = np.take_along_axis(ordered, np.expand_dims(np.maximum((n - 1) // 2, 0), axis), axis)
    hi = np.take_along_axis(ordered, np.expand_dims(np.maximum(n // 2, 0), axis), axis)
    out = np.squeeze((lo + hi) / 2.0, axis=axis)
    return np.where(n == 0, np.nan, out)


def _change_point(e: np.ndarray, lo: int, hi: int, level: float, onset: bool) -> int:
    """Index in [lo, hi] that best splits healthy from slow steps (sign CUSUM)."""
    seg = e[lo : hi + 1]
    signs = np.where(np.isnan(seg), 0.0, np.where(seg > level / 2, 1.0, -1.0))
    if onset:  # slow from c on: maximise the sum over [c, hi]
        scores = np.cumsum(signs[::-1])[::-1]
    else:  # slow until c: maximise the sum over [lo, c]
        scores = np.cumsum(signs)
    return lo + int(np.argmax(scores))


def _intervals(flag: np.ndarray) -> list[tuple[int, int | None]]:
    """(index where a flag rose, index where it cleared or None) for one rank."""
    edges = np.diff(np.concatenate(([0], flag.astype(np.int8), [0])))
    rises = np.flatnonzero(edges == 1)
    falls = np.flatnonzero(edges == -1)
    return [(int(r), int(f) if f < len(flag) else None) for r, f in zip(rises, falls, strict=True)]


def detect(
    data: pd.DataFrame | StepMatrix, config: DetectConfig | None = None, groups: dict[int, str] | None = None
) -> Verdict:
    """Consistent stragglers, their cause and cost, and the job's slowdown. Pure."""
    cfg = config or DetectConfig()
    mat = data if isinstance(data, StepMatrix) else to_matrix(data)
    busy = mat.values["busy_s"]
    n_steps, n_ranks = busy.shape
    group_of = [str(groups.get(int(r), "")) if groups else "" for r in mat.ranks]
    names = sorted(set(group_of))
    members = {g: np.array([j for j, x in enumerate(group_of) if x == g]) for g in names}

    ref = np.full_like(busy, np.nan)
    for idx in members.values():
        ref[:, idx] = peer_reference(busy, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = busy / ref - 1.0
    step_med = nanmedian(mat.values["step_s"], axis=1)
    # the excess must also cost a noticeable part of the step
    with np.errstate(invalid="ignore"):
        costly = excess * ref > cfg.min_step_fraction * step_med[:, None]
    flags, thresholds = consistency_flags(excess, costly, cfg)

    # healthy reference: median over the unflagged ranks of the group, per step
    healthy = np.where(flags, np.nan, busy)
    ref_h = np.full_like(busy, np.nan)
    for idx in members.values():
        with np.errstate(all="ignore"):
            col = nanmedian(healthy[:, idx], axis=1) if len(idx) > 1 else busy[:, idx[0]]
        ref_h[:, idx] = np.where(np.isnan(col), nanmedian(busy[:, idx], axis=1), col)[:, None]

    stragglers = [
        _describe(mat, excess, ref_h, flags, j, start, end, cfg)
        for j in range(n_ranks)
        for start, end in _intervals(flags[:, j])
    ]
    stragglers = _merge_episodes(stragglers, mat.steps, cfg.window)
    stragglers.sort(key=lambda s: -s.lost_seconds)

    busy_max = np.nanmax(np.where(np.isnan(busy), -np.inf, busy), axis=1) if n_steps else np.zeros(0)
    ref_job = nanmedian(ref_h, axis=1)
    step_job = np.nan_to_num(step_med)
    waste = np.clip(np.nan_to_num(busy_max - ref_job), 0.0, step_job)
    job = float(step_job.sum())
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN steps
        least_wait = np.nanmin(mat.values["comm_wait_s"], axis=1) if n_steps else np.zeros(0)
        comm = np.nanmedian(least_wait / step_med) if n_steps else 0.0
    comm = float(np.nan_to_num(comm))
    return Verdict(
        ranks=mat.ranks,
        steps=mat.steps,
        stragglers=stragglers,
        groups=_group_imbalance(busy, members, mat.ranks, cfg),
        job_seconds=job,
        ideal_seconds=job - float(waste.sum()),
        lost_seconds=float(waste.sum()),
        communication_bound=bool(comm >= cfg.comm_bound_fraction and not stragglers),
        comm_fraction=comm,
        thresholds=thresholds,
        slowdown=busy / ref_h,
        flags=flags,
    )


def _describe(
    mat: StepMatrix,
    excess: np.ndarray,
    ref_h: np.ndarray,
    flags: np.ndarray,
    j: int,
    start: int,
    end: int | None,
    cfg: DetectConfig,
) -> Straggler:
    busy = mat.values["busy_s"]
    e = excess[:, j]
    stop = (end if end is not None else len(e)) - 1
    level = float(np.nanmedian(e[start : stop + 1]))
    look = cfg.level_window + cfg.window + cfg.confirm  # the latest a flag can rise after the onset
    first = _change_point(e, max(0, start - look), start, level, onset=True)
    last = None if end is None else _change_point(e, max(first, end - look), end, level, onset=False)
    span = slice(first, (last if last is not None else stop) + 1)
    slowdown = float(np.nanmedian(busy[span, j] / ref_h[span, j]))
    # what-if: the step without this rank's excess is set by the reference or the busiest other rank
    others = np.delete(busy[span], j, axis=1)
    other_max = np.nanmax(np.where(np.isnan(others), -np.inf, others), axis=1) if others.shape[1] else -np.inf
    lost = np.clip(busy[span, j] - np.maximum(ref_h[span, j], other_max), 0.0, None)
    healthy = ~flags[span]
    healthy[:, j] = False
    excess_ms = {}
    for cause, cols in CAUSES.items():
        phase = sum(mat.values[c][span] for c in cols)
        peer = nanmedian(np.where(healthy, phase, np.nan), axis=1) if healthy.any() else nanmedian(phase, 1)
        excess_ms[cause] = round(float(np.nanmedian(phase[:, j] - peer)) * 1000.0, 3)
    return Straggler(
        rank=int(mat.ranks[j]),
        cause=max(excess_ms, key=excess_ms.__getitem__),
        slowdown=round(slowdown, 4),
        first_step=int(mat.steps[first]),
        last_step=None if last is None else int(mat.steps[last]),
        detected_step=int(mat.steps[start]),
        lost_seconds=float(np.nansum(lost)),
        excess_ms=excess_ms,
    )


def _group_imbalance(
    busy: np.ndarray, members: dict[str, np.ndarray], ranks: np.ndarray, cfg: DetectConfig
) -> list[GroupImbalance]:
    if len(members) < 2:
        return []
    med = {g: nanmedian(busy[:, idx], axis=1) for g, idx in members.items()}
    out = []
    for g, series in med.items():
        rest = nanmedian(np.column_stack([s for h, s in med.items() if h != g]), axis=1)
        ratio = float(np.nanmedian(series / rest))
        if ratio > 1.0 + cfg.group_min_slowdown:
            out.append(GroupImbalance(g, [int(ranks[i]) for i in members[g]], round(ratio, 4)))
    return sorted(out, key=lambda x: -x.slowdown)
