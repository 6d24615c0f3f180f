"""The arrival order at every collective: which rank entered it last, and how long the others waited.

Design (pure: rows in, arrays and verdicts out; no I/O). Every rank's collectives come from PyTorch's
own C++ record (``record/collectives.py``): group, sequence number and the wall-clock time the rank
created it. Rows of one (group, sequence number) are one collective; it is compared only when every
member of the group recorded it, and only within groups whose ranks share one host: the creation
times of two hosts differ by their clock offset, which NTP keeps at best to a fraction of a
millisecond, the size of the lags themselves (said in the report, never guessed around).

For a rank ``r`` at a collective ``c``: ``lag = max over the group of created - created_r`` is how long
``r`` waited there for the last arrival (at least: the transfer itself is not in it), and ``r`` entered
last when its lag is 0. Per step, ``wait`` is the length of the union of ``r``'s windows
``[created, created + lag]`` (a union, so that asynchronous collectives issued back to back and all
late by the same amount count once), ``last`` the collectives entered last, ``compared`` those compared.

Busy time and arrival order are two views of one fact: a straggler arrives late and waits little; its
partners arrive early and wait for it. :func:`victims` uses that where the step log cannot see a wait
(a collective inside compiled code, or issued and waited on in C++): the wait for later arrivals that
exceeds the exposed communication the step log holds is a wait no bracket saw, counted as busy; a
flagged rank whose unseen wait exceeds its peers' by at least half its excess is waiting, not working.
The verdict clears it and says why. A real straggler is never cleared by this: it is the
late arrival, whose wait is the smallest of its group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from stragglerwatch._quiet import ignoring

#: A flagged rank is cleared when its extra wait for later arrivals is at least this share of its excess.
VICTIM_SHARE = 0.5
#: ... and at least this much a step (seconds): below it the creation times' own jitter decides.
VICTIM_FLOOR_S = 0.001


@dataclass
class Arrivals:
    """Per step (the report's step axis) and rank: seconds waited for later arrivals, collectives entered
    last, collectives compared (NaN and 0 where a rank shared no compared collective that step)."""

    steps: np.ndarray
    ranks: np.ndarray
    wait: np.ndarray
    last: np.ndarray
    compared: np.ndarray
    groups: int = 0  # groups compared
    skipped: dict[str, str] = field(default_factory=dict)  # group -> why it was not compared


def arrivals(rows: pd.DataFrame, steps: np.ndarray, start: np.ndarray, end: np.ndarray, ranks: np.ndarray,
             hosts: dict[int, Any]) -> Arrivals:  # fmt: skip
    """The arrival order of ``rows`` (``record.collectives`` columns) on the steps [start, end)."""
    n, r = len(steps), len(ranks)
    out = Arrivals(steps, ranks, np.full((n, r), np.nan), np.zeros((n, r), np.int64), np.zeros((n, r), np.int64))
    if rows.empty or n == 0:
        return out
    members = rows.groupby("group")["rank"].agg(lambda s: frozenset(s.tolist()))
    keep = []
    for group, ranks_of in members.items():
        if len(ranks_of) < 2:
            continue
        if len({hosts.get(x, ("rank", x)) for x in ranks_of}) > 1:
            out.skipped[str(group)] = "its ranks are on several hosts (their clocks are not comparable)"
            continue
        keep.append(group)
    out.groups = len(keep)
    df = rows[rows["group"].isin(keep)]
    if df.empty:
        return out
    size = df["group"].map(members.map(len))
    key = ["group", "seq"]
    df = df[df.groupby(key)["rank"].transform("size") == size]  # every member recorded it
    if df.empty:
        return out
    latest = df.groupby(key)["created"].transform("max")
    lag = (latest - df["created"]).to_numpy()
    created = df["created"].to_numpy()
    col = pd.Index(ranks).get_indexer(df["rank"].to_numpy())
    pos = np.searchsorted(start, created, side="right") - 1
    inside = (pos >= 0) & (col >= 0)
    inside[inside] &= created[inside] < end[pos[inside]]
    np.add.at(out.compared, (pos[inside], col[inside]), 1)
    is_last = inside & (lag <= 0)
    np.add.at(out.last, (pos[is_last], col[is_last]), 1)
    out.wait[out.compared > 0] = 0.0
    for c in np.unique(col[inside]):
        mine = inside & (col == c)
        _add_union(out.wait[:, c], created[mine], created[mine] + lag[mine], pos[mine])
    return out


def _add_union(wait: np.ndarray, a: np.ndarray, b: np.ndarray, pos: np.ndarray) -> None:
    """Add the length of the union of the intervals [a, b) to ``wait``, each merged stretch to the step
    of its first interval."""
    order = np.argsort(a, kind="stable")
    a, b, pos = a[order], b[order], pos[order]
    run_start, run_end, run_pos = a[0], b[0], pos[0]
    for x, y, p in zip(a[1:].tolist(), b[1:].tolist(), pos[1:].tolist(), strict=True):
        if x <= run_end:
            run_end = max(run_end, y)
            continue
        wait[run_pos] += run_end - run_start
        run_start, run_end, run_pos = x, y, p
    wait[run_pos] += run_end - run_start


def _median(x: np.ndarray) -> float:
    with ignoring():
        return float(np.nanmedian(x)) if x.size else float("nan")


def _positions(arr: Arrivals, first: int, last: int | None) -> np.ndarray:
    hi = arr.steps[-1] if last is None else last
    return np.flatnonzero((arr.steps >= first) & (arr.steps <= hi))


def unseen_wait(arr: Arrivals, seen: np.ndarray) -> np.ndarray:
    """Per step and rank, the wait for later arrivals that the step log's exposed communication ``seen``
    (steps x ranks, seconds, same axes) does not hold: at least that much of its busy time was waiting."""
    with np.errstate(invalid="ignore"):
        return np.clip(arr.wait - np.nan_to_num(seen), 0.0, None)


def above_group(unseen: np.ndarray, ranks: np.ndarray, roles: dict[int, Any]) -> np.ndarray:
    """Per step, each rank's unseen wait above the least of its peer group's (same role): what every rank
    of a group shows alike (asynchronous collectives overlapped with compute, counted as waits by the
    union of their windows) is taken as no wait, so that only a rank's own extra wait moves its busy time."""
    out = np.zeros_like(unseen)
    keys = [roles.get(int(r)) for r in ranks.tolist()]
    for key in set(keys):
        cols = [i for i, k in enumerate(keys) if k == key]
        block = unseen[:, cols]
        with ignoring():  # steps no rank of the group shared a collective
            least = np.nanmin(block, axis=1, keepdims=True) if len(cols) > 1 else np.zeros((len(block), 1))
        out[:, cols] = np.nan_to_num(block - np.nan_to_num(least))
    return out


def without_unseen(mat: Any, unseen: np.ndarray) -> Any:
    """A copy of ``mat`` (``detect.StepMatrix``, same axes as ``unseen``) whose busy time no longer holds
    the unseen waits: they move to ``collective_wait_s`` and ``comm_wait_s``. The phase they sat in is not
    known (the step log saw no bracket), so the phases are left as they were; the cause of a straggler
    found again is its own phases' excess over its peers', which this does not touch."""
    extra = np.nan_to_num(unseen)
    values = dict(mat.values)
    for column, sign in (("busy_s", -1.0), ("comm_wait_s", 1.0), ("collective_wait_s", 1.0)):
        if column in values:
            values[column] = values[column] + sign * extra
    return dataclasses.replace(mat, values=values)


def victims(stragglers: list[Any], arr: Arrivals, roles: dict[int, Any], seen: np.ndarray) -> dict[int, str]:
    """The flagged ranks (``detect.Straggler``) that arrival order shows to be waiting, with why: their
    unseen wait (:func:`unseen_wait`) exceeds their peers' by at least half their excess."""
    flagged = {s.rank for s in stragglers}
    column = {int(x): i for i, x in enumerate(arr.ranks.tolist())}
    unseen = unseen_wait(arr, seen)
    out = {}
    for s in stragglers:
        c = column.get(s.rank)
        pos = _positions(arr, s.first_step, s.last_step)
        if c is None or not pos.size:
            continue
        own = _median(unseen[pos, c])
        peers = [column[x] for x in column if x not in flagged and roles.get(x) == roles.get(s.rank)]
        theirs = _median(np.array([_median(unseen[pos, p]) for p in peers])) if peers else 0.0
        excess = max(0.0, sum(s.excess_ms.values()) / 1e3)
        extra = own - (theirs if np.isfinite(theirs) else 0.0)
        if np.isfinite(extra) and extra >= max(VICTIM_FLOOR_S, VICTIM_SHARE * excess):
            out[s.rank] = (f"it entered its collectives early and waited for later arrivals a median "
                           f"{own * 1e3:.1f} ms a step more than its exposed communication shows (its peers: "
                           f"{theirs * 1e3:.1f} ms), against its {excess * 1e3:.1f} ms excess: a wait no bracket "
                           "of ours saw (inside compiled code or C++), not work")  # fmt: skip
    return out


def summary(arr: Arrivals) -> list[dict[str, Any]]:
    """Per rank over the run: collectives compared a step, the share it entered last, its median wait."""
    out = []
    for i, rank in enumerate(arr.ranks.tolist()):
        compared = arr.compared[:, i]
        seen = compared > 0
        if not seen.any():
            continue
        out.append({"rank": int(rank), "collectives_per_step": round(float(np.median(compared[seen])), 2),
                    "last_share": round(float(arr.last[:, i].sum() / compared.sum()), 4),
                    "wait_ms": round(_median(arr.wait[seen, i]) * 1e3, 3)})  # fmt: skip
    return out
