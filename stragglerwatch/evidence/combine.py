"""Other evidence, put into a report: PyTorch's failure logs (:func:`add_pytorch_logs`), Flight Recorder
dumps (:func:`add_flight_recorder`: given ones, or those our watchdog wrote into the run dir), and one
hang verdict reconciled from every source (:func:`add_hang_verdict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stragglerwatch.evidence.torchlogs import LogParse

FR_DUMPS = "flightrec-*.pkl"  # the Flight Recorder dumps our watchdog writes at a stall


def add_pytorch_logs(report: dict[str, Any], parsed: LogParse) -> None:
    """Add what PyTorch's own messages say: ``log_events``, ``first_failure``, line counts."""
    report["log_events"] = [e.to_dict() for e in parsed.events]
    report["first_failure"] = parsed.first_failure()
    report["log_lines"] = parsed.lines
    report["log_skipped_lines"] = parsed.skipped


def add_flight_recorder(report: dict[str, Any], source: str | Path | None) -> None:
    """Add what Flight Recorder dumps say (``flight_recorder``): those under ``source`` (``--fr``),
    else those our watchdog wrote into the run dir at a stall. ValueError names a missing source."""
    from stragglerwatch.evidence.flightrec import analyze_dumps
    from stragglerwatch.evidence.frdumps import load_dumps

    run_dir = report.get("run_dir")
    if source is not None:
        dumps = load_dumps(source)
    elif run_dir and any(Path(run_dir).glob(FR_DUMPS)):
        dumps = load_dumps(run_dir, FR_DUMPS)
    else:
        return
    report["flight_recorder"] = analyze_dumps(dumps, report.get("world_size") or _world_from_logs(report) or None)


def _world_from_logs(report: dict[str, Any]) -> int:
    """Without a run dir, the ranks PyTorch's logs name tell the world size (at least): a rank that
    left no dump, and whose group lists no members (gloo), is then still known to exist."""
    ranks = [r for e in report.get("log_events") or [] for r in (e.get("rank"), e.get("peer_rank"),
             *(e.get("failed_ranks") or []), *(e.get("ranks") or [])) if isinstance(r, int)]  # fmt: skip
    return max(ranks) + 1 if ranks else 0


def add_hang_verdict(report: dict[str, Any]) -> None:
    """Reconcile the hang evidence of every source into ``hang_verdict`` (None: no source saw a hang)."""
    from stragglerwatch.evidence.hangverdict import reconcile

    verdict = reconcile(report.get("hangs") or [], report.get("flight_recorder"), report.get("first_failure"))
    if verdict is not None:
        report["hang_verdict"] = verdict
