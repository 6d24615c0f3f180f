"""What fixing a straggler would save the job: the cost test of a flag. Pure.

Every collective waits for the slowest rank, so a rank costs the job what its step would lose if that rank
ran like its peers: its busy time above the busiest *other* rank (or above its peers' reference, whichever
is larger), at the steps where it is the slowest. Two consequences shape the test:

- a rank behind a slower one costs nothing until that one is fixed: the flagged stretches are costed in
  turn, the costliest first, each with the ranks costed before it running at their reference ("the rank
  that would hold the job next once the first is fixed");
- ranks that are slow together (a whole host that drifted) save nothing one at a time: fixing one leaves
  the next as slow. No single rank is to blame; none is flagged for it.

The busiest ranks of each step (:data:`TOP_K` of them, from ``stages.step_stage``) are all it needs, so the
local, live and Ray engines cost the same stretches the same way. Where more than ``TOP_K`` ranks of a step
are fixed or costed, the next one is bounded by the ``TOP_K``-th busiest (it saves no more than that says).
"""

from __future__ import annotations

import numpy as np

#: The busiest ranks of each step kept for the cost test.
TOP_K = 16


def top_k(filled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step (row), the :data:`TOP_K` largest busy times in descending order and their columns; ``filled``
    holds -inf for a missing value. Padding: -inf and column -1."""
    n, r = filled.shape
    vals, cols = np.full((n, TOP_K), -np.inf), np.full((n, TOP_K), -1, dtype=np.int64)
    k = min(TOP_K, r)
    if not (n and k):
        return vals, cols
    idx = np.argpartition(-filled, k - 1, axis=1)[:, :k] if k < r else np.broadcast_to(np.arange(r), (n, r)).copy()
    v = np.take_along_axis(filled, idx, axis=1)
    order = np.argsort(-v, axis=1, kind="stable")
    vals[:, :k], cols[:, :k] = np.take_along_axis(v, order, axis=1), np.take_along_axis(idx, order, axis=1)
    return vals, cols


def savings(top_v: np.ndarray, top_c: np.ndarray, ref: np.ndarray, columns: set[int], fixed: set[int]) -> np.ndarray:
    """Per step: the seconds the job's step would lose if the ranks in ``columns`` ran at ``ref`` (their peers'
    reference, per step), with those in ``fixed`` already running at theirs. Zero where none of them is the
    slowest."""
    ours = np.isin(top_c, list(columns))
    gone = ours | (np.isin(top_c, list(fixed)) if fixed else False)
    mine = np.where(ours, top_v, -np.inf).max(axis=1)
    rest = np.where(gone, -np.inf, top_v)
    known = np.isfinite(rest).any(axis=1)
    bound = np.where(known, rest.max(axis=1), top_v[:, -1])  # every kept one ours or fixed: the K-th bounds
    with np.errstate(invalid="ignore"):
        saved = np.where(mine >= np.where(known, rest.max(axis=1), -np.inf), mine - np.maximum(ref, bound), 0.0)
    return np.clip(np.nan_to_num(saved, nan=0.0, posinf=0.0, neginf=0.0), 0.0, None)


def cost_in_turn(stretches: list[tuple[int, int, int]], top_v: np.ndarray, top_c: np.ndarray, group: np.ndarray,
                 ref: np.ndarray, step_s: np.ndarray, min_share: float,
                 kept: list[bool] | None = None) -> list[tuple[float, float, bool]]:  # fmt: skip
    """For flagged stretches ``(column, first row, stop row)``: ``(seconds saved, share of the stretch's
    time, costly)`` if each were fixed. Costed in turn: those ``kept`` whatever they cost first (taken as
    fixed after), then the one saving most alone, then each with the costly ones before it fixed; costly: a
    share of at least ``min_share``. Then the rest together, where
    their stretches overlap in one peer group (a whole slow host saves nothing one rank at a time): such a
    set is costly where fixing it all would save at least ``min_share`` per rank in it (a host that drifted a
    little, together, is not). ``top_v``, ``top_c``: steps x groups x :data:`TOP_K`, each peer group's
    busiest (a rank is costed against the ranks it is compared with: its pipeline stage's, not a slower
    stage's); ``group``: each column's group; ``ref``: steps x columns, each column's reference; ``step_s``:
    the job's step time."""

    def saved_by(columns: set[int], a: int, b: int, fixed: set[int]) -> tuple[float, float]:
        c = next(iter(columns))
        g = int(group[c])
        saved = float(savings(top_v[a:b, g], top_c[a:b, g], ref[a:b, c], columns, fixed).sum())
        total = float(np.nansum(step_s[a:b]))
        return saved, saved / total if total > 0 else 0.0

    first = kept or [False] * len(stretches)
    alone = [saved_by({c}, a, b, set())[0] for c, a, b in stretches]
    out: list[tuple[float, float, bool]] = [(0.0, 0.0, False)] * len(stretches)
    fixed: set[int] = set()
    for i in sorted(range(len(stretches)), key=lambda i: (not first[i], -alone[i])):
        c, a, b = stretches[i]
        saved, share = saved_by({c}, a, b, fixed)
        out[i] = (saved, share, share >= min_share)
        if share >= min_share or first[i]:
            fixed.add(c)
    for members in _overlapping([i for i in range(len(stretches)) if not out[i][2]], stretches, group):
        if len(members) < 2:
            continue
        a, b = min(stretches[i][1] for i in members), max(stretches[i][2] for i in members)
        saved, share = saved_by({stretches[i][0] for i in members}, a, b, fixed)
        if share >= min_share * len(members):
            for i in members:
                out[i] = (saved / len(members), share / len(members), True)
    return out


def _overlapping(indices: list[int], stretches: list[tuple[int, int, int]], group: np.ndarray) -> list[list[int]]:
    """The stretches in sets that overlap in time, one peer group each (connected: A with B, B with C)."""
    sets: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (int(group[stretches[i][0]]), stretches[i][1])):
        c, a, b = stretches[i]
        last = sets[-1] if sets else None
        if last is not None and int(group[stretches[last[0]][0]]) == int(group[c]) \
                and a < max(stretches[j][2] for j in last):  # fmt: skip
            last.append(i)
        else:
            sets.append([i])
    return sets
