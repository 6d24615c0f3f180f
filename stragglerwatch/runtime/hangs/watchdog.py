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

from stragglerwatch.analysis.hangs import PROGRESS_KEYS, SILENT_S, WAITING, classify, confirm, local_verdict
from stragglerwatch.record.events import BOUNDED_WRITE_S, EventFile
from stragglerwatch.runtime.actions.hangabort import HANG_EXIT_STATUS, TORN_DOWN, HangAbort
from stragglerwatch.runtime.hangs.dumps import dump_flight_recorder, thread_stacks
from stragglerwatch.runtime.hangs.nativestacks import NativeStacks
from stragglerwatch.runtime.hangs.peers import PeerBoard, collective_counts, collective_progress
from stragglerwatch.runtime.hangs.progress import PeerProcesses, ProgressSampler, identity
from stragglerwatch.runtime.log import LOGGER, Problems

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
        replays: Callable[[], int] | None = None,
        silent_s: float = SILENT_S,
        publish_s: float = 1.0,
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
        # a stalled rank's progress (``progress.py``): sampled while a stall lasts, published for the peers
        main = threading.main_thread().ident
        self.sampler = ProgressSampler(lambda: getattr(probe, "thread", None) or main, self._counters,
                                       lambda: self.probe.where[1] in WAITING)  # fmt: skip
        self.replays = replays  # CUDA graph replays so far (a replayed whole step fires no hook)
        self._replayed: tuple[int, float] = (0, float("-inf"))
        self.silent_s, self.publish_s = silent_s, publish_s
        self._peers = PeerProcesses()
        self._me = identity()
        self._published = 0.0
        self._recovered_at = 0.0  # Unix seconds this rank's last stall ended: peers' notes before it are stale
        self._decided = 0.0
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
                dumped = self.native.collect()  # dumped since the thread's last look (the job ended before its next)
                self.native.cancel()
                if dumped:
                    self.record("native_stacks", stacks={"faulthandler": dumped[-20000:]})
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
            self.board.publish({"step": 0, "phase": "idle", "at": time.time(), **self._me})
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
        if self.abort is None or not self.abort.chosen:  # a long pickle holds the GIL too: only stacks
            self.native.arm(threshold + 2.0)
        else:  # a bound the user chose: a rank holding the GIL past it ends itself, its stacks dumped first
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
            if signal.SIGTERM in data and self.collective_failed(TORN_DOWN) is None:
                self.on_terminate("SIGTERM", from_thread=True)

    def _poll(self, native_dump: str | None = None) -> None:
        step, phase, since = self.probe.where
        if phase == "idle" or self._stop.is_set() or not getattr(self.probe, "enabled", True):
            return  # closing: the hooks are off, so where they left the training thread says nothing any more
        now = time.perf_counter()
        replayed = self._replay_time(now)
        if self._stall is not None:
            if (step, phase, since) != self._stall["where"] or replayed > self._stall["detected"]:
                self._recovered(now)
                return
            self._follow(now)
            if self.abort is not None and self.abort.due(self._stall["diagnosed"], self._stall["threshold_s"], now):
                self._decide(now)
            return
        threshold = self.threshold()
        if now - max(since, replayed) <= threshold:
            return
        if self.native is not None:  # this thread is busy on purpose from here: no dump for that
            self.native.pause()
            # and what was dumped after _native looked, while this thread waited to run on (the stall's own dumps)
            native_dump = "".join(d for d in (native_dump, self.native.collect()) if d)[-20000:] or None
        stall_id = f"{self.rank}-{step}-{int(self._wall + since)}"
        # diagnosed: when the diagnosis was written (the hang policy counts from there; until then, from now)
        self._stall = {"id": stall_id, "where": (step, phase, since), "t": since, "diagnosed": now,
                       "detected": now, "threshold_s": threshold}  # fmt: skip
        self.stalled = True
        self.timeouts_by_phase[phase] = self.timeouts_by_phase.get(phase, 0) + 1
        self.sampler.begin(now)
        stacks = thread_stacks()
        if native_dump:  # noticed late: the GIL was held; the dump is where the rank was stuck
            stacks = {"faulthandler": native_dump, **stacks}
        counts, progress = collective_counts(), self._progress()
        if self.probe.where != (step, phase, since):  # it ran on while we looked (noticed late, once the GIL
            counts, progress = {}, {}  # was let go): what it has issued now would blame the ranks it left waiting
        ev = self._event("stall", (step, phase, since), id=stall_id, waited_s=round(now - since, 3),
                         threshold_s=round(threshold, 3), collectives=counts, **progress, stacks=stacks)  # fmt: skip
        verdict = self._diagnose(ev, grace_s=max(2.0, 2 * statistics.median(self.probe.recent_steps or [0.0])))
        self._flight_recorder(stall_id)
        self._stall.update(diagnosed=time.perf_counter(), verdict=verdict)

    def _replay_time(self, now: float) -> float:
        """When this rank last replayed a CUDA graph (perf-counter seconds; -inf: never seen)."""
        if self.replays is None:
            return float("-inf")
        try:
            count = int(self.replays())
        except Exception:
            return float("-inf")
        if count != self._replayed[0]:
            self._replayed = (count, now)
        return self._replayed[1]

    def _recovered(self, now: float) -> None:
        stall = self._stall or {}
        progress = self.sampler.progress
        said: dict[str, Any] = {"doing": progress.doing} if progress is not None and progress.doing else {}
        if stall.get("busy"):  # what the culprits were doing while the policy waited
            said["busy"] = stall["busy"]
        self._event("recovery", stall_id=stall.get("id"), stalled_s=round(now - stall.get("t", now), 3), **said)
        self._stall, self.stalled = None, False
        self._recovered_at = time.time()
        self.sampler.end()
        self._peers.forget()

    def _counters(self) -> Any:
        """The job's own counters at a stall sample: collectives issued, started and completed, the GPU's
        progress, graph replays (any change is progress)."""
        return (collective_counts(), self._progress(), self._replayed[0])

    def _note(self, now: float) -> dict[str, Any]:
        """This rank's note during its stall: its state at the diagnosis and its progress now."""
        stall = self._stall or {}
        note = dict(stall.get("note") or {})
        if self.sampler.progress is not None:
            note.update(self.sampler.progress.note(now))
        return {**note, "at": time.time(), **self._me}

    def _follow(self, now: float) -> None:
        """A stall goes on: sample this rank's progress (and that of culprits running on this host), and, as a
        culprit, tell the peers every ``publish_s`` (a victim's progress decides nothing)."""
        if self.sampler.poll(now) is not None and self.abort is not None:
            self._culprit_processes(now)
        stall = self._stall or {}
        verdict = stall.get("verdict") or {}
        culprit = self.rank in (verdict.get("culprit_ranks") or []) or verdict.get("undecided", False)
        if self.board is not None and "note" in stall and culprit and now - self._published >= self.publish_s:
            self._published = now
            self.board.publish(self._note(now))

    def _culprit_processes(self, now: float) -> dict[int, float | None]:
        """Seconds without progress of each other culprit's process, where it runs on this host (else None)."""
        stall = self._stall or {}
        who = stall.get("who") or {}
        culprits = (stall.get("verdict") or {}).get("culprit_ranks") or []
        return {r: self._peers.quiet_s(r, who.get(r), now) for r in culprits if r != self.rank}

    def _decide(self, now: float) -> None:
        """``on_hang="abort"``, past half the bound: act only if every culprit makes no progress (once a second)."""
        if self.abort is None or self._stall is None or now - self._decided < 1.0:
            return
        self._decided = now
        stall = self._stall
        verdict = stall.get("verdict") or {}
        bound = self.abort.bound(stall["threshold_s"])
        culprits = [r for r in verdict.get("culprit_ranks") or [] if r != self.rank]
        notes = (self.board.read(culprits) if self.board is not None and culprits else None) or {}
        notes[self.rank] = self._note(now)
        wall = time.time()
        local = self._culprit_processes(now)
        decision = confirm(verdict, notes, wall, bound / 2, began=self._wall + stall["t"], silent_s=self.silent_s,
                           local=local)  # fmt: skip
        if decision["act"]:
            self._abort(now)
            return
        busy = {str(r): d for r, d in decision["busy"].items()}
        stall["busy"] = busy or stall.get("busy")
        kind = (decision["why"].split(" (")[0], tuple(sorted(busy)))  # said once, not at every new figure
        if kind != stall.get("deferred"):
            stall["deferred"] = kind
            self._event("deferred", stall_id=stall["id"], why=decision["why"], busy=busy)
            LOGGER.warning("stragglerwatch: hang policy: no action yet on stall %s: %s", stall["id"], decision["why"])

    def _abort(self, now: float) -> None:
        """``on_hang="abort"``: this rank's stall has outlasted half the bound after its diagnosis, and its
        culprits made no progress for that long."""
        stall = self._stall
        if self.abort is None or stall is None or not self.abort.claim():
            return
        self.aborting = True
        self.abort.run(*self._action(stall, now))

    def _action(self, stall: dict[str, Any], now: float) -> tuple[float, float, float, Callable[..., None],
                                                                   dict[str, Any]]:  # fmt: skip
        """The hang policy's arguments for this stall at ``now``: when its bound counts from, the
        threshold, now, how the action is recorded, what ``hang_handler`` is told."""
        verdict = stall.get("verdict") or {}

        def record(**fields: Any) -> None:
            self._event("action", action="abort", stall_id=stall["id"], stalled_s=round(now - stall["t"], 3),
                        culprit_ranks=verdict.get("culprit_ranks"), victim_ranks=verdict.get("victim_ranks"),
                        **fields)  # fmt: skip
            self.actions["abort"] = self.actions.get("abort", 0) + 1
            self._flush()

        info = {"rank": self.rank, "stall_id": stall["id"], "culprit_ranks": verdict.get("culprit_ranks"),
                "victim_ranks": verdict.get("victim_ranks"), "step": stall["where"][0], "phase": stall["where"][1]}
        # the bound counts from the decision: a stall deferred while its culprit worked leaves the handlers time
        half = self.abort.bound(stall["threshold_s"]) / 2 if self.abort is not None else 0.0
        return max(stall["diagnosed"], now - half), stall["threshold_s"], now, record, info

    def collective_failed(self, error: str) -> tuple[str, float] | None:
        """``on_hang="abort"``, from the main thread, whose blocked call has just raised ``error`` and will
        end the process (or from a SIGTERM, :data:`TORN_DOWN`: torchrun ends the other ranks as one leaves,
        often before the collective's error reaches Python): what the hang policy does about it, and within
        how many seconds the rank ends.

        - ``"acting"``: the policy's thread is already ending this rank; its SIGTERM follows, or came.
        - ``"claimed"``: this rank waited, in a diagnosed stall, for culprits other than itself, on a backend
          that blocks the host; the call failed because a culprit left the job (the culprit's policy decides
          about when this rank's does, and its exit closes the connections this rank waits on) or timed
          out, so nothing it waits for will come. The action is taken here, as the policy would have taken it:
          recorded (with ``error``), ``hang_handler`` called, the exit at the bound armed, ``exit_status``
          set; the caller runs the application's SIGTERM handler.
        - None: nothing of the policy's (no policy, no diagnosed stall, this rank a culprit, a device
          backend: there the policy ends the rank at once, from its own thread)."""
        if self.abort is None or not self.abort.host_blocking():
            return None
        threshold = (self._stall or {}).get("threshold_s") or self.threshold()
        if self.abort.started:
            return "acting", self.abort.left_s(time.perf_counter(), threshold) + 2.0
        stall = self._stall
        verdict = (stall or {}).get("verdict")
        if stall is None or verdict is None or self.rank in (verdict.get("culprit_ranks") or []):
            return None
        if not self.abort.claim():  # the watchdog thread took it meanwhile
            return "acting", self.abort.left_s(time.perf_counter(), threshold) + 2.0
        self.aborting = True
        self.exit_status = HANG_EXIT_STATUS
        return "claimed", self.abort.failed(*self._action(stall, time.perf_counter()), error=error)

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
        if self._stall is not None:
            self._stall["note"] = own
        states = None
        if self.board is not None and self.board.publish(self._note(time.perf_counter())):
            self._stop.wait(grace_s)
            states = self.board.read()
            if states is not None and self._stall is not None:  # where each rank's process is (``progress.py``)
                keys = ("host", "pid", "start")
                self._stall["who"] = {r: {k: n.get(k) for k in keys} for r, n in states.items() if n}
            if states is not None:  # notes from an older stall, or of no stall, do not speak for this one:
                # nor any written before this rank's last stall ended (what ended it, its peers' progress,
                # came after them; a rank that moved on and then held the GIL could not write a newer one:
                # it is unheard, a silent culprit)
                horizon = max(stall["since"] - stall["threshold_s"], self._recovered_at)
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
