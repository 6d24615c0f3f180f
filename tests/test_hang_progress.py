"""A hang is a hang only when nothing progresses: the rule the hang policy decides by (``hangs.confirm``),
the process accounts it reads (``runtime/hangs/progress.py``), and the abort on a backend whose device work
an abort leaves unsafe (NCCL): no application code after it unless the user opted in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stragglerwatch.analysis.hangs import confirm
from stragglerwatch.runtime.actions.hangabort import HANG_EXIT_STATUS, HangAbort
from stragglerwatch.runtime.hangs.progress import PeerProcesses, Progress, identity, moved, sample

linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")

VERDICT = {"culprit_ranks": [1], "victim_ranks": [0], "undecided": False}


def note(quiet_s: float, at: float, doing: str | None = None) -> dict:
    return {"quiet_s": quiet_s, "at": at, "doing": doing}


# -- the rule --------------------------------------------------------------------------------------------


def test_a_culprit_that_works_is_not_hung_and_what_it_does_is_said() -> None:
    busy = confirm(VERDICT, {1: note(0.5, 99.0, "I/O 80.0 MB/s; at save (serialization.py:900)")}, 100.0, 5.0,
                   began=90.0)  # fmt: skip
    assert not busy["act"] and "serialization.py" in busy["busy"][1] and "busy, not hung" in busy["why"]
    quiet = confirm(VERDICT, {1: note(5.5, 99.0)}, 100.0, 5.0, began=90.0)
    assert quiet["act"] and quiet["busy"] == {}
    # quiet 4.5 s when written, 1 s ago: what it did since is not known, so not quiet enough yet
    assert not confirm(VERDICT, {1: note(4.5, 99.0)}, 100.0, 5.0, began=90.0)["act"]


def test_no_action_when_nobody_is_behind() -> None:
    """Every rank in the same collective (NCCL's communicators forming at scale): undecided, no action."""
    undecided = {"culprit_ranks": [], "victim_ranks": [0, 1], "undecided": True}
    out = confirm(undecided, {0: note(100.0, 99.0), 1: note(100.0, 99.0)}, 100.0, 5.0, began=0.0)
    assert not out["act"] and "undecided" in out["why"]


def test_a_silent_culprit_is_waited_for_unless_its_process_can_be_read() -> None:
    """No fresh note (its watchdog cannot run: the GIL held, in a large pickle or stuck): read on this host
    where it runs here, else waited for ``silent_s`` from the stall's start or its last note."""
    stale = {1: note(0.0, 50.0)}  # its note is 50 s old
    assert not confirm(VERDICT, stale, 100.0, 5.0, began=90.0, silent_s=300.0)["act"]
    assert "silent" in confirm(VERDICT, stale, 100.0, 5.0, began=90.0, silent_s=300.0)["why"]
    assert confirm(VERDICT, stale, 400.0, 5.0, began=90.0, silent_s=300.0)["act"]
    assert not confirm(VERDICT, {}, 100.0, 5.0, began=90.0, silent_s=300.0)["act"]  # never heard: from began
    assert not confirm(VERDICT, stale, 100.0, 5.0, began=90.0, local={1: 1.0})["act"]  # its CPU runs
    assert confirm(VERDICT, stale, 100.0, 5.0, began=90.0, local={1: 6.0})["act"]  # same host, nothing runs


# -- the accounts ------------------------------------------------------------------------------------------


def sample_as_ours(tid: int | None):
    """A sample taken as the watchdog takes it: from a thread of ours, whose own reads of /proc are not the
    job's I/O."""
    got = []
    t = threading.Thread(target=lambda: got.append(sample(tid)), name="stragglerwatch-test-sampler")
    t.start()
    t.join(30)
    return got[0]


#: The training thread stands in as a thread of a fresh process (asleep, computing, then a writer thread
#: saving): the "idle" sample needs a process with no other thread that may run, which a test session that
#: has run other tests is not (their leftover threads are the job's threads to the sampler, as they should be).
#: The looks are taken by one thread of ours on its own clock, as the watchdog takes them, while the main
#: thread waits in a join: a main thread that started a sampler thread for each look was itself caught
#: runnable at two looks, on a loaded machine, and read as a process waiting for a CPU.
ACCOUNTS = """
import json, sys, threading, time
from stragglerwatch.runtime.hangs.progress import moved, sample

go, done = threading.Event(), threading.Event()

def training():
    go.wait(30)
    stop = time.perf_counter() + 0.6
    while time.perf_counter() < stop:
        sum(range(1000))
    done.wait(30)

def writer():
    with open(sys.argv[1], "wb") as f:
        for _ in range(16):
            f.write(b"x" * (1 << 20))
            f.flush()
            time.sleep(0.01)

worker = threading.Thread(target=training)
worker.start()
looks = {}

def sampler():
    try:
        looks["a"] = sample(worker.ident)
        time.sleep(0.3)
        looks["b"] = sample(worker.ident)
        go.set()
        time.sleep(0.4)
        looks["c"] = sample(worker.ident)
    finally:
        done.set()
    worker.join(30)
    saver = threading.Thread(target=writer)
    saver.start()
    saver.join(30)
    looks["d"] = sample(worker.ident)

ours = threading.Thread(target=sampler, name="stragglerwatch-test-sampler")
ours.start()
ours.join(60)
a, b, c, d = (looks[k] for k in "abcd")
print(json.dumps({"idle": moved(a, b), "computing": moved(b, c), "spinning": moved(b, c, waiting=True),
                  "writing": moved(c, d)}))
"""


@linux
def test_cpu_io_and_python_are_progress_a_sleep_is_not(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", ACCOUNTS, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["idle"] == [], f"an idle process moved: {seen['idle']}"
    assert any(k.startswith("CPU") for k in seen["computing"]), seen
    assert not any(k.startswith("CPU") for k in seen["spinning"]), seen  # a spin in a collective
    assert any(k.startswith("I/O") for k in seen["writing"]), seen


@linux
def test_a_child_process_s_work_is_the_rank_s_and_ours_is_not() -> None:
    """A compile worker or an asynchronous checkpoint writer is a child process; our own child (the
    straggler policy's analysis, ``python -m stragglerwatch...``) is not the job's work."""
    burn = "import time\nt=time.perf_counter()+1.5\nwhile time.perf_counter()<t: pass\n"
    a = sample_as_ours(None)
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        time.sleep(1.2)
        b = sample_as_ours(None)
    finally:
        child.wait(timeout=30)
    assert any(k.startswith("CPU") for k in moved(a, b)), moved(a, b)
    # our own child: its command line holds ``-m stragglerwatch.`` (here as extra arguments to a burner)
    ours = subprocess.Popen([sys.executable, "-c", burn, "-m", "stragglerwatch.policy"])
    try:
        time.sleep(0.3)
        c = sample_as_ours(None)
        time.sleep(0.9)
        d = sample_as_ours(None)
    finally:
        ours.wait(timeout=30)
    assert not any(k.startswith("CPU") for k in moved(c, d)), moved(c, d)


@linux
def test_a_peer_on_this_host_is_read_from_its_process() -> None:
    burn = "import time\nt=time.perf_counter()+3\nwhile time.perf_counter()<t: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", burn])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        peers = PeerProcesses()
        time.sleep(0.3)
        t0 = time.perf_counter()
        first = {r: peers.quiet_s(r, identity(p.pid), t0) for r, p in ((1, busy), (2, idle))}
        time.sleep(1.0)
        t1 = time.perf_counter()
        later = {r: peers.quiet_s(r, identity(p.pid), t1) for r, p in ((1, busy), (2, idle))}
    finally:
        busy.wait(timeout=30)
        idle.wait(timeout=30)
    assert first == {1: 0.0, 2: 0.0}
    assert later[1] == 0.0 and later[2] is not None and later[2] >= 0.9, later
    elsewhere = {**identity(busy.pid), "host": "another-host"}
    assert peers.quiet_s(3, elsewhere, t1) is None  # not on this host: nothing inferred


#: A process that holds the GIL in libc ``sleep`` while eight Python threads wait for it (they wake every few
#: milliseconds: on a crowded host, often found runnable), with faulthandler dumping its stacks each second.
HELD_GIL = """
import ctypes, faulthandler, sys, threading, time
def loop(period):
    while True:
        time.sleep(period)
for period in (0.001,) * 8:
    threading.Thread(target=loop, args=(period,), daemon=True).start()
faulthandler.dump_traceback_later(1.0, repeat=True, file=sys.stderr)
time.sleep(0.5)
print("holding", flush=True)
ctypes.PyDLL(None).sleep(10)
"""


@linux
def test_a_peer_holding_the_gil_on_a_crowded_host_is_quiet() -> None:
    """Its threads waiting for the GIL are runnable now and then, and get a clock tick now and then: no work.
    Two busy processes per core crowd the host, as a loaded CI machine or an oversubscribed node does."""
    crowd = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    held = subprocess.Popen([sys.executable, "-c", HELD_GIL], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)  # fmt: skip
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "holding"
        peers, t0 = PeerProcesses(), time.perf_counter()
        quiet = []
        for _ in range(6):
            quiet.append(peers.quiet_s(1, identity(held.pid), time.perf_counter()))
            time.sleep(1.0)
    finally:
        for p in (*crowd, held):
            p.kill()
            p.wait(timeout=30)
    assert quiet[-1] is not None and quiet[-1] >= 0.9 * (time.perf_counter() - t0 - 1.5), quiet


def test_progress_counts_quiet_time_from_the_stall_or_the_last_work() -> None:
    p = Progress(since=10.0)
    assert p.quiet_s(15.0) == 5.0
    p.moved_at = 13.0
    assert p.quiet_s(15.0) == 2.0


# -- the abort on a backend that runs collectives on the device ----------------------------------------------


def test_on_nccl_no_application_code_runs_after_the_decision_unless_opted_in() -> None:
    calls: list[tuple] = []
    stopped = threading.Event()

    def make(**kw) -> HangAbort:
        return HangAbort(4.0, terminate=lambda: calls.append(("terminate",)) or "ours", stopped=stopped,
                         abort=lambda: calls.append(("abort",)) or "aborted", backend=lambda: "nccl",
                         exit=lambda s: calls.append(("exit", s)), forget=lambda: calls.append(("forget",)) or "",
                         **kw)  # fmt: skip

    make().run(100.0, 10.0, 102.0, lambda **f: calls.append(("record", f)))
    assert [c[0] for c in calls] == ["record", "forget", "exit"], calls  # no SIGTERM, no abort, no wait
    assert calls[0][1]["state_suspect"] is True and calls[0][1]["backend"] == "nccl"
    assert calls[-1] == ("exit", HANG_EXIT_STATUS)
    calls.clear()
    told: list[dict] = []
    make(handler=told.append).run(100.0, 10.0, 102.0, lambda **f: None, {"rank": 0, "culprit_ranks": [1]})
    assert told == [{"rank": 0, "culprit_ranks": [1], "backend": "nccl", "state_suspect": True}]
    assert [c[0] for c in calls] == ["forget", "exit"]
    calls.clear()

    def stuck(info: dict) -> None:
        time.sleep(30)

    t0 = time.perf_counter()
    make(handler=stuck).run(100.0, 10.0, 103.5, lambda **f: None)  # 0.5 s left of the bound
    assert time.perf_counter() - t0 < 5 and calls[-1] == ("exit", HANG_EXIT_STATUS)


def test_only_a_bound_the_user_chose_lets_faulthandler_end_a_rank() -> None:
    assert HangAbort(6.0, lambda: "", threading.Event()).chosen
    assert not HangAbort(None, lambda: "", threading.Event()).chosen


# -- the watchdog: replays are progress; faulthandler's exit only under a chosen bound ---------------------


class _Probe:
    """What the watchdog reads of the probe: where the training thread is, recent step times."""

    def __init__(self) -> None:
        self.where = (5, "forward", time.perf_counter())
        self.recent_steps = [0.01] * 5
        self.thread = threading.get_ident()
        self.device_trail = None


class _Native:
    def __init__(self) -> None:
        self.armed: list[tuple[float, bool]] = []

    def arm(self, timeout_s: float, exit: bool = False) -> None:
        self.armed.append((timeout_s, exit))

    def collect(self) -> None:
        return None

    def pause(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def _watchdog(tmp_path: Path, **kw):
    from stragglerwatch.record.events import EventFile
    from stragglerwatch.runtime.hangs.watchdog import Watchdog

    probe = _Probe()
    dog = Watchdog(probe, EventFile(tmp_path / "events-00000.jsonl"), 0, 1, None, timeout_s=0.5, poll_s=0.05, **kw)
    return probe, dog


def _until(cond, timeout_s: float) -> bool:
    end = time.perf_counter() + timeout_s
    while time.perf_counter() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_victim_whose_collective_fails_leaves_as_its_policy_would_have(tmp_path: Path) -> None:
    """On gloo the culprit's policy decides about when its victims' do, and its exit fails their blocked
    collectives first. A victim in a diagnosed stall whose call raised is ended by the policy from the main
    thread (``ShutdownHooks``' exception hook): the action recorded with the error, ``hang_handler`` told,
    the exit at the bound armed; once only, and never where the policy's thread took the action first, nor
    outside a diagnosed stall, nor for a culprit, nor on a backend that runs collectives on the device."""
    exits: list[int] = []

    def diagnosed(dog) -> bool:
        return _until(lambda: (dog._stall or {}).get("verdict") is not None, 30.0)

    def dog_with(phase: str, backend: str | None = None, bound: float = 1.0):
        told: list[dict] = []
        probe, dog = _watchdog(tmp_path, abort=lambda w: HangAbort(bound, lambda: "ours", w._stop,
                                                                   exit=exits.append, forget=lambda: "kept",
                                                                   backend=lambda: backend, handler=told.append))
        probe.where = (5, phase, time.perf_counter())
        return probe, dog, told

    probe, dog, told = dog_with("allreduce_wait", bound=30.0)  # the policy's thread would act after 15 s
    assert dog.collective_failed("RuntimeError: early") is None  # no stall yet: an error as any other
    dog.start()
    try:
        assert diagnosed(dog), "no diagnosis"
        what, within = dog.collective_failed("RuntimeError: Connection closed by peer")
        assert what == "claimed" and 14.0 < within <= 30.0 and dog.exit_status == HANG_EXIT_STATUS
        assert dog.collective_failed("RuntimeError: again")[0] == "acting"  # once: a second error waits for it
    finally:
        dog.stop()
    events = [json.loads(line) for line in (tmp_path / "events-00000.jsonl").open()]
    (action,) = [e for e in events if e["kind"] == "action"]
    assert action["error"] == "RuntimeError: Connection closed by peer" and action["exit_status"] == HANG_EXIT_STATUS
    assert told and told[0]["backend"] == "host" and told[0]["state_suspect"] is False
    assert exits == []  # the Watch closed before the bound: the exit hook ends the process
    (tmp_path / "events-00000.jsonl").unlink()

    # a bound that passes: whichever thread took the action, the rank is ended once, at the bound
    probe, dog, _ = dog_with("allreduce_wait", bound=0.3)
    dog.start()
    try:
        assert diagnosed(dog), "no diagnosis"
        assert dog.collective_failed("RuntimeError: closed")[0] in ("claimed", "acting")
        assert _until(lambda: exits == [HANG_EXIT_STATUS], 10.0), exits
        time.sleep(0.5)
        assert exits == [HANG_EXIT_STATUS]
    finally:
        dog.stop()
    (tmp_path / "events-00000.jsonl").unlink()

    for phase, backend in (("forward", None), ("allreduce_wait", "nccl")):  # a culprit; a device backend
        probe, dog, told = dog_with(phase, backend, bound=30.0)
        dog.start()
        try:
            assert diagnosed(dog), "no diagnosis"
            assert dog.collective_failed("RuntimeError: x") is None and dog.exit_status is None
        finally:
            dog.stop()
        kinds = [json.loads(line)["kind"] for line in (tmp_path / "events-00000.jsonl").open()]
        assert told == [] and "diagnosis" in kinds and "action" not in kinds
        (tmp_path / "events-00000.jsonl").unlink()

    claimed = HangAbort(1.0, lambda: "ours", threading.Event())
    assert claimed.claim() and not claimed.claim()  # the watchdog thread's and the main thread's, one wins


def test_a_replayed_cuda_graph_is_progress_not_silence(tmp_path: Path) -> None:
    """A whole step replayed as one CUDA graph fires no hook: the replays keep the watchdog quiet; when they
    stop, the stall is noticed."""
    replays = [0]
    probe, dog = _watchdog(tmp_path, replays=lambda: replays[0])
    dog.start()
    try:
        for _ in range(30):  # 1.5 s of replays, three times the threshold
            replays[0] += 1
            time.sleep(0.05)
        assert not dog.stalled
        assert _until(lambda: dog.stalled, 30.0), "no stall once the replays stopped"
        replays[0] += 1
        assert _until(lambda: not dog.stalled, 30.0), "no recovery when the replays came back"
    finally:
        dog.stop()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "events-00000.jsonl").open()]
    assert kinds.count("stall") == 1 and "recovery" in kinds


def test_faulthandler_ends_a_rank_only_under_a_bound_the_user_chose(tmp_path: Path) -> None:
    for bound, exits in ((None, False), (6.0, True)):
        native = _Native()
        _, dog = _watchdog(tmp_path, native=native,
                           abort=lambda w, b=bound: HangAbort(b, lambda: "", w._stop))  # fmt: skip
        dog._native()
        (timeout, exit), *_ = native.armed
        assert exit is exits and (not exits or timeout >= bound), native.armed
