"""The per-rank watchdog thread: notices stalls, names the culprit through the job's
store, and keeps the evidence when the job is torn down.

Design: the training thread only assigns ``probe.where = (step, phase, since)`` at
each hook. This thread polls it; when ``since`` is older than the threshold
(``timeout_s``, or by default ``multiple`` x the median recent step time, at least
``floor_s``; ``warmup_s`` until a few steps are done) it fires once per stall:
an event with the phase, the time waited and the Python stacks of all threads is
appended to ``events-NNNNN.jsonl`` and flushed at once. Then it publishes this
rank's progress under a key of the c10d store that the process group already uses
(its own client connection with a short timeout, so a dead store costs seconds,
never a hang), with the number of collectives it has issued in each process group
(the groups' own sequence numbers, read here, not counted on the training thread),
what completed (Flight Recorder's last started and completed collective per group, where it
tracks them; on a CUDA job, where the GPU is, from the probe's latest events: on NCCL a stuck
GPU leaves every host's issued counts equal, and only what completed tells it),
waits a grace period for the others to do the same, reads them and writes a
``diagnosis`` event (``hangs.classify``: culprits, victims, silent ranks).
When progress resumes, a ``recovery`` event follows. Every failure of ours is
swallowed and counted: the watchdog never harms training.

Shutdown evidence (``shutdown.py``): a SIGTERM handler and an uncaught-exception hook record what
the rank was doing. A rank blocked in native code (waiting in a collective) cannot run Python signal
handlers, so the signal also wakes this thread through ``signal.set_wakeup_fd``: it records and
flushes. A rank stuck in native code while holding the GIL stops this thread too: then
``nativestacks.py`` writes every thread's stack. At each stall, after the diagnosis, the rank also
writes PyTorch's Flight Recorder record of its last collectives (``dumps.py``), so that ``analyze`` can
put PyTorch's evidence beside ours. The events file and its reader are the record format's
(``stragglerwatch.record.events``).
"""

from __future__ import annotations

import os
import select
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stragglerwatch.analysis.hangs import PROGRESS_KEYS, classify, local_verdict
from stragglerwatch.record.events import BOUNDED_WRITE_S, EventFile
from stragglerwatch.runtime.actions.hangabort import HangAbort
from stragglerwatch.runtime.hangs.dumps import dump_flight_recorder, thread_stacks
from stragglerwatch.runtime.hangs.nativestacks import NativeStacks
from stragglerwatch.runtime.hangs.peers import PeerBoard, collective_counts, collective_progress
from stragglerwatch.runtime.log import Problems

if TYPE_CHECKING:  # the probe needs torch; reading a run's events must not
    from stragglerwatch.runtime.capture.probes import StepProbe


class Watchdog:
    """One rank's watchdog thread. ``stats`` holds its counters for the exporter."""

    def __init__(
        self,
        probe: StepProbe,
        events: EventFile,
        rank: int,
        world_size: int,
        board: PeerBoard | None,
        *,
        timeout_s: float | None = None,
        floor_s: float = 10.0,
        multiple: float = 10.0,
        warmup_s: float = 60.0,
        poll_s: float = 0.2,
        wall_anchor: float = 0.0,
        flush: Callable[[], None] | None = None,
        native: NativeStacks | None = None,
        ids: dict[str, Any] | None = None,
        problems: Problems | None = None,
        fr_path: Path | None = None,
        device: Callable[[], dict[str, Any] | None] | None = None,
        abort: Callable[[Watchdog], HangAbort] | None = None,
    ):
        self.probe = probe
        self.device = device  # CUDA timing: where this rank's GPU is (``devices.device_progress``)
        self.fr_path = fr_path  # where the Flight Recorder dump goes at a stall; None: none
        self.native = native
        self.ids = ids or {}  # restart and attach, on every event
        self.problems = problems or Problems()
        self.events = events
        self.rank = rank
        self.world_size = world_size
        self.board = board
        self.timeout_s = timeout_s
        self.floor_s, self.multiple, self.warmup_s, self.poll_s = floor_s, multiple, warmup_s, poll_s
        self.timeouts_by_phase: dict[str, int] = {}
        self.actions: dict[str, int] = {}  # actions taken by this rank's policies, by kind (for the exporter)
        self.stalled = False
        self.errors = 0
        self._wall = wall_anchor
        self._flush = flush or (lambda: None)
        self._stall: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._wakeup: int | None = None
        self._terminated = threading.Event()
        self.exit_grace_s = 2.0
        # does SIGTERM still mean the default action (set by ShutdownHooks): exit if the main thread cannot
        self.exits_by_default: Callable[[], bool] = lambda: False
        self._thread = threading.Thread(target=self._run, name=f"stragglerwatch-watchdog-{rank}", daemon=True)
        self.abort = abort(self) if abort is not None else None  # ``on_hang="abort"`` (``hangabort.py``)
        self.aborting = False  # the hang policy is ending this rank: a SIGTERM now is ours
        # the status the process must end with at interpreter exit (the application's handler replaced ours)
        self.exit_status: int | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if self._stall is not None and not self.aborting and self.probe.where != self._stall["where"]:  # recovered
            self.record("recovery", stall_id=self._stall["id"])
        if self.native is not None:
            try:
                self.native.cancel()
            except Exception:
                self.errors += 1

    def threshold(self) -> float:
        if self.timeout_s:
            return float(self.timeout_s)
        recent = list(self.probe.recent_steps)
        if len(recent) < 3:
            return max(self.warmup_s, self.floor_s)
        return max(self.floor_s, self.multiple * statistics.median(recent))

    def record(self, kind: str, **fields: Any) -> None:
        """Write an event of this rank (e.g. ``closed``, from the training thread: bounded); never raises."""
        try:
            self._event(kind, timeout_s=BOUNDED_WRITE_S, **fields)
        except Exception:
            self.errors += 1

    def _event(self, kind: str, where: tuple[int, str, float] | None = None, timeout_s: float | None = None,
               **fields: Any) -> dict[str, Any]:  # fmt: skip
        step, phase, since = where or self.probe.where
        ev = {"kind": kind, "rank": self.rank, "step": step, "phase": phase, "since": self._wall + since,
              "detected_at": time.time(), **self.ids}  # fmt: skip
        ev.update(fields)
        self.events.write(ev, timeout_s=timeout_s)
        return ev

    def _run(self) -> None:
        if self.board is not None:  # every rank's key exists from the start: the peers read them in one go
            self.board.publish({"step": 0, "phase": "idle", "at": time.time()})
        while not self._stop.is_set():
            try:
                # a dump first: a stall noticed only now, when the rank runs Python again after holding the GIL
                # in native code, was spent where the dump says, not where the threads are at this moment
                self._poll(self._native())
            except Exception as exc:  # never let the watchdog die of our own bug, nor harm training
                self.errors += 1
                self.problems.report("watchdog", f"watchdog: {type(exc).__name__}: {exc}")
            self._wait()

    def _native(self) -> str | None:
        """What faulthandler dumped since the last look (this thread could not run for a whole
        threshold: the GIL was held, in native code), and the timer armed again."""
        if self.native is None:
            return None
        dumped = self.native.collect()
        if dumped:
            dumped = dumped[-20000:]
            self._event("native_stacks", stacks={"faulthandler": dumped})
        threshold = self.threshold()
        if self.abort is None:
            self.native.arm(threshold + 2.0)
        else:  # on_hang="abort": a rank holding the GIL past its bound ends itself, its stacks dumped first
            self.native.arm(threshold + 2.0 + self.abort.bound(threshold), exit=True)
        return dumped or None

    def _wait(self) -> None:
        if self._wakeup is None:
            self._stop.wait(self.poll_s)
            return
        ready, _, _ = select.select([self._wakeup], [], [], self.poll_s)
        if ready:
            try:
                data = os.read(self._wakeup, 64)
            except OSError:
                data = b""
            if signal.SIGTERM in data:
                self.on_terminate("SIGTERM", from_thread=True)

    def _poll(self, native_dump: str | None = None) -> None:
        step, phase, since = self.probe.where
        if phase == "idle":
            return
        now = time.perf_counter()
        if self._stall is not None:
            if (step, phase, since) != self._stall["where"]:
                self._event("recovery", stall_id=self._stall["id"], stalled_s=round(now - self._stall["t"], 3))
                self._stall, self.stalled = None, False
            elif self.abort is not None and self.abort.due(self._stall["diagnosed"], self._stall["threshold_s"], now):
                self._abort(now)
            return
        threshold = self.threshold()
        if now - since <= threshold:
            return
        if self.native is not None:  # this thread is busy on purpose from here: no dump for that
            self.native.pause()
        stall_id = f"{self.rank}-{step}-{int(self._wall + since)}"
        # diagnosed: when the diagnosis was written (the hang policy counts from there; until then, from now)
        self._stall = {"id": stall_id, "where": (step, phase, since), "t": since, "diagnosed": now,
                       "threshold_s": threshold}  # fmt: skip
        self.stalled = True
        self.timeouts_by_phase[phase] = self.timeouts_by_phase.get(phase, 0) + 1
        stacks = thread_stacks()
        if native_dump:  # noticed late: the GIL was held; the dump is where the rank was stuck
            stacks = {"faulthandler": native_dump, **stacks}
        ev = self._event("stall", (step, phase, since), id=stall_id, waited_s=round(now - since, 3),
                         threshold_s=round(threshold, 3), collectives=collective_counts(),
                         **self._progress(), stacks=stacks)  # fmt: skip
        verdict = self._diagnose(ev, grace_s=max(2.0, 2 * statistics.median(self.probe.recent_steps or [0.0])))
        self._flight_recorder(stall_id)
        self._stall.update(diagnosed=time.perf_counter(), verdict=verdict)

    def _abort(self, now: float) -> None:
        """``on_hang="abort"``: this rank's stall has outlasted half the bound after its diagnosis."""
        if self.abort is None or self._stall is None:
            return
        stall = self._stall
        self.aborting = True
        verdict = stall.get("verdict") or {}

        def record(**fields: Any) -> None:
            self._event("action", action="abort", stall_id=stall["id"], stalled_s=round(now - stall["t"], 3),
                        culprit_ranks=verdict.get("culprit_ranks"), victim_ranks=verdict.get("victim_ranks"),
                        **fields)  # fmt: skip
            self.actions["abort"] = self.actions.get("abort", 0) + 1
            self._flush()

        self.abort.run(stall["diagnosed"], stall["threshold_s"], now, record)

    def _progress(self) -> dict[str, Any]:
        """What completed, beside what was issued: per group the last started and completed
        collective (Flight Recorder's status, where tracked) and where this rank's GPU is."""
        out: dict[str, Any] = {}
        try:
            out.update(collective_progress())
        except Exception:
            self.errors += 1
        if self.device is not None:
            try:
                out["device"] = self.device()
            except Exception:
                self.errors += 1
        return out

    def _flight_recorder(self, stall_id: str) -> None:
        if self.fr_path is None:
            return
        try:
            entries = dump_flight_recorder(self.fr_path)
        except Exception as exc:
            self.errors += 1
            self.problems.report("flight_recorder", f"flight recorder dump: {type(exc).__name__}: {exc}")
            return
        if entries:
            self._event("flight_recorder", stall_id=stall_id, file=self.fr_path.name, entries=entries)

    def _diagnose(self, stall: dict[str, Any], grace_s: float) -> dict[str, Any]:
        own = {"step": stall["step"], "phase": stall["phase"], "since": stall["since"], "at": stall["detected_at"],
               "collectives": stall["collectives"],
               **{k: stall[k] for k in PROGRESS_KEYS if stall.get(k) is not None}}  # fmt: skip
        states = None
        if self.board is not None and self.board.publish(own):
            self._stop.wait(grace_s)
            states = self.board.read()
            if states is not None:  # notes from an older stall, or of no stall, do not speak for this one
                horizon = stall["since"] - stall["threshold_s"]
                states = {r: s if s and s.get("phase") != "idle" and s.get("at", 0) >= horizon else None
                          for r, s in states.items()}  # fmt: skip
                states[self.rank] = own
        if states is None:  # store unreachable (rank 0's host dead?): what this rank knows itself
            verdict, evidence = local_verdict({self.rank: own}, self.world_size), "local"
        else:
            verdict, evidence = classify(states, self.world_size), "store"
        hang_step, hang_phase = verdict.pop("step"), verdict.pop("phase")
        self._event("diagnosis", stall_id=stall["id"], evidence=evidence, peers=states, hang_step=hang_step,
                    hang_phase=hang_phase, threshold_s=stall["threshold_s"], **verdict)  # fmt: skip
        return verdict

    # -- shutdown evidence ----------------------------------------------------
    def on_terminate(self, reason: str, from_thread: bool = False) -> None:
        """Record once what the rank was doing, flush the step log."""
        if self._terminated.is_set() or self.aborting:  # the hang policy's own SIGTERM: its action is recorded
            return
        self._terminated.set()
        try:
            self._event("sigterm" if reason == "SIGTERM" else "exception", reason=reason,
                        timeout_s=None if from_thread else BOUNDED_WRITE_S)
            self._flush()
        except Exception:
            self.errors += 1
        if from_thread and self.exits_by_default():
            # nobody but us handles SIGTERM, and the main thread, blocked in native code, cannot run our
            # handler: end the process as the default action would, unless it ends or is handled first
            time.sleep(self.exit_grace_s)
            if self.exits_by_default():
                os._exit(128 + signal.SIGTERM)
