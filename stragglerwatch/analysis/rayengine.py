"""``analyze --engine ray``: the same analysis on a Ray cluster, for runs that fit no single machine.

Every stage is a pure function of ``runmatrix``, ``stages`` and ``consistency``, called here in Ray
tasks on slices of the run and locally by ``analysis.py`` on the whole of it; each result of a
step depends only on that step's row, each result of a rank only on that rank's column, and the
job-wide reductions combine fixed rank blocks in their order, so both engines give the same report.

Data flow (no task opens more than one rank block's files; the object store carries the rest):

1. **scan** (a task per 256 files): each file's ranks and step runs -> the plan (attempts, steps).
2. **load** (a task per rank block): the block's files into steps x ranks arrays; its ranks' medians;
   the arrays cut by step range (the step parts): the repartition by step range.
3. **step stage** (a task per step part, every rank): peer reference, excess, per-step figures; the
   excess cut back into rank blocks.
4. **consistency** (a task per rank block, three rounds with job-wide reductions in between): flags.
5. **healthy stage** (a task per step part): the unflagged ranks' reference and phases.
6. **describe** (a task per rank block): each flagged stretch's onset, cause and cost; each rank's
   slowdown.

Memory: a rank block holds at most ``consistency.BLOCK_RECORDS`` records, a step part at most
``PART_RECORDS``; a worker needs about 64 bytes a record of the slice it works on, several times
over for the consistency rounds' arrays.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stragglerwatch.analysis import consistency, runmatrix, workfit
from stragglerwatch.analysis import imbalance as imb
from stragglerwatch.analysis.attempts import cut_indices, world_cuts
from stragglerwatch.analysis.detect import StepMatrix, Straggler, add_imbalance, straggler, straggling, verdict
from stragglerwatch.analysis.jittertax import host_deviations
from stragglerwatch.analysis.report import (
    RANK_COLUMNS,
    Analysis,
    RankFigures,
    analyze_run,
    finish,
    host_names,
    work_medians,
)
from stragglerwatch.analysis.rounds import joined, thin_copy, thinned
from stragglerwatch.analysis.stages import (
    Groups,
    HealthyStats,
    RankSeries,
    StepStats,
    cause_phases,
    healthy_stage,
    intervals,
    last_rows,
    nanmedian,
    other_max,
    outlasts,
    rank_medians,
    step_stage,
)
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.analysis.workfit import ADJUSTED
from stragglerwatch.record.collectives import collective_files
from stragglerwatch.record.rundir import read_rank_meta
from stragglerwatch.record.schema import GAP_COLUMNS
from stragglerwatch.record.steplog import RunDirWarning, most_common_unit, run_files

#: Ranks x steps records of one step part.
PART_RECORDS = 1 << 22
SCAN_FILES = 256  # files a scan task reads the footers (or ids) of
#: The stages ``analyze_on_ray`` tells its ``progress`` of, at most (a run without work skips the work fit and
#: the imbalance; a run whose first pass flags nobody, the second step stage and consistency).
STAGES = 10
#: What a step part carries of each rank block: the step figures, the phases and the work (adjusted where
#: the run recorded work, in the task that uses them: ``_values``).
PIECE_COLUMNS = ("step_s", "comm_wait_s", "start_time", *ADJUSTED, "work", "work_elements", *GAP_COLUMNS)


class RayEngineError(Exception):
    """Ray cannot be used (not installed, no cluster at the address); one line for the user."""


def step_parts(n_ranks: int, n_steps: int) -> list[slice]:
    size = max(1, PART_RECORDS // max(n_ranks, 1))
    return [slice(lo, min(lo + size, n_steps)) for lo in range(0, n_steps, size)] or [slice(0, 0)]


# -- the tasks (plain functions; Ray runs them remotely) ------------------------------------------


def _scan(files: list[str]) -> tuple[list[runmatrix.FileScan | None], list[str]]:
    """The files' scans, and what was wrong with any of them (warned by the driver)."""
    said: list[str] = []
    return [runmatrix.scan_file(Path(f), warn=said.append) for f in files], said


def _load(files: list[str], plan: runmatrix.StepPlan, ranks: np.ndarray, parts: list[slice]) -> tuple:
    """A rank block's arrays: its ranks' figures, then one slice per step part."""
    units: dict[str, int] = {}
    values = runmatrix.fill([Path(f) for f in files], plan, ranks, units=units)
    summary = {
        "units": units,
        "medians": rank_medians(values, RANK_COLUMNS),
        "steps": np.sum(~np.isnan(values["busy_s"]), axis=0),
        "last": last_rows(values["busy_s"]),
        "work": {c: work_medians(values, c) for c in imb.WORK_COLUMNS if c in values},
    }
    # a column the block never recorded (work, a gap) travels as nothing: ``_values`` fills it with NaN
    kept = [c for c in PIECE_COLUMNS if c in values and (c == "busy_s" or bool(np.isfinite(values[c]).any()))]
    cut = [{c: np.ascontiguousarray(values[c][p]) for c in kept} for p in parts]
    return (summary, *cut)


def _joined(pieces: tuple[dict, ...], axis: int, work: str | None) -> dict[str, np.ndarray]:
    """The pieces of a step part (side by side, ``axis`` 1) or of a rank block (one after the other, 0) as
    one, the fitted work (``work``: its column, None: none) as ``work``."""

    def column(c: str) -> np.ndarray:
        if all(c not in p for p in pieces):
            shape = [p["busy_s"].shape for p in pieces]
            return np.full((sum(x[0] for x in shape), shape[0][1]) if axis == 0 else
                           (shape[0][0], sum(x[1] for x in shape)), np.nan, dtype=np.float32)  # fmt: skip
        return np.concatenate([p[c] if c in p else np.full(p["busy_s"].shape, np.nan, dtype=np.float32)
                               for p in pieces], axis=axis)  # fmt: skip

    values = {c: column(c) for c in PIECE_COLUMNS}
    if work is not None:
        values["work"] = values[work]
    return values


def _values(pieces: tuple[dict, ...], axis: int, work: str | None, model: imb.WorkModel | None, groups: Groups,
            rows: slice, cols: slice) -> dict[str, np.ndarray]:  # fmt: skip
    """:func:`_joined`, adjusted for the work where ``model`` (the run's ``rows`` and ``cols``)."""
    values = _joined(pieces, axis, work)
    return imb.adjust(values, model, groups, rows, cols) if model is not None else values


def _thin_piece(piece: dict[str, np.ndarray], rows: slice, every: int, columns: tuple[str, ...]) -> dict:
    """The steps of a piece (of the part ``rows``) whose index in the run is a multiple of ``every``, its
    ``columns`` only (all where empty)."""
    kept = {c: v for c, v in piece.items() if not columns or c in columns}
    return thin_copy(thinned(kept, rows, every)[0])


def _on_rows(fn: Callable[..., Any], rows: slice, n_blocks: int, work: str | None, every: int, *rest: Any) -> Any:
    """A step round of ``rounds.py`` on one step part (``rest``: the round's arguments, then the part's pieces),
    on every ``every``-th step of the run."""
    pieces, args = rest[len(rest) - n_blocks :], rest[: len(rest) - n_blocks]
    values, rows = thinned(_joined(pieces, 1, work), rows, every)
    return fn(values, rows, slice(0, values["busy_s"].shape[1]), *args)


def _on_cols(fn: Callable[..., Any], cols: slice, n_parts: int, work: str | None, every: int, *rest: Any) -> Any:
    """A rank round of ``rounds.py`` on one rank block, on every ``every``-th step of the run."""
    pieces, args = rest[len(rest) - n_parts :], rest[: len(rest) - n_parts]
    joined_values = _joined(pieces, 0, work)
    values, rows = thinned(joined_values, slice(0, joined_values["busy_s"].shape[0]), every)
    return fn(values, rows, cols, *args)


class RayRounds:
    """The rounds of ``rounds.py`` as Ray tasks over the loaded step parts and rank blocks."""

    def __init__(self, ray: Any, loads: list, parts: list[slice], blocks: list[slice], work: str | None,
                 every: int = 1) -> None:  # fmt: skip
        self.ray, self.loads, self.parts, self.blocks, self.work, self.every = ray, loads, parts, blocks, work, every
        self.rows_task, self.cols_task = ray.remote(_on_rows), ray.remote(_on_cols)

    def thin(self, every: int, columns: tuple[str, ...] = ()) -> RayRounds:
        """The rounds over every ``every``-th step: the pieces are thinned once, by a task each, into the object
        store (the fit's dozen rounds then read a fraction of the run, not all of it at every round)."""
        if every == 1 or self.every != 1:
            return RayRounds(self.ray, self.loads, self.parts, self.blocks, self.work, self.every * every)
        keep = tuple({*columns, "busy_s", *([self.work] if self.work and "work" in columns else [])}) if columns else ()
        task = self.ray.remote(_thin_piece)
        parts = [(p, thinned({}, rows, every)[1]) for p, rows in enumerate(self.parts)]
        parts = [(p, rows) for p, rows in parts if rows.stop > rows.start]  # a part with none of those steps
        loads = [[None, *[task.remote(ld[1 + p], self.parts[p], every, keep) for p, _ in parts]] for ld in self.loads]
        return RayRounds(self.ray, loads, [rows for _, rows in parts], self.blocks, self.work)

    def by_steps(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return self.ray.get([self.rows_task.remote(fn, rows, len(self.blocks), self.work, self.every, *args,
                                                   *[ld[1 + p] for ld in self.loads])
                             for p, rows in enumerate(self.parts)])  # fmt: skip

    def by_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return self.ray.get([self.cols_task.remote(fn, cols, len(self.parts), self.work, self.every, *args,
                                                   *[ld[1 + p] for p in range(len(self.parts))])
                             for ld, cols in zip(self.loads, self.blocks, strict=True)])  # fmt: skip


def _step(rows: slice, blocks: list[slice], groups: Groups, cfg: DetectConfig, work: str | None,
          model: imb.WorkModel | None, *pieces: dict) -> tuple:  # fmt: skip
    values = _values(pieces, 1, work, model, groups, rows, slice(None))
    busy, step_s = values["busy_s"], values["step_s"]
    excess, costly, stats = step_stage(busy, step_s, values["comm_wait_s"], groups, cfg)
    start = values["start_time"]
    times = (nanmedian(start, axis=1), nanmedian(start + step_s, axis=1))
    return ((stats, times), *[(np.ascontiguousarray(excess[:, b]), np.ascontiguousarray(costly[:, b]))
                              for b in blocks])  # fmt: skip


def _round1(cfg: DetectConfig, *pieces: tuple[np.ndarray, np.ndarray]) -> tuple:
    state = consistency.block_state(np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]),
                                    cfg)  # fmt: skip
    return consistency.round1(state), state


def _round2(state: consistency.BlockState, sc: consistency.Scalars, cfg: DetectConfig) -> consistency.Round2:
    return consistency.round2(state, sc, cfg)


def _round3(state: consistency.BlockState, sc: consistency.Scalars, cfg: DetectConfig, lo: int,
            cuts: np.ndarray) -> list:  # fmt: skip
    levels = consistency.round3(state, sc, cfg)
    flags, classic = levels > 0, (levels & consistency.AT_CLASSIC) > 0
    return [(lo + j, a, b, bool(classic[a:b, j].any()), after) for j in np.flatnonzero(flags.any(axis=0))
            for a, b, after in intervals(flags[:, j], cuts, state.e[:, j], outlasts(cfg))]  # fmt: skip


def _flag_rows(found: list[tuple[int, int, int | None, bool, int]], rows: slice, n_ranks: int) -> np.ndarray:
    out = np.zeros((rows.stop - rows.start, n_ranks), dtype=bool)
    for col, a, b, *_ in found:
        lo, hi = max(a, rows.start), min(rows.stop if b is None else b, rows.stop)
        if lo < hi:
            out[lo - rows.start : hi - rows.start, col] = True
    return out


def _healthy(rows: slice, found: list, never: np.ndarray, groups: Groups, work: str | None,
             model: imb.WorkModel | None, *pieces: dict) -> HealthyStats:  # fmt: skip
    values = _values(pieces, 1, work, model, groups, rows, slice(None))
    return healthy_stage(values["busy_s"], cause_phases(values), _flag_rows(found, rows, len(never)), never, groups)


def _describe(block: slice, steps: np.ndarray, ranks: np.ndarray, found: list, groups: Groups, job: dict,
              cfg: DetectConfig, state: consistency.BlockState, work: str | None, model: imb.WorkModel | None,
              *pieces: dict) -> tuple:  # fmt: skip
    values = _values(pieces, 0, work, model, groups, slice(None), block)
    busy, all_phases = values["busy_s"], cause_phases(values)
    ref_h = job["ref_h"]
    relative = busy / ref_h[:, groups.index[block]]
    slowdown = nanmedian(relative, axis=0)
    healthy = job["healthy"][block]  # the jitter tax's ranks: per step and host, their largest deviation
    hosts = host_deviations(relative[:, healthy], job["hosts"][block][healthy], job["host_names"])
    out: list[Straggler] = []
    for col, a, b, classic, after in found:
        j = col - block.start
        others = other_max(job["top_v"], job["top_c"], groups.index[col], col)
        series = RankSeries(np.ascontiguousarray(state.e[:, j]), np.ascontiguousarray(busy[:, j]),
                            [p[:, j] for p in all_phases], ref_h[:, groups.index[col]], others, job["peer_phase"])
        out.append(straggler(int(ranks[col]), steps, series, a, b, cfg, classic, after))
    return slowdown, out, hosts


# -- the driver -------------------------------------------------------------------------------------


def _connect(address: str | None) -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayEngineError('the Ray engine needs ray, which is not installed: pip install "stragglerwatch[ray]"'
                             ) from exc  # fmt: skip
    if not ray.is_initialized():
        _reachable(address)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                     configure_logging=False)  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayEngineError(f"cannot reach a Ray cluster at {address}: {exc}".splitlines()[0]) from exc
    return ray


def _reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster address (``HOST:PORT`` or ``ray://HOST:PORT``) that takes no connection fails in
    seconds here, not after Ray's minutes of retries."""
    if not address or address == "auto" or ":" not in address:
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise RayEngineError(f"cannot reach a Ray cluster at {address}: {exc}") from exc


def analyze_on_ray(
    run_dir: str | os.PathLike[str],
    config: DetectConfig | None = None,
    address: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Analysis:
    """``analyze_run`` on Ray: the same report, computed by tasks on the cluster at ``address``
    (None: a local Ray started here, or the one this process is connected to). The run dir must
    be readable at the same path on every node (shared storage). Raises ``RunDirError`` and
    ``RayEngineError``."""
    cfg = config or DetectConfig()
    say = progress or (lambda stage: None)
    path, _, files = run_files(run_dir)
    ray = _connect(address)
    remote = {f.__name__: ray.remote(f) for f in (_scan, _load, _step, _round1, _round2, _round3, _healthy,
                                                   _describe)}  # fmt: skip
    say(f"scan: {len(files)} files")
    names = [str(f) for f in files]
    scanned = ray.get([remote["_scan"].remote(names[i : i + SCAN_FILES]) for i in range(0, len(names), SCAN_FILES)])
    scans = [s for chunk, _ in scanned for s in chunk]
    for message in (m for _, said in scanned for m in said):
        warnings.warn(message, RunDirWarning, stacklevel=2)
    plan = runmatrix.plan(scans)
    ranks, steps = plan.ranks, plan.steps
    if not len(ranks) or not len(steps):  # nothing to distribute
        return analyze_run(path, cfg)
    blocks = consistency.rank_blocks(len(ranks), len(steps))
    parts = step_parts(len(ranks), len(steps))
    rank_meta = read_rank_meta(path)
    roles = {r: m["role"] for r, m in rank_meta.items() if m.get("role") is not None}
    groups = Groups.of(ranks, roles or None)

    say(f"load: {len(ranks)} ranks x {len(steps)} steps in {len(blocks)} rank blocks and {len(parts)} step parts "
        f"on {len(ray.nodes())} node(s)")
    block_files = [[names[i] for i, s in enumerate(scans) if s is not None and
                    np.any((s.ranks >= ranks[b][0]) & (s.ranks <= ranks[b][-1]))] for b in blocks]  # fmt: skip
    loads = [remote["_load"].options(num_returns=1 + len(parts)).remote(fs, plan, ranks[b], parts)
             for fs, b in zip(block_files, blocks, strict=True)]  # fmt: skip
    cuts = cut_indices(world_cuts(plan.attempts, rank_meta), steps)
    say("work")
    summaries = ray.get([ld[0] for ld in loads])
    recorded = any(bool(np.isfinite(w[0]).any()) for sm in summaries for w in sm["work"].values())
    basis_rows = (joined(RayRounds(ray, loads, parts, blocks, None).by_steps(imb.steps_basis, workfit.fit_every(
        len(steps)))) if recorded else None)  # fmt: skip
    units: dict[str, int] = {}
    for unit, n in ((u, n) for sm in summaries for u, n in sm["units"].items()):
        units[unit] = units.get(unit, 0) + n
    chosen = imb.choose(basis_rows, most_common_unit(units) or "") if basis_rows is not None else None
    work, unit = chosen if chosen is not None else (None, "")
    rounds = RayRounds(ray, loads, parts, blocks, work)
    measured = workfit.measure(rounds, groups) if work is not None else None
    model = imb.model(rounds, groups, measured) if measured is not None else None

    def flag_pass(model: imb.WorkModel | None) -> tuple:
        model_ref = ray.put(model)
        say("step stage")
        step_refs = [remote["_step"].options(num_returns=1 + len(blocks)).remote(
            rows, blocks, groups, cfg, work, model_ref, *[ld[1 + p] for ld in loads])
            for p, rows in enumerate(parts)]  # fmt: skip
        say("consistency")
        r1 = [remote["_round1"].options(num_returns=2).remote(cfg, *[sr[1 + b] for sr in step_refs])
              for b in range(len(blocks))]  # fmt: skip
        sc = consistency.combine1(ray.get([r[0] for r in r1]), cfg)
        sc = consistency.combine2(ray.get([remote["_round2"].remote(r[1], sc, cfg) for r in r1]), sc, cfg)
        found_blocks = ray.get([remote["_round3"].remote(r[1], sc, cfg, b.start, cuts)
                                for r, b in zip(r1, blocks, strict=True)])  # fmt: skip
        return step_refs, r1, sc, found_blocks, model_ref

    step_refs, r1, sc, found_blocks, model_ref = flag_pass(model)
    if measured is not None and any(found_blocks):  # the healthy slopes again, from the ranks never flagged
        never = np.ones(len(ranks), dtype=bool)
        never[[col for fb in found_blocks for col, *_ in fb]] = False
        first, model = model, imb.model(rounds, groups, measured, healthy=never)
        if imb.same_busy(first, model):  # the same busy times, the same flags: the phases' adjustment alone changes
            model_ref = ray.put(model)
        else:
            step_refs, r1, sc, found_blocks, model_ref = flag_pass(model)
    found = [f for fb in found_blocks for f in fb]
    never = np.ones(len(ranks), dtype=bool)
    never[[col for col, *_ in found]] = False
    say("healthy stage")
    healthy = ray.get([remote["_healthy"].remote(rows, found, never, groups, work, model_ref,
                                                 *[ld[1 + p] for ld in loads])
                       for p, rows in enumerate(parts)])  # fmt: skip
    stats_times = ray.get([sr[0] for sr in step_refs])
    stats = StepStats.joined([s for s, _ in stats_times])
    health = HealthyStats.joined(healthy)
    hosts = host_names(ranks, rank_meta)
    job = {"ref_h": health.ref_h, "top_v": stats.top_v, "top_c": stats.top_c,
           "peer_phase": health.peer_phase, "healthy": never & groups.paired(), "hosts": hosts,
           "host_names": np.unique(hosts[never])}  # fmt: skip
    job_ref = ray.put(job)
    say("describe")
    described = ray.get([remote["_describe"].remote(b, steps, ranks, fb, groups, job_ref, cfg, r[1], work, model_ref,
                                                    *[ld[1 + p] for p in range(len(parts))])
                         for b, fb, r, ld in zip(blocks, found_blocks, r1, loads, strict=True)])  # fmt: skip
    thresholds = consistency.thresholds(sc, cfg)
    empty = np.zeros((0, 0))
    result = verdict(ranks, steps, [s for _, d, _ in described for s in d], stats, health, groups, cfg,
                     thresholds, empty, empty.astype(bool), cuts)  # fmt: skip
    result.healthy = never
    if model is not None:
        say("imbalance")
        im = result.imbalance = imb.assess(rounds, model, groups, straggling(result, ranks), ranks,
                                           result.job_seconds, cfg.imbalance_min_slowdown, unit, work)  # fmt: skip
        add_imbalance(result, im)
    if described:
        result.jitter_hosts = np.fmax.reduce([h for _, _, h in described])
        result.jitter_ranks = int((never & groups.paired()).sum())
    figures = RankFigures(
        ranks,
        {c: np.concatenate([s["medians"][c] for s in summaries]) for c in RANK_COLUMNS},
        np.concatenate([d[0] for d in described]) if described else np.zeros(0),
        np.concatenate([s["steps"] for s in summaries]) if summaries else np.zeros(0, dtype=int),
        *((np.concatenate([s["work"][work][k] for s in summaries]) for k in (0, 1)) if work and summaries else ()),
    )
    last_idx = np.concatenate([s["last"] for s in summaries]) if summaries else np.zeros(0, dtype=int)
    last = {int(r): int(steps[i]) for r, i in zip(ranks.tolist(), last_idx.tolist(), strict=True) if i >= 0}
    times = (steps, np.concatenate([t[0] for _, t in stats_times]), np.concatenate([t[1] for _, t in stats_times]))
    mat = StepMatrix(ranks, steps, {})
    seen = _arrival_matrix(ray, path, files, plan, rank_meta, loads, unit, say)
    return finish(path, figures, result, rank_meta, times, last, plan, Analysis(None, mat, result),  # type: ignore[arg-type]
                  config=cfg, seen=seen)  # fmt: skip


def _arrival_matrix(ray: Any, path: Path, files: list[Path], plan: runmatrix.StepPlan, rank_meta: dict[int, dict],
                    loads: list, unit: str, say: Callable[[str], None]) -> StepMatrix | None:  # fmt: skip
    """What the arrival check (``report.arrival_check``) reads, where the ranks recorded their collectives:
    the exposed communication of every step and rank, gathered from the step parts; where some rank said that
    collectives ran where no bracket sees them, the busy time less the unseen waits is detected again, on the
    whole matrix, read here as the local engine reads it (the driver then holds every record)."""
    if not collective_files(path):
        return None
    ranks, steps = plan.ranks, plan.steps
    if any(m.get("coverage") for m in rank_meta.values()):
        say("arrivals: collectives ran unseen; reading every record on the driver to detect again")
        values = runmatrix.fill(files, plan, ranks)
        values.pop("start_time")
        return StepMatrix(ranks, steps, values, work_unit=unit, cuts=world_cuts(plan.attempts, rank_meta))
    say("arrivals")
    pick = ray.remote(_pick)
    parts = len(loads[0]) - 1 if loads else 0
    rows = [np.concatenate(ray.get([pick.remote(ld[1 + p], "comm_wait_s") for ld in loads]), axis=1)
            for p in range(parts)]  # fmt: skip
    return StepMatrix(ranks, steps, {"comm_wait_s": np.concatenate(rows, axis=0)})


def _pick(piece: dict[str, np.ndarray], column: str) -> np.ndarray:
    """One column of a piece (NaN where its block never recorded it)."""
    return piece[column] if column in piece else np.full(piece["busy_s"].shape, np.nan, dtype=np.float32)


def stderr_progress(stage: str) -> None:
    if sys.stderr.isatty():
        print(f"ray: {stage}", file=sys.stderr)
