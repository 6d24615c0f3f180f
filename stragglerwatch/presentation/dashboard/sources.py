"""Data sources of the dashboard, apart from its figures.

Design: a source keeps the latest :class:`Snapshot` (report, matrix, verdict,
events) and refreshes it on a background thread, so that a browser callback
never reads files or queries Prometheus: it only builds figures from the
snapshot it gets. The run dir or Prometheus URL is fixed when the source is
made; nothing a browser sends can point it elsewhere.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stragglerwatch.analysis.detect import detect, to_matrix
from stragglerwatch.analysis.live import LiveRun
from stragglerwatch.analysis.report import Analysis, RankFigures, build_report, empty_analysis
from stragglerwatch.record.events import read_events
from stragglerwatch.record.promsource import frame_from_prometheus, unavailable_from_prometheus


@dataclass
class Snapshot:
    analysis: Analysis
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # why the latest refresh failed (the previous data is kept)
    refreshed_at: float = 0.0
    version: int = 0  # increases when the data changed

    @property
    def empty(self) -> bool:
        return self.analysis.report["steps"] == 0


class _Source:
    label = "source"

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self._snapshot = Snapshot(empty_analysis())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def refresh(self) -> None:
        """Load once (the background thread calls this every ``interval_s``)."""
        try:
            analysis, events, changed = self._load()
            error = None
        except Exception as exc:  # shown on the page; the previous data stays
            analysis, events, changed, error = None, None, False, f"{type(exc).__name__}: {exc}"
        with self._lock:
            old = self._snapshot
            if analysis is None:
                self._snapshot = Snapshot(old.analysis, old.events, error, time.time(), old.version)
            else:
                version = old.version + 1 if changed else old.version
                self._snapshot = Snapshot(analysis, events or [], error, time.time(), version)

    def _load(self) -> tuple[Analysis | None, list[dict[str, Any]] | None, bool]:
        raise NotImplementedError

    def start(self) -> _Source:
        if self._thread is None:
            self.refresh()
            self._thread = threading.Thread(target=self._run, name="stragglerwatch-dashboard-source", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._wait_s()):
            self.refresh()

    def _wait_s(self) -> float:
        """Seconds until the next poll."""
        return self.interval_s

    def stop(self) -> None:
        self._stop.set()


#: A followed run is analysed whole once nothing new has come for this long (and three of its usual gaps between
#: flushes): a job between two flushes, polled every half second, would otherwise be analysed whole after each.
SETTLE_AFTER_S = 2.0
#: Polls in a row, a fifth of the period apart, after a poll that found part of a flush.
EARLY_POLLS = 3


class RunDirSource(_Source):
    """A run dir, followed as the job writes it: each poll reads only the new records and moves the
    analysis on from where it was (``live.LiveRun``); once the run stops growing, the analysis is
    ``analyze``'s. With ``window``, of its last ``window`` steps only (``live.LiveRun``'s window: memory bounded
    whatever the run's length)."""

    def __init__(self, run_dir: str | Path, interval_s: float = 0.25, settle_after_s: float = SETTLE_AFTER_S,
                 window: int | None = None):  # fmt: skip
        super().__init__(interval_s)
        self.run_dir = Path(run_dir)
        self.live = LiveRun(self.run_dir, settle_after_s=settle_after_s, window=window)
        self._early = 0  # polls in a row that found rows held back
        held = f" (its last {self.live.window:,} steps)" if self.live.window is not None else ""
        self.label = f"{self.run_dir}{held}"

    def _wait_s(self) -> float:
        """A poll that found part of a flush (the ranks write it one after another; ``LiveRun`` holds its rows
        back) polls again soon, for the rest: :data:`EARLY_POLLS` times at most, then at its period (a rank that
        stopped writing holds rows back at every flush, and each poll looks at every log)."""
        return self.interval_s / 5 if 0 < self._early <= EARLY_POLLS else self.interval_s

    def _load(self) -> tuple[Analysis | None, list[dict[str, Any]] | None, bool]:
        changed = self.live.update()
        self._early = self._early + 1 if self.live.pending is not None else 0
        if not changed:
            return None, None, False
        events, _ = read_events(self.run_dir)
        return self.live.analysis, events, True


class PrometheusSource(_Source):
    """A live Prometheus: per-rank means over ``window`` at ``step_seconds`` resolution."""

    def __init__(self, url: str, run: str, minutes: float = 30.0, window: str = "1m", step_seconds: float = 15.0,
                 interval_s: float = 5.0):  # fmt: skip
        super().__init__(interval_s)
        self.url, self.run, self.minutes, self.window, self.step_seconds = url, run, minutes, window, step_seconds
        self.label = f"{url} (run {run})"

    def _load(self) -> tuple[Analysis | None, list[dict[str, Any]] | None, bool]:
        frame = frame_from_prometheus(self.url, self.run, minutes=self.minutes, window=self.window,
                                      step_seconds=self.step_seconds)  # fmt: skip
        if frame.empty:
            return empty_analysis(), [], True
        mat = to_matrix(frame)
        verdict = detect(mat)
        rank_meta = unavailable_from_prometheus(self.url, self.run)
        run_meta = {"run_id": self.run, "world_size": len(mat.ranks)}
        report = build_report(RankFigures.of(mat, verdict), verdict, run_meta, rank_meta).to_dict()
        return Analysis(report, mat, verdict), [], True
