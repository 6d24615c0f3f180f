"""A run dir followed as the job writes it: each update reads only the record batches that are new,
and detection moves on from where it was instead of starting over.

- **Reading.** A rank's live log is an Arrow stream that only grows: the batches already read are
  skipped, the complete new ones scattered into the steps x ranks arrays (``runmatrix``'s, grown
  as steps arrive). A stream compacted into Parquet at close is read once; a record that repeats
  what is known changes nothing. What the incremental path cannot follow (a new rank, a new
  attempt, a step inside the known range, a file that shrank) starts the arrays over. The ranks of a
  job write a flush one after another: rows that not every rank of the current attempt has written yet
  are held back from the detection until they have (or ``hold_s``, a second, has passed: a rank that
  stops writing holds nothing back for longer), so that a poll in the middle of a flush costs a read,
  not a detection made again at the next poll.
- **Detection** (``stages``, ``consistency``): the per-step stage and the rolling medians are
  computed for the steps that changed; the consistency rule resumes from its state saved before
  them (every 256 steps). Its job-wide scalars (noise, skew, variance, offset spread) are
  re-estimated from every step of up to 256 ranks when the run has grown by ``regrow`` (10%) since
  they were; the flags of earlier steps keep the scalars they were given with until the run
  settles. The per-rank medians of the table are brought up to date one column an update.
- **Work.** Where the ranks did different work, the detection follows times adjusted for it
  (``imbalance``) with the work model fitted when the run was last ``regrow`` smaller: new rows are
  adjusted with it, and when the run has grown by ``regrow`` it is fitted again (``workfit``: on at most
  2,048 of its steps) and the new rows are adjusted with the new fit; the rows before them keep the
  adjustment they were followed with, as their flags keep their scalars, until the run settles. The
  imbalance verdict is the one of the last fit. Only the first fit holds up an update: a later one runs
  on a thread beside the updates (``fit_in_background``; at 4,096 ranks a fit and its imbalance
  verdict take 10-20 s), over the rows read when it began, and the first update after it ends takes it.
- **Slow figures.** The host context and the jitter tax (a resampling of every healthy step) are
  brought up to date at most every ``slow_every_s``; the jitter tax on a thread beside the updates (at
  4,096 ranks it takes seconds), the last one shown until it ends.
- **Window** (``window``, off by default). The arrays hold the last ``window`` steps of the run (at least
  :data:`MIN_WINDOW`) and at most ``slide`` more (a quarter of the window, a multiple of :data:`SLIDE`): once
  they hold more, the oldest rows are dropped, ``slide`` at a time (into new arrays: a copy of the window,
  so the fewer the better), and the detection goes on from the state it had at the row the window now starts
  at (the consistency rule's checkpoint there, the whole blocks after it, the work model's reference of the
  rows kept), so memory is bounded by the window and the per-rank state, whatever the run's length. A
  stream is cut to its last ``window + slide`` records as it is read (and the last record of each attempt,
  which numbers the steps), so that a long run opened late is not held whole either; records of steps
  before the window are left out. The report is then the window's: its stragglers, costs and figures are
  those of the steps it holds (``first_step`` is the window's first), and settling analyses the window
  whole, not the run (``analyze`` does that).
- **Settling.** When an update finds nothing new, the run has been quiet for ``settle_after_s`` (and
  three of its usual gaps between flushes) and the verdict was not computed from all of the data at
  once, the run is analysed whole (``detect``, as ``analyze`` does): the verdict of a
  finished run is ``analyze``'s, exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from stragglerwatch._memory import huge_pages_stall
from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis import consistency as cons
from stragglerwatch.analysis import imbalance as imb
from stragglerwatch.analysis import workfit
from stragglerwatch.analysis.attempts import cut_indices, members, world_cuts, worlds
from stragglerwatch.analysis.cost import TOP_K
from stragglerwatch.analysis.detect import (
    StepMatrix,
    Verdict,
    add_imbalance,
    detect,
    straggler,
    straggling,
    verdict,
)
from stragglerwatch.analysis.explain import StepTimes
from stragglerwatch.analysis.imbalance import recorded
from stragglerwatch.analysis.intermittent import BLOCK, block_costs, block_means, mark, stretches, within
from stragglerwatch.analysis.report import (
    RANK_COLUMNS,
    Analysis,
    RankFigures,
    empty_analysis,
    finish,
    jitter_projection,
    jitter_work,
    last_steps,
    step_times,
)
from stragglerwatch.analysis.rounds import Whole
from stragglerwatch.analysis.runmatrix import (
    FLOAT64_COLUMNS,
    ID_COLUMNS,
    VALUE_COLUMNS,
    StepPlan,
    attempt_keys,
    attempt_list,
)
from stragglerwatch.analysis.stages import (
    CAUSES,
    Groups,
    HealthyStats,
    RankSeries,
    StepStats,
    cause_phases,
    healthy_stage,
    intervals,
    nanmedian,
    other_max,
    outlasts,
    rank_medians,
    step_stage,
)
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.record.collectives import CollectiveReader
from stragglerwatch.record.context import load_context
from stragglerwatch.record.rundir import read_rank_meta
from stragglerwatch.record.schema import GAP_COLUMNS, read_columns, schema_compatible
from stragglerwatch.record.steplog import RunDirWarning, conform, log_names, read_log, work_unit

SCALAR_RANKS = 256  # ranks the followed run's scalars are estimated from
#: A windowed run drops rows a multiple of this at once (a quarter of its window): the consistency rule's
#: checkpoint interval, a multiple of the intermittent test's block, so that both have their state at the row the
#: window then starts at.
SLIDE = 256
#: The least window: many times the rule's longest look back (``DetectConfig.level_window``).
MIN_WINDOW = 1024
#: New rows wait this long at most for the rest of their flush (``LiveRun._held``).
HOLD_S = 1.0


def window_problem(steps: int) -> str | None:
    """What is wrong with a window of ``steps`` steps (the dashboard's option and variable say it), or None."""
    return f"a window holds at least {MIN_WINDOW} steps" if steps < MIN_WINDOW else None
RESERVE = 16384  # steps of room the arrays are made with
SMALL_PAGES_FROM = 1 << 22  # bytes: a larger array with room is mapped in small pages (``room``)
OTHER_SUFFIXES = (".jsonl", ".json", ".txt")  # the files besides the logs a report reads (``LiveRun._others``)
NAMES = [*ID_COLUMNS, *VALUE_COLUMNS]


class _Restart(Exception):
    """What was read cannot be appended to the arrays: read the run again from the start."""


@dataclass
class _File:
    size: int = -1
    mtime: int = -1
    schema: pa.Schema | None = None  # an Arrow stream's, and where its next batch starts
    offset: int = 0
    schema_key: str = ""  # the schema as text, without metadata: the streams written by the same schema share it


def changed(files: Iterable[str | os.PathLike[str]], seen: dict[str, _File]
            ) -> Iterator[tuple[str | os.PathLike[str], _File, os.stat_result]]:  # fmt: skip
    """The files among ``files`` whose size or modification time differ from what ``seen`` recorded (by
    :func:`stem`), with their state there (the caller reads them, then records ``size`` and ``mtime``)."""
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        state = seen.setdefault(stem(f), _File())
        if (st.st_size, st.st_mtime_ns) != (state.size, state.mtime):
            yield f, state, st


@functools.lru_cache(maxsize=1 << 16)
def stem(f: str | os.PathLike[str]) -> str:
    """A log's name without its suffix: the key of its state (the same thousands of files an update: each found
    once)."""
    return os.path.splitext(os.path.basename(f))[0]


def is_parquet(f: str | os.PathLike[str]) -> bool:
    return os.fspath(f).endswith(".parquet")


def read_changed(files: Iterable[str | os.PathLike[str]], seen: dict[str, _File]
                 ) -> list[tuple[str | os.PathLike[str], pa.Table]] | None:  # fmt: skip
    """The new batches of the step logs among ``files`` that changed since ``seen`` recorded them: a Parquet
    log whole, as this schema's columns; a stream from where the last read stopped, as written (the caller
    conforms it). None where a stream shrank (rewritten: read the run again)."""
    out = []
    for f, state, st in changed(files, seen):
        parquet = is_parquet(f)
        if not parquet and st.st_size < state.size:
            return None
        table = read_log(Path(f), NAMES, quiet) if parquet else read_new(f, state, schema_compatible, st.st_size)
        state.size, state.mtime = st.st_size, st.st_mtime_ns
        if table is not None:
            out.append((f, table))
    return out


def read_grouped(files: Iterable[str | os.PathLike[str]], seen: dict[str, _File], rows: int | None = None
                 ) -> tuple[list[pa.Table], list[pa.Table]] | None:  # fmt: skip
    """As :func:`read_changed`, in as few tables as the logs have schemas: the Parquet logs' tables (this
    schema's columns), and the streams' new batches, those written by the same schema in one table of one
    piece, as written but for the columns not read (the caller conforms each once: thousands of streams an
    update, a few rows each). With ``rows``, each log is cut to its :func:`recent` rows as soon as it is read.
    None where a stream shrank."""
    ready, streams = [], {}
    for f, state, st in changed(files, seen):
        if is_parquet(f):
            table = read_log(Path(f), NAMES, quiet)
            state.size, state.mtime = st.st_size, st.st_mtime_ns
            if table is not None:
                ready.append(table if rows is None else recent(table, rows))
            continue
        if st.st_size < state.size:
            return None
        batches = read_batches(f, state, schema_compatible, st.st_size)
        state.size, state.mtime = st.st_size, st.st_mtime_ns
        if rows is not None and sum(b.num_rows for b in batches) > rows:
            batches = recent(pa.Table.from_batches(batches), rows).to_batches()
        if batches:
            streams.setdefault(state.schema_key, []).extend(batches)
    return ready, [joined(group) for group in streams.values()]


def joined(batches: list[pa.RecordBatch]) -> pa.Table:
    """Record batches of one schema as a table of one piece (each column one array), of the columns this
    schema's are made from (``schema.read_columns``: a stream has a few more, lists among them)."""
    table = pa.Table.from_batches(batches)
    return table.select(read_columns(table.column_names, NAMES)).combine_chunks()


def recent(table: pa.Table, rows: int) -> pa.Table:
    """Of a step log's records, in the order written, the last ``rows``, and before them the last step of each
    rank in each attempt (what the run's numbering of the steps and its attempts are made from): what a window of
    ``rows`` steps needs of it. The table whole where it has no more, or its ids cannot be read."""
    n = len(table)
    if n <= rows:
        return table
    try:
        head = table.slice(0, n - rows)
        keys = attempt_keys(head) if {"restart", "attach"} <= set(table.column_names) else np.zeros(n - rows, np.int64)
        rank, step = head["rank"].to_numpy(), head["step"].to_numpy()
    except (KeyError, pa.ArrowException, TypeError, ValueError):
        return table
    order = np.lexsort((step, rank, keys))
    k, r = keys[order], rank[order]
    last = np.append((k[1:] != k[:-1]) | (r[1:] != r[:-1]), True)  # the last (highest step) of each group
    return table.take(pa.array(np.concatenate([np.sort(order[last]), np.arange(n - rows, n)])))


def room(shape: tuple[int, ...], dtype: type | np.dtype, full: bool = False) -> np.ndarray:
    """An unwritten array, column-major (C order for one dimension), whose memory the system gives page by page
    as it is first written, in small pages: a column-major array with room for more steps has the room of each
    column between the used rows of the next ones, and a huge page (numpy asks for them for large arrays)
    would make the room of a dozen columns resident at the first write of each. ``full``: an array about to be
    written nearly whole (a window's copy), its pages given at once (one call, not a fault a page: a quarter less
    time), in huge pages where the system gives them without stalling (their first writes cost half as much; where
    it compacts memory at the fault to find them, a window's copy at 4,096 ranks stalled for seconds). Either is
    mapped on its own and given back to the system when dropped (an array of the allocator's may stay in its
    heap). A small array: ``np.empty``."""
    order = "F" if len(shape) > 1 else "C"
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < SMALL_PAGES_FROM or not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(shape, dtype=dtype, order=order)
    huge = full and not huge_pages_stall()
    populate = getattr(mmap, "MAP_POPULATE", 0) if full and not huge else 0
    anonymous = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    advice = "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE"  # small pages where the system gives huge ones unasked
    if hasattr(mmap, advice):
        with contextlib.suppress(OSError):
            anonymous.madvise(getattr(mmap, advice))
    return np.frombuffer(anonymous, dtype=dtype).reshape(shape, order=order)


@dataclass
class _Rows:
    """Arrays with room to grow along steps (rows): the room is left unwritten (the system gives it
    pages as rows are used), and a row is filled when it comes into use, so that growing costs
    about as much as the rows added."""

    n: int = 0
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def grow(self, n: int, shapes: dict[str, tuple[tuple[int, ...], type, float]]) -> None:
        cap = next(iter(self.arrays.values())).shape[0] if self.arrays else 0
        if n > cap or set(shapes) != set(self.arrays):
            # room for RESERVE more steps, or four times as many: rows not yet used cost no memory,
            # and each growth copies what is there (about a second per GB)
            new_cap = max(n + RESERVE, 4 * cap)
            for name, (tail, dtype, _) in shapes.items():
                arr = room((new_cap, *tail), dtype)
                if name in self.arrays:
                    arr[: self.n] = self.arrays[name][: self.n]
                self.arrays[name] = arr
        if n > self.n:
            for name, (_, _, fill) in shapes.items():
                self.arrays[name][self.n : n] = fill
        self.n = n

    def dropped(self, k: int, more: int) -> _Rows:
        """The rows from ``k`` on, in new arrays with room for ``more`` rows (the arrays here may still be read: by
        a work fit running beside the updates, by a view of the last analysis); nearly full, in huge pages."""
        out = _Rows(max(0, self.n - k))
        for name, arr in self.arrays.items():
            out.arrays[name] = room((out.n + more, *arr.shape[1:]), arr.dtype, full=True)
            out.arrays[name][: out.n] = arr[k : self.n]
        return out


@dataclass
class _Work:
    """The work model a followed run is adjusted with, fitted when ``steps`` steps had been read (its ``ref``
    extended to every step read since), and the values adjusted with it (the rows read since adjusted as
    they came)."""

    column: str
    unit: str
    model: imb.WorkModel
    steps: int
    adjusted: _Rows  # ``imbalance.ADJUSTED`` columns, every step read
    imbalance: imb.Imbalance | None = None


class _Jitter:
    """A projection of the jitter tax running on a thread beside the updates; a failure keeps the last one."""

    def __init__(self, started: float, work: Callable[[], dict | None]):
        self.started, self.result, self.done = started, None, False

        def run() -> None:
            try:
                self.result, self.done = work(), True
            except Exception:  # noqa: BLE001 - the last projection stays shown; the settled run's is exact
                pass

        self.thread = threading.Thread(target=run, name="stragglerwatch-jitter", daemon=True)
        self.thread.start()


@dataclass
class _Refit:
    """A work fit running on a thread beside the updates, begun when ``steps`` steps had been read; ``done`` holds
    ``(column, unit, model, imbalance)`` once it ended, None where the work no longer varies."""

    steps: int
    thread: threading.Thread | None = None
    done: tuple[str, str, imb.WorkModel, imb.Imbalance] | None = None


class LiveRun:
    """The analysis of a run dir that grows; :meth:`update` returns whether it changed."""

    def __init__(self, run_dir: str | Path, config: DetectConfig | None = None, regrow: float = 0.10,
                 slow_every_s: float = 10.0, settle_after_s: float = 0.0, fit_in_background: bool = True,
                 window: int | None = None, hold_s: float = HOLD_S):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.hold_s = hold_s  # new rows wait at most this long for the rest of their flush (``_held``)
        self.window = None if window is None else max(MIN_WINDOW, int(window))  # steps kept (None: every step)
        self.slide = SLIDE if window is None else max(SLIDE, self.window // 4 // SLIDE * SLIDE)  # rows dropped at once
        self.fit_in_background = fit_in_background
        self.fit_failures = 0  # background fits that raised (each said once on the log)
        self.cfg = config or DetectConfig()
        self.collectives = CollectiveReader(self.run_dir)  # the arrival order, read incrementally
        self.regrow, self.slow_every_s, self.settle_after_s = regrow, slow_every_s, settle_after_s
        self.came: list[float] = []  # when the last updates with new records ran (monotonic seconds)
        self.analysis = empty_analysis()
        self.exact = True  # ``analysis`` is what ``analyze`` gives on the data read so far
        self.restarts = 0
        self._reset()

    def _reset(self) -> None:
        self.files: dict[str, _File] = {}
        self.offsets: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.last_own: dict[int, dict[int, int]] = {}  # attempt key -> rank -> its last step there (run numbering)
        self.ranks = np.zeros(0, dtype=np.int64)
        self.steps = np.zeros(0, dtype=np.int64)
        self.dropped = 0  # rows dropped from the front of the window (``window``), all told
        self.data = _Rows()
        self.det = _Rows()
        self.blocks = _Rows()  # ``intermittent``'s whole blocks of ``det``: their means and largest costs
        self.sc: cons.Scalars | None = None
        self.sc_steps = 0
        self.checkpoints: dict[int, cons.Carry] = {}  # the rule's state before every 256th step, at every floor
        self.never: np.ndarray | None = None
        self.unit = ""  # what the records' work counts, once known
        self.uneven = False  # some step's ranks did different work (sticky)
        self.work: _Work | None = None
        self.refit: _Refit | None = None  # a fit running beside the updates (dropped with the arrays it read)
        self.flagged = np.zeros(0, dtype=bool)  # per rank: a straggler in the last update's verdict
        self.slow_at = 0.0
        self.figures: RankFigures | None = None
        self.turn = 0
        self.context: pd.DataFrame | None = None
        self.context_at = 0.0
        self.jitter_at: tuple[float, dict | None] | None = None  # when the jitter tax was projected, and it
        self.jitter_job: _Jitter | None = None  # a projection running beside the updates
        self.settling = False
        self.previous: tuple[StepMatrix, Verdict, StepTimes] | None = None
        self.pending: int | None = None  # the first row changed by updates held back (``_held``)
        self.frontier, self.followed_at = -1, 0.0  # the last complete step at the last detection, and when
        self.others: tuple = ()
        self.rank_meta = read_rank_meta(self.run_dir)
        # ``_cuts``'s attempts, metadata, their members and worlds
        self.worlds: tuple[tuple, dict, list[dict[int, dict]], list[int]] | None = None
        roles = {r: m["role"] for r, m in self.rank_meta.items() if m.get("role") is not None}
        self.roles = roles or None

    # -- reading ----------------------------------------------------------------------------------

    def _others(self) -> tuple:
        """The files besides the step logs and context streams that the report reads: events, stacks,
        the run's and the ranks' metadata."""
        try:
            with os.scandir(self.run_dir) as found:  # names and stats, without a Path each (thousands an update)
                entries = [(e.name, e.stat()) for e in found if e.name.endswith(OTHER_SUFFIXES)]
            return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in entries))
        except OSError:
            return ()

    def update(self) -> bool:
        """Read what is new and update the analysis; True when it changed."""
        others = self._others()
        if others != self.others and self.data.n:
            metas = read_rank_meta(self.run_dir)
            if metas != self.rank_meta:  # new roles regroup the peers: read the run again
                self._reset()
        self.others, report_again = others, others != self.others
        try:
            lo = self._ingest()
        except _Restart:
            self.restarts += 1
            self._reset()
            lo = self._ingest()
        if lo is not None:
            self.exact = False
            if self._held():
                self.pending, lo = lo, None
                self.came = [*self.came[-8:], time.monotonic()]
        elif self.pending is not None and not self._held():
            lo = self.pending
        if lo is not None:
            self.pending = None
        reported = lo is None and report_again and self.previous is not None
        if reported:  # a new event or stack dump
            self.analysis = self._report(*self.previous)  # type: ignore[misc]
            if self.exact:
                return True
        if lo is None:  # nothing new: settle on the exact analysis of all the data, once the run is quiet
            if self.exact or self.pending is not None or not self.data.n or not self._quiet():
                return reported
            self.settling = True
            try:
                self.wait_for_fit()  # one after the other: a fit's memory and the whole run's analysis' do not add up
                self.analysis = self._exact()
                self.frontier, self.followed_at = self._complete(), time.monotonic()
            finally:
                self.settling = False
            self.exact = True
            return True
        self.analysis = self._follow(lo)
        self.exact = False
        self.came = [*self.came[-8:], time.monotonic()]
        self.frontier, self.followed_at = self._complete(), time.monotonic()
        return True

    def _complete(self) -> int:
        """The last step every rank of the current attempt has written (run numbering; -1: none)."""
        own = self.last_own.get(max(self.offsets), {}) if self.offsets else {}
        return min(own.values(), default=-1)

    def _held(self) -> bool:
        """Whether new rows wait for the rest of their flush: no step became complete (written by every rank of
        the current attempt) since the last detection, which was less than ``hold_s`` ago. The ranks of a job
        write a flush one after another: a poll in the middle of one would detect on the steps of some ranks, and
        the next poll on the same steps again. A rank that stops writing (a hang, a crash) holds nothing back
        for longer: the rows are followed at most ``hold_s`` late."""
        if self.previous is None or self.settling:
            return False
        return self._complete() <= self.frontier and time.monotonic() - self.followed_at < self.hold_s

    def _quiet(self) -> bool:
        """Whether nothing new has come for ``settle_after_s``, or three of the run's usual gaps between two
        updates with new records if longer: a run between two flushes is not analysed whole (at thousands of
        ranks that takes many times an update), one that stopped growing is."""
        if self.settle_after_s <= 0 or not self.came:
            return True
        gaps = np.diff(self.came)
        need = max(self.settle_after_s, 3.0 * float(np.median(gaps))) if gaps.size else self.settle_after_s
        return time.monotonic() - self.came[-1] >= need

    def _ingest(self) -> int | None:
        """Read new batches; the first row whose values changed, or None."""
        try:
            names = log_names(self.run_dir)
        except OSError:  # not a run dir yet: nothing to read
            return None
        folder = os.fspath(self.run_dir)
        read = read_grouped([os.path.join(folder, name) for name in names], self.files,
                            None if self.window is None else self.window + self.slide)  # fmt: skip
        if read is None:
            raise _Restart
        ready, streams = read
        tables = [*ready, *(t for t in (conform(raw, NAMES, self.run_dir, quiet) for raw in streams) if t is not None)]
        lo: int | None = None
        if tables:
            found = np.unique(np.concatenate([t["rank"].to_numpy() for t in tables])).astype(np.int64)
            if not np.isin(found, self.ranks).all():
                lo = self._add_ranks(found)
        for table in tables:
            row = self._scatter(table)
            lo = row if lo is None or (row is not None and row < lo) else lo
        if lo is not None and self.pending is not None:  # rows held back by an earlier update (``_held``)
            lo = min(lo, self.pending)
        return lo if lo is None else self._slide(lo)

    def _slide(self, lo: int) -> int:
        """With a window: the oldest rows dropped, ``slide`` at a time, once more than ``window + slide`` are held;
        the detection's state kept from the row the window starts at. The first row that changed, in the rows
        kept."""
        n = self.data.n
        if self.window is None or n < self.window + self.slide:
            return lo
        k = (n - self.window) // self.slide * self.slide
        more = 2 * self.slide + n - self.det.n  # room for this update's rows and the next ones' until the next slide
        self.steps, self.data, self.dropped = self.steps[k:], self.data.dropped(k, more), self.dropped + k
        if lo < k or self.det.n < k:  # rows before the new window changed: its detection starts afresh
            self.det, self.blocks, self.checkpoints, lo = _Rows(), _Rows(), {}, 0
        else:
            self.det, self.blocks = self.det.dropped(k, more), self.blocks.dropped(k // BLOCK, more // BLOCK + 1)
            self.checkpoints = {s - k: c for s, c in self.checkpoints.items() if s >= k}
        work = self.work
        if work is not None:
            work.model = dataclasses.replace(work.model, ref=work.model.ref[k:])
            work.adjusted = work.adjusted.dropped(k, more)
        return max(0, lo - k)

    def _add_ranks(self, found: np.ndarray) -> int:
        """Columns for ranks seen for the first time (a job's ranks start one after another); the
        detection starts over."""
        ranks = np.union1d(self.ranks, found)
        where = np.searchsorted(ranks, self.ranks)
        n = self.data.n
        for col, arr in self.data.arrays.items():
            grown = room((arr.shape[0], len(ranks)), arr.dtype)
            grown[:n] = np.nan
            grown[:n, where] = arr[:n]
            self.data.arrays[col] = grown
        self.ranks = ranks
        self.det, self.blocks, self.sc, self.sc_steps, self.never = _Rows(), _Rows(), None, 0, None
        self.checkpoints = {}
        # the work model has a slope per rank: fitted again, with the new ranks (a fit running is dropped)
        self.work, self.refit, self.flagged = None, None, np.zeros(0, dtype=bool)
        return 0

    def _scatter(self, table: pa.Table) -> int | None:
        keys = attempt_keys(table)
        raw = table["step"].to_numpy()
        kinds = distinct(keys)
        for key in kinds:
            key, top = int(key), int(raw[keys == key].max())
            if key not in self.offsets:
                if self.offsets and key < max(self.offsets):
                    raise _Restart
                prev = max(self.offsets) if self.offsets else None
                self.offsets[key] = 0 if prev is None else self.offsets[prev] + self.last[prev] + 1
                self.last[key] = top
            elif top > self.last[key]:
                if key != max(self.offsets):  # an earlier attempt grew: the later ones move
                    raise _Restart
                self.last[key] = top
        shift = np.array([self.offsets[int(k)] for k in kinds])
        step = raw + shift[np.searchsorted(kinds, keys)]
        rank = table["rank"].to_numpy()
        for k in kinds:
            sel = keys == k
            lowest = int(rank[sel].min())
            at = rank[sel] - lowest  # ranks are small integers: each its own slot
            top_of = np.full(int(at.max()) + 1, np.iinfo(np.int64).min, dtype=np.int64)
            np.maximum.at(top_of, at, step[sel])  # each rank's last step in the batch, in one pass
            own = self.last_own.setdefault(int(k), {})
            present = np.flatnonzero(top_of > np.iinfo(np.int64).min)
            for r, s in zip((present + lowest).tolist(), top_of[present].tolist(), strict=True):
                own[r] = max(own.get(r, -1), s)
        if self.dropped and self.steps.size:  # the steps before the window are no longer held
            inside = step >= self.steps[0]
            if not inside.all():
                table, step, rank = table.filter(pa.array(inside)), step[inside], rank[inside]
                if not len(table):
                    return None
        new = distinct(step[~np.isin(step, self.steps)])
        if new.size and self.steps.size and new[0] < self.steps[-1]:
            raise _Restart  # a step inside the known range: its row does not exist
        known = len(self.steps)  # rows before the new steps'
        if new.size:
            self.steps = np.concatenate([self.steps, new])
            self.data.grow(len(self.steps), {c: ((len(self.ranks),), np.float64 if c in FLOAT64_COLUMNS
                                                 else np.float32, np.nan) for c in VALUE_COLUMNS})  # fmt: skip
        si = np.searchsorted(self.steps, step)
        ri = np.searchsorted(self.ranks, rank)
        if si.size and si.min() >= known:  # only new steps (as a job writes): every cell is new, nothing to compare
            # one index into the column-major arrays (``room``'s) for every column: a 2-D index is made again each time
            at = ri * self.data.arrays[VALUE_COLUMNS[0]].shape[0] + si
            for col in VALUE_COLUMNS:
                self.data.arrays[col].ravel(order="F")[at] = table[col].to_numpy()
            return int(si.min())
        first = None
        for col in VALUE_COLUMNS:
            arr = self.data.arrays[col]
            value = table[col].to_numpy().astype(arr.dtype)
            old = arr[si, ri]
            changed = ~((old == value) | (np.isnan(old) & np.isnan(value)))
            if changed.any():
                arr[si[changed], ri[changed]] = value[changed]
                row = int(si[changed].min())
                first = row if first is None else min(first, row)
        return first

    # -- detection ------------------------------------------------------------------------------

    def _matrix(self) -> tuple[StepMatrix, np.ndarray]:
        n = self.data.n
        values = {c: a[:n] for c, a in self.data.arrays.items()}
        start = values.pop("start_time")
        if not self.unit and recorded(values):
            self.unit = work_unit(self.run_dir) or ""
        return StepMatrix(self.ranks, self.steps, values, work_unit=self.unit, cuts=self._cuts()), start

    def _cuts(self) -> tuple[int, ...]:
        """Where a new world begins."""
        attempts = attempt_list(self.offsets, self.last)
        return world_cuts(attempts, self.rank_meta, self._worlds(attempts)[1])

    def _worlds(self, attempts: list[dict[str, int]]) -> tuple[list[dict[int, dict]], list[int]]:
        """The attempts' members and worlds, kept while the attempts and the ranks' metadata are the same (they
        read every rank's metadata)."""
        keys = tuple((a["restart"], a["attach"]) for a in attempts)
        if self.worlds is None or self.worlds[0] != keys or self.worlds[1] is not self.rank_meta:
            m = members(attempts, self.rank_meta)
            self.worlds = (keys, self.rank_meta, m, worlds(attempts, self.rank_meta, m))
        return self.worlds[2], self.worlds[3]

    def _exact(self) -> Analysis:
        mat, start = self._matrix()
        found = detect(mat, self.cfg, groups=self.roles)
        self.figures, self.slow_at = RankFigures.of(mat, found), time.monotonic()
        return self._report(mat, found, step_times(mat.steps, start, mat.values["step_s"]))

    def _report(self, mat: StepMatrix, found: Verdict, times: StepTimes) -> Analysis:
        self.previous = (mat, found, times)
        attempts = attempt_list(self.offsets, self.last)
        plan = StepPlan(self.ranks, self.steps, dict(self.offsets), attempts,
                        {k: dict(v) for k, v in self.last_own.items()}, self._worlds(attempts)[0])  # fmt: skip
        if self.context is None or time.monotonic() - self.context_at >= self.slow_every_s or self.settling:
            self.context, self.context_at = load_context(self.run_dir), time.monotonic()
        with ignoring(RunDirWarning):
            return finish(self.run_dir, self.figures, found, self.rank_meta, times, last_steps(mat), plan,  # type: ignore[arg-type]
                          Analysis(None, mat, found), context=self.context, config=self.cfg,
                          collectives=self.collectives, jitter=self._jitter)  # type: ignore[arg-type]  # fmt: skip

    def _jitter(self, found: Verdict, figures: RankFigures, rank_meta: dict[int, dict]) -> dict | None:
        """The jitter tax (it resamples every step of the healthy ranks: seconds at thousands of ranks): in the
        update for the first report and when the run settles; else projected again at most every
        ``slow_every_s``, on a thread beside the updates (from the update's figures, copied), the last one
        shown meanwhile and the new one from the first update after it ended."""
        now, job = time.monotonic(), self.jitter_job
        if self.settling or self.jitter_at is None:
            self.jitter_job = None  # a projection running now is of fewer steps: dropped
            self.jitter_at = (now, jitter_projection(found, figures, rank_meta))
            return self.jitter_at[1]
        if job is not None and not job.thread.is_alive():  # ended: taken (a failed one keeps the last)
            self.jitter_job = None
            if job.done:
                self.jitter_at = (job.started, job.result)
        if self.jitter_job is None and now - self.jitter_at[0] >= self.slow_every_s:
            self.jitter_job = _Jitter(now, jitter_work(found, figures, rank_meta))
        return self.jitter_at[1]

    def _follow(self, lo: int) -> Analysis:
        """The analysis after the rows from ``lo`` on changed (frozen scalars, resumed rule)."""
        cfg, n, r = self.cfg, self.data.n, len(self.ranks)
        mat, start = self._matrix()
        g = Groups.of(self.ranks, self.roles)
        v, lo = self._worked(mat, g, lo)
        self.det.grow(n, {"e": ((r,), np.float64, np.nan), "costly": ((r,), np.float32, np.nan),
                          "med": ((r,), np.float64, np.nan), "level": ((r,), np.float64, np.nan),
                          "counted": ((r,), np.float64, 0.0), "flags": ((r,), bool, False),
                          "classic": ((r,), bool, False),
                          "step_med": ((), np.float64, np.nan), "least": ((), np.float64, np.nan),
                          "top1": ((), np.float64, -np.inf), "top1_at": ((), np.int64, 0),
                          "top2": ((), np.float64, -np.inf), "group_med": ((len(g.names),), np.float64, np.nan),
                          "top_v": ((len(g.names), TOP_K), np.float64, -np.inf),
                          "top_c": ((len(g.names), TOP_K), np.int64, -1),
                          "ref_h": ((len(g.names),), np.float64, np.nan), "ref_job": ((), np.float64, np.nan),
                          "peer_phase": ((len(CAUSES) + len(GAP_COLUMNS),), np.float64, np.nan),
                          "slowdown": ((r,), np.float64, np.nan),
                          "start": ((), np.float64, np.nan), "end": ((), np.float64, np.nan)})  # fmt: skip
        d = self.det.arrays
        rows = slice(lo, n)
        e, costly, st = step_stage(v["busy_s"][rows], v["step_s"][rows], v["comm_wait_s"][rows], g, cfg)
        d["e"][rows], d["costly"][rows] = e, costly
        for name, col in (("step_med", st.step_med), ("least", st.least_wait), ("top1", st.top1),
                          ("top1_at", st.top1_at), ("top2", st.top2), ("group_med", st.group_med),
                          ("top_v", st.top_v), ("top_c", st.top_c)):  # fmt: skip
            d[name][rows] = col
        _, d["start"][rows], d["end"][rows] = step_times(self.steps[rows], start[rows], v["step_s"][rows])
        # rolling medians of the rows that changed, from the window before them
        tail = max(0, lo - cfg.level_window + 1)
        part = cons.block_state(d["e"][tail:n], d["costly"][tail:n], cfg)
        d["med"][rows], d["level"][rows] = part.med[lo - tail :], part.level[lo - tail :]
        d["counted"][rows] = np.asarray(part.counted)[lo - tail :]
        state = cons.BlockState(d["e"][:n], d["costly"][:n], d["med"][:n], d["level"][:n], d["counted"][:n])
        if self.sc is None or n + self.dropped >= (1.0 + self.regrow) * self.sc_steps:
            # the steps before ``lo`` keep the flags the earlier scalars gave them until the run settles
            self.sc, self.sc_steps = self._scalars(state), n + self.dropped
        sc = self.sc
        levels = cons.floor_levels(sc)
        width = r * len(levels)  # the carries hold the levels side by side (``consistency.advance``)
        self.checkpoints = {k: c for k, c in self.checkpoints.items() if k <= lo and c.on.size == width}
        at = max(self.checkpoints, default=0)
        carry = self.checkpoints[at].copy() if at in self.checkpoints else cons.Carry.fresh(width)
        both = cons.advance(state, levels, cfg, carry, at, n, self.checkpoints)
        d["flags"][at:n], d["classic"][at:n] = both[:, :r], both[:, width - r :]
        # the intermittent test looks at whole blocks of the history (their means kept, those from ``lo`` on
        # made again): OR-ed here, not kept in the carry
        means, top = self._blocks(lo, n)
        with np.errstate(invalid="ignore"):
            spans = [stretches(n, means, top > x.floors.step_fraction, x.block_noise, x.floors, cfg, x.ranks)
                     for x in levels]  # fmt: skip
        # the classic floor's flags are the last level's (the only one's where there is one); few ranks have
        # stretches: they are set in the flags of every level, and looked up for the classic floor's
        classic = d["classic" if len(levels) == 2 else "flags"][:n]
        flags = mark(d["flags"][:n] | classic if len(levels) == 2 else d["flags"][:n].copy(), [*spans[0], *spans[-1]])
        never = ~flags.any(axis=0)
        first = 0 if self.never is None or not np.array_equal(never, self.never) else min(lo, at)
        self.never = never
        # each cause's time: of the rows whose healthy reference is made again, and of every row of the
        # ranks ever flagged (not of the whole run at every update)
        timed = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s", *GAP_COLUMNS)
        part_rows = slice(first, n)
        phases = cause_phases({c: v[c][part_rows] for c in timed if c in v})
        health = healthy_stage(v["busy_s"][part_rows], phases, flags[part_rows], never, g)
        d["ref_h"][part_rows], d["ref_job"][part_rows], d["peer_phase"][part_rows] = (
            health.ref_h, health.ref_job, health.peer_phase)  # fmt: skip
        d["slowdown"][part_rows] = v["busy_s"][part_rows] / health.ref_h[:, g.index]
        stats = _stats(d, n)
        full = HealthyStats(d["ref_h"][:n], d["ref_job"][:n], d["peer_phase"][:n])
        found = []
        cuts, carry = cut_indices(self._cuts(), self.steps), outlasts(cfg)
        for j in np.flatnonzero(~never):
            mine = cause_phases({c: np.ascontiguousarray(v[c][:, j]) for c in timed if c in v})
            series = RankSeries(np.ascontiguousarray(d["e"][:n, j]), np.ascontiguousarray(v["busy_s"][:, j]),
                                mine, full.ref_h[:, g.index[j]], other_max(stats.top_v, stats.top_c, g.index[j], j),
                                full.peer_phase)  # fmt: skip
            found += [straggler(int(self.ranks[j]), self.steps, series, a, b, cfg,
                                bool(classic[a:b, j].any()) or within(spans[-1], j, a, b), after)
                      for a, b, after in intervals(flags[:, j], cuts, v["busy_s"][:, j], carry)]  # fmt: skip
        slowdown = d["slowdown"][:n]
        result = verdict(self.ranks, self.steps, found, stats, full, g, cfg, cons.thresholds(self.sc, cfg),  # type: ignore[arg-type]
                         slowdown, flags, cuts)  # fmt: skip
        result.healthy = never & g.paired()
        if self.work is not None:
            work = self.work
            if work.imbalance is None:  # assessed once a fit, with the flags of the update that fitted
                values = {**mat.values, "work": mat.values[work.column]}
                flagged = straggling(result, self.ranks)
                work.imbalance = imb.assess(Whole(values), work.model, g, flagged, self.ranks, result.job_seconds,
                                            cfg.imbalance_min_slowdown, work.unit, work.column)  # fmt: skip
            result.imbalance = work.imbalance
            add_imbalance(result, work.imbalance)
        self.flagged = straggling(result, self.ranks)
        self.figures = self._figures(mat, result)
        return self._report(mat, result, (self.steps, d["start"][:n], d["end"][:n]))

    def _blocks(self, lo: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole blocks' means of the excess and largest costs (``intermittent``) of rows ``:n``, those before
        the block holding row ``lo`` as they were."""
        d, k = self.det.arrays, min(lo // BLOCK, self.blocks.n)
        self.blocks.grow(n // BLOCK, {"means": ((len(self.ranks),), np.float64, np.nan),
                                      "top": ((len(self.ranks),), np.float32, np.nan)})  # fmt: skip
        rows = slice(k * BLOCK, (n // BLOCK) * BLOCK)
        self.blocks.arrays["means"][k : n // BLOCK] = block_means(d["e"][rows])
        self.blocks.arrays["top"][k : n // BLOCK] = block_costs(d["costly"][rows])
        return self.blocks.arrays["means"][: n // BLOCK], self.blocks.arrays["top"][: n // BLOCK]

    def _worked(self, mat: StepMatrix, g: Groups, lo: int) -> tuple[dict[str, np.ndarray], int]:
        """The values the detection follows, and the first row that changed: the read values, or where the
        ranks did different work, adjusted with the work model of the last fit: the rows from ``lo`` on are
        adjusted with it; once the run has grown by ``regrow`` it is fitted again and the new rows adjusted
        with the new fit, the rows before them keeping the adjustment they were followed with (as the flags
        keep their scalars) until the run settles."""
        n = len(mat.steps)
        total = n + self.dropped  # the steps read, all told: the fits are made again as the run grows
        if not self.uneven:
            self.uneven = _uneven_rows(mat.values, lo)
        if not self.uneven:
            return mat.values, lo
        work = self.work
        shapes = {c: ((len(self.ranks),), np.float64, np.nan) for c in workfit.ADJUSTED}
        healthy = None if self.never is None or len(self.never) != len(self.ranks) else self.never
        fitted: tuple[str, str, imb.WorkModel, imb.Imbalance | None] | None = None
        if work is None:  # the first fit: nothing to adjust with before it
            got = _fit(mat.values, mat.work_unit, g, healthy)
            if got is None:
                self.uneven = False
                return mat.values, lo
            fitted, steps = (*got, None), total
        elif self.refit is not None and self.refit.thread is not None and not self.refit.thread.is_alive():
            refit, self.refit = self.refit, None
            if refit.done is not None:
                fitted, steps = refit.done, refit.steps
            else:  # it failed, or found no work that varies: the last fit stays until the run grows again
                work.steps = refit.steps
        elif self.refit is None and total >= (1.0 + self.regrow) * work.steps:
            if self.fit_in_background:
                self._fit_beside(mat.values, mat.work_unit, g, healthy, total)
            else:
                got = _fit(mat.values, mat.work_unit, g, healthy)
                if got is None:
                    self.uneven = False
                    return mat.values, lo
                fitted, steps = (*got, None), total
        if fitted is not None:
            column, unit, model, imbalance = fitted
            if work is None or work.column != column:  # the first fit, or another count of the work: every row
                lo = 0
            elif len(work.model.ref) >= lo:  # the rows adjusted since the fit's data keep their reference
                model = dataclasses.replace(model, ref=work.model.ref[:lo])
            self.work = work = _Work(column, unit, model, steps, work.adjusted if work is not None and lo else _Rows(),
                                     imbalance)  # fmt: skip
        assert work is not None
        if len(work.model.ref) < lo:  # rows the model never saw: adjust them all again
            lo = 0
        rows = slice(lo, n)
        w = mat.values[work.column]
        ref = np.concatenate([work.model.ref[:lo], workfit.group_medians(w[rows], g)])
        work.model = dataclasses.replace(work.model, ref=ref)
        part = imb.adjust({**{c: mat.values[c][rows] for c in workfit.ADJUSTED}, "work": w[rows]}, work.model, g,
                          rows)  # fmt: skip
        work.adjusted.grow(n, shapes)
        for c in workfit.ADJUSTED:
            work.adjusted.arrays[c][rows] = part[c]
        return {**mat.values, **{c: a[:n] for c, a in work.adjusted.arrays.items()}}, lo

    def _fit_beside(self, values: dict[str, np.ndarray], work_unit: str, g: Groups, healthy: np.ndarray | None,
                    n: int) -> None:  # fmt: skip
        """Start fitting the work model again on a thread, over the rows held (views: the rows the updates write
        next are past them, and arrays that grow or slide are new arrays), with its imbalance verdict (with the
        flags of the last update); ``n``: the steps read by then, all told."""
        job = _Refit(n)
        flagged = self.flagged if len(self.flagged) == len(self.ranks) else np.zeros(len(self.ranks), dtype=bool)
        ranks, cfg = self.ranks, self.cfg

        def run() -> None:
            try:
                got = _fit(values, work_unit, g, healthy)
                if got is None:
                    return
                column, unit, model = got
                with ignoring():
                    job_s = float(np.nansum(nanmedian(values["step_s"], axis=1)))
                im = imb.assess(Whole({**values, "work": values[column]}), model, g, flagged, ranks, job_s,
                                cfg.imbalance_min_slowdown, unit, column)  # fmt: skip
                job.done = (column, unit, model, im)
            except Exception as e:  # noqa: BLE001 - a failed fit keeps the last model; the view goes on
                self.fit_failures += 1
                if self.fit_failures == 1:
                    warnings.warn(f"stragglerwatch: the work model could not be fitted again ({type(e).__name__}: "
                                  f"{e}); the last fit stays in use", RuntimeWarning, stacklevel=1)  # fmt: skip

        job.thread = threading.Thread(target=run, name="stragglerwatch-workfit", daemon=True)
        self.refit = job
        job.thread.start()

    def wait_for_fit(self, timeout_s: float | None = None) -> bool:
        """Wait for a work fit running beside the updates (the next update takes it); False if one still runs."""
        job = self.refit
        if job is None or job.thread is None:
            return True
        job.thread.join(timeout_s)
        return not job.thread.is_alive()

    def _figures(self, mat: StepMatrix, result: Verdict) -> RankFigures:
        """The report's per-rank figures, one column's medians brought up to date an update (each
        costs a pass over all the data); the flags are always current."""
        old = self.figures
        if old is None or len(old.ranks) != len(self.ranks):
            return RankFigures.of(mat, result)
        names = [*RANK_COLUMNS, "busy_vs_peers"]
        name = names[self.turn % len(names)]
        self.turn += 1
        medians = dict(old.medians)
        vs_peers = old.busy_vs_peers
        if name == "busy_vs_peers":
            vs_peers = nanmedian(result.slowdown, axis=0)
        else:
            medians[name] = rank_medians(mat.values, (name,))[name]
        return RankFigures(self.ranks, medians, vs_peers, np.sum(~np.isnan(mat.values["busy_s"]), axis=0))

    def _scalars(self, state: cons.BlockState) -> cons.Scalars:
        """The job-wide scalars from every step of at most ``SCALAR_RANKS`` ranks spread over the
        job (job-wide medians and variances; the settled analysis takes them from every rank)."""
        r = state.e.shape[1]
        cols = np.unique(np.linspace(0, r - 1, min(r, SCALAR_RANKS)).astype(np.int64)) if r else np.zeros(0, int)
        part = cons.BlockState(*(np.asarray(a)[:, cols] for a in
                                 (state.e, state.costly, state.med, state.level, state.counted)))  # fmt: skip
        sc = cons.combine1([cons.round1(part)], self.cfg)
        return cons.combine2([cons.round2(part, sc, self.cfg)], sc, self.cfg)


def _fit(values: dict[str, np.ndarray], work_unit: str, g: Groups, healthy: np.ndarray | None
         ) -> tuple[str, str, imb.WorkModel] | None:  # fmt: skip
    """The work model of ``values`` (``imbalance.basis``'s count of the work), or None where it does not vary."""
    chosen = imb.basis(values, work_unit)
    if chosen is None:
        return None
    raw, unit, column = chosen
    rounds = Whole(raw)
    return column, unit, imb.model(rounds, g, workfit.measure(rounds, g), healthy)


def _uneven_rows(values: dict[str, np.ndarray], lo: int) -> bool:
    """Whether in some step from row ``lo`` on the ranks did different work (by either count)."""
    return imb.uneven({c: values[c][lo:] for c in imb.WORK_COLUMNS if c in values})


def distinct(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an integer array: counted in slots where they span a range not much wider
    than the array (steps, attempts: the usual batch), else sorted."""
    if not x.size:
        return np.unique(x)
    lo, hi = int(x.min()), int(x.max())
    if hi - lo > 4 * x.size + 1024:
        return np.unique(x)
    return (np.flatnonzero(np.bincount(x - lo, minlength=hi - lo + 1)) + lo).astype(x.dtype, copy=False)


#: New bytes of a stream read at once, below this size (a memory map costs more to set up than a few batches
#: take to read: 4,096 streams an update); a larger tail (a run opened late) is mapped, not copied.
READ_AT_ONCE = 1 << 20


def _tail(f: str | os.PathLike[str], offset: int, size: int) -> tuple[pa.NativeFile, int]:
    """The stream ``f`` (``size`` bytes when last seen) from ``offset`` on, and where in the file its position
    0 lies."""
    if size - offset > READ_AT_ONCE:
        return pa.memory_map(os.fspath(f), "r"), 0
    fd = os.open(f, os.O_RDONLY)
    try:
        return pa.BufferReader(os.pread(fd, max(0, size - offset), offset)), offset
    finally:
        os.close(fd)


def read_new(f: str | os.PathLike[str], state: _File, problem: Callable[[pa.Schema], str | None],
             size: int | None = None) -> pa.Table | None:  # fmt: skip
    """:func:`read_batches` as a table; None when there is none."""
    batches = read_batches(f, state, problem, size)
    return pa.Table.from_batches(batches, schema=state.schema) if batches else None


def read_batches(f: str | os.PathLike[str], state: _File, problem: Callable[[pa.Schema], str | None],
                 size: int | None = None) -> list[pa.RecordBatch]:  # fmt: skip
    """The complete record batches of the Arrow stream ``f`` after ``state.offset`` (its schema and offset
    kept in ``state``; a batch being written is read next time), up to ``size`` bytes (default: its size
    now); none when the stream's schema has a ``problem``."""
    batches: list[pa.RecordBatch] = []
    try:
        size = os.stat(f).st_size if size is None else size
        src, base = _tail(f, state.offset if state.schema is not None else 0, size)
        with src:
            if state.schema is None:
                try:
                    message = pa.ipc.MessageReader.open_stream(src).read_next_message()
                except StopIteration:
                    return batches  # created, nothing written yet
                schema = pa.ipc.read_schema(message)
                if problem(schema):
                    return batches
                state.schema, state.offset = schema, base + src.tell()
                state.schema_key = schema.to_string(show_schema_metadata=False)
            src.seek(state.offset - base)  # after the last complete batch read
            reader = pa.ipc.MessageReader.open_stream(src)
            while True:
                try:
                    batch = pa.ipc.read_record_batch(reader.read_next_message(), state.schema)
                    batch.validate(full=True)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError, EOFError, ValueError):
                    break  # a batch being written: read it next time
                batches.append(batch)
                state.offset = base + src.tell()
    except (pa.ArrowException, OSError, EOFError, ValueError):
        return batches
    return batches


def _stats(d: dict[str, np.ndarray], n: int) -> StepStats:
    return StepStats(d["step_med"][:n], d["least"][:n], d["top1"][:n], d["top1_at"][:n], d["top2"][:n],
                     d["group_med"][:n], d["top_v"][:n], d["top_c"][:n])  # fmt: skip


def quiet(message: str) -> None:
    """A live run misses ranks and cuts batches in half: normal, not worth a warning."""
