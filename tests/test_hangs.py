"""Hang diagnosis: the pure rules, the watchdog thread in one process, an unreachable store."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import stragglerwatch
from stragglerwatch.hangs import classify, hangs_from_events
from stragglerwatch.watchdog import PeerBoard, read_events

W = "allreduce_wait"


def test_classify_culprit_victims_and_silence() -> None:
    states = {0: {"step": 7, "phase": W}, 1: {"step": 7, "phase": "data_wait"}, 2: {"step": 7, "phase": W}, 3: None}
    v = classify(states, 4)
    assert v["culprit_ranks"] == [1, 3] and v["victim_ranks"] == [0, 2] and v["silent_ranks"] == [3]
    assert (v["step"], v["phase"]) == (7, "data_wait")
    earlier = classify({0: {"step": 7, "phase": W}, 1: {"step": 6, "phase": W}}, 2)
    assert earlier["culprit_ranks"] == [1], "a rank at an earlier step holds the others back"
    dead = classify({0: {"step": 3, "phase": W}, 1: {"step": 3, "phase": W}}, 3)
    assert dead["culprit_ranks"] == [2] == dead["silent_ranks"]
    network = classify({0: {"step": 3, "phase": W}, 1: {"step": 3, "phase": W}}, 2)
    assert network["culprit_ranks"] == [] and network["victim_ranks"] == [0, 1]


def stall(rank: int, phase: str, t: float, peers: dict | None = None, kind: str = "stall") -> dict:
    ev = {"kind": kind, "rank": rank, "step": 12, "phase": phase, "detected_at": t, "waited_s": 3.1,
          "threshold_s": 3.0, "id": f"{rank}-12", "stall_id": f"{rank}-12"}  # fmt: skip
    if kind == "diagnosis":
        ev.update(evidence="store", peers=peers)
    if kind == "stall":
        ev["stacks"] = {"MainThread (1)": "File x.py, line 1, in main\n  time.sleep(60)\n"}
    return ev


def test_hangs_from_events_store_local_and_shutdown() -> None:
    peers = {str(r): {"step": 12, "phase": "other" if r == 2 else W, "at": 100.5} for r in range(4)}
    events = [stall(r, "other" if r == 2 else W, 100.0 + r * 0.1) for r in range(4)]
    events += [stall(r, W, 102.0, peers, kind="diagnosis") for r in range(4)]
    events += [{"kind": "recovery", "rank": 0, "step": 13, "phase": W, "stall_id": "0-12", "detected_at": 110.0}]
    events += [{"kind": "closed", "rank": r, "step": 30, "phase": "other", "detected_at": 120.0} for r in range(4)]
    (h,) = hangs_from_events(events, 4)
    assert h["culprit_ranks"] == [2] and h["victim_ranks"] == [0, 1, 3] and h["evidence"] == "store"
    assert h["recovered"] and h["phase"] == "other" and h["detected_at"] == 100.0
    assert "time.sleep(60)" in h["stacks"]["2"]["MainThread (1)"]
    # only the culprit's own record, no store: it names itself, nobody is called silent
    (local,) = hangs_from_events([stall(2, "forward", 50.0)], 4)
    assert local["culprit_ranks"] == [2] and local["silent_ranks"] == [] and local["evidence"] == "local"
    # rank 1 was SIGKILLed: the survivors' last records, and its silence
    down = [{"kind": k, "rank": r, "step": 9, "phase": W, "detected_at": 200.0, "reason": k}
            for r, k in ((0, "sigterm"), (2, "exception"), (3, "sigterm"))]  # fmt: skip
    (d,) = hangs_from_events(down, 4, last_steps={0: 8, 1: 7, 2: 8, 3: 8})
    assert d["culprit_ranks"] == [1] and d["victim_ranks"] == [0, 2, 3] and d["evidence"] == "shutdown"
    assert hangs_from_events([e for e in events if e["kind"] == "closed"], 4) == [], "clean end: no hang"


def test_read_events_skips_and_counts_garbage(tmp_path: Path) -> None:
    good = {"kind": "closed", "rank": 0, "step": 1, "phase": "other"}
    (tmp_path / "events-00000.jsonl").write_text(json.dumps(good) + "\n{cut by a ki\n[1, 2]\n\n")
    (tmp_path / "events-00001.jsonl").write_bytes(b"\xff\xfe garbage\n")
    events, bad = read_events(tmp_path)
    assert events == [good] and bad == 4


def test_unreachable_store_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    board = PeerBoard("run", 0, 2, timeout_s=1.0)
    board._address = ("127.0.0.1", port)
    t0 = time.monotonic()
    assert board.publish({"step": 1}) is False and board.read() is None
    assert time.monotonic() - t0 < 10 and board.errors == 2


def test_watchdog_in_one_process_stall_recovery_close(tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "run", optimizer=opt, watchdog_timeout_s=0.5) as watch:
        for i in range(6):
            if i == 3:
                time.sleep(1.5)
                assert watch.stats()["stalled"]
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        time.sleep(0.5)
        stats = watch.stats()
        assert not stats["stalled"] and sum(stats["watchdog_timeouts"].values()) == 1
        assert abs(stats["last_step_timestamp"] - time.time()) < 5
    events, bad = read_events(tmp_path / "run")
    assert bad == 0
    assert [e["kind"] for e in events] == ["stall", "diagnosis", "recovery", "closed"]
    stall_ev, diag = events[0], events[1]
    assert stall_ev["step"] == 3 and 0.5 <= stall_ev["waited_s"] < 1.5
    assert any("time.sleep(1.5)" in s for s in stall_ev["stacks"].values())
    assert diag["evidence"] == "local" and diag["culprit_ranks"] == [0]
    assert events[2]["stalled_s"] >= 1.4


def test_watchdog_off_and_healthy(tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "off", optimizer=opt, watchdog_timeout_s=0):
        pass
    assert not list((tmp_path / "off").glob("events-*"))
    with stragglerwatch.attach(model, tmp_path / "on", optimizer=opt, watchdog_timeout_s=0.5):
        for _ in range(20):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            time.sleep(0.05)
    assert [e["kind"] for e in read_events(tmp_path / "on")[0]] == ["closed"]


@pytest.mark.parametrize("exc", [RuntimeError("Connection closed by peer"), ValueError("x")])
def test_uncaught_exception_is_recorded(tmp_path: Path, exc: Exception) -> None:
    import sys

    original = sys.excepthook
    watch = stragglerwatch.attach(nn.Linear(8, 2), tmp_path / "run")
    seen = []
    try:
        watch._shutdown._prev_excepthook = lambda *a: seen.append(a[0])
        sys.excepthook(type(exc), exc, None)  # as Python calls it for an uncaught exception
    finally:
        watch.close()
        sys.excepthook = original
    kinds = [(e["kind"], e.get("reason", "")) for e in read_events(tmp_path / "run")[0]]
    assert kinds[0] == ("exception", f"{type(exc).__name__}: {exc}") and seen == [type(exc)]
