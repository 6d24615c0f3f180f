"""The Dash app: layout, component ids and one refresh callback over a source's snapshot.

Design: ``render(snapshot, rank)`` is a pure function from a snapshot to every
component's content (the callback only calls it), so it is tested and
benchmarked without a browser. Figures carry a ``uirevision`` that stays the
same for a run, so a refresh keeps the user's zoom; the rank selection is a
component value, which a refresh never resets.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, dash_table, dcc, html, no_update

from .. import figures
from ..ctxfigure import context_figure
from ..render import verdict_lines
from .sources import Snapshot

BANNER = "sw-banner"
STATUS = "sw-status"
HEATMAP = "sw-heatmap"
BREAKDOWN = "sw-breakdown"
RANK = "sw-rank"
BAND = "sw-band"
CONTEXT = "sw-context"
EVENTS = "sw-events"
TABLE = "sw-table"
TICK = "sw-tick"
SEEN = "sw-seen"

TABLE_COLUMNS = [
    ("rank", "rank"), ("host", "host"), ("steps", "steps"), ("step_ms", "step ms"), ("busy_ms", "busy ms"),
    ("data_wait_ms", "data"), ("forward_ms", "fwd"), ("backward_ms", "bwd"), ("comm_wait_ms", "comm"),
    ("eval_ms", "eval"), ("optimizer_ms", "opt"), ("other_ms", "other"), ("slowdown", "vs peers"),
    ("flagged", "flagged"),
]  # fmt: skip
OK_STYLE = {"background": "#eef7ee", "borderLeft": "6px solid #2ca02c", "padding": "8px 14px"}
ALERT_STYLE = {"background": "#fdecea", "borderLeft": "6px solid #d62728", "padding": "8px 14px"}
WAIT_STYLE = {"background": "#f3f3f3", "borderLeft": "6px solid #999", "padding": "8px 14px"}
CAUTION_STYLE = {"background": "#fff4e5", "borderLeft": "6px solid #ff7f0e", "padding": "8px 14px"}


def default_rank(snapshot: Snapshot) -> int | None:
    report = snapshot.analysis.report
    if report["stragglers"]:
        return int(report["stragglers"][0]["rank"])
    rows = [r for r in report["ranks"] if r.get("slowdown") is not None]
    return int(max(rows, key=lambda r: r["slowdown"])["rank"]) if rows else None


def banner(snapshot: Snapshot, source_label: str) -> tuple[list[Any], dict[str, str]]:
    report = snapshot.analysis.report
    if snapshot.empty and not report["hangs"]:
        text = [html.B("Waiting for data. "), f"No step recorded yet in {source_label}."]
        if snapshot.error:
            text.append(html.Div(f"Last refresh failed: {snapshot.error}"))
        return text, WAIT_STYLE
    lines = verdict_lines(report)
    alert = bool(report["stragglers"] or report["hangs"] or report["group_imbalance"])
    children: list[Any] = [html.Div(line) for line in lines]
    if snapshot.error:
        children.append(html.Div(f"Last refresh failed (showing earlier data): {snapshot.error}"))
    if alert:
        return children, ALERT_STYLE
    return children, CAUTION_STYLE if report.get("busy_unavailable") else OK_STYLE


def render(snapshot: Snapshot, rank: int | None) -> dict[str, Any]:
    """Every component's content for a snapshot and a chosen rank. Pure."""
    analysis = snapshot.analysis
    report, mat, verdict = analysis.report, analysis.matrix, analysis.verdict
    revision = str(report.get("run_id"))
    if snapshot.empty:
        blank = figures.empty("no step recorded yet")
        heat = breakdown = band = context = blank
    else:
        heat = figures.heatmap(mat, verdict)
        breakdown = figures.breakdown(mat, verdict)
        chosen = rank if rank is not None and rank in set(mat.ranks.tolist()) else default_rank(snapshot)
        band = figures.busy_band(mat, verdict, [chosen] if chosen is not None else [])
        spans = [tuple(s["time_span"]) for s in report["stragglers"] if s["rank"] == chosen and s.get("time_span")]
        context = context_figure(analysis.context, chosen, spans)
        band.update_layout(title="Busy time (ms): step - exposed comm. - eval")  # half width, beside the context
    events = figures.events_timeline(snapshot.events)
    for fig in (heat, breakdown, band, context, events):
        fig.update_layout(uirevision=revision)
    rows = [{k: r.get(k) for k, _ in TABLE_COLUMNS} for r in report["ranks"]]
    for r in rows:
        r["flagged"] = "yes" if r["flagged"] else ""
    options = [{"label": f"rank {r}", "value": int(r)} for r in mat.ranks.tolist()]
    return {"heatmap": heat, "breakdown": breakdown, "band": band, "context": context, "events": events,
            "rows": rows, "options": options}  # fmt: skip


def create_app(source: Any, refresh_ms: int = 3000, title: str = "stragglerwatch") -> Dash:
    """The dashboard over ``source`` (a started :class:`RunDirSource` or :class:`PrometheusSource`)."""
    app = Dash(__name__, title=title, update_title=None)
    graph = {"config": {"displaylogo": False}, "style": {"height": "420px"}}
    app.layout = html.Div(
        style={"fontFamily": "system-ui, sans-serif", "margin": "12px 24px"},
        children=[
            html.H2(f"stragglerwatch: {source.label}", style={"marginBottom": "6px"}),
            html.Div(id=STATUS, style={"color": "#666", "fontSize": "13px", "marginBottom": "6px"}),
            html.Div(id=BANNER, style=WAIT_STYLE),
            dcc.Graph(id=HEATMAP, **graph),
            dcc.Graph(id=BREAKDOWN, **graph),
            html.Div(
                [html.Label("Rank: "), dcc.Dropdown(id=RANK, clearable=False, style={"width": "220px"})],
                style={"display": "flex", "alignItems": "center", "gap": "8px"},
            ),  # fmt: skip
            html.Div(
                [dcc.Graph(id=BAND, **graph), dcc.Graph(id=CONTEXT, **graph)],
                style={"display": "grid", "gridTemplateColumns": "1fr 1fr", "gap": "8px"},
            ),  # the chosen rank's busy time, and beside it its host and GPU context
            dcc.Graph(id=EVENTS, config={"displaylogo": False}, style={"height": "300px"}),
            html.H3("Per rank (medians)"),
            dash_table.DataTable(
                id=TABLE,
                columns=[{"name": t, "id": k} for k, t in TABLE_COLUMNS],
                data=[],
                sort_action="native",
                filter_action="native",
                page_size=16,
                style_cell={"fontFamily": "system-ui, sans-serif", "fontSize": "13px", "padding": "4px"},
                style_data_conditional=[{"if": {"filter_query": '{flagged} = "yes"'}, "backgroundColor": "#fdecea"}],
            ),  # fmt: skip
            dcc.Interval(id=TICK, interval=refresh_ms),
            dcc.Store(id=SEEN),
        ],
    )

    @app.callback(
        Output(BANNER, "children"), Output(BANNER, "style"), Output(STATUS, "children"),
        Output(HEATMAP, "figure"), Output(BREAKDOWN, "figure"), Output(BAND, "figure"), Output(CONTEXT, "figure"),
        Output(EVENTS, "figure"),
        Output(TABLE, "data"), Output(RANK, "options"), Output(RANK, "value"), Output(SEEN, "data"),
        Input(TICK, "n_intervals"), Input(RANK, "value"), State(SEEN, "data"),
    )  # fmt: skip
    def refresh(_: Any, rank: int | None, seen: dict | None) -> tuple:
        snap = source.snapshot()
        key = {"version": snap.version, "rank": rank, "error": snap.error}
        status = f"source {source.label}; refreshed {_ago(snap.refreshed_at)}; {snap.analysis.report['steps']} steps"
        if seen == key:  # nothing new: leave the figures (and the user's zoom) alone
            return (no_update,) * 2 + (status,) + (no_update,) * 9
        if rank is None:
            rank = default_rank(snap)
        out = render(snap, rank)
        children, style = banner(snap, source.label)
        return (children, style, status, out["heatmap"],
                out["breakdown"], out["band"], out["context"], out["events"], out["rows"], out["options"], rank,
                {**key, "rank": rank})  # fmt: skip

    return app


def _ago(t: float) -> str:
    import time

    if not t:
        return "never"
    return f"{max(0.0, time.time() - t):.0f} s ago"


__all__ = ["create_app", "render"]
