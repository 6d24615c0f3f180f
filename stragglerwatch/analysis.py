"""Assemble the analysis report of a run: load, detect, summarise. The report is one
JSON-ready dict that the text and HTML renderers, the CLI and the dashboard share.

Report (``--format json``), schema ``stragglerwatch-report/1``:
``run_id``, ``world_size``, ``steps``, ``job_seconds``, ``ideal_seconds``,
``job_slowdown`` (S = T_actual / T_ideal), ``lost_seconds``, ``lost_gpu_seconds``,
``communication_bound``, ``comm_fraction``, ``stragglers`` (each ``rank``,
``host``, ``cause``, ``slowdown``, ``first_step``, ``last_step``,
``detected_step``, ``lost_seconds``, ``lost_gpu_seconds``, ``excess_ms``, ``time_span``: Unix
seconds from its first flagged step's start to its last's end, and ``context``: the host and GPU
context signals in which it differed from its peers then, each ``signal``, ``value``, ``peers``
(their median) and ``text``, empty when none did or the run has no context; see ``explain.py``),
``group_imbalance``, ``hangs``, ``ranks`` (per-rank medians), ``thresholds``, and
``attempts``: the run's attempts (``restart``, ``attach``, ``first_step``, ``last_step`` in
the report's step numbering, which continues across them), and
``busy_unavailable``: a list of ``{"reason", "ranks"}``, empty when every rank's busy time
could be measured. When it is not empty no straggler verdict is given (``stragglers``
is empty): comparing busy times that still hold communication would blame the wrong ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .context import load_context
from .detect import MATRIX_COLUMNS, DetectConfig, StepMatrix, Verdict, detect, matrix_from_columns, nanmedian
from .eventlog import read_logs
from .explain import StepTimes, explain, span
from .hangs import hangs_from_events
from .runinfo import read_rank_meta, read_run_meta
from .schema import PHASE_COLUMNS
from .torchlogs import LogParse
from .watchdog import read_events

REPORT_SCHEMA = "stragglerwatch-report/1"


@dataclass
class Analysis:
    report: dict[str, Any]
    matrix: StepMatrix
    verdict: Verdict
    context: pd.DataFrame | None = None  # the run's host and GPU context samples (``context.py``)


def _num(x: float, digits: int = 6) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


def rank_rows(mat: StepMatrix, verdict: Verdict, rank_meta: dict[int, dict]) -> list[dict[str, Any]]:
    """Per-rank medians (ms), slowdown vs peers and flag, in rank order."""
    med = {c: nanmedian(mat.values[c], axis=0) * 1000.0 for c in ("step_s", "busy_s", "comm_wait_s", *PHASE_COLUMNS)}
    slow = nanmedian(verdict.slowdown, axis=0)
    counts = np.sum(~np.isnan(mat.values["busy_s"]), axis=0)
    flagged = {s.rank for s in verdict.stragglers}
    rows = []
    for j, rank in enumerate(mat.ranks.tolist()):
        meta = rank_meta.get(rank, {})
        row: dict[str, Any] = {"rank": rank, "host": meta.get("host"), "role": meta.get("role"),
                               "steps": int(counts[j])}  # fmt: skip
        row.update({c.replace("_s", "_ms"): _num(v[j], 3) for c, v in med.items()})
        row["slowdown"] = _num(slow[j], 4)
        row["flagged"] = rank in flagged
        rows.append(row)
    return rows


def build_report(
    mat: StepMatrix,
    verdict: Verdict,
    run_meta: dict | None,
    rank_meta: dict[int, dict],
    context: pd.DataFrame | None = None,
    step_times: StepTimes | None = None,
) -> dict[str, Any]:
    world = int(run_meta["world_size"]) if run_meta else len(mat.ranks)
    hosts = {r: m.get("host") for r, m in rank_meta.items()}
    unavailable = busy_unavailable(rank_meta)
    stragglers = []
    for s in [] if unavailable else verdict.stragglers:
        d = s.to_dict()
        d["host"] = hosts.get(s.rank)
        d["lost_seconds"] = _num(s.lost_seconds, 4)
        d["lost_gpu_seconds"] = _num(s.lost_seconds * world, 3)
        window = span(step_times, s.first_step, s.last_step) if step_times is not None else None
        d["time_span"] = [round(t, 3) for t in window] if window else None
        d["context"] = []
        stragglers.append(d)
    if context is not None and step_times is not None and stragglers:
        roles = {r: m.get("role") for r, m in rank_meta.items()}
        for d, found in zip(stragglers, explain(context, stragglers, step_times, roles), strict=True):
            d["context"] = found
    report = {
        "schema": REPORT_SCHEMA,
        "run_id": run_meta.get("run_id") if run_meta else None,
        "world_size": world,
        "ranks_seen": len(mat.ranks),
        "steps": len(mat.steps),
        "first_step": int(mat.steps[0]) if len(mat.steps) else None,
        "last_step": int(mat.steps[-1]) if len(mat.steps) else None,
        "job_seconds": _num(verdict.job_seconds, 4),
        "ideal_seconds": _num(verdict.ideal_seconds, 4),
        "job_slowdown": _num(verdict.job_slowdown, 4),
        "lost_seconds": _num(verdict.lost_seconds, 4),
        "lost_gpu_seconds": _num(verdict.lost_seconds * world, 3),
        "communication_bound": verdict.communication_bound,
        "comm_fraction": _num(verdict.comm_fraction, 4),
        "stragglers": stragglers,
        "busy_unavailable": unavailable,
        "group_imbalance": [] if unavailable else [g.to_dict() for g in verdict.groups],
        "hangs": [],
        "thresholds": {k: _num(v, 4) for k, v in verdict.thresholds.items()},
        "ranks": rank_rows(mat, verdict, rank_meta),
    }
    if unavailable:  # every figure that compares busy times would be a guess
        report.update(ideal_seconds=None, job_slowdown=None, lost_seconds=None, lost_gpu_seconds=None,
                      communication_bound=None, comm_fraction=None)  # fmt: skip
        for row in report["ranks"]:
            row["slowdown"], row["flagged"] = None, False
    return report


def busy_unavailable(rank_meta: dict[int, dict]) -> list[dict[str, Any]]:
    """Why busy time cannot be trusted, from the ranks' metadata: ``[{"reason", "ranks"}]``."""
    by_reason: dict[str, list[int]] = {}
    for rank, meta in sorted(rank_meta.items()):
        for reason in meta.get("busy_unavailable") or []:
            by_reason.setdefault(str(reason), []).append(rank)
    return [{"reason": reason, "ranks": ranks} for reason, ranks in by_reason.items()]


def analyze_run(
    run_dir: str | os.PathLike[str],
    config: DetectConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Analysis:
    """Load a run dir, detect, and build the report (raises ``RunDirError``)."""
    path = Path(run_dir)
    logs = read_logs(path, columns=[*MATRIX_COLUMNS, "restart", "attach", "start_time"], progress=progress)
    steps, attempts = global_steps(
        [t["step"].to_numpy() for t in logs.tables],
        [t["restart"].to_numpy() for t in logs.tables],
        [t["attach"].to_numpy() for t in logs.tables],
    )
    mat = matrix_from_columns(
        [t["rank"].to_numpy() for t in logs.tables],
        steps,
        {c: [t[c].to_numpy() for t in logs.tables] for c in MATRIX_COLUMNS},
    )
    times = step_times(mat, [t["rank"].to_numpy() for t in logs.tables], steps,
                       [t["start_time"].to_numpy() for t in logs.tables])  # fmt: skip
    del logs
    rank_meta = read_rank_meta(path)
    roles = {r: m["role"] for r, m in rank_meta.items() if m.get("role") is not None}
    verdict = detect(mat, config, groups=roles or None)
    run_meta = read_run_meta(path)
    context = load_context(path)
    report = build_report(mat, verdict, run_meta, rank_meta, context if len(context) else None, times)
    report["run_dir"] = str(path)
    events, bad = read_events(path)
    report["hangs"] = hangs_from_events(events, report["world_size"], last_steps(mat))
    _native_dumps(path, report["hangs"])
    report["events"] = {"count": len(events), "skipped_lines": bad}
    report["attempts"] = attempts
    return Analysis(report, mat, verdict, context if len(context) else None)


def step_times(mat: StepMatrix, ranks: list[np.ndarray], steps: list[np.ndarray], starts: list[np.ndarray]
               ) -> StepTimes:  # fmt: skip
    """(step, start, end) of every step of the matrix (Unix seconds; the median over its ranks)."""
    start = np.full(mat.values["step_s"].shape, np.nan)
    for r, s, t in zip(ranks, steps, starts, strict=True):
        start[np.searchsorted(mat.steps, s), np.searchsorted(mat.ranks, r)] = t
    return mat.steps, nanmedian(start, axis=1), nanmedian(start + mat.values["step_s"], axis=1)


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


def global_steps(
    steps: list[np.ndarray], restarts: list[np.ndarray], attaches: list[np.ndarray]
) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """Steps numbered across attempts, and the attempts. Each (restart, attach) pair counts its
    steps from 0; in the order of the pairs, every attempt's steps follow the last step any
    rank recorded in the one before, so no (rank, step) of one attempt overwrites another's."""
    keys = [r.astype(np.int64) * 65536 + a.astype(np.int64) for r, a in zip(restarts, attaches, strict=True)]
    last: dict[int, int] = {}
    for k, s in zip(keys, steps, strict=True):
        for key in np.unique(k):
            last[int(key)] = max(last.get(int(key), -1), int(s[k == key].max()))
    offsets, attempts, offset = {}, [], 0
    for key in sorted(last):
        offsets[key] = offset
        attempts.append({"restart": key // 65536, "attach": key % 65536, "first_step": offset,
                         "last_step": offset + last[key]})  # fmt: skip
        offset += last[key] + 1
    if len(offsets) <= 1:
        return steps, attempts
    ordered = np.array(sorted(offsets))
    shift = np.array([offsets[k] for k in ordered])
    return [s + shift[np.searchsorted(ordered, k)] for s, k in zip(steps, keys, strict=True)], attempts


def empty_analysis() -> Analysis:
    """The analysis of no run at all (``analyze --logs`` without a run dir)."""
    mat = matrix_from_columns([], [], {c: [] for c in MATRIX_COLUMNS})
    verdict = detect(mat)
    report = build_report(mat, verdict, None, {})
    report["world_size"] = None
    return Analysis(report, mat, verdict)


def add_pytorch_logs(report: dict[str, Any], parsed: LogParse) -> None:
    """Add what PyTorch's own messages say: ``log_events``, ``first_failure``, line counts."""
    report["log_events"] = [e.to_dict() for e in parsed.events]
    report["first_failure"] = parsed.first_failure()
    report["log_lines"] = parsed.lines
    report["log_skipped_lines"] = parsed.skipped


def last_steps(mat: StepMatrix) -> dict[int, int]:
    """The last step each rank recorded."""
    seen = ~np.isnan(mat.values["busy_s"])
    out = {}
    for j, rank in enumerate(mat.ranks.tolist()):
        rows = np.flatnonzero(seen[:, j])
        if len(rows):
            out[rank] = int(mat.steps[rows[-1]])
    return out
