"""The step-log writer: per-rank, crash-safe, columnar (:class:`EventLogWriter`).

Design: the training thread only appends finished :class:`~stragglerwatch.runtime.capture.timing.StepMarks`
to a deque (``submit``). A daemon thread wakes every ``flush_interval_s`` (default 1 s), resolves the
marks (CUDA events lazily, with ``query()``, only while no CUDA graph capture is open:
``devices.CaptureGate``), computes the records and appends one Arrow IPC *stream* record batch to
``rank-NNNNN.arrows``, flushing the file. A SIGKILL therefore loses at most the steps of the last
interval; every earlier batch is complete and stays readable. On ``close`` the stream is compacted
into ``rank-NNNNN.parquet`` (``stragglerwatch.record.steplog.compact_stream``).

Our failures never reach training: an error writing (disk full, read-only filesystem) becomes one
line in the ``stragglerwatch`` logger (rate-limited) and a counter; the log keeps going, in a new
segment.

No step stops the log either. Steps are resolved oldest first, and a step whose resolution raises
(its events cannot be timed: ``elapsed_time`` failing, events of two devices,
``timing.UnresolvableStep``) is dropped and counted (``unresolvable_dropped_steps``, one rate-limited
line), never left at the head of the queue where it would fail every later flush the same way; the
bound on the steps waiting for their events (``MAX_PENDING``) is applied whatever a pass raised.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from stragglerwatch.record.schema import (
    STEP_SCHEMA,
    StepRecord,
    records_to_batch,
)
from stragglerwatch.record.steplog import compact_stream, log_path
from stragglerwatch.runtime.capture.timing import DROPPED, StepMarks, anatomy
from stragglerwatch.runtime.log import Problems

#: Marks waiting for their CUDA events before the oldest are given up on.
MAX_PENDING = 4096


#: Finished steps queued for the log thread before the oldest are dropped (a log thread that cannot
#: write, or a job of very short steps with a very long flush interval).
MAX_QUEUED = 8192


#: Seconds close() waits for the compaction to Parquet of a complete stream beyond its bound.
COMPACT_WAIT_S = 30.0


#: What :meth:`EventLogWriter._take_head` returns for a head step still pending on the device.
_WAIT = object()


#: Seconds a step may stay unresolved while a later step's end has completed on the device
#: (its marks went where they never complete: a capture we did not see) before it is dropped.
STALE_S = 10.0


def _host_resolve(m: StepMarks, deadline: float | None) -> StepMarks:
    return m


@contextlib.contextmanager
def _always_open() -> Iterator[bool]:
    yield True


def _done(ev: Any) -> bool:
    query = getattr(ev, "query", None)
    return query is None or bool(query())


class EventLogWriter:
    """Writes one rank's step records. ``submit`` is the only hot-path call.

    Durability: every batch is flushed to the OS (a crash of the process loses at most
    ``flush_interval_s``); the file is fsynced at most every ``fsync_interval_s`` and at close
    (what a crash of the machine can lose). After a failed write (disk full, file gone) the
    stream is abandoned, since its last batch may be cut, and the next batch starts a new
    segment; a run dir deleted under us is made again (``on_reopen`` rewrites its metadata).
    """

    def __init__(
        self,
        path: Path,
        rank: int,
        wall_anchor: float,
        *,
        timing: str = "host",
        resolve: Resolver | None = None,
        flush_interval_s: float = 1.0,
        fsync_interval_s: float = 10.0,
        restart: int = 0,
        attach: int = 0,
        problems: Problems | None = None,
        on_reopen: Callable[[], None] | None = None,
        gate: Gate | None = None,
        close_timeout_s: float = 5.0,
    ):
        self.path = path
        self.rank = rank
        self.flush_interval_s = flush_interval_s
        self.fsync_interval_s = fsync_interval_s
        self.steps_written = 0
        self.write_errors = 0
        self.dropped_steps = 0
        self.capture_dropped_steps = 0  # a mark made inside a CUDA graph capture: never resolvable
        self.stale_dropped_steps = 0  # events that never completed while later ones did
        self.unresolvable_dropped_steps = 0  # resolving it raised (events of two devices, a broken event)
        self.unresolved: list[int] = []  # steps still pending on the device when close gave up on them
        self.close_timeout_s = close_timeout_s
        self._gate = gate or _always_open
        self._head_since: tuple[int, float] | None = None  # (id of the pending head, when first seen pending)
        self._wall_anchor = wall_anchor
        self._timing = timing
        self._ids = (restart, attach)
        self._resolve = resolve or _host_resolve
        self._problems = problems or Problems()
        self._on_reopen = on_reopen
        self.observers: list[Callable[[list[StepRecord]], None]] = []  # e.g. the exporter's aggregates
        self._queue: deque[StepMarks] = deque()
        self._pending: deque[StepMarks] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Condition()  # wakes the log thread's wait: a new interval, a request, or close
        self._requested: list[threading.Event] = []  # flushes asked for (request_flush), set when done
        self._busy_since: float | None = None  # the log thread is writing since then
        self._gave_up = False  # a request_flush gave up on a write that has not returned since
        self._compacting = False
        self._file: Any = None
        self._writer: pa.RecordBatchStreamWriter | None = None
        self._synced_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"stragglerwatch-log-{rank}", daemon=True)
        self._thread.start()

    def submit(self, marks: StepMarks) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self._queue.popleft()
            self.dropped_steps += 1
        self._queue.append(marks)

    def _run(self) -> None:
        while not self._sleep():
            with self._wake:
                requested, self._requested = self._requested, []
            self._busy_since = time.monotonic()
            try:
                self.flush()
            except Exception as exc:  # never let the thread die of our own bug
                self._fail("thread", f"step log thread: {type(exc).__name__}: {exc}")
            finally:
                self._busy_since = None
            for done in requested:
                done.set()

    def request_flush(self, timeout_s: float = 5.0) -> bool:
        """Have the log thread write every finished step now, and wait for it at most ``timeout_s``:
        what the training thread calls (``Watch.flush``), which then never does I/O itself. Once a
        wait has given up (a write that does not return: a filesystem that does not answer), later
        requests return at once until that write has returned: the bound is paid once."""
        if not self._thread.is_alive():
            return False
        if self._gave_up and self._busy_since is not None:
            return False
        done = threading.Event()
        with self._wake:
            self._requested.append(done)
            self._wake.notify_all()
        if done.wait(timeout_s):
            self._gave_up = False
            return True
        self._gave_up = True
        self._problems.report("log-stuck", f"the step log {self.path} was not written within {timeout_s:g} s "
                              "(a filesystem that does not answer?): flushes do not wait for it again until "
                              "it has")  # fmt: skip
        return False

    def _sleep(self) -> bool:
        """Wait one flush interval, counted from the start of the wait and re-read whenever
        :meth:`set_flush_interval` changes it (so a change applies within the current wait);
        True once the writer is closing."""
        start = time.monotonic()
        with self._wake:
            while not self._stop.is_set():
                if self._requested:
                    return False
                left = start + self.flush_interval_s - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def set_flush_interval(self, seconds: float) -> None:
        """Change how often the log thread writes (runtime control); the current wait is cut short
        or extended at once, without restarting the thread."""
        with self._wake:
            self.flush_interval_s = float(seconds)
            self._wake.notify_all()

    def flush(self, deadline: float | None = None, lock_timeout_s: float = 5.0) -> None:
        """Write every step whose marks are resolved (waiting for the device until ``deadline``, a
        ``time.monotonic()`` time, if given); gives up after ``lock_timeout_s`` if another flush holds
        the log (a write stuck on a hung filesystem must not hold the caller for longer)."""
        if not self._lock.acquire(timeout=lock_timeout_s):
            return
        try:
            records = self._take_resolved(deadline)  # never raises: a step it cannot resolve is dropped
            if records:
                self._write(records)
                for observe in self.observers:
                    try:
                        observe(records)
                    except Exception as exc:
                        self._fail("observer", f"{type(exc).__name__}: {exc}")
        finally:
            self._lock.release()

    def _take_resolved(self, deadline: float | None) -> list[StepRecord]:
        """The records of the resolved steps at the head of the queue, oldest first. What a pass
        raises (the gate) ends the pass, not the records taken so far, nor the bound on the queue."""
        while self._queue:
            self._pending.append(self._queue.popleft())
        records: list[StepRecord] = []
        try:
            with self._gate() as may_query:  # no event query while a CUDA graph capture is open
                while may_query and self._pending:
                    head = self._pending[0]
                    outcome = self._take_head(head, deadline)
                    if outcome is _WAIT:
                        break
                    self._pending.popleft()
                    if outcome is not None:
                        records.append(outcome)
        except Exception as exc:
            self._fail("resolve", f"could not resolve step timings: {type(exc).__name__}: {exc}")
        finally:
            self._trim()
        return records

    def _take_head(self, head: StepMarks, deadline: float | None) -> Any:
        """The head step's record; ``_WAIT`` while its events are pending; None for a step dropped
        (counted here): marked inside a capture, stale, or whose resolution raised."""
        try:
            resolved = self._resolve(head, deadline)
            if resolved is None and not self._stale(head):
                return _WAIT
            if resolved is None or resolved is DROPPED:
                self.dropped_steps += 1
                if resolved is None:
                    self.stale_dropped_steps += 1
                else:
                    self.capture_dropped_steps += 1
                return None
            return anatomy(resolved, self.rank, self._wall_anchor, self._timing, *self._ids)
        except Exception as exc:
            self.dropped_steps += 1
            self.unresolvable_dropped_steps += 1
            self._problems.report("log-unresolvable", f"step {head.step} not recorded: its timings cannot be "
                                  f"resolved ({type(exc).__name__}: {exc}); the next steps are (training "
                                  "continues; later ones are counted)")  # fmt: skip
            return None

    def _trim(self) -> None:
        """Hold :data:`MAX_PENDING`: the oldest steps beyond it are dropped and counted."""
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped_steps += 1

    def _stale(self, head: StepMarks) -> bool:
        """The head step's events have not completed for ``STALE_S`` although the newest pending
        step's end has: they never will (recorded into a capture we did not see). A tail whose end
        cannot be queried is no evidence (the head is not dropped for the tail's fault)."""
        now = time.monotonic()
        if self._head_since is None or self._head_since[0] != id(head):
            self._head_since = (id(head), now)
            return False
        tail = self._pending[-1]
        if tail is head or now - self._head_since[1] < STALE_S:
            return False
        try:
            return _done(tail.end)
        except Exception:
            return False

    def _fail(self, kind: str, message: str) -> None:
        self.write_errors += 1
        self._problems.report(f"log-{kind}", f"{message} (training continues; later errors are counted)")

    def _open(self) -> None:
        if not self.path.parent.is_dir():  # the run dir was deleted under us: make it again
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._on_reopen is not None:
                self._on_reopen()
            self._problems.report("log-reopen", f"run dir {self.path.parent} was gone: made again, logging goes on")
        self.path = log_path(self.path.parent, self.rank)
        self._file = open(self.path, "wb")  # noqa: SIM115 - lives as long as the writer
        self._writer = pa.ipc.new_stream(self._file, STEP_SCHEMA)

    def _abandon(self) -> None:
        """Drop the current stream (its last batch may be cut); the next write starts a new segment."""
        writer, file, self._writer, self._file = self._writer, self._file, None, None
        for closable in (writer, file):
            try:
                if closable is not None:
                    closable.close()
            except Exception:
                pass

    def _batch(self, records: list[StepRecord]) -> pa.RecordBatch:
        """The batch of ``records``; a record that cannot be converted is dropped and counted alone,
        not with the steps of its batch (and not as a write error: the stream is fine)."""
        try:
            return records_to_batch(records)
        except Exception:
            kept = []
            for record in records:
                try:
                    records_to_batch([record])
                    kept.append(record)
                except Exception as exc:
                    self.dropped_steps += 1
                    self.unresolvable_dropped_steps += 1
                    self._problems.report("log-unresolvable", f"step {record.step} not recorded: its record cannot "
                                          f"be written ({type(exc).__name__}: {exc}); the next steps are")  # fmt: skip
            return records_to_batch(kept)

    def _write(self, records: list[StepRecord]) -> None:
        batch = self._batch(records)
        if not batch.num_rows:
            return
        try:
            if self._writer is not None and not self.path.exists():  # deleted under us
                self._abandon()
            if self._writer is None:
                self._open()
            self._writer.write_batch(batch)
            self._file.flush()
            if self.fsync_interval_s and time.monotonic() - self._synced_at >= self.fsync_interval_s:
                os.fsync(self._file.fileno())
                self._synced_at = time.monotonic()
            self.steps_written += batch.num_rows
        except Exception as exc:
            self.dropped_steps += batch.num_rows
            self._abandon()
            self._fail("write", f"cannot write {self.path}: {exc}")

    def close(self) -> None:
        """Stop the thread, write every step the device has finished, compact to Parquet.

        Bounded: the log thread, the device and the last write together get ``close_timeout_s``;
        steps whose events are still pending then (a GPU stuck behind a collective its peers never
        join) are listed in :attr:`unresolved`, not waited for. The writing is done on a thread of
        its own: if the filesystem does not answer, close returns at the bound all the same (said
        once), and the stream written so far stays readable."""
        deadline = time.monotonic() + self.close_timeout_s
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        finisher = threading.Thread(target=self._finish, args=(deadline,), name=f"stragglerwatch-log-close-{self.rank}",
                                    daemon=True)  # fmt: skip
        finisher.start()
        finisher.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        if finisher.is_alive() and self._compacting:  # the stream is complete; a long one compacts for a while
            finisher.join(timeout=COMPACT_WAIT_S)
        if finisher.is_alive():
            self._fail("finish", f"cannot finish {self.path} within close_timeout_s (a filesystem that does not "
                       "answer?); what was written stays readable as a stream")  # fmt: skip

    def _finish(self, deadline: float) -> None:
        self.flush(deadline=deadline, lock_timeout_s=max(0.0, deadline - time.monotonic()))
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._fail("finish", f"cannot finish {self.path}: the log is still busy (it stays readable as a stream)")
            return
        try:
            while self._queue:
                self._pending.append(self._queue.popleft())
            self.unresolved = [m.step for m in self._pending]
            self._pending.clear()
            if self._writer is None:
                return
            try:
                self._writer.close()
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._compacting = True
                compact_stream(self.path)
            except Exception as exc:
                self._fail("finish", f"cannot finish {self.path} (it stays readable as a stream): {exc}")
            self._writer = self._file = None
        finally:
            self._lock.release()


#: ``resolve(marks, deadline)``: resolved marks, ``None`` while pending, or ``timing.DROPPED``; it
#: raises for a step it can never resolve (dropped and counted in ``unresolvable_dropped_steps``).
Resolver = Callable[[StepMarks, "float | None"], Any]


Gate = Callable[[], "contextlib.AbstractContextManager[bool]"]
