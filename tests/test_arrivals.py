"""The arrival order at the collectives: made-up creation times in, lags, unions and verdicts out; the
log-thread copy of PyTorch's record, on a real one-rank gloo group and on a made-up ring."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from stragglerwatch.analysis.arrivals import above_group, arrivals, summary, unseen_wait, victims, without_unseen
from stragglerwatch.analysis.detect import StepMatrix, Straggler
from stragglerwatch.record.collectives import load_collectives
from stragglerwatch.runtime.capture.collectives import CollectiveLog

MS = 1e-3


def rows(spec: list[tuple[int, str, int, float]]) -> pd.DataFrame:
    """(rank, group, seq, created seconds) rows."""
    return pd.DataFrame({"rank": [r for r, _, _, _ in spec], "group": [g for _, g, _, _ in spec],
                         "seq": [s for _, _, s, _ in spec], "created": [c for _, _, _, c in spec],
                         "training": True, "op": "all_reduce"})  # fmt: skip


def tp_job(steps: int = 6, late: float = 20 * MS, step_s: float = 0.1) -> pd.DataFrame:
    """Two TP pairs (0, 1) and (2, 3), two collectives a step each; rank 3 enters every one ``late``."""
    spec = []
    for k in range(steps):
        t0 = k * step_s
        for i, offset in enumerate((0.01, 0.05)):
            seq = 2 * k + i + 1
            for rank, group in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
                spec.append((rank, group, seq, t0 + offset + (late if rank == 3 else 0.0)))
    return rows(spec)


def axes(steps: int = 6, step_s: float = 0.1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = np.arange(steps)
    return s, s * step_s, (s + 1) * step_s


def test_lag_last_arrival_and_union_per_step() -> None:
    steps, start, end = axes()
    arr = arrivals(tp_job(), steps, start, end, np.arange(4), {r: "h" for r in range(4)})
    assert arr.groups == 2 and arr.skipped == {}
    assert (arr.compared == 2).all()
    assert np.allclose(arr.wait[:, 2], 2 * 20 * MS), "rank 2 waits 20 ms at each of its two collectives"
    assert np.allclose(arr.wait[:, 3], 0.0) and (arr.last[:, 3] == 2).all(), "rank 3 arrives last, waits for no one"
    assert np.allclose(arr.wait[:, :2], 0.0), "a pair that arrives together waits for no one"
    by_rank = {x["rank"]: x for x in summary(arr)}
    assert by_rank[3]["last_share"] == 1.0 and by_rank[2]["wait_ms"] == pytest.approx(40.0)


def test_overlapping_windows_count_once() -> None:
    """Three collectives issued back to back, all waiting for the same late rank: one wait, not three."""
    spec = []
    for seq, t in enumerate((0.010, 0.011, 0.012), start=1):
        spec += [(0, "g", seq, t), (1, "g", seq, 0.030)]
    steps, start, end = axes(1)
    arr = arrivals(rows(spec), steps, start, end, np.arange(2), {0: "h", 1: "h"})
    assert arr.wait[0, 0] == pytest.approx(0.020), "the union of [10, 30], [11, 30], [12, 30] ms"


def test_groups_across_hosts_and_incomplete_collectives_are_not_compared() -> None:
    steps, start, end = axes()
    job = tp_job()
    arr = arrivals(job, steps, start, end, np.arange(4), {0: "h1", 1: "h2", 2: "h3", 3: "h3"})
    assert list(arr.skipped) == ["a"] and "hosts" in arr.skipped["a"]
    assert np.isnan(arr.wait[:, 0]).all() and (arr.compared[:, 0] == 0).all()
    partial = job[~((job["rank"] == 3) & (job["seq"] == 1))]  # rank 3's first collective never recorded
    arr = arrivals(partial, steps, start, end, np.arange(4), {r: "h" for r in range(4)})
    assert arr.compared[0, 2] == 1 and arr.compared[1, 2] == 2


def matrix(busy: np.ndarray, comm: np.ndarray) -> StepMatrix:
    n, r = busy.shape
    return StepMatrix(np.arange(r), np.arange(n), {"busy_s": busy, "comm_wait_s": comm, "collective_wait_s": comm,
                                                   "step_s": busy + comm})  # fmt: skip


def test_the_partner_of_a_straggler_is_cleared_only_where_its_wait_was_unseen() -> None:
    steps, start, end = axes()
    arr = arrivals(tp_job(), steps, start, end, np.arange(4), {r: "h" for r in range(4)})
    roles = {0: "tp=0", 1: "tp=1", 2: "tp=0", 3: "tp=1"}
    flagged = [Straggler(rank=r, cause="compute", slowdown=1.5, first_step=0, last_step=None, detected_step=2,
                         lost_seconds=0.0, excess_ms={"compute": 40.0}) for r in (2, 3)]  # fmt: skip
    unseen_comm = np.zeros((6, 4))  # compiled: the partner's 40 ms a step is in no bracket
    cleared = victims(flagged, arr, roles, unseen_comm)
    assert list(cleared) == [2] and "not work" in cleared[2]
    seen_comm = np.zeros((6, 4))
    seen_comm[:, 2] = 0.045  # eager: the brackets saw the wait (and its transfer)
    assert victims(flagged, arr, roles, seen_comm) == {}, "nothing unseen: nothing to clear"
    assert np.allclose(unseen_wait(arr, seen_comm)[:, 2], 0.0)
    adjusted = without_unseen(matrix(np.full((6, 4), 0.05), unseen_comm), unseen_wait(arr, unseen_comm))
    assert np.allclose(adjusted.values["busy_s"][:, 2], 0.01) and np.allclose(adjusted.values["busy_s"][:, 3], 0.05)
    assert np.allclose(adjusted.values["comm_wait_s"][:, 2], 0.04)


def test_a_straggler_is_never_cleared_by_its_own_arrivals() -> None:
    """The late rank's wait is the smallest of its group, however much busier it is."""
    steps, start, end = axes()
    arr = arrivals(tp_job(late=50 * MS), steps, start, end, np.arange(4), {r: "h" for r in range(4)})
    only = [Straggler(rank=3, cause="data", slowdown=2.0, first_step=0, last_step=None, detected_step=2,
                      lost_seconds=0.0, excess_ms={"data": 100.0})]  # fmt: skip
    assert victims(only, arr, {}, np.zeros((6, 4))) == {}


class Ring:
    """A made-up Flight Recorder: ``entries`` grows, the oldest ones fall off past ``size``."""

    def __init__(self, size: int = 4):
        self.size, self.entries, self.next_id = size, [], 0

    def record(self, n: int, group: str = "0", p2p: bool = False) -> None:
        for _ in range(n):
            self.entries.append({"record_id": self.next_id, "process_group": (group, "default_pg"),
                                 "collective_seq_id": self.next_id + 1, "time_created_ns": 10**9 + self.next_id,
                                 "thread_id": "7", "profiling_name": "gloo:all_reduce", "is_p2p": p2p})  # fmt: skip
            self.next_id += 1
        self.entries = self.entries[-self.size :]

    def dump(self) -> bytes:
        return pickle.dumps({"entries": list(self.entries)})


def test_the_log_copies_new_entries_once_and_counts_what_the_ring_lost(tmp_path: Path) -> None:
    ring = Ring(size=4)
    log = CollectiveLog(tmp_path / "collectives-00000.jsonl", lambda: 7, dump=ring.dump, budget=1.0)
    ring.record(3)
    assert log.read() == 3
    assert log.read() == 0, "nothing new: nothing written"
    ring.record(6)  # 9 recorded, the ring holds the last 4: 2 were lost between the reads
    assert log.read() == 4 and log.lost == 2
    ring.record(1, p2p=True)
    assert log.read() == 0, "point-to-point operations are left out"
    found = load_collectives(tmp_path)
    assert found is not None and found.lost == {0: 2}
    assert found.rows["seq"].tolist() == [1, 2, 3, 6, 7, 8, 9] and found.rows["training"].all()
    assert (found.rows["group"] == "0@0").all(), "a group's name carries the attempt"
    (tmp_path / "collectives-00001.jsonl").write_text("not json\n" + json.dumps({"groups": ["0"]}) + "\n")
    assert load_collectives(tmp_path).bad_lines == 2, "lines that are not ours are skipped and counted"


def test_the_log_defers_costly_reads_to_close_and_never_raises(tmp_path: Path) -> None:
    calls = []

    def slow() -> bytes:
        calls.append(1)
        import time

        time.sleep(0.02)  # longer than MAX_READ_S
        return pickle.dumps({"entries": []})

    log = CollectiveLog(tmp_path / "c.jsonl", lambda: 1, dump=slow, budget=1.0)
    log([])
    assert log.deferred and len(calls) == 1
    log([])
    assert len(calls) == 1, "after a costly read, the flushes read no more"
    log.read()
    assert len(calls) == 2, "close still reads"

    def broken() -> bytes:
        raise RuntimeError("no ring")

    failing = CollectiveLog(tmp_path / "d.jsonl", lambda: 1, dump=broken, budget=1.0)
    assert failing.read() == 0 and failing.failures == 1


def test_the_real_record_of_a_gloo_group(one_rank_group, tmp_path: Path) -> None:
    """torch's own ring: a ``torch.distributed`` call and a functional collective, both recorded."""
    import threading

    from torch.distributed import _functional_collectives as funcol

    log = CollectiveLog(tmp_path / "collectives-00000.jsonl", threading.get_ident, budget=1.0)
    log.read()  # whatever earlier tests left in this process's ring
    before = log.rows
    t = torch.ones(4)
    dist.all_reduce(t)
    funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
    assert log.read() == 2 and log.rows == before + 2
    found = load_collectives(tmp_path)
    assert found.rows["training"].iloc[-2:].all(), "issued on this thread"
    assert (found.rows["seq"].diff().iloc[-1:] == 1).all(), "consecutive in their group"


def test_what_a_whole_group_waits_alike_moves_no_busy_time() -> None:
    """Overlapped asynchronous collectives count as unseen waits on every rank of a group alike; only a
    rank's wait above its group's least is its own."""
    unseen = np.array([[0.005, 0.005, 0.025, 0.000], [0.004, 0.006, 0.030, np.nan]])
    roles = {0: "tp=0", 1: "tp=1", 2: "tp=0", 3: "tp=1"}
    out = above_group(unseen, np.arange(4), roles)
    assert np.allclose(out[:, 0], 0.0) and np.allclose(out[:, 2], [0.020, 0.026]), "above rank 0's"
    assert np.allclose(out[:, 1], [0.005, 0.0]) and np.allclose(out[:, 3], 0.0), "a step rank 3 shared nothing"
    assert np.allclose(above_group(unseen[:, :1], np.arange(1), {}), unseen[:, :1]), "alone in its group: all its own"
