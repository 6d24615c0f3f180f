"""Where in the code is a straggler slow? Its code samples against its peers' over the same span
and phase. Pure: frames in, findings out.

Design: the code stream (``codelog.load_code``) holds, per rank and window of a few seconds, how
many samples saw the training thread at each (phase, site). For a flagged rank and its flagged
span (``explain.span``), each window's samples are turned into seconds (the window's share of
samples at a site times the part of the window inside the span), summed over the phases of the
straggler's cause (:data:`CAUSE_PHASES`), per step. Its peers (the other ranks of its role that
were not flagged; all other ranks if none is left) get the same figure, and a site's excess is the
straggler's seconds per step there minus the peers' median. The findings are the sites holding the
excess, with their share of it ("91% of its extra 14.0 ms/step in train.py:117 get_batch").

When it cannot be said, the finding says why (``note``): no code samples (sampling off, an older
run), too few in the span, or no site whose excess stands out (the excess is spread over the code,
as a uniformly slower device spreads it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch.analysis.explain import StepTimes, span

#: The phases (``StepProbe.where``) whose samples hold each cause's time.
CAUSE_PHASES = {"data": ("data_wait",), "compute": ("forward", "backward"), "optimizer": ("optimizer",),
                "other": ("other",)}  # fmt: skip
#: The note of a run without code samples (the text report leaves it out: nothing was asked).
NO_SAMPLES = "no code samples in this run (code_sample_hz=0, or recorded before they existed)"
MIN_SAMPLES = 10  # samples of the straggler in its cause's phases needed to say anything
MIN_SHARE = 0.10  # a site is named when it holds at least this share of the excess
MOST_SITES = 3
#: The excess the sites explain, as a share of the cause's excess, below which no site stands out.
MIN_EXPLAINED = 0.25


#: Unflagged peers of a role whose code samples a straggler is compared with, at most.
MOST_PEERS = 16


def needed_ranks(stragglers: Sequence[Any], ranks: Sequence[int], roles: Mapping[int, str | None]) -> list[int]:
    """The ranks whose code samples :func:`locate` needs: the stragglers, and of each straggler's
    role up to :data:`MOST_PEERS` unflagged peers spread over the role's ranks (a run of thousands
    of ranks is not read whole for a median of peers)."""
    flagged = {int(_get(s, "rank")) for s in stragglers}
    out = set(flagged)
    for role in {roles.get(r) for r in flagged}:
        peers = [r for r in ranks if roles.get(r) == role and r not in flagged]
        step = max(1, len(peers) // MOST_PEERS)
        out.update(peers[::step][:MOST_PEERS])
    return sorted(out)


def _get(s: Any, key: str) -> Any:
    return s[key] if isinstance(s, Mapping) else getattr(s, key)


def _seconds(rows: pd.DataFrame, t0: float, t1: float) -> tuple[pd.Series, int]:
    """Per site, the seconds its samples stand for inside [t0, t1]; and the samples counted."""
    lo, hi = np.maximum(rows["t0"].to_numpy(), t0), np.minimum(rows["t1"].to_numpy(), t1)
    inside = np.clip(hi - lo, 0.0, None)  # a window of one sample has no length: it stands for nothing
    seconds = rows["samples"].to_numpy() / np.maximum(rows["total"].to_numpy(), 1) * inside
    counted = int(rows["samples"].to_numpy()[inside > 0].sum())
    return pd.Series(seconds, index=rows["site"].to_numpy()).groupby(level=0).sum(), counted


def locate(
    code: pd.DataFrame | None,
    stragglers: Sequence[Any],
    step_times: StepTimes,
    roles: Mapping[int, str | None] | None = None,
) -> list[dict[str, Any]]:
    """Per straggler (``rank``, ``cause``, ``first_step``, ``last_step``, ``excess_ms``): ``{"code":
    [{"site", "leaf", "native", "share", "excess_ms"}, ...], "note": str | None}``."""
    if code is None or code.empty:
        return [{"code": [], "note": NO_SAMPLES} for _ in stragglers]
    by_rank = {int(r): g for r, g in code.groupby("rank", sort=True)}
    flagged = {int(_get(s, "rank")) for s in stragglers}
    roles = roles or {}
    return [_one(s, by_rank, flagged, step_times, roles) for s in stragglers]


def _one(s: Any, by_rank: dict[int, pd.DataFrame], flagged: set[int], step_times: StepTimes,
         roles: Mapping[int, str | None]) -> dict[str, Any]:  # fmt: skip
    rank, cause = int(_get(s, "rank")), str(_get(s, "cause"))
    window = span(step_times, int(_get(s, "first_step")), _get(s, "last_step"))
    if window is None or rank not in by_rank:
        return {"code": [], "note": f"no code samples of rank {rank} in its slow span"}
    phases = CAUSE_PHASES.get(cause, ())
    others = [r for r in by_rank if r != rank and roles.get(r) == roles.get(rank)]
    peers = [r for r in others if r not in flagged] or others
    if not peers:
        return {"code": [], "note": "no peer with code samples to compare with"}
    mine_rows = by_rank[rank][by_rank[rank]["phase"].isin(phases)]
    mine, counted = _seconds(mine_rows, *window)
    if counted < MIN_SAMPLES:
        return {"code": [], "note": f"too few code samples in its {cause} phases while it was slow ({counted}; "
                                    "a higher code_sample_hz or a longer run gives more)"}  # fmt: skip
    theirs = [_seconds(g[g["phase"].isin(phases)], *window)[0] for g in (by_rank[p] for p in peers)]
    sites = mine.index
    for t in theirs:
        sites = sites.union(t.index)
    table = pd.DataFrame({i: t.reindex(sites, fill_value=0.0) for i, t in enumerate(theirs)}, index=sites)
    excess = mine.reindex(sites, fill_value=0.0) - table.median(axis=1)
    steps = _steps_in(step_times, int(_get(s, "first_step")), _get(s, "last_step"))
    positive = excess[excess > 0].sort_values(ascending=False)
    total = float(positive.sum())
    cause_ms = float((_get(s, "excess_ms") or {}).get(cause, 0.0))
    if total <= 0 or (cause_ms > 0 and total / steps * 1000.0 < MIN_EXPLAINED * cause_ms):
        return {"code": [], "note": f"no code location stands out: its {cause} time is spread like its peers' "
                                    "(a uniformly slower device or host spreads it so)"}  # fmt: skip
    found = []
    for site, value in positive.items():
        share = float(value) / total
        if found and (share < MIN_SHARE or len(found) >= MOST_SITES):
            break
        rows = mine_rows[mine_rows["site"] == site]
        leaf = rows.groupby("leaf")["samples"].sum().idxmax()
        native = bool(rows.loc[rows["leaf"] == leaf, "samples"].groupby(rows["native"]).sum().idxmax())
        found.append({"site": str(site), "leaf": str(leaf), "native": native, "share": round(share, 3),
                      "excess_ms": round(float(value) / steps * 1000.0, 3)})  # fmt: skip
    return {"code": found, "note": None}


def _steps_in(step_times: StepTimes, first: int, last: int | None) -> int:
    steps = step_times[0]
    hi = steps[-1] if last is None else last
    return max(1, int(np.sum((steps >= first) & (steps <= hi))))


def describe_site(entry: Mapping[str, Any]) -> str:
    """``train.py:117 get_batch`` with what it called: ``(in numpy/core/memmap.py:290 __getitem__)``,
    or that Python could not see further (native code)."""
    text = str(entry["site"])
    leaf = entry.get("leaf")
    if leaf and leaf != entry["site"]:
        text += f" (in {leaf}{', native code' if entry.get('native') else ''})"
    elif entry.get("native"):
        text += " (in native code)"
    return text
