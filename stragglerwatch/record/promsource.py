"""Feed the detection core from a live Prometheus instead of a run dir.

``frame_from_prometheus`` returns the same long frame ``load_run`` does (one row
per rank and "step"), where a step is one evaluation point of a range query and
each value is the rank's mean over the preceding ``window`` (rate of the
histogram's ``_sum`` over rate of its ``_count``). ``detect`` then works unchanged;
only the unit of ``first_step``/``last_step`` is the query step (``steps_seconds``).
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.record.schema import COMM_PHASES, PHASES


class PrometheusError(Exception):
    """Prometheus could not be queried; the message is one line for the user."""


def _query_range(url: str, query: str, start: float, end: float, step: float, timeout: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout) as resp:
            data = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"cannot query {url}: {exc}") from None
    if data.get("status") != "success":
        raise PrometheusError(f"{url}: {data.get('error', 'query failed')}")
    return data["data"]["result"]


def unavailable_from_prometheus(url: str, run: str, timeout: float = 10.0) -> dict[int, dict[str, list[str]]]:
    """Each rank's ``busy_unavailable`` reasons as exported now, in ``read_rank_meta``'s shape."""
    query = f'stragglerwatch_busy_unavailable{{run="{run}"}} == 1'
    now = time.time()
    out: dict[int, dict[str, list[str]]] = {}
    for series in _query_range(url, query, now, now, 1.0, timeout):
        labels = series["metric"]
        out.setdefault(int(labels["rank"]), {"busy_unavailable": []})["busy_unavailable"].append(labels["reason"])
    return out


def frame_from_prometheus(
    url: str,
    run: str,
    *,
    minutes: float = 30.0,
    window: str = "1m",
    step_seconds: float = 15.0,
    end: float | None = None,
    timeout: float = 10.0,
) -> pd.DataFrame:
    """Per-rank, per-query-step means of busy, step and phase times of ``run`` over the last ``minutes``."""
    end = time.time() if end is None else end
    start = end - minutes * 60.0
    sel = f'run="{run}"'

    def mean(metric: str, extra: str = "", by: str = "rank") -> str:
        m = f"stragglerwatch_{metric}"
        return (f"sum by ({by}) (rate({m}_sum{{{sel}{extra}}}[{window}]))"
                f" / sum by ({by}) (rate({m}_count{{{sel}{extra}}}[{window}]))")  # fmt: skip

    columns: dict[str, list[dict[str, Any]]] = {
        "busy_s": _query_range(url, mean("busy_seconds"), start, end, step_seconds, timeout),
        "step_s": _query_range(url, mean("step_seconds"), start, end, step_seconds, timeout),
    }
    phases = _query_range(url, mean("phase_seconds", by="rank, phase"), start, end, step_seconds, timeout)
    for phase in PHASES:
        columns[f"{phase}_s"] = [r for r in phases if r["metric"].get("phase") == phase]
    times = np.arange(start, end + step_seconds / 2, step_seconds)
    rows: dict[tuple[int, int], dict[str, float]] = {}
    for col, results in columns.items():
        for series in results:
            rank = int(series["metric"]["rank"])
            for t, v in series["values"]:
                value = float(v)
                if np.isfinite(value):
                    idx = int(round((float(t) - start) / step_seconds))
                    rows.setdefault((rank, idx), {})[col] = value
    if not rows:
        return pd.DataFrame(columns=["rank", "step", "start_time", *columns, "world_size"])
    frame = pd.DataFrame([{"rank": r, "step": s, **vals} for (r, s), vals in rows.items()])
    for col in columns:
        if col not in frame:
            frame[col] = np.nan
    frame = frame.dropna(subset=["busy_s", "step_s"]).fillna(0.0)
    frame["comm_wait_s"] = sum(frame[f"{p}_s"] for p in COMM_PHASES)
    frame["start_time"] = frame["step"].map(lambda s: float(times[min(s, len(times) - 1)]))
    frame["world_size"] = frame["rank"].nunique()
    return frame.sort_values(["step", "rank"]).reset_index(drop=True)
