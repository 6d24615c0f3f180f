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

Shutdown evidence: a SIGTERM handler (torchrun's teardown) and an uncaught-exception
hook record what the rank was doing. A rank blocked in native code (waiting in a
collective) cannot run Python signal handlers, so the signal also wakes this thread
through ``signal.set_wakeup_fd``: it records and flushes. Only when nobody else handles
SIGTERM (ours is the handler, none came before it) and the main thread still has not
handled the signal after ``exit_grace_s`` does it end the process (status 143 = 128 +
SIGTERM), as the default action would have; an application's own handler, installed
before or after attach, always runs to completion.

A rank stuck in native code while holding the GIL stops this thread too: then
:class:`NativeStacks` (``faulthandler`` on a timer this thread keeps re-arming) writes
every thread's stack to ``stacks-NNNNN.txt``.

Flight Recorder: at each stall, after the diagnosis, the rank also writes PyTorch's own record of
its last collectives (``flightrec-NNNNN.pkl``, torch's writer, the format ProcessGroupNCCL dumps on
a timeout; gloo records too) when Flight Recorder records (on by default in recent torch, else
``TORCH_FR_BUFFER_SIZE``), so that ``analyze`` can put PyTorch's evidence beside ours. The latest
stall's dump replaces the previous.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .hangs import PROGRESS_KEYS, classify, local_verdict
from .log import Problems
from .peers import PeerBoard, collective_counts, collective_progress

if TYPE_CHECKING:  # the probe needs torch; reading a run's events must not
    from .probes import StepProbe


def thread_stacks(limit: int = 40) -> dict[str, str]:
    """Python stack of every thread, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        out[f"{names.get(ident, 'thread')} ({ident})"] = "".join(traceback.format_stack(frame, limit=limit))
    return out


def dump_flight_recorder(path: Path) -> int | None:
    """Write this process's Flight Recorder buffer to ``path`` (torch's pickle, replaced atomically);
    the number of entries, or None when there is no multi-rank job, no Flight Recorder in this torch,
    or nothing recorded. Without the stacks of the entries: symbolising them holds the GIL for up to
    a second at a time (seconds in all), while the dump without them takes ~25 ms for 2,000 entries."""
    try:
        import pickle

        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None  # a buffer left by an earlier group of this process says nothing of this job
    data = _dump_fr_trace(includeStackTraces=False)
    entries = len(pickle.loads(data, fix_imports=False).get("entries") or [])  # torch's own bytes, no classes
    if not entries:
        return None
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return entries


#: The most a write of an event waits when the training thread makes it (close, SIGTERM, an exception).
BOUNDED_WRITE_S = 1.0


class EventFile:
    """Append-only JSON Lines file of a rank's events, flushed and synced at every write.

    A write with ``timeout_s`` (one made on the training thread) runs on a thread of its own and
    is waited for at most that long; while a write that did not return is still stuck (a
    filesystem that does not answer), later ones are counted as errors, not waited for."""

    def __init__(self, path: Path):
        self.path = path
        self.errors = 0
        self._lock = threading.Lock()
        self._stuck: threading.Thread | None = None

    def write(self, event: dict[str, Any], timeout_s: float | None = None) -> None:
        line = json.dumps(event, default=str) + "\n"
        if timeout_s is None:
            self._append(line)
            return
        if self._stuck is not None and self._stuck.is_alive():
            self.errors += 1
            return
        writer = threading.Thread(target=self._append, args=(line,), name="stragglerwatch-event-write", daemon=True)
        writer.start()
        writer.join(timeout_s)
        if writer.is_alive():
            self._stuck = writer
            self.errors += 1

    def _append(self, line: str) -> None:
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                self.errors += 1


def read_events(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Every event of a run dir, and how many lines could not be read (skipped)."""
    events, bad = [], 0
    for path in sorted(run_dir.glob("events-*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            bad += 1
            continue
        for line in lines:
            if not line.strip():
                continue  # a blank line holds nothing to lose
            try:
                ev = json.loads(line)
            except ValueError:
                bad += 1  # a line cut by a kill, or garbage
                continue
            if isinstance(ev, dict) and "kind" in ev and "rank" in ev:
                events.append(ev)
            else:
                bad += 1
    return events, bad


class NativeStacks:
    """Stacks of a rank stuck in native code holding the GIL, where no Python thread can run.

    The watchdog thread re-arms ``faulthandler.dump_traceback_later`` about once a second with a
    timeout of its stall threshold; if it cannot run that long (the GIL is held), faulthandler's
    C thread writes every thread's stack to ``stacks-NNNNN.txt``. ``collect`` returns what a
    dump added, once the rank runs again; if it never does, the file is the evidence.

    A fork must not happen while the timer is armed: faulthandler's timer thread does not exist
    in the child, and the child's exit (which cancels the timer) would wait for it forever. So
    :meth:`before_fork` disarms it (holding the lock that arming takes, across the fork) and
    :meth:`after_fork_in_parent` arms it again."""

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None
        self._armed_at = -1e9
        self._timeout_s: float | None = None  # the timer armed now, if any
        self._seen = 0
        self._lock = threading.Lock()
        self._rearm: float | None = None

    def arm(self, timeout_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._armed_at < 1.0:
                return
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - faulthandler writes to its fd
                self._seen = self.path.stat().st_size
            faulthandler.dump_traceback_later(timeout_s, repeat=False, file=self._file, exit=False)
            self._armed_at, self._timeout_s = now, timeout_s

    def collect(self) -> str | None:
        if self._file is None:
            return None
        size = self.path.stat().st_size
        if size <= self._seen:
            return None
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self._seen)
            text = f.read()
        self._seen = size
        return text

    def _disarm(self) -> None:
        if self._timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at, self._timeout_s = -1e9, None

    def pause(self) -> None:
        """Disarm until the next ``arm`` (while the watchdog thread waits on purpose)."""
        with self._lock:
            self._disarm()

    def cancel(self) -> None:
        with self._lock:
            self._disarm()
            if self._file is not None:
                self._file.close()
                self._file = None

    def before_fork(self) -> None:
        self._lock.acquire()
        self._rearm = self._timeout_s
        self._disarm()

    def after_fork_in_parent(self) -> None:
        try:
            if self._rearm is not None and self._file is not None:
                faulthandler.dump_traceback_later(self._rearm, repeat=False, file=self._file, exit=False)
                self._armed_at, self._timeout_s = time.monotonic(), self._rearm
        finally:
            self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock.release()  # the child's copy, held by the thread that forked: this one


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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if self._stall is not None and self.probe.where != self._stall["where"]:  # recovered, not yet noticed
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
                self._poll()
                self._native()
            except Exception as exc:  # never let the watchdog die of our own bug, nor harm training
                self.errors += 1
                self.problems.report("watchdog", f"watchdog: {type(exc).__name__}: {exc}")
            self._wait()

    def _native(self) -> None:
        if self.native is None:
            return
        dumped = self.native.collect()
        if dumped:  # we could not run for a whole threshold: the GIL was held, in native code
            self._event("native_stacks", stacks={"faulthandler": dumped[-20000:]})
        self.native.arm(self.threshold() + 2.0)

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

    def _poll(self) -> None:
        step, phase, since = self.probe.where
        if phase == "idle":
            return
        now = time.perf_counter()
        if self._stall is not None:
            if (step, phase, since) != self._stall["where"]:
                self._event("recovery", stall_id=self._stall["id"], stalled_s=round(now - self._stall["t"], 3))
                self._stall, self.stalled = None, False
            return
        threshold = self.threshold()
        if now - since <= threshold:
            return
        if self.native is not None:  # this thread is busy on purpose from here: no dump for that
            self.native.pause()
        stall_id = f"{self.rank}-{step}-{int(self._wall + since)}"
        self._stall = {"id": stall_id, "where": (step, phase, since), "t": since}
        self.stalled = True
        self.timeouts_by_phase[phase] = self.timeouts_by_phase.get(phase, 0) + 1
        ev = self._event("stall", (step, phase, since), id=stall_id, waited_s=round(now - since, 3),
                         threshold_s=round(threshold, 3), collectives=collective_counts(),
                         **self._progress(), stacks=thread_stacks())  # fmt: skip
        self._diagnose(ev, grace_s=max(2.0, 2 * statistics.median(self.probe.recent_steps or [0.0])))
        self._flight_recorder(stall_id)

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

    def _diagnose(self, stall: dict[str, Any], grace_s: float) -> None:
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

    # -- shutdown evidence ----------------------------------------------------
    def on_terminate(self, reason: str, from_thread: bool = False) -> None:
        """Record once what the rank was doing, flush the step log."""
        if self._terminated.is_set():
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


class ShutdownHooks:
    """SIGTERM handler (main thread only), wakeup fd for the watchdog, uncaught-exception hook.

    Only this process's signals count: the handler and the wakeup pipe are inherited by a forked
    child (a DataLoader worker, a fork ``Pool``), where :meth:`forked` puts back what was there
    before us; a signal the handler sees in another process than ours passes straight on. After
    :meth:`remove` the handler, if it could not be taken off (``close()`` off the main thread, or
    somebody chained to it since), is a plain pass-through to what came before it."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        self._pid = os.getpid()
        self._prev_handler: Any = None
        self._prev_excepthook = sys.excepthook
        self._pipe: tuple[int, int] | None = None
        self._prev_wakeup = -1
        self._active = True  # False after remove(): the handler only passes the signal on
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._prev_handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._prev_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if self._prev_wakeup != -1:  # somebody (asyncio?) uses it: leave it to them
                signal.set_wakeup_fd(self._prev_wakeup)
                os.close(r)
                os.close(w)
            else:
                self._pipe = (r, w)
                watchdog._wakeup = r
                watchdog.exits_by_default = self._exits_by_default
        except (ValueError, OSError):
            pass

    def _ours(self) -> bool:
        return self._active and os.getpid() == self._pid

    def _exits_by_default(self) -> bool:
        """True while ours is the SIGTERM handler and there was none before it: then the default
        action (ending the process) is what SIGTERM means. A handler of the application's,
        installed before attach (we chain to it) or after (it replaced ours), is never overridden."""
        try:
            ours = signal.getsignal(signal.SIGTERM) == self._on_sigterm
            return ours and self._ours() and self._prev_handler in (signal.SIG_DFL, None)
        except Exception:
            return False

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if self._ours() and not issubclass(exc_type, KeyboardInterrupt):
            self.watchdog.on_terminate(f"{exc_type.__name__}: {exc}"[:500])
        self._prev_excepthook(exc_type, exc, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._ours():
            self.watchdog.on_terminate("SIGTERM")
        prev = self._prev_handler
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _restore(self) -> None:
        """Put back what was there before us where it is still ours (main thread only)."""
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._prev_handler if self._prev_handler is not None else signal.SIG_DFL)
        if self._pipe is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self._pipe[1]:  # somebody set their own since: theirs stays
                signal.set_wakeup_fd(current)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def forked(self) -> None:
        """In a forked child, before any of its own code: everything back to what it was before us."""
        self._active = False
        self.watchdog._wakeup = None
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        try:
            self._restore()
        except (ValueError, OSError):
            pass

    def remove(self) -> None:
        self._active = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if threading.current_thread() is not threading.main_thread():
            return  # signals can be changed on the main thread only: ours stays, as a pass-through
        try:
            self._restore()
            self.watchdog._wakeup = None
        except (ValueError, OSError):
            pass
