"""PyTorch's own C++ record of every collective, copied into the run dir off the training thread.

Design: every process group of the NCCL and gloo backends records each collective it runs in the
Flight Recorder ring (torch >= 2.5; on by default), whoever issued it: ``torch.distributed`` calls,
DDP's reducer, FSDP2, DTensor's functional collectives, compiled graphs. Each entry has the group's
name, the collective's sequence number in that group and the wall-clock time it was created
(``time_created_ns``), and the id of the thread that issued it. This module reads the new entries
(a ``record_id`` cursor) on the log thread and appends them to ``collectives-NNNNN.jsonl``; the
analysis joins the ranks' entries by (group, sequence number) into the *arrival order*: which rank
entered each collective last, and how long the others waited for it (``analysis/arrivals.py``).
The training thread pays nothing for it.

What it costs, and where: torch 2.13 has no incremental read; a read dumps the whole ring (2,000
entries by default, ``TORCH_FR_BUFFER_SIZE``) as a pickle, about 10 us an entry in C++ and 3 to 50 us
an entry to unpickle, holding the interpreter lock throughout: 35 to 130 ms for a full ring, during
which the training thread waits, and with it, at its next collective, every other rank. So reads are
paced by a budget (after a read that took ``d`` seconds the next comes no sooner than ``d / budget``
later, ``budget`` 1% of the wall clock), and once a read takes longer than ``MAX_READ_S`` (the ring
has filled) reads are made only every ``ALIGNED_S`` seconds, at the same wall-clock moment on every
rank, so that the ranks' stalls overlap (one stall of the job, not one per rank), and at close. A job
with fewer collectives than the ring holds is recorded whole; a longer one keeps its first stretch,
a ring's worth every ``ALIGNED_S`` and its last ring's worth (``TORCH_FR_BUFFER_SIZE`` of a few
hundred keeps every read short and the record whole, at the price of a shorter history in PyTorch's
own dumps). Entries the ring overwrote between two reads are counted as lost, never
guessed; so is everything after ``max_bytes`` written.

A file line: ``{"restart", "attach", "t", "lost", "groups": [name, ...], "rows": [[group index,
sequence number, created (ns), on the training thread (0/1), name], ...]}``; point-to-point operations
(their sequence numbers are not shared across ranks) are left out.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stragglerwatch.runtime.log import Problems

#: The share of the wall clock the reads may take (their cost is measured, not assumed).
BUDGET = 0.01
#: What one rank's file may grow to; then reading stops, and that is said once.
MAX_BYTES = 16 << 20
#: A read holds the interpreter lock throughout (the dump and its unpickling are single C calls), which
#: stalls the training thread and, through the next collective, every rank: once one read takes longer
#: than this, reads are made only at the aligned times below, and at close.
MAX_READ_S = 0.005
#: Once reads are costly, one every this many seconds of the wall clock, at the same moment on every
#: rank (a multiple of it since the epoch), so that the ranks' stalls overlap instead of adding up.
ALIGNED_S = 300.0


def _dump() -> bytes | None:
    """Torch's Flight Recorder pickle, without stacks; None where this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    return _dump_fr_trace(includeStackTraces=False)


class CollectiveLog:
    """Copies new Flight Recorder entries into ``path``: a writer observer (``__call__``), paced by the
    budget, and :meth:`read` at close. Never raises; a failure is one line and a counter."""

    def __init__(self, path: Path, training_thread: Callable[[], int], ids: tuple[int, int] = (0, 0),
                 budget: float = BUDGET, max_bytes: int = MAX_BYTES, problems: Problems | None = None,
                 dump: Callable[[], bytes | None] = _dump):  # fmt: skip
        self.path, self._thread, self._ids = path, training_thread, ids
        self._budget, self._max_bytes, self._dump = budget, max_bytes, dump
        self.problems = problems or Problems()
        self.cursor = -1  # the last record_id copied
        self._next_at = 0.0
        self._aligned_at = 0.0
        self.rows = self.lost = self.reads = self.failures = 0
        self.seconds = 0.0  # spent reading, in all
        self.longest = 0.0
        self.written = 0
        self.stopped: str | None = None  # why reading stopped, once it has
        self.deferred = False  # reads only at aligned times: one took longer than MAX_READ_S
        self._aligned_s = ALIGNED_S

    def __call__(self, records: list[Any]) -> None:
        if self.stopped is not None:
            return
        if self.deferred:
            if time.time() >= self._aligned_at:
                self.read()
        elif time.monotonic() >= self._next_at:
            self.read()

    def read(self) -> int:
        """Copy the entries recorded since the last read; the number copied."""
        if self.stopped is not None:
            return 0
        t0 = time.perf_counter()
        try:
            raw = self._dump()
            if raw is None:
                self.stopped = "this torch has no Flight Recorder"
                return 0
            line = self._line(pickle.loads(raw, fix_imports=False).get("entries") or [])
            if line is not None:
                self._append(line)
        except Exception as exc:
            self.failures += 1
            self.problems.report("collectives", "reading PyTorch's record of the collectives failed "
                                 f"({type(exc).__name__}: {exc}); training continues, the arrival order may be "
                                 "partial")  # fmt: skip
            return 0
        finally:
            spent = time.perf_counter() - t0
            self.seconds += spent
            self.reads += 1
            self.longest = max(self.longest, spent)
            self._next_at = time.monotonic() + spent / self._budget
            self.deferred = self.deferred or spent > MAX_READ_S
            self._aligned_at = (time.time() // self._aligned_s + 1) * self._aligned_s
        return len(line["rows"]) if line is not None else 0

    def _line(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        new = [e for e in entries if isinstance(e.get("record_id"), int) and e["record_id"] > self.cursor]
        if not new:
            return None
        first = min(e["record_id"] for e in new)
        lost = max(0, first - self.cursor - 1) if self.cursor >= 0 else 0
        self.cursor = max(e["record_id"] for e in new)
        tid = str(self._thread())
        groups: dict[str, int] = {}
        rows = []
        for e in sorted(new, key=lambda e: e["record_id"]):
            if e.get("is_p2p"):
                continue
            pg = e.get("process_group")
            name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id"))
            created = e.get("time_created_ns")
            seq = e.get("collective_seq_id")
            if not isinstance(created, int) or not isinstance(seq, int):
                continue
            op = str(e.get("profiling_name") or "").split(":")[-1]
            rows.append([groups.setdefault(name, len(groups)), seq, created, int(str(e.get("thread_id")) == tid), op])
        self.rows += len(rows)
        self.lost += lost
        restart, attach = self._ids
        return {"restart": restart, "attach": attach, "t": time.time(), "lost": lost, "groups": list(groups),
                "rows": rows}  # fmt: skip

    def _append(self, line: dict[str, Any]) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        if self.written + len(data) > self._max_bytes:
            self.stopped = f"the file reached {self._max_bytes >> 20} MiB"
            self.problems.report("collectives", f"arrival order: {self.path.name} {self.stopped}; no more is recorded")
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self.written += len(data)

    def stats(self) -> dict[str, Any]:
        return {"rows": self.rows, "lost": self.lost, "reads": self.reads, "seconds": round(self.seconds, 4),
                "longest_read_s": round(self.longest, 4), "deferred_to_close": self.deferred,
                "failures": self.failures, "stopped": self.stopped}  # fmt: skip
