"""Assemble the analysis report of a run: load, detect, summarise.

The report's schema (``stragglerwatch-report/2``) is typed in ``reportschema.py``: ``build_report``
makes a :class:`~stragglerwatch.analysis.reportschema.Report`, and ``Analysis.report`` is its JSON object,
which the text and HTML renderers, the CLI and the dashboard share. ``busy_unavailable`` not
empty means no straggler verdict is given: comparing busy times that still hold communication
would blame the wrong ranks.

The local engine reads the run with ``runmatrix`` (two passes over the files, the values straight
into steps x ranks arrays) and detects with ``detect``; ``rayengine.py`` runs the same stages on a
cluster and ends in :func:`finish`, like this one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.analysis import runmatrix
from stragglerwatch.analysis.advice import advise
from stragglerwatch.analysis.arrivals import above_group, arrivals, summary, unseen_wait, victims, without_unseen
from stragglerwatch.analysis.attempts import attempt_index, world_cuts
from stragglerwatch.analysis.attempts import describe as describe_attempts
from stragglerwatch.analysis.codeprofile import locate, needed_ranks
from stragglerwatch.analysis.detect import MATRIX_COLUMNS, STAGES, StepMatrix, Verdict, detect, matrix_from_columns
from stragglerwatch.analysis.explain import StepTimes, explain, prepare, span, span_values
from stragglerwatch.analysis.hangs import hangs_from_events
from stragglerwatch.analysis.imbalance import Imbalance, recorded
from stragglerwatch.analysis.imbalance import advice as imbalance_advice
from stragglerwatch.analysis.jittertax import host_deviations, project_hosts
from stragglerwatch.analysis.policy import actions_from_events
from stragglerwatch.analysis.reportschema import (
    REPORT_SCHEMA,
    Attempt,
    CodeSite,
    ContextSignal,
    Events,
    GroupEntry,
    ImbalanceEntry,
    MinorEntry,
    RankRow,
    Report,
    StragglerEntry,
    Unavailable,
)
from stragglerwatch.analysis.rounds import workers
from stragglerwatch.analysis.stages import Groups, last_rows, nanmedian, rank_medians
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.record.codelog import load_code
from stragglerwatch.record.collectives import CollectiveReader, Collectives, load_collectives
from stragglerwatch.record.context import load_context
from stragglerwatch.record.events import read_events
from stragglerwatch.record.rundir import read_rank_meta, read_run_meta, where_ran
from stragglerwatch.record.schema import PHASE_COLUMNS
from stragglerwatch.record.steplog import RunDirWarning, most_common_unit, run_files, world_size

#: The per-rank medians of the report's ``ranks`` rows.
RANK_COLUMNS = ("step_s", "busy_s", "comm_wait_s", *PHASE_COLUMNS)

__all__ = ["REPORT_SCHEMA", "Analysis", "analyze_run", "build_report"]


@dataclass
class Analysis:
    report: dict[str, Any]
    matrix: StepMatrix
    verdict: Verdict
    context: pd.DataFrame | None = None  # the run's host and GPU context samples (``context.py``)
    typed: Report | None = None  # ``report`` before it became JSON (None for an op-level trace)


def _num(x: float, digits: int = 6) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


@dataclass
class RankFigures:
    """Per rank (in rank order): what the report's ``ranks`` rows say of it."""

    ranks: np.ndarray
    medians: dict[str, np.ndarray]  # column -> median, ms
    busy_vs_peers: np.ndarray  # median over the steps of busy time over its group's healthy reference
    steps: np.ndarray  # steps recorded
    work: np.ndarray | None = None  # median work per step (None: not recorded)
    busy_per_work: np.ndarray | None = None  # median busy seconds per unit of work

    @classmethod
    def of(cls, mat: StepMatrix, verdict: Verdict, medians: dict[str, np.ndarray] | None = None) -> RankFigures:
        """``medians``: ``rank_medians`` of ``mat``'s :data:`RANK_COLUMNS` where they were taken already."""
        im = verdict.imbalance
        work, per = work_medians(mat.values, im.column) if im is not None else (None, None)
        medians = rank_medians(mat.values, RANK_COLUMNS) if medians is None else medians
        return cls(mat.ranks, medians, nanmedian(verdict.slowdown, axis=0),
                   np.sum(~np.isnan(mat.values["busy_s"]), axis=0), work, per)  # fmt: skip


def work_medians(values: dict[str, np.ndarray], column: str = "work") -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the median work per step and the median busy seconds per unit of work."""
    work, busy = values[column], values["busy_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(work > 0, busy / np.where(work > 0, work, 1.0), np.nan)
    return nanmedian(work, axis=0), nanmedian(per, axis=0)


def rank_rows(figures: RankFigures, verdict: Verdict, rank_meta: dict[int, dict]) -> list[RankRow]:
    """Per-rank medians (ms), busy time vs peers and flag, in rank order."""
    flagged = {s.rank for s in verdict.stragglers}
    # each column rounded as a list first: a call per value on numpy scalars costs seconds at thousands of ranks
    medians = {c.replace("_s", "_ms"): _nums(v, 3) for c, v in figures.medians.items()}
    vs_peers, steps = _nums(figures.busy_vs_peers, 4), figures.steps.tolist()
    worked = figures.work is not None and figures.busy_per_work is not None
    work = _nums(figures.work, 3) if worked else []
    per_work = _nums(figures.busy_per_work * 1e6, 4) if worked else []
    rows = []
    for j, rank in enumerate(figures.ranks.tolist()):
        meta = rank_meta.get(rank, {})
        rows.append(RankRow(rank=rank, host=meta.get("host"), role=meta.get("role"), steps=int(steps[j]),
                            **{c: v[j] for c, v in medians.items()}, busy_vs_peers=vs_peers[j],
                            flagged=rank in flagged))  # fmt: skip
        if worked:
            rows[-1].work, rows[-1].busy_per_work_us = work[j], per_work[j]
    return rows


def _nums(values: np.ndarray, digits: int) -> list[float | None]:
    """:func:`_num` of every value (Python's rounding, as one value at a time)."""
    return [round(x, digits) if math.isfinite(x) else None for x in np.asarray(values, dtype=np.float64).tolist()]


def build_report(
    figures: RankFigures,
    verdict: Verdict,
    run_meta: dict | None,
    rank_meta: dict[int, dict],
    context: pd.DataFrame | None = None,
    step_times: StepTimes | None = None,
    code: pd.DataFrame | None = None,
    jitter: Callable[[Verdict, RankFigures, dict[int, dict]], dict | None] | None = None,
) -> Report:
    """The typed report of a detected run; ``jitter``: what gives its jitter tax (default
    :func:`jitter_projection`; the live path reuses a recent one)."""
    world = int(run_meta["world_size"]) if run_meta else len(figures.ranks)
    hosts = {r: m.get("host") for r, m in rank_meta.items()}
    unavailable = busy_unavailable(rank_meta)
    stragglers = []
    for s in [] if unavailable else verdict.stragglers:
        window = span(step_times, s.first_step, s.last_step) if step_times is not None else None
        spans = [span(step_times, a, b) if step_times is not None else None for a, b, _ in s.episodes]
        stragglers.append(StragglerEntry(
            rank=s.rank, cause=s.cause, slowdown=s.slowdown, first_step=s.first_step, last_step=s.last_step,
            detected_step=s.detected_step, lost_seconds=_num(s.lost_seconds, 4), excess_ms=s.excess_ms,
            episodes=[list(e) for e in s.episodes], host=hosts.get(s.rank),
            lost_gpu_seconds=_num(s.lost_seconds * world, 3),
            time_span=[round(t, 3) for t in window] if window else None, where=s.where, gap_ms=s.gap_ms,
            saves_seconds=_num(s.saves_seconds, 4), saves_share=_num(s.saves_share, 5),
            episode_spans=[[round(t, 3) for t in w] if w else None for w in spans],
        ))  # fmt: skip
    minor = [MinorEntry(rank=s.rank, cause=s.cause, slowdown=s.slowdown, episodes=[list(e) for e in s.episodes],
                        lost_seconds=_num(s.lost_seconds, 4), saves_seconds=_num(s.saves_seconds, 4),
                        host=hosts.get(s.rank)) for s in ([] if unavailable else verdict.minor)]  # fmt: skip
    roles = {r: m.get("role") for r, m in rank_meta.items()}
    context = prepare(context) if context is not None and not context.empty and stragglers else context  # once
    if context is not None and step_times is not None and stragglers:
        for entry, found in zip(stragglers, explain(context, stragglers, step_times, roles), strict=True):
            entry.context = [ContextSignal(**c) for c in found]
    if step_times is not None and stragglers:
        for entry, located in zip(stragglers, locate(code, stragglers, step_times, roles), strict=True):
            entry.code, entry.code_note = [CodeSite(**c) for c in located["code"]], located["note"]
    own = span_values(context, stragglers, step_times, roles) if step_times is not None else [{}] * len(stragglers)
    for entry, mine in zip(stragglers, own, strict=True):
        entry.hints = advise(entry, stragglers, mine, rank_meta.get(entry.rank), hosts)
    report = Report(
        run_id=run_meta.get("run_id") if run_meta else None,
        world_size=world,
        ranks_seen=len(figures.ranks),
        steps=len(verdict.steps),
        first_step=int(verdict.steps[0]) if len(verdict.steps) else None,
        last_step=int(verdict.steps[-1]) if len(verdict.steps) else None,
        job_seconds=_num(verdict.job_seconds, 4),
        ideal_seconds=_num(verdict.ideal_seconds, 4),
        job_slowdown=_num(verdict.job_slowdown, 4),
        lost_seconds=_num(verdict.lost_seconds, 4),
        lost_gpu_seconds=_num(verdict.lost_seconds * world, 3),
        communication_bound=verdict.communication_bound,
        comm_fraction=_num(verdict.comm_fraction, 4),
        stragglers=stragglers,
        minor=minor,
        busy_unavailable=unavailable,
        group_imbalance=[] if unavailable else [GroupEntry(g.group, g.ranks, g.slowdown) for g in verdict.groups],
        hangs=[],
        thresholds={k: _num(v, 4) for k, v in verdict.thresholds.items()},
        ranks=rank_rows(figures, verdict, rank_meta),
        imbalance=None if verdict.imbalance is None or unavailable else imbalance_entry(verdict.imbalance, world),
    )
    report.lost_split = None if unavailable else lost_split(verdict)
    report.unpaired = unpaired(figures.ranks, roles)
    report.jitter_tax = None if unavailable else (jitter or jitter_projection)(verdict, figures, rank_meta)
    if unavailable:  # every figure that compares busy times would be a guess
        report.ideal_seconds = report.job_slowdown = report.lost_seconds = report.lost_gpu_seconds = None
        report.communication_bound = report.comm_fraction = None
        for row in report.ranks:
            row.busy_vs_peers, row.flagged = None, False
    return report


def unpaired(ranks: np.ndarray, roles: dict[int, Any]) -> list[int] | None:
    """The ranks alone in their peer group (role), where there are several ranks: None when every rank has a
    peer. A pipeline whose stages are one rank each compares no rank with another."""
    if len(ranks) < 2:
        return None
    alone = [int(r) for r, ok in zip(ranks, Groups.of(ranks, roles).paired(), strict=True) if not ok]
    return alone or None


def lost_split(verdict: Verdict) -> dict[str, float]:
    """Where the job's lost time went: what fixing the flagged stragglers would save, what unequal work cost
    (where detected), what unequal peer groups cost (a heavier pipeline stage or role: ``groups``), and the
    rest, jitter: at every step some rank is the slowest by chance. Each part is capped by what is left."""
    left = float(verdict.lost_seconds)
    im = verdict.imbalance
    parts = {"stragglers": float(sum(s.saves_seconds for s in verdict.stragglers)),
             "imbalance": float(im.lost_seconds or 0.0) if im is not None and im.detected else 0.0,
             "groups": float(verdict.groups_lost_seconds)}  # fmt: skip
    out = {}
    for name, value in parts.items():
        out[name] = round(min(max(value, 0.0), left), 4)
        left = max(0.0, left - out[name])
    out["jitter"] = round(left, 4)
    return out


def jitter_projection(verdict: Verdict, figures: RankFigures, rank_meta: dict[int, dict]) -> dict | None:
    """The jitter tax at 2, 8 and 64 times today's ranks (``jittertax.py``), from the ranks never flagged."""
    return jitter_work(verdict, figures, rank_meta)()


def jitter_work(verdict: Verdict, figures: RankFigures, rank_meta: dict[int, dict]) -> Callable[[], dict | None]:
    """:func:`jitter_projection` in two halves: its inputs taken now (the healthy ranks' slowdown copied), and
    the projection from them as the call returned, which may run later, on another thread."""
    busy, step = (x[np.isfinite(x)] for x in (figures.medians["busy_s"], figures.medians["step_s"]))
    with np.errstate(invalid="ignore", divide="ignore"):  # (no rank with a record: NaN, without a warning)
        share = float(np.median(busy) / np.median(step)) if busy.size and step.size else float("nan")
    share = share if np.isfinite(share) and share > 0 else 1.0
    if verdict.jitter_hosts is not None:  # the Ray engine's, reduced over its rank blocks
        per_host, ranks = verdict.jitter_hosts, verdict.jitter_ranks
        return lambda: project_hosts(per_host, ranks, share).to_dict()
    if verdict.slowdown.ndim != 2 or verdict.slowdown.shape[1] != len(verdict.ranks) or not verdict.slowdown.size:
        return lambda: None
    healthy = verdict.healthy if verdict.healthy is not None else np.ones(len(verdict.ranks), dtype=bool)
    hosts = host_names(verdict.ranks[healthy], rank_meta)
    slowdown = verdict.slowdown[:, healthy]  # a copy: the arrays it came from may be written after
    return lambda: project_hosts(host_deviations(slowdown, hosts), int(healthy.sum()), share).to_dict()


def host_names(ranks: np.ndarray, rank_meta: dict[int, dict]) -> np.ndarray:
    """Each rank's host (its rank, where the host is not known): the units the jitter tax draws."""
    return np.array([str(rank_meta.get(int(r), {}).get("host") or f"rank {int(r)}") for r in ranks])


def imbalance_entry(im: Imbalance, world: int) -> ImbalanceEntry:
    """The report's imbalance section: the verdict's figures, rounded, and what to try."""
    phases = {k: round(v, 12) for k, v in im.phase_seconds_per_unit.items()}
    return ImbalanceEntry(
        unit=im.unit, steps=im.steps, detected=im.detected, lost_seconds=_num(im.lost_seconds, 4),
        lost_gpu_seconds=_num(im.lost_seconds * world, 3) if im.lost_seconds is not None else None,
        slowdown=_num(im.slowdown, 4), explained=_num(im.explained, 4), seconds_per_unit=_num(im.seconds_per_unit, 12),
        work_spread=_num(im.work_spread, 4), heaviest_ranks=im.heaviest_ranks,
        heaviest_share=_num(im.heaviest_share, 4), varies=im.varies, phase_seconds_per_unit=phases,
        hints=imbalance_advice(im),
    )  # fmt: skip


def busy_unavailable(rank_meta: dict[int, dict]) -> list[Unavailable]:
    """Why busy time cannot be trusted, from the ranks' metadata."""
    by_reason: dict[str, list[int]] = {}
    for rank, meta in sorted(rank_meta.items()):
        for reason in meta.get("busy_unavailable") or []:
            by_reason.setdefault(str(reason), []).append(rank)
    return [Unavailable(reason, ranks) for reason, ranks in by_reason.items()]


def analyze_run(
    run_dir: str | os.PathLike[str],
    config: DetectConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Analysis:
    """Load a run dir, detect, and build the report (raises ``RunDirError``). ``progress(done, total)``: each
    file scanned and read, then each stage of the detection (:data:`detect.STAGES`)."""
    path, _, files = run_files(run_dir)
    done = [0]
    total = 2 * len(files) + len(STAGES) + 2  # and the report
    aside = ThreadPoolExecutor(1)
    medians: list[Future] = []

    def tick(stage: str = "") -> None:
        done[0] += 1
        if progress:
            progress(done[0], total)
        if stage == "flags" and not medians:  # the table's per-rank medians read the values as recorded: taken
            # beside the flags, whose rule steps through the run on one core
            medians.append(aside.submit(rank_medians, mat.values, RANK_COLUMNS))

    def scan(f: Path) -> tuple[runmatrix.FileScan | None, list[str]]:
        said: list[str] = []
        return runmatrix.scan_file(f, said.append), said

    scans = []
    with ThreadPoolExecutor(workers()) as pool:  # Arrow parses the footers without the interpreter lock
        for found, said in pool.map(scan, files):
            for message in said:  # in file order, whichever thread read the file
                warnings.warn(message, RunDirWarning, stacklevel=2)
            scans.append(found)
            tick()
    plan = runmatrix.plan(scans)
    units: dict[str, int] = {}
    values = runmatrix.fill(files, plan, plan.ranks, tick, units)
    start = values.pop("start_time")
    rank_meta = read_rank_meta(path)
    unit = (most_common_unit(units) or "") if recorded(values) else ""
    mat = StepMatrix(plan.ranks, plan.steps, values, work_unit=unit,
                     cuts=world_cuts(plan.attempts, rank_meta))  # fmt: skip
    when = aside.submit(step_times, mat.steps, start, mat.values["step_s"])  # beside the detection's first stages
    del start
    roles = {r: m["role"] for r, m in rank_meta.items() if m.get("role") is not None}
    with aside:
        verdict = detect(mat, config, groups=roles or None, progress=tick)
        figures = RankFigures.of(mat, verdict, medians[0].result() if medians else None)
        times = when.result()
    done[0] = max(done[0], total - 2)  # the stages a run without work skips
    tick()
    analysis = finish(path, figures, verdict, rank_meta, times, last_steps(mat), plan, Analysis(None, mat, verdict),
                      config=config)  # type: ignore[arg-type]  # fmt: skip
    tick()
    return analysis


def finish(
    path: Path,
    figures: RankFigures,
    verdict: Verdict,
    rank_meta: dict[int, dict],
    times: StepTimes,
    last: dict[int, int],
    plan: runmatrix.StepPlan,
    analysis: Analysis,
    context: pd.DataFrame | None = None,
    config: DetectConfig | None = None,
    collectives: CollectiveReader | None = None,
    jitter: Callable[[Verdict, RankFigures, dict[int, dict]], dict | None] | None = None,
    seen: StepMatrix | None = None,
) -> Analysis:
    """The report of a detected run (every engine): the arrival order at the collectives (read by
    ``collectives``, or from the run dir), context (``context``, or the run dir's), hangs, events,
    attempts; ``jitter``: as :func:`build_report`'s; ``seen``: the matrix the arrival check reads (default: the
    analysis's; the Ray engine gathers what it needs of it only where the ranks recorded collectives)."""
    run_meta = read_run_meta(path)
    world_size(path, run_meta, set(plan.ranks.tolist()))  # warns of ranks that recorded nothing
    context = load_context(path) if context is None else context
    roles = {r: m.get("role") for r, m in rank_meta.items()}
    found = collectives.read() if collectives is not None else load_collectives(path)
    verdict, adjusted, arrival = arrival_check(found, verdict, times, rank_meta, roles,
                                               analysis.matrix if seen is None else seen, config)  # fmt: skip
    if adjusted is not None:
        figures, analysis.matrix, analysis.verdict = RankFigures.of(adjusted, verdict), adjusted, verdict
    code = load_code(path, needed_ranks(verdict.stragglers, plan.ranks.tolist(), roles)) if verdict.stragglers else None
    report = build_report(figures, verdict, run_meta, rank_meta, context if len(context) else None, times, code,
                          jitter)  # fmt: skip
    report.run_dir = str(path)
    report.arrivals = arrival
    events, bad = read_events(path)
    report.hangs = hangs_from_events(events, report.world_size or 0, last)
    report.actions = actions_from_events(events)
    _native_dumps(path, report.hangs)
    report.events = Events(len(events), bad)
    report.attempts = attempts_of(plan, rank_meta, events, verdict, report)
    analysis.typed, analysis.report = report, report.to_dict()
    analysis.context = context if len(context) else None
    return analysis


def attempts_of(plan: runmatrix.StepPlan, rank_meta: dict[int, dict], events: list[dict[str, Any]], verdict: Verdict,
                report: Report) -> list[Attempt]:  # fmt: skip
    """The run's attempts, described (``attempts.describe``). With several, each straggler is named with the
    attempt it was flagged in and that attempt's host, and lost GPU-seconds count each attempt's own ranks: a
    job that went on with fewer GPUs lost fewer GPU-seconds per second."""
    last_own = {runmatrix.split_key(k): v for k, v in plan.last_own.items()}
    found = describe_attempts(plan.attempts, rank_meta, events, last_own, verdict.step_seconds, verdict.step_lost,
                              verdict.steps, plan.members)  # fmt: skip
    if len(found) > 1:
        ran = {int(r): where_ran(dict(m)) for r, m in rank_meta.items()}
        for s in report.stragglers:
            i = attempt_index(int(s.episodes[0][2]) if s.episodes else s.detected_step, found)  # type: ignore[arg-type]
            if i is None:
                continue
            a, s.attempt = found[i], i
            s.host = (ran.get(s.rank, {}).get((a["restart"], a["attach"])) or {}).get("host", s.host)
            if s.lost_seconds is not None and a.get("world_size"):
                s.lost_gpu_seconds = _num(s.lost_seconds * a["world_size"], 3)
        costs = [a.get("lost_gpu_seconds") for a in found]
        if report.lost_seconds is not None and all(c is not None for c in costs):
            rest = max(0.0, report.lost_seconds - sum(a["lost_seconds"] for a in found))  # unequal work, job-wide
            job = sum(a["job_seconds"] for a in found)
            world = sum(a["job_seconds"] * a["world_size"] for a in found) / job if job else report.world_size or 0
            report.lost_gpu_seconds = _num(sum(costs) + rest * world, 3)  # type: ignore[arg-type]
    return [Attempt(**a) for a in found]


def arrival_check(found: Collectives | None, verdict: Verdict, times: StepTimes, rank_meta: dict[int, dict],
                  roles: dict[int, Any], mat: StepMatrix | None, config: DetectConfig | None
                  ) -> tuple[Verdict, StepMatrix | None, dict[str, Any] | None]:  # fmt: skip
    """The arrival order at the collectives (``arrivals.py``), when the ranks recorded it, and the verdict
    it leaves: where the ranks said that collectives run where no bracket sees them (``coverage``), busy
    time less the unseen waits, detected again; otherwise the verdict less the flagged ranks it shows to
    be waiting. Returns the verdict, the matrix it was detected on when that changed, and the report's
    ``arrivals`` section."""
    notes = sorted({str(n) for m in rank_meta.values() for n in m.get("coverage") or []})
    seen = mat.values.get("comm_wait_s") if mat is not None else None
    if found is None or seen is None:
        return verdict, None, ({"coverage": notes} if notes else None)
    steps, start, end = times
    arr = arrivals(found.rows, steps, start, end, verdict.ranks, {r: m.get("host") for r, m in rank_meta.items()})
    reasons = victims(verdict.stragglers, arr, roles, seen)
    adjusted = None
    if notes and mat is not None:  # waits no bracket saw: taken out of busy time, every rank, every step
        adjusted = without_unseen(mat, above_group(unseen_wait(arr, seen), verdict.ranks, roles))
        verdict = detect(adjusted, config, groups={r: g for r, g in roles.items() if g is not None} or None)
        flagged = {s.rank for s in verdict.stragglers}
        cleared = {r: why for r, why in reasons.items() if r not in flagged}
    else:
        cleared = reasons
        verdict = dataclasses.replace(verdict, stragglers=[s for s in verdict.stragglers if s.rank not in cleared])
    ranks = summary(arr)
    share = {x["rank"]: x["last_share"] for x in ranks}
    disagree = []
    for s in verdict.stragglers:
        peers = [share[r] for r in share if r != s.rank and roles.get(r) == roles.get(s.rank)]
        if s.rank in share and peers and share[s.rank] <= float(np.median(peers)):
            why = (f"busy time flags it, but it entered its collectives last no more often than its peers "
                   f"({share[s.rank]:.0%} against {np.median(peers):.0%})")
            disagree.append({"rank": s.rank, "reason": why})
    section = {"coverage": notes, "groups_compared": arr.groups, "groups_skipped": arr.skipped, "ranks": ranks,
               "busy_adjusted": adjusted is not None,
               "cleared": [{"rank": r, "reason": why} for r, why in sorted(cleared.items())],
               "disagree": disagree, "lost_entries": {str(r): n for r, n in sorted(found.lost.items()) if n},
               "bad_lines": found.bad_lines}  # fmt: skip
    return verdict, adjusted, section


def step_times(steps: np.ndarray, start: np.ndarray, step_s: np.ndarray) -> StepTimes:
    """(step, start, end) of every step (Unix seconds; the median over its ranks)."""
    return steps, nanmedian(start, axis=1), nanmedian(start + step_s, axis=1)


def _native_dumps(run_dir: Path, hangs: list[dict[str, Any]]) -> None:
    """A culprit that never ran Python again (stuck holding the GIL, then killed) left only
    faulthandler's dump in ``stacks-NNNNN.txt``: its last dump becomes its stacks."""
    for hang in hangs:
        for rank in hang.get("culprit_ranks", []):
            if str(rank) in (hang.get("stacks") or {}):
                continue
            try:
                text = (run_dir / f"stacks-{int(rank):05d}.txt").read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            dumps = [d for d in text.split("Timeout (") if d.strip()]
            if dumps:
                hang.setdefault("stacks", {})[str(rank)] = {"faulthandler": "Timeout (" + dumps[-1][-20000:]}


def empty_analysis() -> Analysis:
    """The analysis of no run at all (``analyze --logs`` without a run dir)."""
    mat = matrix_from_columns([], [], {c: [] for c in MATRIX_COLUMNS})
    verdict = detect(mat)
    report = build_report(RankFigures.of(mat, verdict), verdict, None, {})
    report.world_size = None
    return Analysis(report.to_dict(), mat, verdict, typed=report)


def last_steps(mat: StepMatrix) -> dict[int, int]:
    """The last step each rank recorded."""
    rows = last_rows(mat.values["busy_s"])
    return {int(r): int(mat.steps[i]) for r, i in zip(mat.ranks.tolist(), rows.tolist(), strict=True) if i >= 0}
