"""Plotly figures of an analysis: pure functions (matrix, verdict in; figure out), shared by
the HTML report and the dashboard. Large runs are aggregated here, on the server side: no figure
carries more than ``MAX_STEP_COLS`` x ``MAX_RANK_ROWS`` heatmap cells or ``MAX_POINTS`` points a line,
and none reads more than ``SAMPLE_ROWS`` steps of every rank: a bin of a longer run is the mean of
steps spread over it (one from each of equal strata), so that a figure costs the same at any length
of run (the chosen ranks' lines read all of their steps). The peers' band around a rank's busy time is
drawn from ``SAMPLE_RANKS`` ranks spread over the job at most."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import plotly.graph_objects as go

from stragglerwatch._quiet import ignoring
from stragglerwatch.analysis.detect import StepMatrix, Verdict, nanmedian

MAX_RANK_ROWS = 256
MAX_STEP_COLS = 400
MAX_POINTS = 1500
MAX_BARS = 64
#: Step rows a figure reads at most: past it, the same number of steps spread over each bin (``_sampled``).
SAMPLE_ROWS = 2048
#: Ranks the peers' band of a busy time line is drawn from at most: past it, as many spread over the ranks.
SAMPLE_RANKS = 512
#: Ranks whose steps are binned at once (``_reduce``): a chunk of 2,048 steps is 2 MB of float64.
RANK_CHUNK = 128
PHASES = (
    ("data_wait_s", "data wait", "#8c564b"),
    ("forward_s", "forward", "#1f77b4"),
    ("backward_s", "backward", "#2ca02c"),
    ("allreduce_wait_s", "all-reduce wait", "#c7c7c7"),
    ("collective_wait_s", "other collectives", "#e3e3e3"),
    ("eval_s", "evaluation", "#bcbd22"),
    ("optimizer_s", "optimizer", "#9467bd"),
    ("other_s", "other", "#ff7f0e"),
)


def _bins(n: int, most: int) -> np.ndarray:
    """Start index of each of at most ``most`` contiguous bins over ``n`` items."""
    return np.unique(np.linspace(0, n, num=min(n, most) + 1, dtype=int)[:-1]) if n else np.zeros(0, dtype=int)


def _sampled(n: int, starts: np.ndarray, most: int = SAMPLE_ROWS) -> tuple[np.ndarray | None, np.ndarray]:
    """The rows of ``n`` a figure binned at ``starts`` reads: where the bins hold more than ``most`` rows,
    the same number from each bin (at least one), one from each of as many equal strata of it, at a place
    in its stratum drawn from the bin and stratum alone (so that a refresh reads the same rows, and a rank
    slow every k-th step is not read always in its slow or always in its fast steps); and each bin's start
    among them. ``(None, starts)``: every row."""
    if n <= most or not len(starts):
        return None, starts
    widths = np.diff(np.append(starts, n))
    take = np.minimum(widths, max(1, most // len(starts)))
    first = np.concatenate([[0], np.cumsum(take)[:-1]])
    which = np.repeat(np.arange(len(starts)), take)
    j = np.arange(int(take.sum())) - first[which]
    lo, hi = j * widths[which] // take[which], (j + 1) * widths[which] // take[which]
    # a fixed hash of (bin start, stratum): where in the stratum (SplitMix64's finaliser)
    h = (starts[which].astype(np.uint64) << np.uint64(20)) ^ j.astype(np.uint64)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    rows = starts[which] + lo + (h % (hi - lo).astype(np.uint64)).astype(np.int64)
    return rows, first


def _reduce(a: np.ndarray, starts: np.ndarray, axis: int, how: str) -> np.ndarray:
    """Each bin's (from ``starts`` along ``axis``) ``how`` (``"mean"`` or ``"max"``) of its finite values;
    NaN for a bin with none."""
    if len(starts) == a.shape[axis]:
        return a
    if axis == 0 and _steps_together(a):
        return _binned_steps(a, None, starts, how)
    if axis == 0:  # one reduction per bin of contiguous rows: ufunc.reduceat across rows is ten times slower
        a = np.ascontiguousarray(a)  # rows laid out one after the other: a bin's rows are added row by row
        ends = np.append(starts[1:], a.shape[0])
        return np.stack([_reduce_rows(a[s:e], how) for s, e in zip(starts, ends, strict=True)])
    with np.errstate(all="ignore"):
        if how == "max":
            filled = np.where(np.isnan(a), -np.inf, a)
            out = np.maximum.reduceat(filled, starts, axis=axis)
            return np.where(np.isinf(out), np.nan, out)
        finite = np.isfinite(a)  # the mean of a bin's finite values: NaN where it has none
        counts = np.add.reduceat(finite, starts, axis=axis, dtype=np.int64)
        sums = np.add.reduceat(np.where(finite, a, 0.0), starts, axis=axis)
        return sums / np.where(counts == 0, np.nan, counts)


def _steps_together(a: np.ndarray) -> bool:
    """Whether each rank's steps lie one after the other in memory (a column-major steps x ranks array, or its first
    rows)."""
    return a.ndim == 2 and a.strides[0] == a.itemsize


def _binned_steps(a: np.ndarray, rows: np.ndarray | None, starts: np.ndarray, how: str) -> np.ndarray:
    """:func:`_reduce` of ``a[rows]`` (``rows`` None: every row) along the steps (axis 0). Where each rank's steps
    lie together (the run's column-major matrix, or its first rows), along them, a few ranks at a time, whose
    temporaries (and the rows read) stay in the caches: copied whole to row-major first, the matrix was tens of
    MB, written out and mapped anew."""
    if not _steps_together(a):
        return _reduce(a if rows is None else a[rows], starts, 0, how)
    out = np.empty((len(starts), a.shape[1]))
    t = a.T
    for lo in range(0, t.shape[0], RANK_CHUNK):
        chunk = t[lo : lo + RANK_CHUNK]
        out[:, lo : lo + RANK_CHUNK] = _reduce(chunk if rows is None else chunk[:, rows], starts, 1, how).T
    return out


def _reduce_rows(block: np.ndarray, how: str) -> np.ndarray:
    """``how`` of each column's finite values in ``block`` (rows of one bin); NaN for a column with none."""
    finite = np.isfinite(block)
    with np.errstate(all="ignore"):
        if how == "max":
            out = np.where(finite, block, -np.inf).max(axis=0)
            return np.where(np.isinf(out), np.nan, out)
        counts = finite.sum(axis=0)
        return np.where(finite, block, 0.0).sum(axis=0) / np.where(counts == 0, np.nan, counts)


def _nanquantiles(a: np.ndarray, qs: tuple[float, ...]) -> list[np.ndarray]:
    """Per row, each quantile of the finite values (linear between order statistics, as numpy's
    default); NaN for a row with none. One sort for all of them, no per-row loop."""
    if not a.shape[1]:
        return [np.full(a.shape[0], np.nan) for _ in qs]
    ordered = np.sort(a, axis=1)  # NaNs last
    n = np.sum(~np.isnan(a), axis=1)
    rows = np.arange(a.shape[0])
    out = []
    for q in qs:
        pos = q * np.maximum(n - 1, 0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
        frac = pos - lo
        value = ordered[rows, lo] + frac * (ordered[rows, hi] - ordered[rows, lo])
        out.append(np.where(n > 0, value, np.nan))
    return out


def heatmap(mat: StepMatrix, verdict: Verdict) -> go.Figure:
    """Rank x step slowdown vs peers (busy / reference). Steps binned by mean, ranks by max
    (a single slow rank in a bin of ranks stays visible)."""
    z = verdict.slowdown
    sb = _bins(z.shape[0], MAX_STEP_COLS)
    rb = _bins(z.shape[1], MAX_RANK_ROWS)
    rows, starts = _sampled(z.shape[0], sb)
    z = _reduce(_binned_steps(z, rows, starts, "mean"), rb, 1, "max").T
    ranks = mat.ranks[rb] if len(rb) else mat.ranks
    label = "rank" if len(rb) == len(mat.ranks) else "first rank of bin"
    # scale to the stragglers, not to one-step spikes
    zmax = min(3.0, max([1.3] + [1.1 * s.slowdown for s in verdict.stragglers]))
    fig = go.Figure(
        go.Heatmap(
            z=z, x=mat.steps[sb] if len(sb) else mat.steps, y=[str(r) for r in ranks],
            zmin=0.5, zmid=1.0, zmax=zmax,
            colorscale="RdBu_r", colorbar={"title": "busy / peers"},
            hovertemplate=f"step %{{x}}<br>{label} %{{y}}<br>slowdown %{{z:.2f}}<extra></extra>",
        )
    )  # fmt: skip
    fig.update_layout(title="Slowdown vs peers (rank x step)", xaxis_title="step", yaxis_title=label,
                      yaxis={"type": "category"}, margin={"t": 50})  # fmt: skip
    return fig


def breakdown(mat: StepMatrix, verdict: Verdict, rows: list[dict] | None = None) -> go.Figure:
    """Per-rank stacked median phase times; at most ``MAX_BARS`` ranks (flagged and busiest).
    ``rows``: the report's ``ranks`` rows, whose medians are used instead of computed again."""
    if rows is not None and len(rows) == len(mat.ranks):
        medians = {c: np.array([np.nan if r[c[:-2] + "_ms"] is None else r[c[:-2] + "_ms"] for r in rows])
                   for c in ("busy_s", *(p[0] for p in PHASES))}  # fmt: skip
    else:
        medians = {c: nanmedian(mat.values[c], axis=0) * 1000.0 for c in ("busy_s", *(p[0] for p in PHASES))}
    busy = medians["busy_s"]
    flagged = {s.rank for s in verdict.stragglers}
    heavy = (-np.nan_to_num(busy)).tolist()
    order = sorted(range(len(mat.ranks)), key=lambda j: (mat.ranks[j] not in flagged, heavy[j]))
    keep = sorted(order[:MAX_BARS], key=lambda j: mat.ranks[j])
    x = [f"{'*' if mat.ranks[j] in flagged else ''}{mat.ranks[j]}" for j in keep]
    fig = go.Figure()
    for col, name, color in PHASES:
        fig.add_bar(x=x, y=medians[col][keep], name=name, marker_color=color)
    title = "Median step anatomy per rank (ms)"
    if len(keep) < len(mat.ranks):
        title += f" — {len(keep)} of {len(mat.ranks)} ranks: flagged and busiest"
    fig.update_layout(barmode="stack", title=title, xaxis_title="rank (* flagged)", yaxis_title="ms",
                      xaxis={"type": "category"}, margin={"t": 50})  # fmt: skip
    return fig


def busy_band(mat: StepMatrix, verdict: Verdict, ranks: list[int] | None = None) -> go.Figure:
    """Busy time of the chosen (default: flagged) ranks against their peers' 10-90% band."""
    if ranks is None:
        ranks = [s.rank for s in verdict.stragglers][:8]
    cols = [int(np.searchsorted(mat.ranks, r)) for r in ranks if r in set(mat.ranks.tolist())]
    n = mat.values["busy_s"].shape[0]
    sb = _bins(n, MAX_POINTS)
    x = mat.steps[sb] if len(sb) else mat.steps
    busy = {j: mat.values["busy_s"][:, j] * 1000.0 for j in cols}  # the chosen ranks' lines: every step
    # the peers' band of their busy time over each bin of steps (a step when there are few)
    rows, starts = _sampled(n, sb)
    peers = _peers(len(mat.ranks), cols)
    picked = (lambda a: a[:, peers]) if rows is None else (lambda a: a[np.ix_(rows, peers)])
    healthy = np.where(picked(verdict.flags), np.nan, picked(mat.values["busy_s"]) * 1000.0)
    lo, med, hi = _nanquantiles(_reduce(healthy, starts, 0, "mean") if len(sb) else healthy, (0.1, 0.5, 0.9))
    fig = go.Figure()
    fig.add_scatter(x=x, y=hi, line={"width": 0}, showlegend=False, hoverinfo="skip")
    fig.add_scatter(x=x, y=lo, fill="tonexty", fillcolor="rgba(31,119,180,0.2)", line={"width": 0},
                    name="peers 10-90%")  # fmt: skip
    fig.add_scatter(x=x, y=med, line={"color": "#1f77b4"}, name="peers median")
    for j in cols:
        fig.add_scatter(x=x, y=_reduce(busy[j][:, None], sb, 0, "mean")[:, 0], name=f"rank {mat.ranks[j]}")
    fig.update_layout(title="Busy time (ms): step minus exposed communication and evaluation", xaxis_title="step",
                      yaxis_title="ms", margin={"t": 50})  # fmt: skip
    shown = np.concatenate([hi, *(busy[j] for j in cols)]) if len(hi) else np.zeros(0)
    if np.isfinite(shown).any():  # a stall of seconds must not flatten milliseconds: clip, zoom out to see it
        typical, top = np.nanpercentile(shown, 99), np.nanmax(shown)
        if top > 3 * typical:
            fig.update_yaxes(range=[0, 1.3 * typical], title="ms (spikes clipped: zoom out)")
    return fig


def _peers(n: int, chosen: list[int], most: int = SAMPLE_RANKS) -> np.ndarray:
    """The columns a band of the peers reads: every one but the ``chosen``, or ``most`` of them spread evenly over
    the ranks (the same at every refresh)."""
    others = np.setdiff1d(np.arange(n), chosen)
    if len(others) <= most:
        return others
    return others[np.linspace(0, len(others) - 1, most).round().astype(np.int64)]


def empty(text: str) -> go.Figure:
    """A blank figure that says why it is blank."""
    fig = go.Figure()
    fig.update_layout(
        annotations=[{"text": text, "showarrow": False, "font": {"size": 14}, "xref": "paper", "yref": "paper"}],
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"t": 30},
    )
    return fig


EVENT_COLORS = {"stall": "#d62728", "recovery": "#2ca02c", "sigterm": "#9467bd", "exception": "#8c564b",
                "closed": "#7f7f7f"}  # fmt: skip


def events_timeline(events: list[dict]) -> go.Figure:
    """Watchdog and shutdown events over wall-clock time, one row per rank."""
    shown = [e for e in events if e.get("kind") in EVENT_COLORS]
    if not shown:
        return empty("no watchdog event: no rank stalled")
    fig = go.Figure()
    for kind, color in EVENT_COLORS.items():
        evs = [e for e in shown if e["kind"] == kind]
        if not evs:
            continue
        fig.add_scatter(
            x=[datetime.fromtimestamp(e.get("detected_at", 0), tz=timezone.utc) for e in evs],
            y=[str(e["rank"]) for e in evs],
            mode="markers",
            marker={"color": color, "size": 12, "symbol": "diamond"},
            name=kind,
            text=[f"step {e.get('step')}, {e.get('phase')}, waited {e.get('waited_s', '-')} s" for e in evs],
            hovertemplate="rank %{y}<br>%{x}<br>%{text}<extra>" + kind + "</extra>",
        )
    fig.update_layout(title="Watchdog events", xaxis_title="time (UTC)", yaxis_title="rank",
                      yaxis={"type": "category"}, margin={"t": 50})  # fmt: skip
    return fig


MAX_SCATTER = 3000  # points of a scatter figure


def work_column(mat: StepMatrix, verdict: Verdict | None = None) -> str | None:
    """The column of work the figures show: the one the verdict's imbalance was fitted on (the counted
    ``work``, or the input's padded shape ``work_elements``), else the first recorded; None: neither."""

    def recorded(col: str) -> bool:
        return col in mat.values and _any_finite(mat.values[col])

    fitted = getattr(getattr(verdict, "imbalance", None), "column", None)
    return next((c for c in (fitted, "work", "work_elements") if c and recorded(c)), None)


def _any_finite(a: np.ndarray) -> bool:
    """Whether ``a`` (steps x ranks) holds a finite value, looked for a few ranks at a time: a column recorded has one
    in its first ranks, and the matrix is not read whole at every refresh."""
    if a.ndim != 2:
        return bool(np.isfinite(a).any())
    return any(np.isfinite(a[:, lo : lo + RANK_CHUNK]).any() for lo in range(0, a.shape[1], RANK_CHUNK))


def has_work(mat: StepMatrix) -> bool:
    """Whether the run recorded work per step (``values["work"]`` or ``values["work_elements"]``) on any rank."""
    return work_column(mat) is not None


def _work(mat: StepMatrix, verdict: Verdict | None, unit: str | None) -> tuple[np.ndarray | None, str]:
    col = work_column(mat, verdict)
    if col is None:
        return None, unit or "units"
    return mat.values[col], unit or (mat.work_unit if col == "work" else "elements") or "units"


def work_heatmap(mat: StepMatrix, unit: str | None = None, verdict: Verdict | None = None) -> go.Figure:
    """Rank x step work per step (tokens, elements: ``unit``; of the column :func:`work_column` picks).
    Steps binned by mean, ranks by max (the heaviest rank of a bin stays visible)."""
    z, unit = _work(mat, verdict, unit)
    if z is None:
        return empty("no work per step recorded")
    sb = _bins(z.shape[0], MAX_STEP_COLS)
    rb = _bins(z.shape[1], MAX_RANK_ROWS)
    rows, starts = _sampled(z.shape[0], sb)
    z = _reduce(_binned_steps(z, rows, starts, "mean"), rb, 1, "max").T
    ranks = mat.ranks[rb] if len(rb) else mat.ranks
    label = "rank" if len(rb) == len(mat.ranks) else "first rank of bin"
    title = f"Work per step ({unit}), rank x step"
    if len(sb) < len(mat.steps):
        title += f" — steps binned by {int(np.ceil(len(mat.steps) / len(sb)))}: zoom in for single steps"
    fig = go.Figure(
        go.Heatmap(
            z=z, x=mat.steps[sb] if len(sb) else mat.steps, y=[str(r) for r in ranks], colorscale="Viridis",
            colorbar={"title": unit},
            hovertemplate=f"step %{{x}}<br>{label} %{{y}}<br>%{{z:,.0f}} {unit}<extra></extra>",
        )
    )  # fmt: skip
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=label, yaxis={"type": "category"},
                      margin={"t": 50})  # fmt: skip
    return fig


def busy_vs_work(mat: StepMatrix, verdict: Verdict, unit: str | None = None) -> go.Figure:
    """Each rank's step: its work against its busy time, both as the difference from its step's
    typical (mean work, median busy), so that what moves every rank in a step drops out. Load
    imbalance shows as a slope (heavier batch, busier rank); a straggler as points above it (busier
    for the same work). The line: what one more unit of work costs a healthy rank, when it is known."""
    work, unit = _work(mat, verdict, unit)
    if work is None:
        return empty("no work per step recorded")
    # the points are a sample: taken from steps spread over the run (every rank of each), enough for a few times
    # the points shown, so that a long run's figure costs no pass over all of its records
    n, r = work.shape
    rows = np.unique(np.linspace(0, n - 1, num=min(n, max(64, 16 * MAX_SCATTER // max(r, 1))), dtype=int))
    work, busy = work[rows], mat.values["busy_s"][rows] * 1000.0
    steps = mat.steps[rows]
    ok = np.isfinite(work) & np.isfinite(busy)
    with ignoring(), np.errstate(all="ignore"):  # a step no rank measured: NaN
        w = work - np.nanmean(np.where(ok, work, np.nan), axis=1, keepdims=True)
        b = busy - nanmedian(np.where(ok, busy, np.nan), axis=1)[:, None]
    flagged = verdict.flags[rows] if verdict.flags.shape == (n, r) else np.zeros(ok.shape, dtype=bool)
    fig = go.Figure()
    for name, cells, color in (("healthy ranks' steps", ok & ~flagged, "rgba(31,119,180,0.45)"),
                               ("stragglers' flagged steps", ok & flagged, "rgba(214,39,40,0.7)")):  # fmt: skip
        si, ri = np.nonzero(cells)
        if not len(si):
            continue
        pick = np.unique(np.linspace(0, len(si) - 1, num=min(len(si), MAX_SCATTER), dtype=int))
        si, ri = si[pick], ri[pick]
        fig.add_scatter(
            x=w[si, ri], y=b[si, ri], mode="markers", name=name, marker={"color": color, "size": 5},
            customdata=np.stack([steps[si], mat.ranks[ri]], axis=1),
            hovertemplate=f"step %{{customdata[0]}}, rank %{{customdata[1]}}<br>%{{x:+,.0f}} {unit}<br>"
                          "busy %{y:+.2f} ms<extra></extra>",
        )  # fmt: skip
    imb = getattr(verdict, "imbalance", None)
    rate = getattr(imb, "seconds_per_unit", None)
    if rate is not None and np.isfinite(rate) and ok.any():
        lo, hi = float(np.nanmin(w[ok])), float(np.nanmax(w[ok]))
        fig.add_scatter(x=[lo, hi], y=[lo * rate * 1000.0, hi * rate * 1000.0], mode="lines",
                        line={"color": "#2ca02c", "dash": "dash"},
                        name=f"healthy slope: {rate * 1e6:.3g} µs/{unit.removesuffix('s') or unit}")  # fmt: skip
    explained = getattr(imb, "explained", None)
    title = "Busy time vs work" + (f" (work explains {explained:.0%})" if explained is not None else "")
    fig.update_layout(title=title, xaxis_title=f"work - the step's mean ({unit})",
                      yaxis_title="busy - the step's median (ms)", margin={"t": 50},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.18})  # fmt: skip
    return fig
