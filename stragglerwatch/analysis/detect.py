"""Straggler detection: pure functions over per-rank step timings, no I/O, no torch.

Design (docs/analysis.md, "How detection works"):

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
8. Load imbalance (``imbalance.py``): where the records carry the work of each step, steps 2-6 run on
   work-adjusted times (what each rank would have taken for the step's median work), so a rank is
   judged by its time per unit of work, never by the batches it drew; the imbalance's own cost is
   the verdict's ``imbalance``, and, once detected, part of the job's time lost. The healthy slopes
   are taken again without the flagged ranks (their own slopes are not fitted again), and the flags
   found again, once a first pass flagged any (unless busy time's healthy slopes came out the same: the
   flags read busy time alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis import imbalance as imb
from stragglerwatch.analysis import workfit
from stragglerwatch.analysis.attempts import cut_indices
from stragglerwatch.analysis.consistency import AT_CLASSIC
from stragglerwatch.analysis.consistency import flags as consistency_flags
from stragglerwatch.analysis.cost import cost_in_turn
from stragglerwatch.analysis.episodes import spells
from stragglerwatch.analysis.rounds import Whole, on_threads, slices
from stragglerwatch.analysis.stages import (
    CAUSES,
    Groups,
    HealthyStats,
    RankSeries,
    StepStats,
    cause_phases,
    describe,
    healthy_stage,
    intervals,
    nanmedian,
    other_max,
    outlasts,
    step_stage,
)
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.record.schema import GAP_COLUMNS, PHASE_COLUMNS

__all__ = ["CAUSES", "DetectConfig", "StepMatrix", "Verdict", "detect", "nanmedian"]
MATRIX_COLUMNS = ("busy_s", "step_s", "comm_wait_s", *PHASE_COLUMNS, *GAP_COLUMNS, "work", "work_elements")


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
    where: str | None = None  # where in the step the excess lies (``stages.where_excess``)
    gap_ms: dict[str, float] = field(default_factory=dict)  # median excess per gap (schema.GAPS)
    # (first_step, last_step, detected_step) of each flagged stretch of the rank: one straggler per rank,
    # its episodes in step order (a stall, a gap in the data, healthy steps between them)
    episodes: list[tuple[int, int | None, int]] = field(default_factory=list)
    # what fixing it would save the job (``cost.py``: costed in turn, the costlier stragglers fixed first),
    # in seconds and as a share of the job's time while it was flagged
    saves_seconds: float = 0.0
    saves_share: float = 0.0
    classic: bool = True  # flagged at the fixed floor (``min_slowdown`` of earlier releases) too

    def to_dict(self) -> dict:
        return asdict(self)

    def spells(self, gap: int) -> list[Straggler]:
        """Its episodes, those at most ``gap`` steps apart joined (:func:`spells`), each as a verdict of its own
        with the rank's cause and figures: what a rule that acts once per spell, or a benchmark that scores
        each flag, counts."""
        return [replace(self, first_step=a, last_step=b, detected_step=d, episodes=[(a, b, d)])
                for a, b, d in spells(self.episodes, gap)]  # fmt: skip


def _merge_episodes(found: list[Straggler], steps: np.ndarray, cuts: np.ndarray | None = None) -> list[Straggler]:
    """One verdict per rank and world (``cuts``: the step indices where a new world of the run begins,
    ``attempts.world_cuts``): its flagged stretches are its episodes (in step order). Its cause, excess and
    where are its costliest episode's; its slowdown their mean over their steps; its costs their sums."""
    out: list[Straggler] = []
    position = {int(s): i for i, s in enumerate(steps)}
    cut = np.zeros(0, dtype=np.int64) if cuts is None else np.asarray(cuts)

    def world(s: Straggler) -> int:
        return int(np.searchsorted(cut, position[s.detected_step], side="right"))

    for s in sorted(found, key=lambda x: (x.rank, x.first_step)):
        s.episodes = [(s.first_step, s.last_step, s.detected_step)]
        prev = out[-1] if out and out[-1].rank == s.rank and world(out[-1]) == world(s) else None
        if prev is None or prev.last_step is None:
            out.append(s)
            continue
        n_prev = sum((len(steps) if b is None else position[b] + 1) - position[a] for a, b, _ in prev.episodes)
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
            where=main.where,
            gap_ms=main.gap_ms,
            episodes=[*prev.episodes, *s.episodes],
            saves_seconds=prev.saves_seconds + s.saves_seconds,
            saves_share=max(prev.saves_share, s.saves_share),
            classic=prev.classic or s.classic,
        )
    return out


def _headline(stragglers: list[Straggler], job_seconds: float, cfg: DetectConfig
              ) -> tuple[list[Straggler], list[Straggler]]:  # fmt: skip
    """The stragglers of the verdict, and the minor ones: brief (every episode ended, under two level windows
    of flagged steps in all) and of negligible cost (fixing the rank, with every rank flagged at the same
    time, would have saved the job less than ``min_cost_share`` of its whole time). A short spell of
    contention on a healthy run is a detail of the report, not a straggler; ranks slow together save little
    one at a time, and are costed together; a long episode is a straggler whatever it cost."""
    least = cfg.min_cost_share * job_seconds

    def brief(x: Straggler) -> bool:
        return x.last_step is not None and sum(int(b) - a + 1 for a, b, _ in x.episodes) < 2 * cfg.level_window  # type: ignore[arg-type]

    def overlap(x: Straggler, y: Straggler) -> bool:
        return any(a <= (d if d is not None else a) and c <= (b if b is not None else c)
                   for a, b, _ in x.episodes for c, d, _ in y.episodes)  # fmt: skip

    minor = [s for s in stragglers if brief(s) and s.saves_seconds < least
             and sum(o.saves_seconds for o in stragglers if overlap(s, o)) < least]  # fmt: skip
    return [s for s in stragglers if s not in minor], minor


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
    minor: list[Straggler]  # ended episodes of negligible cost (``_headline``): details, not stragglers
    groups: list[GroupImbalance]
    job_seconds: float
    ideal_seconds: float
    lost_seconds: float
    communication_bound: bool
    comm_fraction: float  # median over steps of the bottleneck rank's exposed wait / step
    thresholds: dict[str, float]
    slowdown: np.ndarray  # steps x ranks: busy / reference (1.0 = like its peers), for the same work
    flags: np.ndarray  # steps x ranks bool
    imbalance: imb.Imbalance | None = None  # None: no work per step recorded
    healthy: np.ndarray | None = None  # ranks never flagged before the cost test (the jitter tax's ranks)
    jitter_hosts: np.ndarray | None = None  # steps x hosts of the healthy ranks (``jittertax``): the Ray engine's
    jitter_ranks: int = 0
    # of ``lost_seconds``, what the busiest rank's peer group (e.g. the heavier pipeline stage) took above the
    # job's reference by its healthy level: unequal groups, not jitter (0 with one group)
    groups_lost_seconds: float = 0.0
    # per step: the job's time, and what it lost to stragglers, jitter and unequal groups (each attempt's cost)
    step_seconds: np.ndarray | None = None
    step_lost: np.ndarray | None = None

    @property
    def job_slowdown(self) -> float:
        return self.job_seconds / self.ideal_seconds if self.ideal_seconds > 0 else 1.0


@dataclass
class StepMatrix:
    ranks: np.ndarray
    steps: np.ndarray
    values: dict[str, np.ndarray]  # column -> steps x ranks (NaN where a rank has no row)
    work_unit: str = ""  # what ``values["work"]`` counts ("tokens", "elements", ...)
    cuts: tuple[int, ...] = ()  # the steps where a new world of the run begins (``attempts.world_cuts``)


def _column(frame: pd.DataFrame, col: str) -> np.ndarray:
    if col in frame:
        return frame[col].to_numpy(dtype=float)
    if col == "comm_wait_s":  # a frame without it: everything that is not busy was communication
        return (frame["step_s"] - frame["busy_s"]).to_numpy(dtype=float)
    if col in GAP_COLUMNS or col.startswith("work"):  # where the untimed time lay, the work done: unknown
        return np.full(len(frame), np.nan)
    return np.zeros(len(frame))  # a phase the frame's source does not measure


def to_matrix(frame: pd.DataFrame) -> StepMatrix:
    """Pivot a ``load_run`` frame into steps x ranks arrays."""
    mat = matrix_from_columns(
        frame["rank"].to_numpy(), frame["step"].to_numpy(), {c: _column(frame, c) for c in MATRIX_COLUMNS}
    )
    units = frame["work_unit"][frame["work_unit"] != ""] if "work_unit" in frame else ()
    mat.work_unit = str(units.mode().iloc[0]) if len(units) else ""
    return mat


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


#: The stages of :func:`detect` its ``progress`` is told of (a run without work skips the first, third and last).
STAGES = ("work fit", "flags", "flags again", "stragglers", "imbalance")


def detect(
    data: pd.DataFrame | StepMatrix,
    config: DetectConfig | None = None,
    groups: dict[int, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Verdict:
    """Consistent stragglers, their cause and cost, the job's slowdown and its load imbalance. Pure
    (``progress`` is told each of :data:`STAGES` as it begins)."""
    cfg = config or DetectConfig()
    say = progress or (lambda stage: None)
    mat = data if isinstance(data, StepMatrix) else to_matrix(data)
    g = Groups.of(mat.ranks, groups)
    chosen = imb.basis(mat.values, mat.work_unit)
    raw, unit, column = chosen if chosen is not None else (mat.values, "", "work")
    rounds = Whole(raw)
    if chosen is not None:
        say("work fit")
    measured = workfit.measure(rounds, g) if chosen is not None else None
    model = imb.model(rounds, g, measured) if measured is not None else None
    values = imb.adjust(raw, model, g) if model is not None else raw
    say("flags")
    flagged = _flag(values, g, cfg)
    if model is not None and flagged[0].any():  # the healthy slopes again, from the ranks never flagged
        say("flags again")
        first, model = model, imb.model(rounds, g, measured, healthy=~flagged[0].any(axis=0))
        values = imb.adjust(raw, model, g, before=(first, values))
        if not imb.same_busy(first, model):  # else the same busy times: the same flags
            flagged = _flag(values, g, cfg)
    flags, thresholds, excess, stats, classic = flagged
    say("stragglers")
    busy = values["busy_s"]
    phases = cause_phases(values)
    never = ~flags.any(axis=0)
    parts = slices(*busy.shape)  # each step part in a thread of its own (they are independent, as on Ray)
    health = HealthyStats.joined(on_threads([lambda p=p: healthy_stage(busy[p], [x[p] for x in phases], flags[p],
                                                                       never, g) for p in parts]))  # fmt: skip
    found = []
    cuts = cut_indices(mat.cuts, mat.steps)
    for j in np.flatnonzero(flags.any(axis=0)):
        col = health.ref_h[:, g.index[j]]
        series = RankSeries(excess[:, j], busy[:, j], [p[:, j] for p in phases], col,
                            other_max(stats.top_v, stats.top_c, g.index[j], j), health.peer_phase)  # fmt: skip
        found += [straggler(int(mat.ranks[j]), mat.steps, series, a, b, cfg, bool(classic[a:b, j].any()), after)
                  for a, b, after in intervals(flags[:, j], cuts, busy[:, j], outlasts(cfg))]  # fmt: skip
    slowdown = busy / health.ref_h[:, g.index] if busy.size else np.zeros(busy.shape)
    result = verdict(mat.ranks, mat.steps, found, stats, health, g, cfg, thresholds, slowdown, flags, cuts)
    result.healthy = never & g.paired()
    if model is not None:
        say("imbalance")
        im = result.imbalance = imb.assess(rounds, model, g, straggling(result, mat.ranks), mat.ranks,
                                           result.job_seconds, cfg.imbalance_min_slowdown, unit, column)  # fmt: skip
        add_imbalance(result, im)
    return result


def add_imbalance(result: Verdict, im: imb.Imbalance) -> None:
    """A detected imbalance's cost is part of the job's time lost: its ideal has neither stragglers nor unequal work."""
    if im.detected and im.lost_seconds:
        result.lost_seconds = min(result.job_seconds, result.lost_seconds + im.lost_seconds)
        result.ideal_seconds = result.job_seconds - result.lost_seconds


def straggling(result: Verdict, ranks: np.ndarray) -> np.ndarray:
    """Per rank: flagged somewhere in the verdict (a straggler or a minor one): the imbalance's cost uses its
    own slope."""
    return np.isin(ranks, [s.rank for s in (*result.stragglers, *result.minor)])


def _flag(values: dict[str, np.ndarray], g: Groups, cfg: DetectConfig
          ) -> tuple[np.ndarray, dict[str, float], np.ndarray, StepStats, np.ndarray]:  # fmt: skip
    """The flags of every rank and step, the thresholds, the excess, the per-step figures, and where the
    flags are at the fixed floor (``consistency.round3``)."""
    busy, step_s, wait = values["busy_s"], values["step_s"], values["comm_wait_s"]
    cut = slices(*busy.shape)
    if len(cut) == 1:
        excess, costly, stats = step_stage(busy, step_s, wait, g, cfg)
    else:  # each step part's excess written in place by its thread (not kept whole, then copied again)
        excess, costly = np.empty(busy.shape, dtype=busy.dtype), np.empty(busy.shape, dtype=np.float32)

        def part(p: slice) -> StepStats:
            excess[p], costly[p], st = step_stage(busy[p], step_s[p], wait[p], g, cfg)
            return st

        stats = StepStats.joined(on_threads([lambda p=p: part(p) for p in cut]))
    levels, thresholds = consistency_flags(excess, costly, cfg)
    return levels > 0, thresholds, excess, stats, (levels & AT_CLASSIC) > 0


def straggler(rank: int, steps: np.ndarray, series: RankSeries, start: int, end: int | None, cfg: DetectConfig,
              classic: bool = True, after: int = 0) -> Straggler:  # fmt: skip
    """The verdict on one flagged stretch [start, end) of a rank (step indices); ``classic``: flagged at the
    fixed floor too (it stands whatever it costs; below it, ``verdict`` keeps it only where it is costly);
    ``after``: where its stretch before ended (its onset is not before)."""
    d = describe(series, start, end, cfg, after)
    return Straggler(
        rank=rank,
        cause=d["cause"],
        slowdown=d["slowdown"],
        first_step=int(steps[d["first"]]),
        last_step=None if d["last"] is None else int(steps[d["last"]]),
        detected_step=int(steps[start]),
        lost_seconds=d["lost_seconds"],
        excess_ms=d["excess_ms"],
        where=d["where"],
        gap_ms=d["gap_ms"],
        classic=classic,
    )


def verdict(
    ranks: np.ndarray,
    steps: np.ndarray,
    found: list[Straggler],
    stats: StepStats,
    health: HealthyStats,
    groups: Groups,
    cfg: DetectConfig,
    thresholds: dict[str, float],
    slowdown: np.ndarray,
    flags: np.ndarray,
    cuts: np.ndarray | None = None,
) -> Verdict:
    """The job's verdict from the per-step figures of every step and the flagged stretches: those whose
    fixing would save the job at least ``min_cost_share`` of its time while they last (``cost.py``); the
    flags of the others are cleared (``flags`` is changed in place). ``cuts``: the step indices where a new
    world of the run begins: a rank's stretches in two worlds are two verdicts."""
    found = _costly(found, ranks, steps, stats, health, groups, cfg, flags)
    step_job = np.nan_to_num(stats.step_med)
    waste = np.clip(np.maximum(np.nan_to_num(stats.top1 - health.ref_job), _held(stats, health)), 0.0, step_job)
    job = float(step_job.sum())
    groups_waste = _groups_waste(stats, health, groups, waste)
    stragglers, minor = _headline(_merge_episodes(found, steps, cuts), job, cfg)
    stragglers.sort(key=lambda s: -s.lost_seconds)
    with np.errstate(divide="ignore", invalid="ignore"), ignoring():  # all-NaN steps
        comm = np.nanmedian(stats.least_wait / stats.step_med) if len(steps) else 0.0
    comm = float(np.nan_to_num(comm))
    return Verdict(
        ranks=ranks,
        steps=steps,
        stragglers=stragglers,
        minor=minor,
        groups=_group_imbalance(stats.group_med, groups, ranks, cfg, {s.rank for s in stragglers}),
        job_seconds=job,
        ideal_seconds=job - float(waste.sum()),
        lost_seconds=float(waste.sum()),
        communication_bound=bool(comm >= cfg.comm_bound_fraction and not stragglers),
        comm_fraction=comm,
        thresholds=thresholds,
        slowdown=slowdown,
        flags=flags,
        groups_lost_seconds=groups_waste,
        step_seconds=step_job,
        step_lost=waste,
    )


def _held(stats: StepStats, health: HealthyStats) -> np.ndarray:
    """Per step, the most any one rank holds the step by, costed within its group (``stages.other_max``): its
    busy time above its group's healthy level and every other rank of its group. With one group it is never
    more than the busiest rank's excess over the job's reference; with pipeline stages it can be (a slow rank
    of a light stage still holds its pipeline)."""
    if stats.top_v.ndim != 3 or stats.top_v.shape[2] < 2 or not stats.top_v.shape[1]:
        return np.zeros(len(stats.step_med))
    with np.errstate(invalid="ignore"):
        held = stats.top_v[:, :, 0] - np.fmax(health.ref_h, stats.top_v[:, :, 1])
    return np.nan_to_num(np.max(np.where(np.isfinite(held), held, 0.0), axis=1), posinf=0.0, neginf=0.0)


def _groups_waste(stats: StepStats, health: HealthyStats, groups: Groups, waste: np.ndarray) -> float:
    """Of each step's lost time, the part that the busiest rank's group holds by its healthy level above the
    job's reference (``health.ref_job``): a heavier peer group (a pipeline stage, a role), summed over steps."""
    if len(groups.names) < 2 or not len(waste):
        return 0.0
    top_group = groups.index[np.clip(stats.top1_at, 0, len(groups.index) - 1)]
    level = health.ref_h[np.arange(len(waste)), top_group]
    return float(np.clip(np.nan_to_num(level - health.ref_job), 0.0, waste).sum())


def _costly(found: list[Straggler], ranks: np.ndarray, steps: np.ndarray, stats: StepStats, health: HealthyStats,
            groups: Groups, cfg: DetectConfig, flags: np.ndarray) -> list[Straggler]:  # fmt: skip
    """The stretches flagged at the fixed floor, and those below it that cost the job enough, with what fixing
    each would save (``cost.cost_in_turn``)."""
    if not found:
        return found
    position = {int(s): i for i, s in enumerate(steps)}
    columns = {int(r): i for i, r in enumerate(ranks)}
    spans = [(columns[s.rank], position[s.first_step], position[s.detected_step],
              len(steps) if s.last_step is None else position[s.last_step] + 1) for s in found]  # fmt: skip
    stretches = [(c, a, b) for c, a, _, b in spans]
    ref = health.ref_h[:, groups.index]
    costs = cost_in_turn(stretches, stats.top_v, stats.top_c, groups.index, ref, np.nan_to_num(stats.step_med),
                         cfg.min_cost_share, [s.classic for s in found])  # fmt: skip
    kept = []
    job = float(np.nansum(stats.step_med))
    for s, (c, a, flagged, b), (saved, share, ok) in zip(found, spans, costs, strict=True):
        # below the fixed floor, a stretch that ended must also have cost the run something, or have lasted
        # (a few dozen slow steps by chance, as two-mode noise has them, are not a straggler)
        lasting = s.last_step is None or b - a >= cfg.level_window or saved >= cfg.min_cost_share * job
        if (ok and lasting) or s.classic:
            s.saves_seconds, s.saves_share = round(saved, 6), round(share, 6)
            kept.append(s)
        elif flags.size:  # (the Ray engine keeps no flags matrix)
            flags[flagged:b, c] = False
    return kept


def _group_imbalance(group_med: np.ndarray, groups: Groups, ranks: np.ndarray, cfg: DetectConfig,
                     flagged: set[int]) -> list[GroupImbalance]:  # fmt: skip
    """Groups busier than the others; a group holding a flagged straggler is not one (its excess is the
    straggler's: a whole slow group is slow in every member, and none of them stands out)."""
    if len(groups.names) < 2:
        return []
    out = []
    for g, name in enumerate(groups.names):
        if any(int(ranks[i]) in flagged for i in groups.members[g]):
            continue
        rest = nanmedian(np.delete(group_med, g, axis=1), axis=1)
        with ignoring():
            ratio = float(np.nanmedian(group_med[:, g] / rest))
        if ratio > 1.0 + cfg.group_min_slowdown:
            out.append(GroupImbalance(name, [int(ranks[i]) for i in groups.members[g]], round(ratio, 4)))
    return sorted(out, key=lambda x: -x.slowdown)
