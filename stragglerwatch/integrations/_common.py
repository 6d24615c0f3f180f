"""What the framework integrations share: finding the framework's objects, and the figures they log.

Design: an integration attaches at the framework's "training starts" hook (the model is wrapped
by then), times the framework's batch fetch as data wait where it has a place for that, and
closes at the end of training. The figures it may log to the framework's loggers come from the
same places as everywhere else: the rank's own latest steps (:meth:`Watch.latest`) and, at the
end, :func:`~stragglerwatch.analysis.analyze_run` on the run dir (pure detection).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..log import Problems


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
        from ..analysis import analyze_run

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
