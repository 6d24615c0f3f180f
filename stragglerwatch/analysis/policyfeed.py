"""The analysis behind ``on_straggler``: a run dir followed in a bounded window of steps, in a process of its own.

Design: rank 0's policy thread starts ``python -m stragglerwatch.analysis.policyfeed RUN_DIR`` (:func:`main`),
at a lower priority (``os.nice``), with one thread for numpy. Every ``--interval`` seconds it reads what is
new in the run dir and writes one line of JSON to its stdout, a pipe the thread reads: the *view* the rule
needs (``policy.view``: the run's scalars and, per straggler, its figures, context signals, hints,
attempts, hosts and why it looks busier by design), a few kB. The thread parses the line and runs the
actions; it holds no array of the run. The process ends when its stdin (the thread's end of a pipe)
closes, so it never outlives rank 0.

:class:`WindowRun` analyses the last ``window`` steps that every rank has written, and keeps at most twice
that (about 100 bytes a rank a step: 2 x 2,000 steps x 1,024 ranks, 400 MB, while the ranks are apart),
the context samples and recorded collectives of those steps, and per attempt the busy and duty times of
its first ``START_SKIP + START_STEPS`` steps (``policy.start_profile``: the start that tells a duty of
rank 0 from a fault). Each update reads the complete record batches added to
the Arrow streams since the last (a compacted Parquet segment once), keeps of them only what falls in the
window, and detects on the window (``detect``, with the arrival order check and the context explanation,
as ``analyze`` does on a whole run). An episode longer than the window is continued by the thread
(``policy.Episodes``). :func:`view_of_run` gives the same view of a whole finished run (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.detect import StepMatrix, detect
from stragglerwatch.analysis.live import NAMES, _File, changed, is_parquet, quiet, read_changed, read_new
from stragglerwatch.analysis.policy import START_SKIP, START_STEPS, start_profile, view
from stragglerwatch.analysis.report import RankFigures, analyze_run, arrival_check, build_report, step_times
from stragglerwatch.analysis.reportschema import Attempt
from stragglerwatch.analysis.runmatrix import FLOAT64_COLUMNS, VALUE_COLUMNS, attempt_keys, attempt_list
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.record.collectives import CollectiveReader
from stragglerwatch.record.context import as_schema, context_files, read_file, schema_problem
from stragglerwatch.record.rundir import read_rank_meta, read_run_meta
from stragglerwatch.record.steplog import RunDirWarning, conform, run_files, work_unit

#: Steps of every rank the live analysis keeps (``straggler_window_steps``).
WINDOW_STEPS = 2000
#: Context and collectives kept from this many seconds before the window's first step.
PAD_S = 30.0
_KEY = 65536  # attempt key = restart * _KEY + attach (``runmatrix``)
_START_COLS = ["rank", "step", "restart", "attach", "busy_s", "data_wait_s", "other_s"]


class _Reset(Exception):
    """What was read moves the steps already placed (an earlier attempt grew, a stream shrank): read again."""


@dataclass
class _Start:
    """The first steps of an attempt, until they are all there."""

    first: int  # its first raw step seen
    tables: list[pa.Table] = field(default_factory=list)
    profile: dict[int, dict[str, float]] = field(default_factory=dict)
    done: bool = False


class WindowRun:
    """The last ``window`` steps of a run dir that grows; :meth:`update` returns the view of them
    (``policy.view``) when something new was read, else None."""

    def __init__(self, run_dir: str | Path, window: int = WINDOW_STEPS, config: DetectConfig | None = None):
        self.run_dir = Path(run_dir)
        self.window = max(64, int(window))
        self.cfg = config or DetectConfig()
        self.resets = 0
        self._reset()

    def _reset(self) -> None:
        self.files: dict[str, _File] = {}
        self.ctx_files: dict[str, _File] = {}
        self.first_raw: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.offsets: dict[int, int] = {}
        self.ranks = np.zeros(0, dtype=np.int64)
        self.rank_last: dict[int, int] = {}  # each rank's last step read (the run's numbering)
        self.steps = np.zeros(0, dtype=np.int64)
        self.values: dict[str, np.ndarray] = {}
        self.starts: dict[int, _Start] = {}
        self.context: pa.Table | None = None
        self.collectives = CollectiveReader(self.run_dir)
        self.unit = ""
        self.seen_to = -1  # the last step of the latest view

    @property
    def cells(self) -> int:
        """Steps x ranks held (at most twice ``window`` x ranks)."""
        return int(self.steps.size * self.ranks.size)

    def update(self) -> dict[str, Any] | None:
        with ignoring(RunDirWarning):
            try:
                new = self._ingest()
            except _Reset:
                self.resets += 1
                self._reset()
                new = self._ingest()
            if not new or not self.steps.size:
                return None
            _, hi = self._bounds()
            if hi == self.seen_to:  # what came was beyond what every rank has reached: wait for the rest
                return None
            v = self._view()
            # steps no view judged: more came between two looks than the window holds
            v["skipped"] = max(0, int(v["window"][0]) - self.seen_to - 1) if self.seen_to >= 0 else 0
            self.seen_to = hi
            return v

    # -- reading ----------------------------------------------------------------------------------

    def _ingest(self) -> bool:
        try:
            _, _, files = run_files(self.run_dir)
        except Exception:  # noqa: BLE001 - not a run dir yet: nothing to read
            return False
        read = read_changed(files, self.files)
        if read is None:
            raise _Reset
        tables = []
        for f, raw in read:
            table = raw if is_parquet(f) else conform(raw, NAMES, f, quiet)
            if table is not None and table.num_rows:
                kept = self._keep(table)
                if kept is not None:
                    tables.append(kept)
        if not tables:
            return False
        self._place(tables)
        return True

    def _keep(self, table: pa.Table) -> pa.Table | None:
        """Of a table just read, the rows of each attempt's start (kept aside) and its last two windows."""
        keys, raw = attempt_keys(table), table["step"].to_numpy()
        first = np.empty_like(raw)
        last = np.empty_like(raw)
        for key in np.unique(keys).tolist():
            sel = keys == key
            lo, hi = int(raw[sel].min()), int(raw[sel].max())
            if key not in self.first_raw or lo < self.first_raw[key]:
                self.first_raw[key] = lo
            self.last[key] = max(self.last.get(key, hi), hi)
            first[sel], last[sel] = self.first_raw[key], self.last[key]
            start = self.starts.setdefault(key, _Start(self.first_raw[key]))
            start.first = self.first_raw[key]
            early = sel & (raw < start.first + START_SKIP + START_STEPS)
            if not start.done and early.any():
                start.tables.append(table.filter(pa.array(early)).select(_START_COLS))
        keep = raw > last - 2 * self.window
        return table.filter(pa.array(keep)) if keep.any() else None

    def _place(self, tables: list[pa.Table]) -> None:
        offsets, offset = {}, 0
        for key in sorted(self.last):  # as ``runmatrix.plan`` numbers a run's attempts
            offsets[key] = offset
            offset += self.last[key] + 1
        if any(offsets.get(k) != v for k, v in self.offsets.items()):
            raise _Reset  # an earlier attempt grew: the later ones' steps move
        self.offsets = offsets
        steps = [t["step"].to_numpy() + np.array([offsets[int(k)] for k in attempt_keys(t)], dtype=np.int64)
                 for t in tables]  # fmt: skip
        for t, st in zip(tables, steps, strict=True):
            ranks = t["rank"].to_numpy()
            for r in np.unique(ranks).tolist():
                self.rank_last[r] = max(self.rank_last.get(r, -1), int(st[ranks == r].max()))
        lo = self._bounds()[0]
        found = np.unique(np.concatenate([s[s >= lo] for s in steps]))
        new_steps = np.union1d(self.steps[self.steps >= lo], found)
        new_ranks = np.union1d(self.ranks, np.unique(np.concatenate([t["rank"].to_numpy() for t in tables])))
        if not (np.array_equal(new_steps, self.steps) and np.array_equal(new_ranks, self.ranks)):
            si = np.searchsorted(new_steps, self.steps)
            old = self.steps >= lo
            ri = np.searchsorted(new_ranks, self.ranks)
            for col in VALUE_COLUMNS:
                dtype = np.float64 if col in FLOAT64_COLUMNS else np.float32
                arr = np.full((len(new_steps), len(new_ranks)), np.nan, dtype=dtype)
                if col in self.values and self.steps.size and self.ranks.size:
                    arr[np.ix_(si[old], ri)] = self.values[col][old]
                self.values[col] = arr
            self.steps, self.ranks = new_steps, new_ranks
        for t, s in zip(tables, steps, strict=True):
            inside = s >= lo
            if not inside.any():
                continue
            si = np.searchsorted(self.steps, s[inside])
            ri = np.searchsorted(self.ranks, t["rank"].to_numpy()[inside])
            for col in VALUE_COLUMNS:
                self.values[col][si, ri] = t[col].to_numpy()[inside]
        if not self.unit and "work" in self.values and np.isfinite(self.values["work"]).any():
            self.unit = work_unit(self.run_dir) or ""
        self._starts()

    def _bounds(self) -> tuple[int, int]:
        """The first step kept, and the last step analysed: the one every rank has reached (a rank more than
        two windows behind the others, stopped or gone, aside), so that a look while the ranks write their
        batches one after another judges no rank on steps it has not written yet. The steps after it are
        kept for the next look: at most twice the window in all."""
        top = max(self.rank_last.values())
        hi = min(v for v in self.rank_last.values() if v > top - 2 * self.window)
        return max(top - 2 * self.window + 1, hi - self.window + 1), hi

    def _starts(self) -> None:
        roles = {r: m.get("role") for r, m in read_rank_meta(self.run_dir).items()}
        for key, start in self.starts.items():
            if start.done or not start.tables:
                continue
            t = pa.concat_tables(start.tables)
            raw = t["step"].to_numpy()
            rows = (raw >= start.first + START_SKIP) & (raw < start.first + START_SKIP + START_STEPS)
            if rows.sum() == 0:
                continue
            frame = t.filter(pa.array(rows)).to_pandas()
            busy = frame.pivot_table(index="step", columns="rank", values="busy_s", aggfunc="last")
            duty = (frame.assign(duty=frame["data_wait_s"] + frame["other_s"])
                    .pivot_table(index="step", columns="rank", values="duty", aggfunc="last")
                    .reindex(index=busy.index, columns=busy.columns))  # fmt: skip
            start.profile = start_profile(busy.to_numpy(), duty.to_numpy(), busy.columns.tolist(), roles)
            if self.last.get(key, -1) >= start.first + START_SKIP + START_STEPS + 1:
                start.done, start.tables = True, []  # every rank has gone past its start: final
            else:
                start.tables = [t]

    def _read_context(self, since: float) -> pd.DataFrame | None:
        """The context samples from ``since`` (Unix seconds) on, read incrementally."""
        tables = [self.context.filter(pc.greater_equal(self.context["time"], since))] if self.context else []
        for f, state, st in changed(context_files(self.run_dir), self.ctx_files):
            table = read_file(f) if is_parquet(f) else read_new(f, state, schema_problem, st.st_size)
            state.size, state.mtime = st.st_size, st.st_mtime_ns
            table = as_schema(table, f) if table is not None and table.num_rows else None
            if table is not None:
                tables.append(table.filter(pc.greater_equal(table["time"], since)))
        self.context = pa.concat_tables(tables) if tables else None
        if self.context is None or not self.context.num_rows:
            return None
        frame = self.context.to_pandas()
        frame = frame[np.isfinite(frame["time"])].drop_duplicates(["rank", "time"], keep="last")
        return frame.sort_values(["rank", "time"], kind="stable").reset_index(drop=True)

    # -- detection --------------------------------------------------------------------------------

    def _view(self) -> dict[str, Any]:
        _, hi = self._bounds()
        a, b = np.searchsorted(self.steps, [hi - self.window + 1, hi + 1])
        values = {c: v[a:b] for c, v in self.values.items()}
        start = values.pop("start_time")
        mat = StepMatrix(self.ranks, self.steps[a:b], values, work_unit=self.unit)
        times = step_times(mat.steps, start, mat.values["step_s"])
        rank_meta, run_meta = read_rank_meta(self.run_dir), read_run_meta(self.run_dir)
        roles = {r: m.get("role") for r, m in rank_meta.items()}
        named = {r: g for r, g in roles.items() if g is not None}
        found = detect(mat, self.cfg, groups=named or None)
        since = float(np.nanmin(times[1])) - PAD_S if np.isfinite(times[1]).any() else 0.0
        self.collectives.read()
        self.collectives.keep_since(since)
        found, adjusted, _ = arrival_check(self.collectives.read(), found, times, rank_meta, roles, mat, self.cfg)
        figures = RankFigures.of(adjusted if adjusted is not None else mat, found)
        context = self._read_context(since)
        report = build_report(figures, found, run_meta, rank_meta, context, times, None)
        report.attempts = [Attempt(**a) for a in attempt_list(self.offsets, self.last)]
        starts = {(k // _KEY, k % _KEY): s.profile for k, s in self.starts.items() if s.profile}
        return view(report.to_dict(), rank_meta, starts, window=[int(mat.steps[0]), int(mat.steps[-1])])


def view_of_run(run_dir: str | Path, config: DetectConfig | None = None) -> dict[str, Any]:
    """The view (``policy.view``) of a whole run dir, analysed as ``analyze`` does: what the live window
    gives of a run no longer than it (tests, benchmarks)."""
    path = Path(run_dir)
    analysis = analyze_run(path, config)
    report, mat = analysis.report, analysis.matrix
    rank_meta = read_rank_meta(path)
    roles = {r: m.get("role") for r, m in rank_meta.items()}
    starts = {}
    for a in report.get("attempts") or []:
        lo = int(a["first_step"]) + START_SKIP
        rows = (mat.steps >= lo) & (mat.steps < lo + START_STEPS) & (mat.steps <= int(a["last_step"]))
        if rows.any():
            v = mat.values
            starts[(int(a["restart"]), int(a["attach"]))] = start_profile(
                v["busy_s"][rows], v["data_wait_s"][rows] + v["other_s"][rows], mat.ranks.tolist(), roles
            )
    return view(report, rank_meta, starts)


# -- the process ------------------------------------------------------------------------------------


def _peak_mb() -> float:
    """This process's peak resident memory (MB): the kernel's high-water mark (``getrusage`` would count its
    parent's memory at the fork too)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError, IndexError):
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def _write(out: Any, line: dict[str, Any]) -> None:
    out.write((json.dumps(line, separators=(",", ":"), default=str) + "\n").encode())
    out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stragglerwatch.analysis.policyfeed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_dir", type=Path)
    p.add_argument("--window", type=int, default=WINDOW_STEPS, help="steps of every rank kept")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between two looks at the run dir")
    p.add_argument("--nice", type=int, default=10, help="added to the process's niceness (lower priority)")
    p.add_argument("--once", action="store_true", help="one look, its line, and exit")
    args = p.parse_args(argv)
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError:
            pass
    out = sys.stdout.buffer
    run = WindowRun(args.run_dir, args.window)
    _write(out, {"kind": "hello", "pid": os.getpid(), "window": run.window})
    errors = 0
    while True:
        t0 = time.monotonic()
        try:
            v = run.update()
            errors = 0
        except Exception as exc:  # a bug of ours or a damaged file: said, and the next look tries again
            errors += 1
            _write(out, {"kind": "error", "error": f"{type(exc).__name__}: {exc}"})
            if errors >= 5:
                return 1
            v = None
        if v is not None:
            _write(out, {"kind": "view", **v, "took_s": round(time.monotonic() - t0, 3), "cells": run.cells,
                         "max_rss_mb": _peak_mb()})  # fmt: skip
        if args.once:
            return 0
        wait = max(0.0, args.interval - (time.monotonic() - t0))
        readable, _, _ = select.select([sys.stdin], [], [], wait)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            return 0  # the policy thread closed its end (or its process ended): so do we


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
