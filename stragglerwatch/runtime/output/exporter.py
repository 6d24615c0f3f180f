"""Per-rank Prometheus exporter: ``/metrics`` on ``port + local_rank``, values taken at scrape time.

Design (client_python's custom-collector pattern): the training thread does nothing
for the exporter. The event-log thread hands each batch of finished step records
to :meth:`RankMetrics.observe`, which folds them into histogram buckets under a
lock; a scrape (a thread of our HTTP server) takes a snapshot under the same
lock and builds the metric families from it. The registry is our own
``CollectorRegistry``: nothing leaks into the user's global registry. A port in
use, or any other failure, is one line in the ``stragglerwatch`` logger and a counter;
training goes on.

Series (labels ``run`` and ``rank`` on all of them):
``stragglerwatch_step_seconds``, ``stragglerwatch_busy_seconds`` and
``stragglerwatch_phase_seconds{phase}`` (histograms), ``stragglerwatch_steps_total``,
``stragglerwatch_last_step_timestamp_seconds``, ``stragglerwatch_watchdog_timeouts_total{phase}``,
``stragglerwatch_stalled``, ``stragglerwatch_exporter_errors_total``, the info metric
``stragglerwatch_rank_info{local_rank, host, pid}``, ``stragglerwatch_busy_unavailable{reason}``
(1 for each reason the rank's busy time cannot be measured; absent when it can); with a policy on,
``stragglerwatch_policy_actions_total{action}`` and, on rank 0, ``stragglerwatch_straggler_action{straggler_rank,
host, cause}`` (1 for each straggler acted on); and the work of the
steps: ``stragglerwatch_work_total{unit}`` (the sum of ``work`` over the recorded steps whose work
was measured; one series per unit seen, at most ``MAX_UNITS``; none before such a step) and
``stragglerwatch_work_steps_total`` (those steps). ``rate(work_total) / rate(work_steps_total)`` is
the work per step; ``rate(busy_seconds_sum) / rate(work_total)`` the busy seconds per unit of work,
which tells a straggler (slow for the same work) from load imbalance (given more work), exact
only while every step's work is measured: ``busy_seconds`` counts all steps (compare
``work_steps_total`` with ``steps_total``).

Modes (``attach(..., prometheus_mode=...)``, ``$STRAGGLERWATCH_PROMETHEUS_MODE``): ``full`` (the
default) exports the three timings as histograms (18 buckets, +Inf, sum, count: 21 series each,
168 for the phases); ``lean`` exports them as summaries without quantiles (``_sum`` and ``_count``
only, under the same names and labels) and the context collector keeps only the gauges the
dashboards read. Every shipped rule, panel and ``promsource`` query reads ``_sum``/``_count``,
never ``_bucket``, so they answer the same in both modes; a lean GPU rank whose work is measured
exports 50 to 57 series instead of 260, which is what a per-tenant series limit counts at 1,000 ranks.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from stragglerwatch.record.rundir import RunInfo, write_json_atomic
from stragglerwatch.record.schema import PHASES, StepRecord
from stragglerwatch.runtime.log import Problems

#: Upper bounds (seconds) for step and phase times: 1 ms to 10 minutes.
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Units of work exported per rank (``note_work`` takes any): the work of steps in further units is
#: not exported, so that a loop noting ever new units cannot grow the series without end.
MAX_UNITS = 4


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
        self.work_total: dict[str, float] = {}  # unit -> work of the steps measured in it
        self.work_steps = 0  # steps whose work was measured (and exported)
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
                self._work(r.work, r.work_unit)

    def _work(self, work: float, unit: str) -> None:
        if not unit or work != work or (unit not in self.work_total and len(self.work_total) >= MAX_UNITS):
            return
        self.work_total[unit] = self.work_total.get(unit, 0.0) + work
        self.work_steps += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "step": (self.step.cumulative(), self.step.sum),
                "busy": (self.busy.cumulative(), self.busy.sum),
                "phases": {p: (h.cumulative(), h.sum) for p, h in self.phases.items()},
                "steps_total": self.steps_total,
                "work_total": dict(self.work_total),
                "work_steps": self.work_steps,
                "last_step_end": self.last_step_end,
            }


class RankCollector(Collector):
    """Builds this rank's metric families at scrape time."""

    def __init__(
        self,
        metrics: RankMetrics,
        info: RunInfo,
        watchdog: Any = None,
        errors: Any = None,
        unavailable: Any = None,
        lean: bool = False,
        policy: Any = None,
    ):
        self.metrics = metrics
        self.info = info
        self.watchdog = watchdog
        self.errors = errors  # callable returning our error count
        self.unavailable = unavailable  # callable returning why busy time cannot be measured
        self.lean = lean  # summaries (sum, count) instead of histograms
        # with a policy on: callable returning (actions taken by kind, the straggler verdicts acted on)
        self.policy = policy
        self.labels = {"run": info.run_id, "rank": str(info.rank)}

    def _timing(self, name: str, doc: str, labels: list[str], rows: list[tuple[list[str], Any]]) -> Any:
        """One family of step timings: a histogram, or in lean mode a summary (the same ``_sum`` and
        ``_count`` series, no buckets)."""
        if self.lean:
            s = SummaryMetricFamily(name, doc, labels=labels)
            for values, (buckets, total) in rows:
                s.add_metric(values, count_value=buckets[-1][1], sum_value=total)
            return s
        h = HistogramMetricFamily(name, doc, labels=labels)
        for values, (buckets, total) in rows:
            h.add_metric(values, buckets=buckets, sum_value=total)
        return h

    def collect(self) -> Iterator[Any]:
        snap = self.metrics.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        yield self._timing("stragglerwatch_step_seconds", "Optimizer step time (end of one step to the end of the "
                           "next)", names, [(values, snap["step"])])  # fmt: skip
        yield self._timing("stragglerwatch_busy_seconds", "Step time minus exposed communication and evaluation: "
                           "the straggler signal", names, [(values, snap["busy"])])  # fmt: skip
        phases = [([*values, phase], hist) for phase, hist in snap["phases"].items()]
        yield self._timing("stragglerwatch_phase_seconds", "Time per step in each phase", [*names, "phase"], phases)
        c = CounterMetricFamily("stragglerwatch_steps", "Optimizer steps recorded", labels=names)
        c.add_metric(values, snap["steps_total"])
        yield c
        w = CounterMetricFamily("stragglerwatch_work", "Work of the recorded steps whose work was measured "
                                "(elements, tokens or the unit the loop noted)", labels=[*names, "unit"])  # fmt: skip
        for unit, total in sorted(snap["work_total"].items()):
            w.add_metric([*values, unit], total)
        yield w
        ws = CounterMetricFamily("stragglerwatch_work_steps", "Recorded steps whose work was measured", labels=names)
        ws.add_metric(values, snap["work_steps"])
        yield ws
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
        if self.policy is not None:
            yield from self._policy(names, values)
        i = InfoMetricFamily("stragglerwatch_rank", "Where this rank runs", labels=names)
        i.add_metric(values, {"local_rank": str(self.info.local_rank), "host": self.info.host, "pid": str(os.getpid())})
        yield i


    def _policy(self, names: list[str], values: list[str]) -> Iterator[Any]:
        """With ``on_hang`` or ``on_straggler`` on: the actions taken, and on rank 0 a series per straggler
        acted on, for alerting to route (the shipped rule ``StragglerAction``)."""
        taken, acted = self.policy()
        a = CounterMetricFamily("stragglerwatch_policy_actions", "Actions of the policies (on_hang, on_straggler)",
                                labels=[*names, "action"])  # fmt: skip
        for action in ("abort", "straggler"):
            a.add_metric([*values, action], float(taken.get(action, 0)))
        yield a
        if acted:
            g = GaugeMetricFamily("stragglerwatch_straggler_action", "1 for each straggler the policy acted on "
                                  "(rank 0)", labels=[*names, "straggler_rank", "host", "cause"])  # fmt: skip
            for v in acted:
                g.add_metric([*values, str(v["rank"]), str(v.get("host") or ""), str(v.get("cause") or "")], 1.0)
            yield g


def sd_file(sd_dir: Path, info: RunInfo) -> Path:
    return sd_dir / f"stragglerwatch-{info.run_id}-{info.rank:05d}.json"


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape (a scraper that hangs holds only its own); errors are counted, not printed."""

    daemon_threads = True
    failures = 0  # a connection that failed (reset, timed out): counted on the instance, never printed

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.failures += 1


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    timeout = 10  # seconds a connection may sit idle: a hung scraper frees its thread

    def log_message(self, *args: Any) -> None:  # no line on stderr per scrape
        pass


class Exporter:
    """The HTTP server of one rank and its file_sd target file.

    The server is ours (``wsgiref`` with a thread per request over client_python's WSGI app),
    not ``start_http_server``, whose return value changed across the prometheus-client
    versions we allow: every version with ``make_wsgi_app`` serves the same way, and
    ``close()`` can always stop it."""

    def __init__(
        self,
        collector: RankCollector,
        port: int,
        addr: str = "0.0.0.0",
        sd_dir: Path | None = None,
        problems: Problems | None = None,
    ):
        self.errors = 0
        self.server: Any = None
        self.port = port
        self.sd_path: Path | None = None
        self._problems = problems or Problems()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        info = collector.info
        try:
            server_class = _Server6 if ":" in addr else _Server
            self.server = make_server(addr, port, self._app(make_wsgi_app(self.registry)), server_class, _Handler)
            thread = threading.Thread(target=self.server.serve_forever, name=f"stragglerwatch-metrics-{info.rank}",
                                      daemon=True)  # fmt: skip
            thread.start()
        except Exception as exc:
            self.errors += 1
            self.server = None
            reason = getattr(exc, "strerror", None) or exc
            self._problems.report("exporter", f"cannot serve /metrics on {addr}:{port} ({reason}); "
                                  "training continues without the exporter")  # fmt: skip
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
        except OSError as exc:
            self.errors += 1
            self._problems.report("exporter-sd", f"cannot write the target file in {sd_dir}: {exc}")

    def _app(self, app: Any) -> Any:
        def guarded(environ: dict[str, Any], start_response: Any) -> Any:
            try:
                return app(environ, start_response)
            except Exception as exc:  # a collector of ours that failed: a 500, one line, a counter
                self.errors += 1
                self._problems.report("exporter-scrape", f"/metrics failed: {type(exc).__name__}: {exc}")
                start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
                return [b"stragglerwatch: metrics unavailable\n"]

        return guarded

    def close(self) -> None:
        if self.server is not None:
            try:
                self.server.shutdown()
                self.server.server_close()
            except Exception:
                pass
            self.server = None
        if self.sd_path is not None:
            try:
                self.sd_path.unlink()
            except OSError:
                pass
            self.sd_path = None
