"""``stragglerwatch summary``: the analysis report's per-rank table alone, every rank of it. Its figures are the
report's (``analyze``'s, the dashboard's), under the report's names. Pure: report in, text/dict out."""

from __future__ import annotations

from typing import Any

from stragglerwatch.presentation.render import rank_table


def summary_dict(report: dict[str, Any]) -> dict[str, Any]:
    """``summary --format json``: the run's size and the report's ``ranks`` rows."""
    return {"run_id": report.get("run_id"), "world_size": report["world_size"], "ranks_seen": report["ranks_seen"],
            "steps": report["steps"], "ranks": report["ranks"]}  # fmt: skip


def render_summary(report: dict[str, Any]) -> str:
    """The per-rank table for a terminal, every rank (80 columns up to ~6-digit ms values)."""
    head = f"run {report.get('run_id') or '?'}: {report['ranks_seen']} of {report['world_size']} ranks, " \
           f"{report['steps']} steps"
    return "\n".join([head, *rank_table(report, limit=None)])
