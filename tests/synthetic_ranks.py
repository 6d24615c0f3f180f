"""Ranks that serve made-up step timings through the real exporter: the lean-mode side of the
real-Prometheus tests, next to the real 4-rank job of ``conftest.live_prometheus``.

``SyntheticJob(run_id, ranks, base_port, sd_dir, lean=True)`` starts one :class:`Exporter` per rank
(``RankCollector`` and ``ContextCollector``, as ``attach`` wires them) and a thread that plays the
job: 20 steps a second; rank ``slow`` 30 ms a step slower in forward and backward, the others
waiting for it in the gradient all-reduce (busy time 65 ms against 35 ms); every rank records its
work (tokens, a different rank the heaviest each step: :func:`tokens`); once :meth:`SyntheticJob.arm`
is called, ``stall_at_s`` later and every ``stall_every_s`` after that, all ranks stop for ``stall_s``
(armed only once Prometheus has scraped the ranks: a stall counted before their first scrape shows
no increase), and after ``watchdog_s`` of it every rank's watchdog counts a
stall: the slow rank's in ``backward`` (the culprit), the others' in ``allreduce_wait`` (its
victims), the same story as the real job's. The host context is this process's, sampled for real
once a second.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.record.schema import StepRecord
from stragglerwatch.runtime.context.ctxmetrics import ContextCollector
from stragglerwatch.runtime.context.sampler import ContextSampler
from stragglerwatch.runtime.output.exporter import Exporter, RankCollector, RankMetrics

#: Seconds a healthy rank spends per step in each phase (the slow rank adds to forward and backward).
BASE = {"data_wait": 0.001, "forward": 0.010, "backward": 0.020, "allreduce_wait": 0.005, "collective_wait": 0.001,
        "eval": 0.0, "optimizer": 0.003, "other": 0.001}  # fmt: skip


def step_record(rank: int, step: int, end: float, work: float | None = None, **phases: float) -> StepRecord:
    """One made-up step of ``rank`` ending at ``end`` (Unix seconds): ``BASE`` with ``phases`` added;
    ``work``: the tokens of the step (None: not measured)."""
    s = {p: v + phases.get(p, 0.0) for p, v in BASE.items()}
    total, comm = sum(s.values()), s["allreduce_wait"] + s["collective_wait"]
    measured = {} if work is None else {"work": float(work), "work_unit": "tokens"}
    return StepRecord(rank, step, end - total, *(s[p] for p in BASE), total, total - comm - s["eval"], comm, 1,
                      "host", [], [], [], **measured)  # fmt: skip


def tokens(rank: int, step: int) -> float:
    """The made-up work of a rank's step: 4096 tokens, up to 1536 more on a rank that changes every
    step (an imbalance that moves from rank to rank, and averages out over a scrape interval)."""
    return 4096.0 + 512.0 * ((step + rank) % 4)


@dataclass
class Watchdog:
    """What the exporter reads of a rank's watchdog."""

    timeouts_by_phase: dict[str, int] = field(default_factory=dict)
    stalled: bool = False


class SyntheticJob:
    def __init__(self, run_id: str, ranks: int, base_port: int, sd_dir: Path, *, lean: bool = True, slow: int = 2,
                 stall_every_s: float = 60.0, stall_at_s: float = 3.0, stall_s: float = 6.0,
                 watchdog_s: float = 2.0):  # fmt: skip
        self.run_id, self.slow, self.step = run_id, slow, 0
        self.stall_at_s, self.stall_every_s = stall_at_s, stall_every_s
        self.stall_s, self.watchdog_s = stall_s, watchdog_s
        self.sampler = ContextSampler(None, 0, open_gpu_sampler=lambda: None)
        self.sampler.sample_once()
        host = socket.gethostname()
        self.metrics = [RankMetrics() for _ in range(ranks)]
        self.watchdogs = [Watchdog() for _ in range(ranks)]
        self.exporters = []
        for rank in range(ranks):
            info = RunInfo(run_id, sd_dir, rank, rank, ranks, host)
            exporter = Exporter(RankCollector(self.metrics[rank], info, self.watchdogs[rank], lean=lean),
                                base_port + rank, "127.0.0.1", sd_dir)  # fmt: skip
            exporter.registry.register(ContextCollector(self.sampler, run_id, rank, host, lean=lean))
            self.exporters.append(exporter)
        self._stop, self._armed = threading.Event(), threading.Event()
        self._armed_at = 0.0
        self._thread = threading.Thread(target=self._play, name="synthetic-job", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Start the stall clock: the first stall comes ``stall_at_s`` from now."""
        self._armed_at = time.monotonic()
        self._armed.set()

    def _play(self) -> None:
        last_sample = time.monotonic()
        stalls_counted = 0
        after_stall = False
        while not self._stop.wait(0.05):
            now = time.monotonic()
            if now - last_sample >= 1.0:
                self.sampler.sample_once()
                last_sample = now
            armed = self._armed.is_set()  # before _armed_at is read: arm() sets it first
            k, into = divmod(now - self._armed_at - self.stall_at_s, self.stall_every_s)
            if armed and k >= 0 and into < self.stall_s:  # stalled: no steps; the watchdogs fire after watchdog_s
                if into >= self.watchdog_s and stalls_counted <= k:
                    stalls_counted = int(k) + 1
                    for rank, wd in enumerate(self.watchdogs):
                        phase = "backward" if rank == self.slow else "allreduce_wait"
                        wd.timeouts_by_phase[phase] = wd.timeouts_by_phase.get(phase, 0) + 1
                        wd.stalled = True
                after_stall = True
                continue
            self.step += 1
            end = time.time()
            for rank, metrics in enumerate(self.metrics):
                extra = {"forward": 0.010, "backward": 0.020} if rank == self.slow else {"allreduce_wait": 0.030}
                if after_stall:  # the stuck step: the culprit outside a collective, the victims waiting in one
                    extra = {**extra, ("other" if rank == self.slow else "allreduce_wait"): self.stall_s}
                metrics.observe([step_record(rank, self.step, end, tokens(rank, self.step), **extra)])
                self.watchdogs[rank].stalled = False
            after_stall = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for exporter in self.exporters:
            exporter.close()
