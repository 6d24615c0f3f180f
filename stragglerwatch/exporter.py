"""Per-rank Prometheus exporter: ``/metrics`` on ``port + local_rank``, values taken at scrape time.

Design (client_python's custom-collector pattern): the training thread does nothing
for the exporter. The event-log thread hands each batch of finished step records
to :meth:`RankMetrics.observe`, which folds them into histogram buckets under a
lock; a scrape (the HTTP server's own thread) takes a snapshot under the same
lock and builds the metric families from it. The registry is our own
``CollectorRegistry``: nothing leaks into the user's global registry. A port in
use, or any other failure, is one warning and a counter; training goes on.

Series (labels ``run`` and ``rank`` on all of them):
``stragglerwatch_step_seconds``, ``stragglerwatch_busy_seconds`` and
``stragglerwatch_phase_seconds{phase}`` (histograms), ``stragglerwatch_steps_total``,
``stragglerwatch_last_step_timestamp_seconds``, ``stragglerwatch_watchdog_timeouts_total{phase}``,
``stragglerwatch_stalled``, ``stragglerwatch_exporter_errors_total``, the info metric
``stragglerwatch_rank_info{local_rank, host, pid}``, and ``stragglerwatch_busy_unavailable{reason}``
(1 for each reason the rank's busy time cannot be measured; absent when it can).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from .runinfo import RunInfo, write_json_atomic
from .schema import PHASES, StepRecord

#: Upper bounds (seconds) for step and phase times: 1 ms to 10 minutes.
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _Hist:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(BUCKETS) and v > BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*(str(b) for b in BUCKETS), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class RankMetrics:
    """One rank's step aggregates, fed by the event-log thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step = _Hist()
        self.busy = _Hist()
        self.phases = {p: _Hist() for p in PHASES}
        self.steps_total = 0
        self.last_step_end: float | None = None

    def observe(self, records: list[StepRecord]) -> None:
        with self._lock:
            for r in records:
                self.step.observe(r.step_s)
                self.busy.observe(r.busy_s)
                for p in PHASES:
                    self.phases[p].observe(getattr(r, f"{p}_s"))
                self.steps_total += 1
                self.last_step_end = r.start_time + r.step_s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "step": (self.step.cumulative(), self.step.sum),
                "busy": (self.busy.cumulative(), self.busy.sum),
                "phases": {p: (h.cumulative(), h.sum) for p, h in self.phases.items()},
                "steps_total": self.steps_total,
                "last_step_end": self.last_step_end,
            }


class RankCollector(Collector):
    """Builds this rank's metric families at scrape time."""

    def __init__(
        self, metrics: RankMetrics, info: RunInfo, watchdog: Any = None, errors: Any = None, unavailable: Any = None
    ):
        self.metrics = metrics
        self.info = info
        self.watchdog = watchdog
        self.errors = errors  # callable returning our error count
        self.unavailable = unavailable  # callable returning why busy time cannot be measured
        self.labels = {"run": info.run_id, "rank": str(info.rank)}

    def collect(self) -> Iterator[Any]:
        snap = self.metrics.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        for name, key, doc in (
            ("stragglerwatch_step_seconds", "step", "Optimizer step time (end of one step to the end of the next)"),
            (
                "stragglerwatch_busy_seconds",
                "busy",
                "Step time minus exposed communication and evaluation: the straggler signal",
            ),
        ):
            h = HistogramMetricFamily(name, doc, labels=names)
            h.add_metric(values, buckets=snap[key][0], sum_value=snap[key][1])
            yield h
        ph = HistogramMetricFamily(
            "stragglerwatch_phase_seconds", "Time per step in each phase", labels=[*names, "phase"]
        )
        for phase, (buckets, total) in snap["phases"].items():
            ph.add_metric([*values, phase], buckets=buckets, sum_value=total)
        yield ph
        c = CounterMetricFamily("stragglerwatch_steps", "Optimizer steps recorded", labels=names)
        c.add_metric(values, snap["steps_total"])
        yield c
        g = GaugeMetricFamily("stragglerwatch_last_step_timestamp_seconds", "When the last step ended", labels=names)
        if snap["last_step_end"] is not None:
            g.add_metric(values, snap["last_step_end"])
        yield g
        wd = self.watchdog
        t = CounterMetricFamily(
            "stragglerwatch_watchdog_timeouts", "Stalls noticed by the watchdog", labels=[*names, "phase"]
        )
        counts = wd.timeouts_by_phase if wd else {}
        for phase in PHASES:  # every phase from the start: a first stall then shows as 0 -> 1
            t.add_metric([*values, phase], counts.get(phase, 0))
        yield t
        s = GaugeMetricFamily("stragglerwatch_stalled", "1 while the watchdog sees this rank stalled", labels=names)
        s.add_metric(values, 1.0 if wd is not None and wd.stalled else 0.0)
        yield s
        e = CounterMetricFamily("stragglerwatch_exporter_errors", "Failures of stragglerwatch itself", labels=names)
        e.add_metric(values, float(self.errors() if self.errors else 0))
        yield e
        reasons = self.unavailable() if self.unavailable else []
        if reasons:
            doc = "Why this rank's busy time cannot be measured"
            u = GaugeMetricFamily("stragglerwatch_busy_unavailable", doc, labels=[*names, "reason"])
            for reason in reasons:
                u.add_metric([*values, reason], 1.0)
            yield u
        i = InfoMetricFamily("stragglerwatch_rank", "Where this rank runs", labels=names)
        i.add_metric(values, {"local_rank": str(self.info.local_rank), "host": self.info.host, "pid": str(os.getpid())})
        yield i


def sd_file(sd_dir: Path, info: RunInfo) -> Path:
    return sd_dir / f"stragglerwatch-{info.run_id}-{info.rank:05d}.json"


class Exporter:
    """The HTTP server of one rank and its file_sd target file."""

    def __init__(self, collector: RankCollector, port: int, addr: str = "0.0.0.0", sd_dir: Path | None = None):
        self.errors = 0
        self.server: Any = None
        self.port = port
        self.sd_path: Path | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        info = collector.info
        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            self.errors += 1
            warnings.warn(
                f"stragglerwatch: cannot serve /metrics on {addr}:{port} ({exc.strerror or exc}); "
                "training continues without the exporter",
                stacklevel=3,
            )
            return
        host = info.host if addr in ("", "0.0.0.0", "::") else addr
        target = [
            {"targets": [f"{host}:{port}"], "labels": {"run": info.run_id, "rank": str(info.rank), "host": info.host}}
        ]
        try:
            sd_dir = sd_dir or info.run_dir
            sd_dir.mkdir(parents=True, exist_ok=True)
            self.sd_path = sd_file(sd_dir, info)
            write_json_atomic(self.sd_path, target)
        except OSError:
            self.errors += 1

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.sd_path is not None:
            try:
                self.sd_path.unlink()
            except OSError:
                pass
            self.sd_path = None
