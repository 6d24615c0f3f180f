"""The Dash app: layout, component ids and one refresh callback over a source's snapshot.

Design: ``render(snapshot, rank)`` is a pure function from a snapshot to every
component's content (the callback only asks for it, made ahead by ``prerender.py``
where the source's new analysis came before the page's refresh), so it is tested and
benchmarked without a browser. Figures carry a ``uirevision`` that stays the
same for a run, so a refresh keeps the user's zoom; the rank selection is a
component value, which a refresh never resets. A service of many runs passes a
function instead of a source: the page's URL names the run (``?run=NAME``) and
the function gives its source or refuses it (:class:`RunRefused`, one line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, quote

from dash import Dash, Input, Output, State, dash_table, dcc, html, no_update

from stragglerwatch.presentation import figures
from stragglerwatch.presentation.ctxfigure import context_figure
from stragglerwatch.presentation.dashboard.prerender import Prerender
from stragglerwatch.presentation.dashboard.sources import Snapshot
from stragglerwatch.presentation.render import verdict_lines

BANNER = "sw-banner"
STATUS = "sw-status"
HEATMAP = "sw-heatmap"
BREAKDOWN = "sw-breakdown"
WORK_ROW = "sw-work-row"  # holds WORK and IMBALANCE; shown only for a run that recorded work per step
WORK = "sw-work"
IMBALANCE = "sw-imbalance"
RANK = "sw-rank"
BAND = "sw-band"
CONTEXT = "sw-context"
EVENTS = "sw-events"
TABLE = "sw-table"
TICK = "sw-tick"
SEEN = "sw-seen"
URL = "sw-url"
HEADING = "sw-heading"
RUNS = "sw-runs"
LISTED = "sw-listed"

TABLE_COLUMNS = [
    ("rank", "rank"), ("host", "host"), ("steps", "steps"), ("step_ms", "step ms"), ("busy_ms", "busy ms"),
    ("data_wait_ms", "data"), ("forward_ms", "fwd"), ("backward_ms", "bwd"), ("comm_wait_ms", "comm"),
    ("eval_ms", "eval"), ("optimizer_ms", "opt"), ("other_ms", "other"), ("busy_vs_peers", "busy vs peers"),
    ("flagged", "flagged"),
]  # fmt: skip
WORK_GRID = {"display": "grid", "gridTemplateColumns": "minmax(0, 1fr) minmax(0, 1fr)", "gap": "8px"}
OK_STYLE = {"background": "#eef7ee", "borderLeft": "6px solid #2ca02c", "padding": "8px 14px"}
ALERT_STYLE = {"background": "#fdecea", "borderLeft": "6px solid #d62728", "padding": "8px 14px"}
WAIT_STYLE = {"background": "#f3f3f3", "borderLeft": "6px solid #999", "padding": "8px 14px"}
CAUTION_STYLE = {"background": "#fff4e5", "borderLeft": "6px solid #ff7f0e", "padding": "8px 14px"}


class RunRefused(Exception):
    """A run a page asks for and cannot be shown: a one-line reason and its HTTP status."""

    def __init__(self, message: str, status: int = 404):
        super().__init__(message)
        self.status = status


def url_run(search: str | None) -> str | None:
    """The run a page's query string names (``?run=NAME``); None when it names none."""
    names = parse_qs((search or "").lstrip("?"), keep_blank_values=True).get("run", [])
    if len(names) > 1:
        raise RunRefused("name one run (?run=NAME), not several", 400)
    return names[0] if names else None


def run_links(names: list[str], current: str | None) -> list[Any]:
    """The run picker: a link to each run's page, the current one in bold (nothing for a single run)."""
    if not names:
        return []
    links: list[Any] = [html.Span(f"{len(names)} run{'s' if len(names) != 1 else ''}: ")]
    for name in names:
        link = html.A(name, href=f"?run={quote(name, safe='')}", style={"marginRight": "12px"})
        links.append(html.B(link) if name == current else link)
    return links


def default_rank(snapshot: Snapshot) -> int | None:
    report = snapshot.analysis.report
    if report["stragglers"]:
        return int(report["stragglers"][0]["rank"])
    rows = [r for r in report["ranks"] if r.get("busy_vs_peers") is not None]
    return int(max(rows, key=lambda r: r["busy_vs_peers"])["rank"]) if rows else None


def banner(snapshot: Snapshot, source_label: str) -> tuple[list[Any], dict[str, str]]:
    report = snapshot.analysis.report
    if snapshot.empty and not report["hangs"]:
        text = [html.B("Waiting for data. "), f"No step recorded yet in {source_label}."]
        if snapshot.error:
            text.append(html.Div(f"Last refresh failed: {snapshot.error}"))
        return text, WAIT_STYLE
    lines = verdict_lines(report)
    alert = bool(report["stragglers"] or report["hangs"] or report["group_imbalance"] or report.get("actions"))
    children: list[Any] = [html.Div(line) for line in lines]
    if snapshot.error:
        children.append(html.Div(f"Last refresh failed (showing earlier data): {snapshot.error}"))
    if alert:
        return children, ALERT_STYLE
    imbalanced = bool((report.get("imbalance") or {}).get("detected"))
    return children, CAUTION_STYLE if report.get("busy_unavailable") or imbalanced else OK_STYLE


def table_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The per-rank table's columns: the work ones too when any rank has them."""
    rows = report["ranks"]
    if not any(r.get("work") is not None or r.get("busy_per_work_us") is not None for r in rows):
        return TABLE_COLUMNS
    unit = (report.get("imbalance") or {}).get("unit") or "units"
    work = [("work", f"{unit}/step"), ("busy_per_work_us", f"busy µs/{unit.removesuffix('s') or unit}")]
    return TABLE_COLUMNS[:-2] + work + TABLE_COLUMNS[-2:]


def render(snapshot: Snapshot, rank: int | None) -> dict[str, Any]:
    """Every component's content for a snapshot and a chosen rank. Pure."""
    analysis = snapshot.analysis
    report, mat, verdict = analysis.report, analysis.matrix, analysis.verdict
    revision = str(report.get("run_id"))
    unit = (report.get("imbalance") or {}).get("unit") or None  # None: the unit of the column shown
    shown = not snapshot.empty and figures.has_work(mat)
    if shown:
        work, balance = figures.work_heatmap(mat, unit, verdict), figures.busy_vs_work(mat, verdict, unit)
    else:
        work = balance = figures.empty("no work per step recorded")
    if snapshot.empty:
        blank = figures.empty("no step recorded yet")
        heat = breakdown = band = context = blank
    else:
        heat = figures.heatmap(mat, verdict)
        breakdown = figures.breakdown(mat, verdict, snapshot.analysis.report["ranks"])
        chosen = rank if rank is not None and rank in set(mat.ranks.tolist()) else default_rank(snapshot)
        band = figures.busy_band(mat, verdict, [chosen] if chosen is not None else [])
        spans = [tuple(s["time_span"]) for s in report["stragglers"] if s["rank"] == chosen and s.get("time_span")]
        context = context_figure(analysis.context, chosen, spans)
        band.update_layout(title="Busy time (ms): step - exposed comm. - eval")  # half width, beside the context
    events = figures.events_timeline(snapshot.events)
    for fig in (heat, breakdown, band, context, events, work, balance):
        fig.update_layout(uirevision=revision)
    columns = table_columns(report)
    rows = [{k: r.get(k) for k, _ in columns} for r in report["ranks"]]
    for r in rows:
        r["flagged"] = "yes" if r["flagged"] else ""
    options = [{"label": f"rank {r}", "value": int(r)} for r in mat.ranks.tolist()]
    return {"heatmap": heat, "breakdown": breakdown, "band": band, "context": context, "events": events,
            "work": work, "imbalance": balance, "work_style": WORK_GRID if shown else {**WORK_GRID, "display": "none"},
            "rows": rows, "columns": [{"name": t, "id": k} for k, t in columns], "options": options}  # fmt: skip


def create_app(
    source: Any,
    refresh_ms: int = 250,
    title: str = "stragglerwatch",
    runs: Callable[[], list[str]] | None = None,
    extend: Callable[[Any], None] | None = None,
) -> Dash:
    """The dashboard over ``source``: a started :class:`RunDirSource` or :class:`PrometheusSource`, or a
    function from the run the page's URL names (None: it names none) to a started source, raising
    :class:`RunRefused` for a run it will not show. ``runs``: the run picker's names (None: no picker).
    ``extend``: called with the Flask server to add its own hooks, before the app is set up to serve
    (Flask takes no hook after its first request, and the app makes one: see :func:`set_up_now`)."""
    pick: Callable[[str | None], Any] = (lambda run: source) if hasattr(source, "snapshot") else source
    ahead = Prerender(render)  # each shown source's content made as soon as it holds a new analysis
    fixed = source.label if hasattr(source, "snapshot") else ""
    app = Dash(__name__, title=title, update_title=None)
    graph = {"config": {"displaylogo": False}, "style": {"height": "420px"}}
    app.layout = html.Div(
        style={"fontFamily": "system-ui, sans-serif", "margin": "12px 24px"},
        children=[
            dcc.Location(id=URL, refresh=False),
            html.H2(
                f"stragglerwatch: {fixed}" if fixed else "stragglerwatch", id=HEADING, style={"marginBottom": "6px"}
            ),  # fmt: skip
            html.Div(id=RUNS, style={"marginBottom": "6px", "display": "block" if runs else "none"}),
            html.Div(id=STATUS, style={"color": "#666", "fontSize": "13px", "marginBottom": "6px"}),
            html.Div(id=BANNER, style=WAIT_STYLE),
            dcc.Graph(id=HEATMAP, **graph),
            dcc.Graph(id=BREAKDOWN, **graph),
            html.Div(
                [dcc.Graph(id=WORK, responsive=True, **graph), dcc.Graph(id=IMBALANCE, responsive=True, **graph)],
                id=WORK_ROW,
                style={**WORK_GRID, "display": "none"},
            ),  # the work per step per rank, and beside it busy time against work (load imbalance); hidden
            # until shown, the figures follow their cells' width (responsive) instead of plotly's default
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
                columns=[{"name": t, "id": k} for k, t in TABLE_COLUMNS],  # the work ones too where recorded
                data=[],
                sort_action="native",
                filter_action="native",
                page_size=16,
                style_cell={"fontFamily": "system-ui, sans-serif", "fontSize": "13px", "padding": "4px"},
                style_data_conditional=[{"if": {"filter_query": '{flagged} = "yes"'}, "backgroundColor": "#fdecea"}],
            ),  # fmt: skip
            dcc.Interval(id=TICK, interval=refresh_ms),
            dcc.Store(id=SEEN),
            dcc.Store(id=LISTED),
        ],
    )

    @app.callback(
        Output(BANNER, "children"), Output(BANNER, "style"), Output(STATUS, "children"), Output(HEADING, "children"),
        Output(HEATMAP, "figure"), Output(BREAKDOWN, "figure"), Output(BAND, "figure"), Output(CONTEXT, "figure"),
        Output(EVENTS, "figure"), Output(WORK, "figure"), Output(IMBALANCE, "figure"), Output(WORK_ROW, "style"),
        Output(TABLE, "data"), Output(TABLE, "columns"), Output(RANK, "options"), Output(RANK, "value"),
        Output(SEEN, "data"),
        Input(TICK, "n_intervals"), Input(RANK, "value"), Input(URL, "search"), State(SEEN, "data"),
    )  # fmt: skip
    def refresh(_: Any, rank: int | None, search: str | None, seen: dict | None) -> tuple:
        try:
            src = pick(url_run(search))
        except RunRefused as exc:
            return refused(str(exc), exc.status, seen)
        snap = src.snapshot()
        key = {"version": snap.version, "rank": rank, "error": snap.error, "source": src.label}
        status = f"source {src.label}; refreshed {_ago(snap.refreshed_at)}; {snap.analysis.report['steps']} steps"
        if seen == key:  # nothing new: leave the figures (and the user's zoom) alone
            return (no_update,) * 2 + (status,) + (no_update,) * 14
        if rank is None or (seen or {}).get("source") != src.label:
            rank = default_rank(snap)
        out = ahead.content(src, snap, rank)
        children, style = banner(snap, src.label)
        return (children, style, status, f"stragglerwatch: {src.label}", out["heatmap"], out["breakdown"],
                out["band"], out["context"], out["events"], out["work"], out["imbalance"], out["work_style"],
                out["rows"], out["columns"], out["options"], rank, {**key, "rank": rank})  # fmt: skip

    if runs is not None:

        @app.callback(Output(RUNS, "children"), Output(LISTED, "data"), Input(TICK, "n_intervals"),
                      Input(URL, "search"), State(LISTED, "data"))  # fmt: skip
        def picker(_: Any, search: str | None, listed: list | None) -> tuple:
            try:
                current = url_run(search)
            except RunRefused:
                current = None
            names = runs()
            if listed == [names, current]:  # the same links: leave them (one being clicked) alone
                return no_update, no_update
            return run_links(names, current), [names, current]

    if extend is not None:
        extend(app.server)
    set_up_now(app)
    return app


def set_up_now(app: Dash) -> None:
    """Have Dash set itself up now, before a thread serves. Dash does it at its first request, without a
    lock: the scripts a page loads are registered then, and a request on another thread meanwhile was
    refused (500, "not a registered library"), which left a browser's first page blank."""
    app.server.test_client().get(app.config.requests_pathname_prefix + "_dash-dependencies")


def refused(message: str, status: int, seen: dict | None) -> tuple:
    """What the page shows for a run it will not show: the reason, and nothing of any run."""
    key = {"refused": message}
    if seen == key:
        return (no_update,) * 17
    blank = figures.empty("nothing to show")
    style = WAIT_STYLE if status in (404, 503) else ALERT_STYLE
    hidden = {**WORK_GRID, "display": "none"}
    columns = [{"name": t, "id": k} for k, t in TABLE_COLUMNS]
    return ([html.B(message)], style, "", "stragglerwatch", blank, blank, blank, blank, blank, blank, blank, hidden,
            [], columns, [], None, key)  # fmt: skip


def _ago(t: float) -> str:
    import time

    if not t:
        return "never"
    return f"{max(0.0, time.time() - t):.0f} s ago"


__all__ = ["RunRefused", "create_app", "render"]
