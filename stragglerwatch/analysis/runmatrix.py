"""A run dir's step logs as steps x ranks arrays, read in two passes that any engine can run on
any subset of the files (``analysis.py`` here, ``rayengine.py`` per rank block on a cluster).

1. **Scan** (:func:`scan_file`): a file's ranks and, per attempt (``restart``, ``attach``), the
   runs of consecutive steps it holds: four integer columns, a few numbers kept.
2. **Plan** (:func:`plan`): the attempts numbered on one after the other (each attempt's steps
   follow the last step any rank recorded in the one before), the run's ranks and steps.
3. **Fill** (:func:`fill`): the files' values scattered into ``steps x ranks`` arrays of the
   planned steps, for the ranks asked for. Durations of the phases are kept as float32
   (microseconds stay exact to 0.1 us up to a minute); what detection computes with is float64.

Only the columns analysis needs are read; the per-bucket lists never are.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglerwatch.record.rundir import MAX_RANKS
from stragglerwatch.record.schema import GAP_COLUMNS, PHASE_COLUMNS, schema_compatible
from stragglerwatch.record.steplog import count_units, read_log

ID_COLUMNS = ["rank", "step", "restart", "attach"]
FLOAT64_COLUMNS = ("busy_s", "step_s", "comm_wait_s", "start_time", "work", "work_elements")
VALUE_COLUMNS = (*FLOAT64_COLUMNS, *PHASE_COLUMNS, *GAP_COLUMNS)
_KEY = 65536  # attempt key = restart * _KEY + attach


def _quiet(message: str) -> None:
    """The fill pass reads files the scan pass already warned about."""


@dataclass
class FileScan:
    path: Path
    ranks: np.ndarray  # the ranks it holds
    runs: dict[int, np.ndarray]  # attempt key -> (k, 2) first and last step of each run of consecutive steps


@dataclass
class StepPlan:
    ranks: np.ndarray  # sorted
    steps: np.ndarray  # the run's step numbers (continuing across attempts), sorted
    offsets: dict[int, int]  # attempt key -> what its steps are shifted by
    attempts: list[dict[str, int]]
    last_own: dict[int, dict[int, int]] = field(default_factory=dict)  # attempt key -> rank -> its last step there
    # per attempt, where its ranks ran (``attempts.members``), where the caller kept it
    members: list[dict[int, dict[str, Any]]] | None = None


def _runs(steps: np.ndarray) -> np.ndarray:
    """(first, last) of each run of consecutive values of a sorted unique array."""
    if not steps.size:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(steps) != 1)
    first = np.concatenate(([steps[0]], steps[breaks + 1]))
    last = np.concatenate((steps[breaks], [steps[-1]]))
    return np.column_stack([first, last]).astype(np.int64)


def scan_file(path: Path, warn: Callable[[str], None] | None = None) -> FileScan | None:
    """Pass 1 for one file; None when it has no readable record (``warn`` says why). A Parquet
    log (a finished rank's) of one rank and one attempt whose steps are consecutive is scanned
    from its footer's statistics alone."""
    if path.suffix == ".parquet":
        found = _scan_footer(path)
        if found is not None:
            return found
    table = read_log(path, ID_COLUMNS, warn) if warn else read_log(path, ID_COLUMNS)
    if table is None:
        return None
    keys = attempt_keys(table)
    steps = table["step"].to_numpy()
    one = keys.min() == keys.max()
    runs = {int(k): _runs(_unique(steps if one else steps[keys == k])) for k in (keys[:1] if one else np.unique(keys))}
    rank = table["rank"].to_numpy()
    return FileScan(path, rank[:1].copy() if rank.min() == rank.max() else np.unique(rank), runs)


def _unique(steps: np.ndarray) -> np.ndarray:
    """Sorted unique steps (a log's steps are usually in order already)."""
    return steps if steps.size < 2 or bool(np.all(np.diff(steps) > 0)) else np.unique(steps)


def _scan_footer(path: Path) -> FileScan | None:
    """The scan from a Parquet footer when its statistics settle it, else None."""
    try:
        meta = pq.ParquetFile(path).metadata
        if schema_compatible(meta.schema.to_arrow_schema()) is not None or not meta.num_rows:
            return None
        names = meta.schema.names
        stats: dict[str, tuple[int, int]] = {}
        for name in ID_COLUMNS:
            if name not in names:
                return None
            lo = hi = None
            for g in range(meta.num_row_groups):
                st = meta.row_group(g).column(names.index(name)).statistics
                if st is None or not st.has_min_max or st.null_count:
                    return None
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
            stats[name] = (int(lo), int(hi))
    except (pa.ArrowException, OSError, ValueError, TypeError):
        return None  # the full read says what is wrong with it
    (rank, rank_hi), (first, last) = stats["rank"], stats["step"]
    same = all(stats[c][0] == stats[c][1] for c in ("restart", "attach"))
    if rank != rank_hi or not same or not 0 <= rank < MAX_RANKS or last - first + 1 != meta.num_rows:
        return None
    key = stats["restart"][0] * _KEY + stats["attach"][0]
    return FileScan(path, np.array([rank], dtype=np.int64), {key: np.array([[first, last]], dtype=np.int64)})


def attempt_keys(table: Any) -> np.ndarray:
    """Each record's attempt, one integer: ``restart * 65536 + attach``."""
    return table["restart"].to_numpy().astype(np.int64) * _KEY + table["attach"].to_numpy().astype(np.int64)


def plan(scans: Iterable[FileScan | None]) -> StepPlan:
    """Pass 2: the attempts, ranks and steps of the scanned files."""
    found = [s for s in scans if s is not None]
    last: dict[int, int] = {}
    for s in found:
        for key, runs in s.runs.items():
            last[key] = max(last.get(key, -1), int(runs[-1, 1]))
    offsets, offset = {}, 0
    for key in sorted(last):
        offsets[key] = offset
        offset += last[key] + 1
    spans = [runs + offsets[key] for s in found for key, runs in s.runs.items()]
    ranks = np.unique(np.concatenate([s.ranks for s in found])) if found else np.zeros(0, dtype=np.int64)
    last_own: dict[int, dict[int, int]] = {}
    for s in found:  # (a file of several ranks: each taken to run as long as the file's last step)
        for key, runs in s.runs.items():
            own, end = last_own.setdefault(key, {}), int(runs[-1, 1]) + offsets[key]
            for r in s.ranks.tolist():
                own[r] = max(own.get(r, -1), end)
    return StepPlan(ranks.astype(np.int64), _expand(spans), offsets, attempt_list(offsets, last), last_own)


def split_key(key: int) -> tuple[int, int]:
    """An attempt key's ``(restart, attach)``."""
    return key // _KEY, key % _KEY


def attempt_list(offsets: dict[int, int], last: dict[int, int]) -> list[dict[str, int]]:
    """The report's attempts: each attempt key's ``restart``, ``attach`` and its first and last step in
    the run's numbering (``offsets``: what its steps are shifted by; ``last``: its last own step)."""
    return [dict(zip(("restart", "attach"), split_key(k), strict=True), first_step=offsets[k],
                 last_step=offsets[k] + last[k]) for k in sorted(offsets)]  # fmt: skip


def _expand(spans: list[np.ndarray]) -> np.ndarray:
    """The union of the (first, last) spans, as a sorted array of every step in them."""
    if not spans:
        return np.zeros(0, dtype=np.int64)
    all_spans = np.concatenate(spans)
    all_spans = all_spans[np.argsort(all_spans[:, 0], kind="stable")]
    merged: list[list[int]] = []
    for first, last in all_spans.tolist():
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return np.concatenate([np.arange(a, b + 1, dtype=np.int64) for a, b in merged])


def _read_ahead(files: Iterable[Path], read: Callable[[Path], Any], ahead: int = 32) -> Iterator[Any]:
    """``read`` of each file, in order, run by a few threads ahead of the caller (Arrow reads without holding the
    interpreter lock)."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        pending: deque[Future[Any]] = deque()
        for f in files:
            pending.append(pool.submit(read, f))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _one_run(keys: np.ndarray, step: np.ndarray, rank: np.ndarray, known: np.ndarray, shift: np.ndarray,
             steps: np.ndarray, ranks: np.ndarray) -> tuple[int, int] | None:  # fmt: skip
    """Where a table that is one rank's consecutive steps of one known attempt, each a step of the plan, lies:
    its first step's row and its rank's column; None for any other table (found row by row)."""
    n = len(keys)
    if not n or keys[0] != keys[-1] or rank[0] != rank[-1] or step[-1] - step[0] != n - 1:
        return None
    if not ((keys == keys[0]).all() and (rank == rank[0]).all() and (np.diff(step) == 1).all()):
        return None
    k, r = int(np.searchsorted(known, keys[0])), int(np.searchsorted(ranks, rank[0]))
    if k >= len(known) or known[k] != keys[0] or r >= len(ranks) or ranks[r] != rank[0]:
        return None
    first = int(step[0] + shift[k])
    i = int(np.searchsorted(steps, first))
    # the plan's steps are sorted and unique: n of them from ``first`` on are consecutive where the last is
    if i + n > len(steps) or steps[i] != first or steps[i + n - 1] != first + n - 1:
        return None
    return i, r


def _placed(f: Path, names: list[str], known: np.ndarray, shift: np.ndarray, steps: np.ndarray, ranks: np.ndarray,
            count: bool) -> tuple[dict[str, np.ndarray], tuple, dict[str, int]] | None:  # fmt: skip
    """A step log's value columns, where they go in the steps x ranks arrays (an index: the rows and column of one
    rank's consecutive steps, or the row and column of each record kept), and its units counted (``count``);
    None: no record to keep.
    (Rows of ranks or attempts not in the plan, and rows written after the scan, are left out.)"""
    table = read_log(f, names, _quiet)
    if table is None:
        return None
    counted: dict[str, int] = {}
    keys = attempt_keys(table)
    rank = table["rank"].to_numpy()
    at = _one_run(keys, table["step"].to_numpy(), rank, known, shift, steps, ranks)
    if at is not None:  # the usual file: one rank's consecutive steps of one attempt, all kept (a slice of its column)
        if count:
            count_units(table["work_unit"], counted)
        return {col: table[col].to_numpy() for col in VALUE_COLUMNS}, (slice(at[0], at[0] + len(rank)), at[1]), counted
    k = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    ok = known[k] == keys
    step = table["step"].to_numpy() + shift[k]
    si = np.minimum(np.searchsorted(steps, step), len(steps) - 1)
    ri = np.minimum(np.searchsorted(ranks, rank), len(ranks) - 1)
    ok &= (steps[si] == step) & (ranks[ri] == rank)
    if count:
        count_units(table["work_unit"] if ok.all() else table["work_unit"].filter(pa.array(ok)), counted)
    return {col: table[col].to_numpy()[ok] for col in VALUE_COLUMNS}, (si[ok], ri[ok]), counted


def empty_values(n_steps: int, n_ranks: int) -> dict[str, np.ndarray]:
    """Arrays not yet written, column-major: a rank's steps lie together, as they are read (:class:`_Blanks` makes
    them NaN where no record lands)."""
    return {c: np.empty((n_steps, n_ranks), dtype=np.float64 if c in FLOAT64_COLUMNS else np.float32, order="F")
            for c in VALUE_COLUMNS}  # fmt: skip


class _Blanks:
    """NaN where no record lands, written once: a rank's column is made NaN outside the rows its records filled
    (runs of consecutive steps, the usual file) when its first scattered record arrives, or at the end. A run
    whose ranks recorded every step writes no NaN at all (filling the arrays with NaN first cost as much as
    placing the records)."""

    def __init__(self, out: dict[str, np.ndarray]) -> None:
        self.out = out
        self.spans: dict[int, list[tuple[int, int]]] = {}  # column -> rows filled, until it is made whole
        self.whole = np.zeros(next(iter(out.values())).shape[1], dtype=bool)

    def filled(self, at: tuple) -> None:
        """Before records are written ``at`` (``_placed``'s index)."""
        rows, col = at
        if isinstance(rows, slice):
            if not self.whole[col]:
                self.spans.setdefault(int(col), []).append((rows.start, rows.stop))
            return
        for c in np.unique(col).tolist():
            self._blank(c)

    def _blank(self, col: int) -> None:
        if self.whole[col]:
            return
        self.whole[col] = True
        n, lo = len(next(iter(self.out.values()))), 0
        for a, b in [*sorted(self.spans.pop(col, [])), (n, n)]:
            if a > lo:
                for v in self.out.values():
                    v[lo:a, col] = np.nan
            lo = max(lo, b)

    def finish(self) -> None:
        for col in np.flatnonzero(~self.whole).tolist():
            self._blank(col)


def fill(
    files: Iterable[Path],
    step_plan: StepPlan,
    ranks: np.ndarray,
    progress: Callable[[], None] | None = None,
    units: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Pass 3: ``steps x len(ranks)`` arrays of ``VALUE_COLUMNS`` from ``files`` (rows of other
    ranks, and rows written after the scan, are left out). NaN where a rank has no record. With
    ``units``, the ``work_unit`` of the rows kept is counted into it (``steplog.count_units``) in the same read."""
    steps = step_plan.steps
    out = empty_values(len(steps), len(ranks))
    blanks = _Blanks(out)
    known = np.array(sorted(step_plan.offsets), dtype=np.int64)
    shift = np.array([step_plan.offsets[k] for k in known], dtype=np.int64)
    names = [*ID_COLUMNS, *VALUE_COLUMNS, *(["work_unit"] if units is not None else [])]
    if not known.size or not len(steps) or not len(ranks):  # nothing a record could be placed in
        for _ in files:
            if progress:
                progress()
        blanks.finish()
        return out
    place = functools.partial(_placed, names=names, known=known, shift=shift, steps=steps, ranks=ranks,
                              count=units is not None)  # fmt: skip
    for got in _read_ahead(files, place):  # each file read and placed by a reader thread; written here, in order
        if progress:
            progress()
        if got is None:
            continue
        columns, at, counted = got
        if units is not None:
            for unit, n in counted.items():
                units[unit] = units.get(unit, 0) + n
        blanks.filled(at)
        for col in VALUE_COLUMNS:
            out[col][at] = columns[col]
    blanks.finish()
    return out
