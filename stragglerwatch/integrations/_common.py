"""What the framework integrations share: finding the framework's objects, and the figures they log.

Design: an integration attaches at the framework's "training starts" hook (the model is wrapped
by then), times the framework's batch fetch as data wait where it has a place for that, and
closes at the end of training. The figures it may log to the framework's loggers come from the
same places as everywhere else: the rank's own latest steps (:meth:`Watch.latest`) and, at the
end, :func:`~stragglerwatch.analysis.report.analyze_run` on the run dir (pure detection).

The end-of-fit verdict costs the job nothing (:class:`LateVerdict`): no barrier, no collective;
rank 0 computes it on a thread of its own once every rank's log is complete, while the job goes
on to whatever follows the fit.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stragglerwatch.runtime.log import Problems


def find_caller_self(cls: type, depth: int = 12) -> Any:
    """The ``self`` of the nearest calling frame that is a method of ``cls`` (a framework's
    trainer calling its callbacks), or None. Looked up once, at the start of training."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, cls):
            return obj
        frame = frame.f_back
    return None


def verdict_metrics(run_dir: Path | None, problems: Problems) -> dict[str, float]:
    """The job's verdict as flat metrics for a framework's loggers: how many consistently slow
    ranks, the worst one's rank and time lost, the job's slowdown. Empty when the run cannot be
    analysed, or when busy time is unavailable (nothing is guessed)."""
    if run_dir is None:
        return {}
    try:
        from stragglerwatch.analysis.report import analyze_run

        report = analyze_run(run_dir).report
    except Exception as exc:
        problems.report("verdict", f"cannot analyse {run_dir} for the trainer's loggers ({type(exc).__name__}: {exc})")
        return {}
    if report["busy_unavailable"] or report["job_slowdown"] is None:
        return {}
    out = {"stragglerwatch/stragglers": float(len(report["stragglers"])),
           "stragglerwatch/job_slowdown": float(report["job_slowdown"]),
           "stragglerwatch/lost_seconds": float(report["lost_seconds"] or 0.0)}  # fmt: skip
    if report["stragglers"]:
        worst = report["stragglers"][0]
        out["stragglerwatch/straggler_rank"] = float(worst["rank"])
        out["stragglerwatch/straggler_lost_seconds"] = float(worst["lost_seconds"] or 0.0)
    return out


#: The most the end-of-fit verdict waits for every rank's log to be complete.
LOGS_WAIT_S = 60.0
#: The most the interpreter's exit waits for a verdict still being computed.
EXIT_WAIT_S = 30.0


def logs_complete(run_dir: Path, world_size: int) -> bool:
    """Every rank has closed its step log (compacted to Parquet, no stream left)."""
    for rank in range(world_size):
        stem = f"rank-{rank:05d}"
        if any(run_dir.glob(f"{stem}*.arrows")) or not any(run_dir.glob(f"{stem}*.parquet")):
            return False
    return True


class LateVerdict:
    """The job's verdict for a framework's loggers, computed off the critical path.

    ``start`` (rank 0, at the end of fit, after its own ``close()``) runs a daemon thread that waits
    until every rank's log is complete (at most ``LOGS_WAIT_S``; then it analyses what is there),
    analyses the run and hands the metrics to ``log``. Nothing of the job waits for it; ``join``
    waits at most ``timeout_s`` for it (and the interpreter's exit at most ``EXIT_WAIT_S``, so a
    script that ends right after fit still gets its verdict logged)."""

    def __init__(self, run_dir: Path | None, world_size: int, problems: Any, log: Callable[[dict[str, float]], None]):
        self.run_dir, self.world_size, self.problems, self.log = run_dir, world_size, problems, log
        self.metrics: dict[str, float] | None = None
        self._thread = threading.Thread(target=self._run, name="stragglerwatch-verdict", daemon=True)

    def start(self) -> LateVerdict:
        self._thread.start()
        # at exit, waited for before concurrent.futures refuses new work (the analysis uses a thread
        # pool): threading's own exit hooks run first, the latest registered first
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise AttributeError
            register(self.join, EXIT_WAIT_S)
        except Exception:
            atexit.register(self.join, EXIT_WAIT_S)
        return self

    def _run(self) -> None:
        if self.run_dir is None:
            return
        deadline = time.monotonic() + LOGS_WAIT_S
        while not logs_complete(self.run_dir, self.world_size) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.metrics = verdict_metrics(self.run_dir, self.problems)
        if self.metrics:
            try:
                self.log(self.metrics)
            except Exception as exc:
                self.problems.report("verdict", f"cannot log the verdict to the trainer ({type(exc).__name__}: {exc})")

    def join(self, timeout_s: float = EXIT_WAIT_S) -> bool:
        """Wait at most ``timeout_s`` for the verdict; True once it has been logged (or found empty)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return self._thread.ident is not None and not self._thread.is_alive()
