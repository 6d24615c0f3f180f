"""The ops of a trace laid out as a grid, and the dependency model of one step, for the what-if replay.

Grid: an op is a *node* ``(stage, optype, seq_id)``; an *instance* is one (step, dp rank). Every
node occurs once per instance (steps where a worker misses an op, or has an extra one, are left
out), so a replay handles all steps and data-parallel replicas at once, one vector per node.

Dependency model (the streams of a Megatron-style worker, after the OSDI'25 what-if analysis,
Lin et al., "Understanding Stragglers in Large Model Training Using What-if Analysis"). It is read
off one reference instance (dp rank 0 of the first step) and holds for all of them:

- compute stream: forward and backward compute in their recorded order;
- pipeline streams: ``forward-send``, ``forward-recv``, ``backward-send``, ``backward-recv``, one
  stream each, in recorded order. Receives that start after the last compute of their direction,
  and sends that end before the first one, were recorded but never launched. The k-th launched
  send of a direction depends on the k-th compute of that direction; the k-th launched receive
  feeds the compute that consumes it (the k-th, or the (k+1)-th on a first or last stage whose
  first receive is missing) and waits for the compute before. The first backward send/receive also
  waits for the forward compute two before the first backward. A launched op whose model chunk has
  a peer (not the first chunk's receives, nor the last chunk's sends) is numbered in order among
  those of its type; the k-th send of stage s meets the k-th receive of its peer stage. The rest
  are no-ops (in their streams, but meeting nobody);
- data-parallel stream: ``params-all-gather`` and ``grads-reduce-scatter`` in recorded order; the
  first forward compute of a model chunk waits for its all-gather;
- after the last compute: ``gc``, ``layernorm-grads-all-reduce``, ``embedding-grads-all-reduce``
  (first and last stage), the reduce-scatters (or, overlapped, ``separate-grads-all-reduce``),
  ``optimizer-clip-main-grad``, ``optimizer``.

Communication groups start together when their last member is ready: a send/receive pair; a
data-parallel collective (synchronised over all dp ranks of its stage); the embedding all-reduce
of the first and last stage; the clip all-reduce of all stages (synchronised over dp ranks too).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np
import pandas as pd

FWD, BWD = "forward-compute", "backward-compute"
AG, RS, SEP_AR = "params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce"
GC, LAYERNORM, EMBEDDING = "gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce"
CLIP, OPTIMIZER = "optimizer-clip-main-grad", "optimizer"
# a p2p op's peer type and the stage offset of the peer (also the model-chunk offset)
P2P_PEER = {"forward-send": ("forward-recv", 1), "forward-recv": ("forward-send", -1),
            "backward-send": ("backward-recv", -1), "backward-recv": ("backward-send", 1)}  # fmt: skip
DP_COMM = (AG, RS, SEP_AR)
# communication in the method's sense: its ideal duration is the median, not the mean
COMM_TYPES = (*P2P_PEER, *DP_COMM, LAYERNORM, EMBEDDING, CLIP)
MODELLED = (FWD, BWD, GC, OPTIMIZER, *COMM_TYPES)
MATCH_EPS = 5e-5  # s, clock error allowed when telling launched sends/receives from no-ops


class ModelError(Exception):
    """The trace does not fit the dependency model; the message is one line."""


@dataclass
class OpGrid:
    nodes: pd.DataFrame  # stage, optype, seq_id, mc, gmc; one row per node
    steps: np.ndarray  # the steps kept, in order
    dp: int
    pp: int
    start: np.ndarray  # [node, instance], seconds from the step's first op; instance = step index * dp + dp rank
    end: np.ndarray
    skipped_steps: list[int]

    @property
    def instances(self) -> int:
        return self.start.shape[1]


def build_grid(df: pd.DataFrame, dp: int, pp: int) -> OpGrid:
    """Lay the modelled ops of complete steps out as [node, instance] arrays."""
    df = df[df["optype"].isin(MODELLED)]
    if df.empty:
        raise ModelError(f"no op of the types the replay models ({', '.join(MODELLED[:4])}, ...)")
    key = ["stage", "optype", "seq_id"]
    seen = df.drop_duplicates(["step", "dp_rank", *key]).groupby(key).size()
    n_all = df["step"].nunique() * dp
    node_index = seen[seen * 2 > n_all].index  # ops present on most instances: the step's anatomy
    node_id = node_index.get_indexer(pd.MultiIndex.from_frame(df[key]))
    cell = pd.DataFrame({"step": df["step"].to_numpy(), "dp": df["dp_rank"].to_numpy(), "node": node_id})
    bad = (node_id < 0) | cell.duplicated(keep=False).to_numpy()  # an unknown op, or one recorded twice
    per_step = pd.Series(~bad).groupby(cell["step"]).agg(["all", "size"])
    good = per_step.index[per_step["all"] & (per_step["size"] == len(node_index) * dp)]
    skipped = sorted(int(s) for s in set(per_step.index) - set(good))
    if len(good) == 0:
        raise ModelError("no step in which every worker has the same ops (a complete step)")
    keep = df["step"].isin(good).to_numpy()
    df, node_id = df.loc[keep], node_id[keep]
    steps = np.sort(good.to_numpy())
    inst = np.searchsorted(steps, df["step"].to_numpy()) * dp + df["dp_rank"].to_numpy()
    start_ts = df["start_ts"].to_numpy(np.float64)
    step_start = pd.Series(start_ts).groupby(df["step"].to_numpy()).transform("min").to_numpy()
    start = np.zeros((len(node_index), len(steps) * dp))
    end = np.zeros_like(start)
    start[node_id, inst] = start_ts - step_start
    end[node_id, inst] = start_ts - step_start + df["duration"].to_numpy(np.float64)
    nodes = node_index.to_frame(index=False)
    ref = df[(df["step"] == steps[0]) & (df["dp_rank"] == 0)]
    ref_ids = node_id[(df["step"] == steps[0]).to_numpy() & (df["dp_rank"] == 0).to_numpy()]
    for col, default in (("mc", 0), ("gmc", None)):
        values = np.full(len(nodes), -1, dtype=np.int64)
        given = pd.to_numeric(ref[col], errors="coerce") if col in ref.columns else None
        if given is not None and given.notna().all():
            values[ref_ids] = given.to_numpy(np.int64)
        else:
            values[:] = nodes["stage"].to_numpy() if default is None else default
        nodes[col] = values
    return OpGrid(nodes, steps, dp, pp, start, end, skipped)


@dataclass
class DepModel:
    deps: list[np.ndarray]  # per node: the nodes it waits for
    groups: list[np.ndarray]  # communication groups: nodes that start together
    dp_sync: list[bool]  # per group: also synchronised over the dp ranks of the step
    group_of: np.ndarray  # per node: its group, -1 for an op that waits for nobody else
    order: list[tuple[np.ndarray, int]]  # (nodes, group or -1), in an order that respects every dependency
    noops: int  # pipeline sends/receives recorded but never launched


class _Builder:
    def __init__(self, grid: OpGrid):
        self.grid = grid
        nodes = grid.nodes
        self.stage = nodes["stage"].to_numpy()
        self.optype = nodes["optype"].to_numpy()
        self.seq = nodes["seq_id"].to_numpy()
        self.mc, self.gmc = nodes["mc"].to_numpy(), nodes["gmc"].to_numpy()
        self.rs, self.re = grid.start[:, 0], grid.end[:, 0]  # the reference instance: dp rank 0, first step
        self.by: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (s, o) in enumerate(zip(self.stage, self.optype, strict=True)):
            self.by[(int(s), str(o))].append(i)
        self.deps: list[list[int]] = [[] for _ in range(len(nodes))]

    def ordered(self, s: int, *types: str) -> list[int]:
        """Ops of a stage in the order the reference instance ran them."""
        ids = [i for t in types for i in self.by.get((s, t), [])]
        return sorted(ids, key=lambda i: (self.rs[i], self.seq[i], self.optype[i]))

    def by_seq(self, s: int, t: str) -> list[int]:
        return sorted(self.by.get((s, t), []), key=lambda i: self.seq[i])

    def chain(self, ids: list[int], first: list[int] | None = None) -> None:
        prev = list(first or [])
        for i in ids:
            self.deps[i].extend(prev)
            prev = [i]

    def pipeline(self, s: int, vpp: int, valid: dict[tuple[str, int, int], int], noop: list[int]) -> None:
        """Match sends/receives of stage ``s`` to computes; number the launched ones per type."""
        pp = self.grid.pp
        for direction in ("forward", "backward"):
            computes = self.by_seq(s, f"{direction}-compute")
            last_start = max((self.rs[c] for c in computes), default=-np.inf)
            first_end = min((self.re[c] for c in computes), default=np.inf)
            for kind in ("send", "recv"):
                t = f"{direction}-{kind}"
                ops = self.ordered(s, t)
                if kind == "recv":
                    launched = [self.rs[i] <= last_start + MATCH_EPS for i in ops]
                else:
                    launched = [self.re[i] >= first_end - MATCH_EPS for i in ops]
                n, k = sum(launched), 0
                if n != len(computes):  # only the first and last stage may lack them
                    if s not in (0, pp - 1) or n not in (0, len(computes) - 1):
                        raise ModelError(f"stage {s} has {n} launched {t} ops for {len(computes)} {direction} computes")
                    k = 1 if kind == "recv" and n == len(computes) - 1 else 0  # the first receive is missing
                n_valid = 0
                for i, ok in zip(ops, launched, strict=True):
                    if not ok:
                        noop.append(i)
                        continue
                    c = computes[k]
                    if kind == "send":
                        self.deps[i].append(c)
                    else:
                        self.deps[c].append(i)
                        if k > 0:
                            self.deps[i].append(computes[k - 1])
                    k += 1
                    if 0 <= self.gmc[c] + P2P_PEER[t][1] < vpp * pp:
                        valid[(t, s, n_valid)] = i
                        n_valid += 1
                    else:  # no peer model chunk: the first chunk's receive, the last chunk's send
                        noop.append(i)

    def first_backward_p2p(self, s: int, computes: list[int]) -> None:
        kinds = [self.optype[i] for i in computes]
        if BWD not in kinds or kinds.index(BWD) < 2:
            return
        fb = kinds.index(BWD)
        if kinds[fb - 1] != FWD or kinds[fb - 2] != FWD:
            raise ModelError(f"stage {s}: the first backward compute does not follow two forward computes")
        for t in ("backward-recv", "backward-send"):
            for i in self.by.get((s, t), []):
                if self.seq[i] == 0:
                    self.deps[i].append(computes[fb - 2])

    def data_parallel(self, s: int, overlapped: bool) -> None:
        self.chain(self.ordered(s, AG, RS))
        done: set[int] = set()
        for i in reversed(self.by_seq(s, AG)):  # a chunk's first forward waits for its all-gather
            forwards = [c for c in self.by.get((s, FWD), []) if self.mc[c] == self.mc[i]]
            if self.mc[i] not in done and forwards:
                self.deps[min(forwards, key=lambda c: self.rs[c])].append(i)
            done.add(int(self.mc[i]))
        done = set()
        for i in self.by_seq(s, RS) if overlapped else []:  # reduce-scatter waits for the chunk's last backward
            backwards = [c for c in self.by.get((s, BWD), []) if self.mc[c] == self.mc[i]]
            if self.mc[i] not in done and backwards:
                self.deps[i].append(max(backwards, key=lambda c: self.re[c]))
            done.add(int(self.mc[i]))

    def tail(self, s: int, computes: list[int], use_dp: bool, overlapped: bool) -> None:
        if not self.by.get((s, OPTIMIZER)):
            raise ModelError(f"stage {s} has no optimizer op (the end of a step)")
        last = [max(computes, key=lambda c: self.re[c])] if computes else []
        gcs = self.by_seq(s, GC)
        self.chain(gcs, last)
        last = gcs[-1:] or last
        scatters = self.by_seq(s, RS)
        middle = self.by_seq(s, SEP_AR) if overlapped else scatters if use_dp else []
        first = [*scatters[-1:], *last] if overlapped else last
        ops = [*self.by_seq(s, LAYERNORM), *self.by_seq(s, EMBEDDING), *middle, *self.by_seq(s, CLIP)]
        self.chain([*ops, *self.by_seq(s, OPTIMIZER)], first)


def build_model(grid: OpGrid, use_dp: bool) -> DepModel:
    """The dependency model of a step, read off the reference instance (dp rank 0 of the first step)."""
    b, pp = _Builder(grid), grid.pp
    compute_mc = grid.nodes.loc[grid.nodes["optype"].isin((FWD, BWD)), "mc"]
    vpp = max(1, int(compute_mc.max()) + 1) if len(compute_mc) else 1
    overlapped = use_dp and bool((grid.nodes["optype"] == SEP_AR).any())
    valid: dict[tuple[str, int, int], int] = {}
    noop: list[int] = []
    for s in range(pp):
        computes = b.ordered(s, FWD, BWD)
        b.chain(computes)
        for t in P2P_PEER:
            b.chain(b.ordered(s, t))
        b.pipeline(s, vpp, valid, noop)
        b.first_backward_p2p(s, computes)
        if use_dp:
            b.data_parallel(s, overlapped)
        b.tail(s, computes, use_dp, overlapped)
    groups: list[list[int]] = []
    sync: list[bool] = []
    for (t, s, k), i in valid.items():
        peer_type, delta = P2P_PEER[t]
        j = valid.get((peer_type, (s + delta) % pp, k))
        if j is None:
            raise ModelError(f"stage {s}: {t} #{k} has no {peer_type} on stage {(s + delta) % pp}")
        if t.endswith("send"):
            groups.append([i, j])
            sync.append(False)
    groups += [[i] for i in noop]
    sync += [False] * len(noop)
    if use_dp:
        for i in np.flatnonzero(grid.nodes["optype"].isin(DP_COMM).to_numpy()):
            groups.append([int(i)])
            sync.append(True)
    for t, synced in ((EMBEDDING, False), (CLIP, True)):
        for _, ids in grid.nodes[grid.nodes["optype"] == t].groupby("seq_id").groups.items():
            groups.append([int(i) for i in ids])
            sync.append(synced)
    return _finish(b.deps, groups, sync, len(noop))


def _finish(deps: list[list[int]], groups: list[list[int]], sync: list[bool], noops: int) -> DepModel:
    n = len(deps)
    group_of = np.full(n, -1, dtype=np.int64)
    for g, members in enumerate(groups):
        group_of[members] = g
    # a group is one vertex of the order; an op outside any group is a vertex of its own
    vertex = np.where(group_of >= 0, group_of, len(groups) + np.arange(n))
    members_of: dict[int, list[int]] = defaultdict(list)
    for i, v in enumerate(vertex):
        members_of[int(v)].append(i)
    succ: dict[int, set[int]] = defaultdict(set)
    indeg = dict.fromkeys(members_of, 0)
    for i, ds in enumerate(deps):
        for u in ds:
            a, z = int(vertex[u]), int(vertex[i])
            if a == z:
                raise ModelError("the dependency model has a cycle (an op waits for its own group)")
            if z not in succ[a]:
                succ[a].add(z)
                indeg[z] += 1
    queue = deque(v for v, d in indeg.items() if d == 0)
    order: list[tuple[np.ndarray, int]] = []
    while queue:
        v = queue.popleft()
        order.append((np.array(members_of[v]), v if v < len(groups) else -1))
        for z in succ[v]:
            indeg[z] -= 1
            if indeg[z] == 0:
                queue.append(z)
    if len(order) != len(members_of):
        raise ModelError("the dependency model has a cycle (the trace's op order contradicts the schedule)")
    dep_arrays = [np.array(sorted(set(d)), dtype=np.int64) for d in deps]
    return DepModel(dep_arrays, [np.array(g) for g in groups], sync, group_of, order, noops)
