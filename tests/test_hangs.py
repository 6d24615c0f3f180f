"""Hang diagnosis: the pure rules, the watchdog thread in one process, an unreachable store."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

import stragglerwatch
from stragglerwatch.analysis.hangs import classify, confirm, hangs_from_events
from stragglerwatch.record.events import read_events
from stragglerwatch.runtime.hangs.peers import PeerBoard

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


def st(step: int, phase: str, **counts: int) -> dict:
    """A published progress note: step, phase and the collectives issued per process group."""
    return {"step": step, "phase": phase, "collectives": counts}


def final_verdicts(sequence: list[dict[int, dict | None]], world_size: int) -> list[dict]:
    """The verdict after each read of a recorded sequence of notes (later notes replace earlier ones)."""
    seen: dict[int, dict | None] = {r: None for r in range(world_size)}
    out = []
    for notes in sequence:
        seen.update(notes)
        out.append(classify(dict(seen), world_size))
    return out


def test_counts_name_the_rank_behind_on_a_host_blocking_backend() -> None:
    """gloo, model with buffers: rank 1 stalls in its loader before step 10; rank 0 blocks in the buffer
    broadcast it roots, rank 2 got the broadcast and blocks in the gradient all-reduce, rank 3 in the broadcast."""
    sequence = [
        {1: st(10, "data_wait", **{"0": 36})},  # the culprit notices first
        {0: st(10, "collective_wait", **{"0": 38}), 3: st(10, "collective_wait", **{"0": 38})},
        {2: st(10, "allreduce_wait", **{"0": 39})},
    ]
    verdicts = final_verdicts(sequence, 4)
    v = verdicts[-1]
    assert (v["culprit_ranks"], v["victim_ranks"], v["silent_ranks"]) == ([1], [0, 2, 3], [])
    assert v["basis"] == "collective counts" and (v["step"], v["phase"]) == (10, "data_wait")
    assert not v["mismatch_suspected"]
    assert verdicts[1]["culprit_ranks"] == [1, 2], "before rank 2 speaks, it is silent, hence suspect"


def test_counts_hold_where_the_host_phase_lies() -> None:
    """NCCL: the host does not block in collectives. The victims ran ahead into step 11 and block at a
    host sync (``.item()``: phase other) or are still enqueueing (forward); the culprit sits in its loader."""
    notes = {
        0: st(11, "other", **{"0": 44}),
        1: st(10, "data_wait", **{"0": 40}),
        2: st(11, "forward", **{"0": 42}),
        3: st(11, "other", **{"0": 44}),
    }
    v = classify(notes, 4)
    assert (v["culprit_ranks"], v["victim_ranks"]) == ([1], [0, 2, 3]) and v["basis"] == "collective counts"
    # the phases alone would blame every rank (nobody is "waiting in a collective" on the host): they decide
    # nothing, and the verdict says so with what it compared instead of naming everybody
    phases_only = classify({r: {k: x for k, x in s.items() if k != "collectives"} for r, s in notes.items()}, 4)
    assert phases_only["culprit_ranks"] == [] and phases_only["basis"] == "undecided" and phases_only["undecided"]
    assert "rank 1: step 10 data_wait" in phases_only["detail"]


def test_counts_across_groups_find_the_end_of_the_chain() -> None:
    """2-D job: tensor-parallel groups {0,1}, {2,3}; data-parallel groups {0,2}, {1,3}. Rank 1 is stuck in
    compute; rank 0 waits for it in TP, rank 3 in DP, and rank 2 for rank 3 in TP."""
    notes = {
        0: st(5, "other", tp01=9, dp02=6),
        1: st(5, "backward", tp01=8, dp13=6),
        2: st(5, "other", tp23=9, dp02=6),
        3: st(5, "other", tp23=8, dp13=7),
    }
    v = classify(notes, 4)
    assert (v["culprit_ranks"], v["victim_ranks"]) == ([1], [0, 2, 3]) and v["phase"] == "backward"


def test_counts_cycle_silence_mismatch_and_a_device_hang() -> None:
    # ranks issue two groups' collectives in opposite orders: each waits for the other
    cycle = classify({0: st(3, "collective_wait", a=3, b=2), 1: st(3, "collective_wait", a=2, b=3)}, 2)
    assert cycle["culprit_ranks"] == [0, 1] and cycle["victim_ranks"] == []
    # a dead rank: the others issued the same collectives and wait for it
    dead = classify({0: st(7, "other", **{"0": 20}), 1: st(7, "other", **{"0": 20}), 2: None}, 3)
    assert (dead["culprit_ranks"], dead["victim_ranks"], dead["basis"]) == ([2], [0, 1], "collective counts")
    # rank 0 alone issued an extra collective (a broadcast the others never issue), all block in one
    mismatch = classify({0: st(4, "collective_wait", **{"0": 12}), 1: st(4, "collective_wait", **{"0": 11})}, 2)
    assert mismatch["culprit_ranks"] == [1] and mismatch["mismatch_suspected"]
    # every rank issued the same collectives, none is silent, every rank blocks outside a collective (NCCL:
    # at .item()): neither the counts nor the phases tell a culprit, so nobody is named
    device = classify({0: st(4, "other", **{"0": 11}), 1: st(4, "other", **{"0": 11})}, 2)
    assert device["basis"] == "undecided" and device["culprit_ranks"] == [] and device["victim_ranks"] == []
    assert "issued 0:11" in device["detail"]
    # a rank that reported no counts: the phases decide, as before
    mixed = classify({0: st(4, W, **{"0": 11}), 1: {"step": 4, "phase": "data_wait"}}, 2)
    assert mixed["basis"] == "phases" and mixed["culprit_ranks"] == [1]


def test_a_rank_with_nothing_pending_is_behind_with_the_silent() -> None:
    """gloo, two ranks: rank 0 compiles after its step (every collective it issued completed) and notices
    its own stall before rank 1, waiting for it in a barrier, has said anything for this stall. Blaming the
    silent rank alone would have the busy rank's policy end the job when rank 1's process sat quiet."""
    own = {"step": 13, "phase": "data_wait", "collectives": {"0": 20}, "completed": {"0": 20}}
    v = classify({0: own, 1: None}, 2)
    assert (v["culprit_ranks"], v["victim_ranks"], v["silent_ranks"]) == ([0, 1], [], [1])
    assert v["phase"] == "data_wait"
    # the same rank blocked in the barrier its peer never joined (a killed peer): the silent one alone
    waits = {"step": 13, "phase": "collective_wait", "collectives": {"0": 21}, "completed": {"0": 20}}
    v = classify({0: waits, 1: None}, 2)
    assert (v["culprit_ranks"], v["victim_ranks"]) == ([1], [0])
    # NCCL: the host at a sync in any phase, the GPU inside a collective: a victim, whatever it completed
    gpu = {**own, "phase": "other", "device": {"step": 13, "phase": "allreduce_wait"}}
    assert classify({0: gpu, 1: None}, 2)["culprit_ranks"] == [1]
    # completions not tracked (older PyTorch): the silence rule as before
    assert classify({0: {**own, "completed": None}, 1: None}, 2)["culprit_ranks"] == [1]
    # the policy on rank 0 then asks its own note too: busy, so no action
    verdict = classify({0: own, 1: None}, 2)
    notes = {0: {"at": 100.0, "quiet_s": 0.1, "doing": "CPU 103% of a core"}, 1: {"at": 90.0, "quiet_s": 0.0}}
    decision = confirm(verdict, notes, 100.0, 2.0, began=85.0, local={1: 15.0})
    assert not decision["act"] and "rank 0: CPU 103%" in decision["why"]


def test_local_verdict_ignores_counts() -> None:
    (local,) = hangs_from_events([{**stall(2, "forward", 50.0), "collectives": {"0": 5}}], 4)
    assert local["culprit_ranks"] == [2] and local["evidence"] == "local"


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
    assert events == [good] and bad == 3, "the cut line, the non-event and the garbage; a blank line is no loss"


def test_unreachable_store_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    board = PeerBoard("run", 0, 2, timeout_s=1.0)
    board._address = ("127.0.0.1", port)
    t0 = time.monotonic()
    assert board.publish({"step": 1}) is False and board.read() is None
    # two operations, each bounded by the 1 s timeout plus TCPStore's connect retries (~2.6 s seen): a wide margin
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
        deadline = time.monotonic() + 30
        while watch.stats()["stalled"] and time.monotonic() < deadline:  # until the watchdog sees the recovery,
            time.sleep(0.05)  # in steps well under its threshold: an idle wait as long as it is a new stall
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
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
    with stragglerwatch.attach(model, tmp_path / "on", optimizer=opt, watchdog_timeout_s=2.0):  # 40x a step's gap
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


#: A process whose SIGTERM handler (installed before attach) is sent SIGTERM again while it runs, after the
#: hang policy began ending the rank (torchrun's teardown of the survivors as a peer leaves).
_TWICE = """
import os, signal, sys, time
from torch import nn
import stragglerwatch

calls = []

def checkpoint(signum, frame):
    calls.append(signum)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # the second SIGTERM's handler runs in here
    print("saved after", len(calls), "call(s)", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, checkpoint)
watch = stragglerwatch.attach(nn.Linear(2, 2), sys.argv[1], watchdog_timeout_s=60)
watch._watchdog.aborting = True  # the hang policy's SIGTERM, as its terminate() sends it
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("not ended", flush=True)
"""


def test_a_sigterm_while_the_handler_runs_for_the_hang_policy_does_not_interrupt_it(tmp_path: Path) -> None:
    """The application's handler (chained to by ours) runs to its end once, and the rank exits 75: a second
    SIGTERM meanwhile neither calls it again nor ends the process inside it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _TWICE, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.stdout.strip() == "saved after 1 call(s)" and proc.returncode == 75, (proc.returncode, proc.stdout,
                                                                                       proc.stderr[-2000:])


def nccl_note(step: int, issued: int, completed: int | None = None, started: int | None = None,
              gpu: tuple[int, str] | None = None) -> dict:
    """A rank's note on NCCL: the host blocks at ``.item()`` (phase other) whatever its GPU does."""
    note: dict = {"step": step, "phase": "other", "collectives": {"0": issued}}
    if completed is not None:
        note["completed"] = {"0": completed}
    if started is not None:
        note["started"] = {"0": started}
    if gpu is not None:
        note["device"] = {"step": gpu[0], "phase": gpu[1]}
    return note


def test_a_stuck_gpu_on_nccl_is_told_by_what_completed() -> None:
    """Rank 2's GPU never finishes a backward kernel. Every host enqueued the same 40 collectives and blocks
    at its loss's .item(): issued counts are equal and every host phase is "other"."""
    # Flight Recorder with timing on (started tracked): the peers' GPUs started #37, rank 2's did not
    started = classify({r: nccl_note(9, 40, completed=36, started=36 if r == 2 else 37) for r in range(4)}, 4)
    assert (started["culprit_ranks"], started["victim_ranks"], started["basis"]) == ([2], [0, 1, 3], "started counts")
    # completed counts (NCCL's default: no start events): rank 1 never completed the broadcast of its subgroup
    completed = classify({r: nccl_note(9, 40, completed=35 if r == 1 else 36) for r in range(4)}, 4)
    assert (completed["culprit_ranks"], completed["basis"]) == ([1], "completed counts")
    # equal started and completed counts: where each GPU is (the probe's latest completed CUDA event) decides
    gpus = {0: (9, "allreduce_wait"), 1: (9, "allreduce_wait"), 2: (9, "backward"), 3: (9, "allreduce_wait")}
    device = classify({r: nccl_note(9, 40, completed=36, gpu=gpus[r]) for r in range(4)}, 4)
    assert (device["culprit_ranks"], device["victim_ranks"]) == ([2], [0, 1, 3])
    assert device["basis"] == "device progress" and device["phase"] == "backward (on the GPU)"
    # a GPU that has not even reached its oldest mark kept is behind, hence the culprit
    behind = {**gpus, 2: (8, "behind")}
    behind_v = classify({r: nccl_note(9, 40, completed=36, gpu=behind[r]) for r in range(4)}, 4)
    assert behind_v["culprit_ranks"] == [2]
    # every GPU inside the same collective, counts equal: the collective itself (transport, network) is stuck;
    # undecided, with the evidence, and every rank a waiting victim of it
    inside = classify({r: nccl_note(9, 40, completed=36, gpu=(9, "collective_wait")) for r in range(4)}, 4)
    assert inside["undecided"] and inside["culprit_ranks"] == [] and inside["victim_ranks"] == [0, 1, 2, 3]
    assert "GPU in collective_wait (step 9)" in inside["detail"] and "completed 0:36" in inside["detail"]
    # issued counts, where they differ, still come first (a host stuck before issuing)
    host = classify({r: nccl_note(9, 38 if r == 3 else 40, completed=36, gpu=(9, "backward")) for r in range(4)}, 4)
    assert host["culprit_ranks"] == [3] and host["basis"] == "collective counts"


def test_progress_travels_from_the_stall_events_to_the_post_hoc_verdict() -> None:
    """The same rules post hoc: the stall events carry what completed, the diagnosis the peers' notes."""
    peers = {str(r): {**nccl_note(9, 40, completed=36, gpu=(9, "backward" if r == 1 else "allreduce_wait")),
                      "at": 100.0} for r in range(3)}  # fmt: skip
    events = [{"kind": "stall", "rank": r, "step": 9, "phase": "other", "since": 90.0, "detected_at": 100.0 + r,
               "threshold_s": 10.0, "waited_s": 10.0, "id": f"{r}-9", "collectives": {"0": 40},
               "completed": {"0": 36}, "device": peers[str(r)]["device"]} for r in range(3)]  # fmt: skip
    events.insert(0, {"kind": "diagnosis", "rank": 0, "step": 9, "phase": "other", "detected_at": 99.0,
                      "evidence": "store", "peers": peers, "stall_id": "0-9"})  # the stall events come after it
    (hang,) = hangs_from_events(events, 3)
    assert hang["culprit_ranks"] == [1] and hang["basis"] == "device progress"


# -- a rank stuck in native code holding the GIL: its own dumps, its late stall ------------------------------


def _dump(at: float, *frames: str) -> str:
    """One faulthandler dump as ``NativeStacks.collect`` returns it (stamped with when it was written): a
    helper thread, then the main thread, most recent call first."""
    main = "".join(f'  File "work.py", line {n} in {f}\n' for n, f in enumerate([*frames, "main", "<module>"], 1))
    return (f"Timeout (0:00:04)! dumped at {at:.3f}\nThread 0x0000000000000002 (most recent call first):\n"
            '  File "threading.py", line 331 in wait\n\nThread 0x0000000000000001 (most recent call first):\n'
            + main)  # fmt: skip


#: Where the main thread was in the earlier hold (deep in a forward) and in the stall's (in the loop itself).
EARLIER = ("pre_hook", "_call_impl", "_wrapped_call_impl", "forward", "_call_impl", "_wrapped_call_impl",
           "_run_ddp_forward", "forward", "_call_impl", "train_step", "distributed")  # fmt: skip
HELD = ("distributed",)


def _stall_and_diagnosis(rank: int, step: int, phase: str, since: float, at: float, counts: int) -> list[dict]:
    note = {"step": step, "phase": phase, "since": since, "at": at, "collectives": {"0": counts}}
    sid = f"{rank}-{step}-{int(since)}"
    return [{"kind": "stall", "rank": rank, "step": step, "phase": phase, "since": since, "detected_at": at,
             "threshold_s": 2.0, "waited_s": round(at - since, 3), "id": sid, "collectives": {"0": counts}},
            {"kind": "diagnosis", "rank": rank, "step": step, "phase": phase, "since": since, "detected_at": at + 2,
             "stall_id": sid, "evidence": "store", "peers": {str(rank): note, str(1 - rank): None}}]  # fmt: skip


def test_a_hold_in_native_code_shows_its_own_dump_not_an_earlier_ones() -> None:
    """Rank 1 of 2 holds the GIL for 8 s before step 10 (faulthandler dumps it; its watchdog cannot run).
    A few seconds earlier, on a loaded machine, it had been held up 5 s at step 2 already (a first
    dump, deep in a forward): rank 0 stalled at step 2, recovered, stalled again at step 10. Those are two
    hangs, each with its own dump. Where the record lacks the first stall's recovery, both stalls are one
    cluster: the verdict speaks of the later one, and so must the stacks (the dump of the hold at step 10,
    not the first dump collected after the cluster began)."""
    from stragglerwatch.presentation.render import main_stack

    events = _stall_and_diagnosis(0, 2, W, 98.0, 100.0, 15)
    events += [{"kind": "native_stacks", "rank": 1, "step": 2, "phase": "forward", "since": 97.9,
                "detected_at": 102.8, "stacks": {"faulthandler": _dump(101.9, *EARLIER)}}]  # fmt: skip
    recovered = {"kind": "recovery", "rank": 0, "step": 10, "phase": "collective_wait", "stall_id": "0-2-98",
                 "detected_at": 103.0}  # fmt: skip
    events += _stall_and_diagnosis(0, 10, "collective_wait", 102.9, 105.0, 38)
    # rank 1 runs again at 110.9: its watchdog collects both dumps of the 8 s hold (the timer repeats), and
    # the training thread is past its next hook already (no stall event of its own: it is silent)
    held = _dump(106.8, *HELD) + _dump(110.8, *HELD)
    events += [{"kind": "native_stacks", "rank": 1, "step": 10, "phase": "forward", "since": 110.9,
                "detected_at": 110.9, "stacks": {"faulthandler": held}},
               {"kind": "recovery", "rank": 0, "step": 19, "phase": W, "stall_id": "0-10-102",
                "detected_at": 111.0}]  # fmt: skip
    first, second = hangs_from_events([*events, recovered], 2)
    assert (first["culprit_ranks"], first["step"], first["recovered"]) == ([1], 2, True)
    assert first["stacks"]["1"]["faulthandler"] == _dump(101.9, *EARLIER)
    assert (second["culprit_ranks"], second["victim_ranks"], second["step"]) == ([1], [0], 10)
    assert second["stacks"]["1"]["faulthandler"] == _dump(106.8, *HELD)
    (hang,) = hangs_from_events(events, 2)  # the first stall's recovery not recorded: one cluster
    assert (hang["culprit_ranks"], hang["victim_ranks"], hang["step"]) == ([1], [0], 10)
    dump = hang["stacks"]["1"]["faulthandler"]
    assert dump == _dump(106.8, *HELD), "the hold's first dump, alone: not the earlier one, not both"
    shown = main_stack(hang["stacks"]["1"]).splitlines()
    assert shown[0].startswith("(stuck in native code holding the GIL") and shown[1].endswith("line 1 in distributed")
    # where the stalled rank's watchdog records the stall itself, late, its stall carries every dump since it
    # last looked, the earlier hold's among them (the timer fired before, and the watchdog had not run since)
    late = [e for e in events if e["kind"] != "native_stacks"]
    stacks = {"faulthandler": _dump(101.9, *EARLIER) + held, "MainThread (1)": "File x.py, in forward"}
    late += [{"kind": "stall", "rank": 1, "step": 10, "phase": "data_wait", "since": 102.85, "detected_at": 110.9,
              "threshold_s": 2.0, "waited_s": 8.05, "id": "1-10-102", "collectives": {},  # moved on: not its counts
              "stacks": stacks}]  # fmt: skip
    (hang,) = hangs_from_events(late, 2)
    assert (hang["culprit_ranks"], hang["victim_ranks"], hang["step"], hang["phase"]) == ([1], [0], 10, "data_wait")
    assert hang["stacks"]["1"]["faulthandler"] == _dump(106.8, *HELD)
    # an older record (dumps not stamped): as before, the first dump collected after the stall began
    unstamped = [{**e, "stacks": {"faulthandler": e["stacks"]["faulthandler"].replace(" dumped at ", " ")}}
                 if e["kind"] == "native_stacks" else e for e in events]  # fmt: skip
    (old,) = hangs_from_events(unstamped, 2)
    assert "in pre_hook" in old["stacks"]["1"]["faulthandler"]


def test_a_stall_noticed_late_joins_the_hang_it_overlapped() -> None:
    """A rank that held the GIL for 20 s notices its stall once it runs again, long after the others'
    stall and diagnosis: its stall began with theirs, so it is the same hang, not a second one."""
    events = _stall_and_diagnosis(0, 10, "collective_wait", 103.0, 105.0, 38)
    events += [{"kind": "stall", "rank": 1, "step": 10, "phase": "data_wait", "since": 102.9, "detected_at": 123.0,
                "threshold_s": 2.0, "waited_s": 20.1, "id": "1-10-102", "collectives": {},
                "stacks": {"faulthandler": _dump(106.9, *HELD)}}]  # fmt: skip
    (hang,) = hangs_from_events(events, 2)
    assert (hang["culprit_ranks"], hang["victim_ranks"], hang["step"]) == ([1], [0], 10)
    # a stall that began after the others' last event is a hang of its own
    apart = [*events[:2], {**events[2], "since": 112.0, "waited_s": 11.0}]
    assert len(hangs_from_events(apart, 2)) == 2


def test_pauses_a_few_seconds_apart_are_hangs_of_their_own() -> None:
    """Rank 0 saves a checkpoint (10 s), trains 3 steps, holds the GIL 5 s, trains 3 steps, compiles: rank 1
    stalls behind each pause, less than the clustering gap (10 s) after its previous diagnosis. Each pause
    ended (its stalls recovered) before the next stall was noticed, at a later step: three hangs. While
    rank 0 held the GIL, its note in the store was still the checkpoint's, written before rank 1's stall
    ended: rank 1's watchdog recorded it as unheard (None), so the hold is at step 10 with rank 0 silent,
    not at step 7."""
    events = _stall_and_diagnosis(0, 7, "data_wait", 49.0, 51.0, 12)
    events += _stall_and_diagnosis(1, 7, "collective_wait", 49.0, 51.2, 13)
    events[1]["peers"]["1"] = {**events[3]["peers"]["1"]}
    events[3]["peers"]["0"] = {**events[1]["peers"]["0"]}
    def recovery(rank: int, stall_id: str, step: int, phase: str, at: float) -> dict:
        return {"kind": "recovery", "rank": rank, "stall_id": stall_id, "step": step, "phase": phase, "detected_at": at}

    events += [recovery(1, "1-7-49", 9, "backward", 59.05), recovery(0, "0-7-49", 10, "data_wait", 59.1)]
    held = _stall_and_diagnosis(1, 10, "collective_wait", 59.05, 61.06, 17)
    held[0]["completed"] = {"0": 16}
    held[1]["peers"] = {"0": None, "1": {**held[1]["peers"]["1"], "completed": {"0": 16}}}
    events += [*held, recovery(1, "1-10-59", 13, W, 64.3)]
    events += _stall_and_diagnosis(1, 13, "collective_wait", 64.2, 66.27, 21)
    events += _stall_and_diagnosis(0, 13, "data_wait", 64.2, 66.36, 20)
    checkpoint, native, compile_ = hangs_from_events(events, 2)  # fmt: skip
    assert (checkpoint["culprit_ranks"], checkpoint["step"], checkpoint["recovered"]) == ([0], 7, True)
    assert (native["culprit_ranks"], native["silent_ranks"], native["step"]) == ([0], [0], 10)
    assert (compile_["culprit_ranks"], compile_["victim_ranks"], compile_["step"]) == ([0], [1], 13)
    # the same events without the recoveries: nothing says the job moved on in between, one hang
    assert len(hangs_from_events([e for e in events if e["kind"] != "recovery"], 2)) == 1


class _LateProbe:
    """A probe whose training thread runs on (past its next hook) once the stall's first look is taken."""

    def __init__(self, stale: tuple[int, str, float]) -> None:
        self.recent_steps = [0.01] * 5
        self.device_trail = None
        self.enabled = True
        self.reads = 0
        self._stale = stale

    @property
    def where(self) -> tuple[int, str, float]:
        self.reads += 1
        return self._stale if self.reads == 1 else (self._stale[0], "forward", time.perf_counter())


class _Dumps:
    """NativeStacks where faulthandler wrote a dump after the watchdog's first look of the round."""

    def __init__(self, dump: str) -> None:
        self.dump: str | None = dump

    def arm(self, timeout_s: float, exit: bool = False) -> None:
        pass

    def pause(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def collect(self) -> str | None:
        dump, self.dump = self.dump, None
        return dump


def test_a_stall_noticed_late_records_the_hold_not_what_came_after(tmp_path: Path, monkeypatch) -> None:
    """The watchdog runs again after the GIL was held 8 s: by the time it records the stall, the training
    thread is past its next hook and has issued more collectives. Those counts would make the peers it left
    waiting look behind it (the culprit): the stall keeps where it was stuck, without them, and carries the
    dump written while the watchdog could not run, even one written after its last look; one written after
    the thread's last round is recorded when it stops."""
    import stragglerwatch.runtime.hangs.watchdog as watchdog
    from stragglerwatch.record.events import EventFile

    monkeypatch.setattr(watchdog, "collective_counts", lambda: {"0": 39})  # issued since the hold ended
    stale = (10, "data_wait", time.perf_counter() - 8.0)
    dog = watchdog.Watchdog(_LateProbe(stale), EventFile(tmp_path / "events-00001.jsonl"), 1, 2, None,
                            timeout_s=2.0, native=_Dumps(_dump(time.time() - 4.0, *HELD)))  # fmt: skip
    dog._poll(None)
    stall, diagnosis = read_events(tmp_path)[0]
    assert stall["kind"] == "stall" and (stall["step"], stall["phase"]) == (10, "data_wait")
    assert stall["collectives"] == {} and "in distributed" in stall["stacks"]["faulthandler"]
    assert diagnosis["culprit_ranks"] == [1]
    # a dump the thread had no round left to collect (the job ended first) is recorded when it stops
    dog.native.dump = _dump(time.time(), *HELD)
    dog.stop()
    assert [e["kind"] for e in read_events(tmp_path)[0]][2:] == ["recovery", "native_stacks"]
    # closing: the hooks are off, where they left the training thread is no stall
    quiet = watchdog.Watchdog(_LateProbe(stale), EventFile(tmp_path / "q" / "events-00000.jsonl"), 0, 2, None,
                              timeout_s=2.0)  # fmt: skip
    quiet.probe.enabled = False
    quiet._poll(None)
    quiet.probe.enabled, quiet.probe.reads = True, 0
    quiet._stop.set()
    quiet._poll(None)
    assert not (tmp_path / "q").exists() or read_events(tmp_path / "q")[0] == []


def test_native_stacks_dump_each_hold_once_and_say_when(tmp_path: Path) -> None:
    """faulthandler's timer fires once in a hold of the GIL; its keeper thread arms it again once the hold
    ends, with no call from the watchdog, so the next hold is dumped too; what ``collect`` returns says when
    each dump was written."""
    import ctypes

    from stragglerwatch.analysis.hangs import native_dumps
    from stragglerwatch.runtime.hangs.nativestacks import NativeStacks

    native = NativeStacks(tmp_path / "stacks-00000.txt")
    holds = []
    try:
        native.arm(0.5)
        for _ in range(2):
            t0 = time.time()
            ctypes.PyDLL(None).usleep(1_500_000)  # holding the GIL: the timer fires at most 0.5 s in, once
            holds.append((t0, time.time()))
            time.sleep(0.5)  # Python runs: the keeper arms the timer again
        dumps = native_dumps(native.collect() or "")
    finally:
        native.cancel()
    assert len(dumps) == 2, dumps
    for (at, text), (start, end) in zip(dumps, holds, strict=True):
        assert at is not None and start - 0.1 <= at <= end + 0.1, (holds, [a for a, _ in dumps])
        assert "test_native_stacks_dump_each_hold_once" in text
    assert native.collect() is None, "collected once"


def test_native_stacks_never_dump_while_python_runs(tmp_path: Path) -> None:
    """The dump reads the frames without the GIL: fired while Python runs, it may read a frame freed under it
    and end the process (a rank died so in a cold ``torch.compile``, its timer re-armed by the watchdog's own
    loop, which a slow look at its children held up). With a deep call stack pushed and popped for several
    timeouts, the keeper thread keeps the timer from firing: no dump, and the process ends normally."""
    script = f"""
import sys, time
sys.setrecursionlimit(10000)
from pathlib import Path
from stragglerwatch.runtime.hangs.nativestacks import NativeStacks
def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1
native = NativeStacks(Path({str(tmp_path / "stacks-00000.txt")!r}))
native.arm(2.0)
t0, n = time.monotonic(), 0
while time.monotonic() - t0 < 6.0:
    deep(2500 + n % 300)
    n += 1
print(native.collect() is None, native.rearms)
native.cancel()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    nodump, rearms = done.stdout.split()
    assert nodump == "True", (tmp_path / "stacks-00000.txt").read_text()[:2000]
    assert int(rearms) >= 6, f"re-armed {rearms} times in 6 s"


def test_two_pauses_are_two_hangs_when_the_first_ones_recovery_is_recorded_late() -> None:
    """Rank 0 checkpoints (a stall at step 7), runs on, and right after holds the GIL in native code (a stall
    at step 10): its watchdog could not run in between, so it records the first stall's recovery only after
    rank 1 noticed the second, finding itself at step 10 by then. It had left step 7 before the job got to step
    10: two hangs, not one (as seen in a real job of ``tests/workers/pauses.py``)."""
    def stall(rank, step, at, phase):
        return {"kind": "stall", "id": f"{rank}-{step}", "rank": rank, "step": step, "phase": phase,
                "since": at - 2.0, "detected_at": at, "threshold_s": 2.0, "waited_s": 2.0}  # fmt: skip

    def diagnosis(rank, step, at):
        return {"kind": "diagnosis", "stall_id": f"{rank}-{step}", "rank": rank, "detected_at": at,
                "evidence": "store", "peers": {"0": {"step": step, "phase": "data_wait"},
                                               "1": {"step": step, "phase": "collective_wait"}}}  # fmt: skip

    def recovery(rank, step, of, at):
        return {"kind": "recovery", "stall_id": f"{rank}-{of}", "rank": rank, "step": step, "detected_at": at}

    events = [stall(0, 7, 364.7, "data_wait"), stall(1, 7, 364.7, "collective_wait"), diagnosis(1, 7, 366.7),
              recovery(1, 7, 7, 372.6), stall(1, 10, 374.8, "collective_wait"), diagnosis(1, 10, 376.8),
              recovery(0, 10, 7, 379.8), recovery(1, 13, 10, 379.9)]  # fmt: skip
    hangs = hangs_from_events(events, 2)
    assert [(h["culprit_ranks"], h["step"]) for h in hangs] == [([0], 7), ([0], 10)], hangs
