"""What-if replay of op-level traces of hybrid-parallel jobs (pipeline x data parallel).

Design (after the OSDI'25 what-if analysis of stragglers): each step is replayed as a
discrete-event simulation. On a worker, ops run one after another in their recorded
order; ops that started together (a batched send/recv) form one group. Groups that
must meet, the two ends of a pipeline send/recv (``forward-send`` of stage s with
``forward-recv`` of stage s+1 for the same micro-batch; ``backward-send`` with
``backward-recv`` of stage s-1) and the members of a collective (data-parallel
``params-all-gather``/``grads-reduce-scatter`` within a stage, ``embedding-grads-all-reduce``
between the first and last stage, the global ``optimizer-clip-main-grad``), start together
when the last of them is ready. Communication always lasts its transfer time (for
pipeline sends and receives the fastest p2p op of the step, for a collective its fastest
occurrence: the waiting is what the replay recomputes); compute lasts either its real
duration or its *ideal* one, the mean of its op type over all workers in that step (the
durations are given by the caller, see ``traces.Replay``). ``S = T(real) / T(ideal)``; a part's share of S is
``T(ideal, with only that part's compute real) / T(ideal)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pandas as pd

COMPUTE = ("forward-compute", "backward-compute", "optimizer")
P2P = {"forward-send": ("forward-recv", 1), "backward-send": ("backward-recv", -1)}
DP_COLLECTIVES = ("params-all-gather", "grads-reduce-scatter")
GLOBAL_COLLECTIVES = ("optimizer-clip-main-grad",)
EDGE_COLLECTIVES = ("embedding-grads-all-reduce",)


@dataclass
class StepGraph:
    """One step: groups per worker (in order), their ops, and the sync sets they belong to."""

    worker_groups: dict[tuple[int, int], list[int]]  # (dp, stage) -> group ids in order
    group_ops: list[np.ndarray]  # row indices into the step's frame
    group_set: np.ndarray  # sync-set id of each group
    set_members: dict[int, list[int]]


def build_graph(step: pd.DataFrame, pp: int) -> StepGraph:
    step = step.sort_values(["dp_rank", "stage", "start_ts", "optype"], kind="stable")
    rows = step.reset_index(drop=True)
    worker_groups: dict[tuple[int, int], list[int]] = {}
    group_ops: list[np.ndarray] = []
    op_group = np.empty(len(rows), dtype=np.int64)
    for (dp, st), idx in rows.groupby(["dp_rank", "stage"], sort=True).indices.items():
        starts = rows["start_ts"].to_numpy()[idx]
        order = np.argsort(starts, kind="stable")
        idx, starts = idx[order], starts[order]
        breaks = np.flatnonzero(np.diff(starts) > 1e-7) + 1
        ids = []
        for chunk in np.split(idx, breaks):
            op_group[chunk] = len(group_ops)
            ids.append(len(group_ops))
            group_ops.append(chunk)
        worker_groups[(int(dp), int(st))] = ids
    parent = np.arange(len(group_ops))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    key = {}
    opt, dp_col, st_col, seq = (rows[c].to_numpy() for c in ("optype", "dp_rank", "stage", "seq_id"))
    for i in range(len(rows)):
        key[(opt[i], int(dp_col[i]), int(st_col[i]), int(seq[i]))] = i
    collectives: dict[tuple, list[int]] = defaultdict(list)
    for i in range(len(rows)):
        o = opt[i]
        if o in P2P:
            recv, delta = P2P[o]
            j = key.get((recv, int(dp_col[i]), int(st_col[i]) + delta, int(seq[i])))
            if j is not None:
                union(op_group[i], op_group[j])
        elif o in DP_COLLECTIVES:
            collectives[(o, int(st_col[i]), int(seq[i]))].append(i)
        elif o in GLOBAL_COLLECTIVES:
            collectives[(o, int(seq[i]))].append(i)
        elif o in EDGE_COLLECTIVES and int(st_col[i]) in (0, pp - 1):
            collectives[(o, int(dp_col[i]), int(seq[i]))].append(i)
    for members in collectives.values():
        for j in members[1:]:
            union(op_group[members[0]], op_group[j])
    group_set = np.array([find(g) for g in range(len(group_ops))])
    set_members: dict[int, list[int]] = defaultdict(list)
    for g, s in enumerate(group_set):
        set_members[int(s)].append(g)
    return StepGraph(worker_groups, group_ops, group_set, dict(set_members))


def makespan(graph: StepGraph, durations: np.ndarray) -> float:
    """Replay a step with the given op durations; the time from its first op to its last."""
    dur = np.array([durations[ops].max() if len(ops) else 0.0 for ops in graph.group_ops])
    worker_of, pos = {}, {}
    for w, groups in graph.worker_groups.items():
        for i, g in enumerate(groups):
            worker_of[g], pos[g] = w, i
    head = dict.fromkeys(graph.worker_groups, 0)
    ready = dict.fromkeys(graph.worker_groups, 0.0)
    remaining = {s: len(m) for s, m in graph.set_members.items()}
    at_head: dict[int, int] = defaultdict(int)
    fire: list[int] = []

    def arrive(g: int) -> None:
        s = int(graph.group_set[g])
        at_head[s] += 1
        if at_head[s] == remaining[s]:
            fire.append(s)

    for groups in graph.worker_groups.values():
        if groups:
            arrive(groups[0])
    end_time, done, total = 0.0, 0, len(graph.group_ops)
    while done < total:
        if fire:
            s = fire.pop()
        else:  # a partner the trace does not show: let the set's present members go, earliest first
            s = min((s for s, n in at_head.items() if n > 0),
                    key=lambda s: min(ready[worker_of[g]] for g in graph.set_members[s]
                                      if head[worker_of[g]] == pos[g]))  # fmt: skip
        members = [g for g in graph.set_members[s] if head[worker_of[g]] == pos[g]]
        start = max(ready[worker_of[g]] for g in members)
        at_head[s] -= len(members)
        remaining[s] -= len(members)
        for g in members:
            w = worker_of[g]
            ready[w] = start + dur[g]
            end_time = max(end_time, ready[w])
            head[w] += 1
            done += 1
            if head[w] < len(graph.worker_groups[w]):
                arrive(graph.worker_groups[w][head[w]])
    return end_time
