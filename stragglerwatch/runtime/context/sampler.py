"""The context sampler: a background thread that samples the rank's host and GPU context.

Design: once per ``interval_s`` (1 s by default, never more often) a daemon thread of its own
samples the host (``hostctx.py``) and, on a GPU rank, its device (``gpuctx.py``); the training
thread never does any of it. Each sample becomes ``latest`` (what the exporter serves) and a row
of the run dir's context stream (``context.py``), written every ``write_every_s`` seconds (so a
crash loses at most that much context) and compacted to Parquet at close. The cost of each
sample is recorded with it (``sample_s``; ``benchmarks/context_cost.py`` measures it).

Never harm training: a failure of ours (a write that fails, a bug) is one line in the
``stragglerwatch`` logger and a counter (``errors``); the thread goes on. A machine without NVML
or without a GPU, or without some ``/proc`` file, is normal and silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stragglerwatch.record.context import CONTEXT_SCHEMA, compact, context_path, rows_to_batch
from stragglerwatch.record.streams import SegmentAppender
from stragglerwatch.runtime.context.gpuctx import EMPTY as GPU_EMPTY
from stragglerwatch.runtime.context.gpuctx import GpuSampler, open_gpu
from stragglerwatch.runtime.context.hostctx import HostSampler
from stragglerwatch.runtime.log import Problems

#: Fewest seconds between two samples: the sampler is low-rate by design.
MIN_INTERVAL_S = 1.0


class ContextSampler:
    """Samples this rank's context every ``interval_s`` on its own thread; ``close()`` finishes the stream.

    ``gpu_index`` is the CUDA device of the rank (None on a CPU rank: no GPU context);
    ``open_gpu_sampler`` and ``host`` are for tests (a fake NVML, a fake ``/proc``)."""

    def __init__(
        self,
        run_dir: Path | None,
        rank: int,
        *,
        interval_s: float = 1.0,
        gpu_index: int | None = None,
        problems: Problems | None = None,
        host: HostSampler | None = None,
        open_gpu_sampler: Callable[[], GpuSampler | None] | None = None,
        write_every_s: float = 10.0,
        wall: Callable[[], float] = time.time,
    ):
        self.run_dir = run_dir
        self.rank = rank
        self.interval_s = max(float(interval_s), MIN_INTERVAL_S)
        self.problems = problems or Problems()
        self.samples = 0
        self.errors = 0
        self.latest: dict[str, Any] | None = None  # replaced whole, never mutated: safe to read anywhere
        self.host = host or HostSampler(on_unreadable=self._unreadable)
        self.gpu: GpuSampler | None = None
        self._gpu_index = gpu_index
        self._open_gpu = open_gpu_sampler
        self._write_every = max(1, round(write_every_s / self.interval_s))
        self._wall = wall
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream = SegmentAppender(lambda: context_path(run_dir, rank), CONTEXT_SCHEMA,  # type: ignore[arg-type]
                                       lambda message: self._fail("write", message))  # fmt: skip
        self._last: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"stragglerwatch-context-{rank}", daemon=True)

    @property
    def file(self) -> Any:
        """The open stream's file (for a forked child to point away from)."""
        return self._stream.file

    def start(self) -> ContextSampler:
        self._thread.start()
        return self

    def _fail(self, kind: str, message: str) -> None:
        self.errors += 1
        self.problems.report(f"context-{kind}", f"context sampler: {message} (training continues)")

    def _unreadable(self, what: str, why: str) -> None:
        self.problems.report("context-unreadable", f"context sampler: cannot parse /proc/{what} ({why}); skipped")

    def _gpu_error(self, query: str, why: str) -> None:
        self.problems.report("context-gpu", f"context sampler: NVML {query} failed: {why}")

    def _start_gpu(self) -> None:
        if self._open_gpu is not None:
            self.gpu = self._open_gpu()
        elif self._gpu_index is not None:
            self.gpu = open_gpu(self._gpu_index, on_error=self._gpu_error)

    def _run(self) -> None:
        try:
            self._start_gpu()
            self.host.sample()  # the baseline of the first rates
            self._last = time.monotonic()
        except Exception as exc:
            self._fail("start", f"{type(exc).__name__}: {exc}")
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except Exception as exc:  # never let the thread die of our own bug
                self._fail("sample", f"{type(exc).__name__}: {exc}")

    def sample_once(self) -> dict[str, Any]:
        """Take one sample now (the thread does this every interval); returns its row."""
        t0 = time.perf_counter()
        now = time.monotonic()
        row = {"rank": self.rank, "time": self._wall(), "interval_s": now - (self._last or now)}
        self._last = now
        row.update(self.host.sample())
        row.update(self.gpu.sample() if self.gpu is not None else GPU_EMPTY)
        row["sample_s"] = time.perf_counter() - t0
        self.latest = row
        with self._lock:
            self.samples += 1
            self._rows.append(row)
            if len(self._rows) >= self._write_every:
                self._write()
        return row

    def _write(self) -> None:
        """Append the buffered rows to the stream (under the lock)."""
        rows, self._rows = self._rows, []
        if rows and self.run_dir is not None:
            self._stream.append(rows_to_batch(rows))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waiting at most ``timeout_s``), write the rest, compact to Parquet. Never raises."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if not self._lock.acquire(timeout=timeout_s):
            self._fail("close", "a sample did not finish: the last rows are not written")
            return
        try:
            self._write()
            self._stream.finish(compact)
        except Exception as exc:
            self._fail("close", f"cannot finish {self._stream.path} (it stays readable as a stream): {exc}")
        finally:
            self.run_dir = None  # a sample still under way after close() writes nothing
            self._lock.release()
        if self.gpu is not None and not self._thread.is_alive():
            self.gpu.close()
            self.gpu = None
