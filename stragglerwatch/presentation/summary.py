"""Per-rank summaries of a loaded run, and their text rendering. Pure: frames in, frames/text out."""

from __future__ import annotations

import pandas as pd

from stragglerwatch.record.schema import PHASE_COLUMNS

_PHASE_MS = tuple(c.replace("_s", "_ms") for c in PHASE_COLUMNS)
SUMMARY_COLUMNS = ("steps", "step_ms", "busy_ms", "comm_wait_ms", *_PHASE_MS, "busy_vs_peers")


def rank_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per rank: step count, median step and busy time and phase times (ms),
    and ``busy_vs_peers``: the rank's median busy time over the median of the other
    ranks' medians (1.0 = like its peers; the straggler stands out above 1)."""
    if frame.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS), index=pd.Index([], name="rank"))
    by_rank = frame.groupby("rank")
    med = by_rank[["step_s", "busy_s", "comm_wait_s", *PHASE_COLUMNS]].median() * 1000.0
    med.columns = [c.replace("_s", "_ms") for c in med.columns]
    med.insert(0, "steps", by_rank.size())
    busy = med["busy_ms"]
    ratios = []
    for rank in med.index:
        peers = busy.drop(rank)
        ref = peers.median() if len(peers) else busy[rank]
        ratios.append(busy[rank] / ref if ref > 0 else float("nan"))
    med["busy_vs_peers"] = ratios
    return med[list(SUMMARY_COLUMNS)]


def render_summary(summary: pd.DataFrame, world_size: int) -> str:
    """The per-rank table for a terminal (fits 80 columns up to ~6-digit ms values)."""
    if summary.empty:
        return "no steps recorded yet"
    steps = int(summary["steps"].max())
    lines = [
        f"{len(summary)} of {world_size} ranks, {steps} steps; medians in ms; "
        "busy = step - exposed communication - eval",
        f"{'rank':>5} {'steps':>6} {'step':>7} {'busy':>7} {'data':>6} {'fwd':>6} {'bwd':>6} "
        f"{'comm':>7} {'opt':>5} {'other':>6} {'vs peers':>8}",
    ]
    top = summary["busy_vs_peers"].idxmax()
    for rank, r in summary.iterrows():
        mark = "  <- slowest" if rank == top and len(summary) > 1 and r["busy_vs_peers"] > 1.05 else ""
        lines.append(
            f"{rank:>5} {int(r['steps']):>6} {r['step_ms']:>7.1f} {r['busy_ms']:>7.1f} {r['data_wait_ms']:>6.1f} "
            f"{r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} {r['comm_wait_ms']:>7.1f} "
            f"{r['optimizer_ms']:>5.1f} {r['other_ms']:>6.1f} {r['busy_vs_peers']:>7.2f}x{mark}"
        )
    return "\n".join(lines)
