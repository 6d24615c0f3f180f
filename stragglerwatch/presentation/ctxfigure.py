"""Plotly figure of one rank's host and GPU context against its peers' median over time. Pure;
shared by the dashboard (beside the rank's busy time) and the HTML report."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from stragglerwatch.presentation.figures import MAX_POINTS, empty

#: (column, title, scale) of the rows shown, where the run has them.
ROWS = (
    ("run_delay", "training thread waiting for a CPU (%)", 100.0),
    ("invol_switches", "involuntary context switches/s", 1.0),
    ("cpu_pressure", "CPU pressure (%)", 100.0),
    ("workers_invol_switches", "data-loader workers' involuntary switches/s", 1.0),
    ("sm_clock_mhz", "GPU SM clock (MHz)", 1.0),
    ("temperature_c", "GPU temperature (°C)", 1.0),
)
MAX_ROWS = 4


def _binned(frame: pd.DataFrame, column: str, edges: np.ndarray) -> np.ndarray:
    """Per time bin, the median of ``column`` over the rows in it."""
    idx = np.clip(np.searchsorted(edges, frame["time"].to_numpy(), side="right") - 1, 0, len(edges) - 2)
    return frame.groupby(idx)[column].median().reindex(range(len(edges) - 1)).to_numpy()


def context_figure(context: pd.DataFrame | None, rank: int | None,
                   spans: list[tuple[float, float]] | None = None) -> go.Figure:  # fmt: skip
    """``rank``'s context signals (one row each) and its peers' median; ``spans`` shaded (when it was slow)."""
    if context is None or context.empty or rank is None or rank not in set(context["rank"].tolist()):
        return empty("no host or GPU context recorded for this rank")
    mine, peers = context[context["rank"] == rank], context[context["rank"] != rank]
    rows = [r for r in ROWS if mine[r[0]].notna().any()][:MAX_ROWS]
    if not rows:
        return empty("no host or GPU context recorded for this rank")
    t0, t1 = float(context["time"].min()), float(context["time"].max())
    bins = max(1, min(MAX_POINTS, int(t1 - t0) + 1))
    edges = np.linspace(t0, t1 + 1e-6, bins + 1)
    x = [datetime.fromtimestamp(t, tz=timezone.utc) for t in (edges[:-1] + edges[1:]) / 2]
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[title for _, title, _ in rows])  # fmt: skip
    for i, (column, _, scale) in enumerate(rows, start=1):
        if not peers.empty and peers[column].notna().any():
            peer_med = peers.groupby("time")[column].median().reset_index()
            fig.add_scatter(x=x, y=_binned(peer_med, column, edges) * scale, row=i, col=1, name="peers median",
                            line={"color": "#1f77b4", "dash": "dot"}, showlegend=i == 1)  # fmt: skip
        fig.add_scatter(x=x, y=_binned(mine, column, edges) * scale, row=i, col=1, name=f"rank {rank}",
                        line={"color": "#d62728"}, showlegend=i == 1)  # fmt: skip
    for a, b in spans or []:
        fig.add_vrect(x0=datetime.fromtimestamp(a, tz=timezone.utc), x1=datetime.fromtimestamp(b, tz=timezone.utc),
                      fillcolor="rgba(214,39,40,0.08)", line_width=0, row="all", col=1)  # fmt: skip
    fig.update_layout(title=f"Host and GPU context: rank {rank} vs its peers", margin={"t": 70})
    fig.update_annotations(font_size=12)
    return fig
