"""Is a stalled rank still working? What its process did between two looks, from the kernel's accounts.

Design: a stall says only that the watched model's hooks have not run for a while. A rank saving a
checkpoint, compiling, generating through another engine or pickling a large object is stalled in that
sense and is not hung; a hang policy that cannot tell the two apart aborts healthy jobs. While a stall
lasts, the watchdog takes a :class:`Sample` about once a second (never on the training thread, never
between stalls) and :class:`Progress` says whether anything moved since the last one:

- **CPU time** of the process's Python threads other than ours (not the libraries' native threads:
  NCCL's proxy may spin while a collective is pending), and of its descendant processes (a compile
  worker pool, an asynchronous checkpoint writer, data loader workers), from ``/proc``; at least
  :data:`CPU_SHARE` of one CPU. Time spent spinning while blocked in a collective is no work: while the
  probe says the training thread waits in one, CPU time is not counted (a CUDA host spins in a sync).
  A thread found runnable (state ``R``) at two samples in a row computes too, however little CPU an
  oversubscribed host gave it;
- **I/O**: bytes read and written (``rchar``/``wchar``) by the process's threads but ours and by its
  descendants, at least
  :data:`IO_BYTES`; a thread in uninterruptible sleep (state ``D``, waiting for storage) is I/O too;
- **the training thread's Python stack**: a different frame or line (Python running);
- **the job's own counters**: collectives issued, started or completed per group, the GPU's progress,
  CUDA graph replays (a replayed whole-step graph fires no hook at all).

Where ``/proc`` is missing (not Linux), the process's CPU time and its children's stand in. What the
rank was doing at its last progress (:attr:`Progress.doing`) goes into its notes and events, so that a
report says "busy writing" rather than "hung". Reading ``/proc/self/task/*`` is a few file reads per
thread: about 1 ms for a hundred threads, once a second, during a stall only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The least CPU time, as a share of one CPU over the time between two samples, that counts as work.
CPU_SHARE = 0.2
#: The least bytes read or written between two samples that count as I/O.
IO_BYTES = 64 * 1024
#: The least seconds between two samples compared (CPU time is counted in clock ticks of 10 ms).
MIN_INTERVAL_S = 0.5
#: Thread names of ours: their CPU time and I/O are the observer's, not the job's.
OWN_PREFIX = "stragglerwatch"
_PROC = "/proc/self"


@dataclass
class Sample:
    """One look at the process: when (perf-counter seconds), its work and the training thread's stack."""

    t: float
    cpu_s: float | None
    io_bytes: int | None
    in_io: bool
    stack: tuple[tuple[str, int], ...]
    top: str | None
    counters: Any = None
    running: bool = False  # a thread whose CPU time counts is running or runnable (state ``R``)


def _ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


_HZ = _ticks()


def _stat(path: str) -> tuple[str, float, int] | None:
    """``(state, CPU seconds, ppid)`` from a ``stat`` file, or None."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command may hold spaces and parentheses
    try:
        return fields[0], (int(fields[11]) + int(fields[12])) / _HZ, int(fields[1])
    except (IndexError, ValueError):
        return None


def _io(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("rchar", "wchar"):
            try:
                total += int(value)
            except ValueError:
                return None
    return total


def own_thread_ids() -> set[int]:
    """Native ids of this process's observer threads (named ``stragglerwatch-*``)."""
    return {t.native_id for t in threading.enumerate() if t.name.startswith(OWN_PREFIX) and t.native_id}


def python_thread_ids() -> set[int]:
    """Native ids of this process's Python threads other than ours: the threads whose CPU time is the job's
    work. Native threads of the libraries (NCCL's proxy, which may spin while a collective is pending,
    gloo's, CUDA's, OpenMP's) are left out; the work they do for the job shows in its Python threads,
    its I/O and its GPU."""
    return {t.native_id for t in threading.enumerate() if not t.name.startswith(OWN_PREFIX) and t.native_id}


def _children(pid: int | str) -> list[int]:
    """Child processes of ``pid`` (every thread's ``children`` list), or [] where not kept."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


#: A child process of ours (the straggler policy's analysis) runs ``python -m stragglerwatch...``.
OWN_CHILD = b"\0-m\0stragglerwatch."


def _ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return OWN_CHILD in f.read()
    except OSError:
        return False


def process_work(root: str = _PROC, skip: set[int] | frozenset[int] = frozenset(), depth: int = 3,
                 cpu_of: set[int] | None = None, threads: dict[str, tuple[str, float]] | None = None,
                 ) -> tuple[float, int | None, bool, bool] | None:  # fmt: skip
    """``(CPU seconds, I/O bytes, a thread in uninterruptible sleep, a thread running)`` of a process's
    threads but ``skip``, with its descendants' (``depth`` generations); None where ``/proc`` cannot be read.
    ``cpu_of``: the threads whose CPU time and running state count (None: all); the others' I/O counts.
    ``threads``: filled with each counted thread's ``(state, CPU seconds)`` by its ``/proc`` path."""
    try:
        tasks = os.listdir(f"{root}/task")
    except OSError:
        return None
    cpu, own_io, in_io, running = 0.0, 0, False, False
    for tid in tasks:
        mine = tid.isdigit() and int(tid) in skip
        st = None if mine else _stat(f"{root}/task/{tid}/stat")
        if mine:
            own_io += _io(f"{root}/task/{tid}/io") or 0
        if st is None:
            continue  # ours, or the thread ended between the listing and the read
        if cpu_of is None or int(tid) in cpu_of:
            cpu += st[1]
            running = running or st[0] == "R"  # on a CPU or waiting for one: computing, not blocked
            if threads is not None:
                threads[f"{root}/{tid}"] = (st[0], st[1])
        in_io = in_io or st[0] == "D"
    # the process's bytes (its ended threads' included: a writer thread that finished) less our threads'
    total = _io(f"{root}/io")
    io = max(0, total - own_io) if total is not None else 0
    io_known = total is not None
    if depth > 0:
        for child in _children(root.rsplit("/", 1)[-1] if root != _PROC else os.getpid()):
            if _ours(child):
                continue
            sub = process_work(f"/proc/{child}", frozenset(), depth - 1, threads=threads)
            if sub is not None:
                cpu += sub[0]
                io += sub[1] or 0
                in_io = in_io or sub[2]
                running = running or sub[3]
    return cpu, (io if io_known else None), in_io, running


def _fallback_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def stack_of(thread_id: int | None) -> tuple[tuple[tuple[str, int], ...], str | None]:
    """A thread's Python stack as ``((file, line), ...)`` (innermost last) and its innermost frame in words."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    frames: list[tuple[str, int]] = []
    top = None
    while frame is not None and len(frames) < 64:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno or 0))
        if top is None:
            top = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        frame = frame.f_back
    return tuple(reversed(frames)), top


def sample(thread_id: int | None, counters: Any = None, root: str = _PROC) -> Sample:
    """One look at this process (``thread_id``: the training thread's ``threading.get_ident()``)."""
    work = process_work(root, own_thread_ids(), cpu_of=python_thread_ids()) if os.path.isdir(root) else None
    stack, top = stack_of(thread_id)
    if work is None:
        return Sample(time.perf_counter(), _fallback_cpu(), None, False, stack, top, counters)
    return Sample(time.perf_counter(), work[0], work[1], work[2], stack, top, counters, work[3])


@dataclass
class Progress:
    """A stalled rank's progress over its samples: when it last did something, and what."""

    since: float  # perf-counter seconds the stall began to count (its detection)
    last: Sample | None = None
    moved_at: float | None = None  # the last sample that showed work
    doing: str | None = None  # what that work was, in words
    top: str | None = None  # the training thread's innermost frame at the last sample
    notes: list[str] = field(default_factory=list)

    def update(self, s: Sample, waiting: bool = False) -> list[str]:
        """Take a sample; the kinds of work seen since the last (empty: none). ``waiting``: the training
        thread is blocked in a collective (its CPU time is a spin, not work)."""
        prev, self.last, self.top = self.last, s, s.top
        if prev is None:
            return []
        seen = moved(prev, s, waiting)
        if seen:
            self.moved_at, self.doing = s.t, f"{', '.join(seen)}; at {s.top or 'no Python frame'}"
        return seen

    def quiet_s(self, now: float | None = None) -> float:
        """Seconds without any progress, counted from the stall's detection."""
        now = time.perf_counter() if now is None else now
        return max(0.0, now - max(self.since, self.moved_at or self.since))

    def note(self, now: float | None = None) -> dict[str, Any]:
        """What goes into the rank's note for its peers and into its events."""
        return {"quiet_s": round(self.quiet_s(now), 3), "doing": self.doing, "top": self.top}


def moved(a: Sample, b: Sample, waiting: bool = False) -> list[str]:
    """The kinds of work the process did between samples ``a`` and ``b``, in words."""
    out = []
    dt = max(b.t - a.t, 1e-3)
    if not waiting and a.cpu_s is not None and b.cpu_s is not None and b.cpu_s - a.cpu_s >= CPU_SHARE * dt:
        out.append(f"CPU {100 * (b.cpu_s - a.cpu_s) / dt:.0f}% of a core")
    elif not waiting and a.running and b.running:  # computing, though others got the CPU (an oversubscribed host)
        out.append("running (waiting for a CPU)")
    if a.io_bytes is not None and b.io_bytes is not None and b.io_bytes - a.io_bytes >= IO_BYTES:
        out.append(f"I/O {(b.io_bytes - a.io_bytes) / dt / 1e6:.1f} MB/s")
    if b.in_io:
        out.append("waiting for storage (uninterruptible sleep)")
    if a.stack != b.stack:
        out.append("Python running")
    if a.counters != b.counters:
        out.append("collectives or the GPU advancing")
    return out


class ProgressSampler:
    """Samples this process for the watchdog: ``counters`` returns the job's own counters (collectives,
    GPU progress, graph replays); ``waiting`` whether the training thread is blocked in a collective."""

    def __init__(self, thread_id: Callable[[], int | None], counters: Callable[[], Any],
                 waiting: Callable[[], bool], interval_s: float = 1.0):  # fmt: skip
        self.thread_id, self.counters, self.waiting, self.interval_s = thread_id, counters, waiting, interval_s
        self.progress: Progress | None = None
        self._next = 0.0

    def begin(self, now: float) -> Progress:
        """A stall begins: a fresh account, its first sample taken now."""
        self.progress = Progress(since=now)
        self.progress.update(sample(self.thread_id(), self.counters()))
        self._next = now + self.interval_s
        return self.progress

    def poll(self, now: float) -> list[str] | None:
        """Another sample if one is due; what moved (None: no sample taken)."""
        if self.progress is None or now < self._next:
            return None
        self._next = now + self.interval_s
        return self.progress.update(sample(self.thread_id(), self.counters()), self.waiting())

    def end(self) -> None:
        self.progress = None


def identity(pid: int | None = None) -> dict[str, Any]:
    """What lets a peer on the same host find this process in ``/proc``: host name, pid, start time (ticks
    since boot: a pid of another PID namespace, or reused, does not match it)."""
    import socket

    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid)}


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        return int(raw[raw.rfind(")") + 2 :].split()[19])
    except (OSError, IndexError, ValueError):
        return None


#: CPU seconds a thread runnable at two looks must have had between them to count as computing.
RUNNING_CPU_S = 2 / _HZ


class PeerProcesses:
    """The progress of peers' processes that run on this host, read from ``/proc`` (a peer holding the GIL
    cannot publish a note; its CPU time and I/O still show whether it works).

    From outside, the peer's threads cannot be told apart (its Python threads from the libraries', ours from
    the job's), and a thread waiting for the GIL wakes every few milliseconds: on a crowded host it is often
    found runnable. So a peer's thread counts as running only where it was runnable at both looks *and* got
    CPU time in between (:data:`RUNNING_CPU_S`): computing, however little CPU the host gave it."""

    def __init__(self) -> None:
        self._me = identity()
        self._seen: dict[int, Progress] = {}
        self._threads: dict[int, dict[str, tuple[str, float]]] = {}

    def quiet_s(self, rank: int, note: dict[str, Any] | None, now: float) -> float | None:
        """Seconds without progress of ``rank``'s process, or None where it is not on this host or cannot be
        read (gone, or of another PID namespace under the same host name: nothing is inferred from that)."""
        who = note or {}
        pid, start = who.get("pid"), who.get("start")
        if who.get("host") != self._me["host"] or not isinstance(pid, int) or start is None:
            return None
        if _start_ticks(pid) != start:
            return None
        progress = self._seen.get(rank)
        if progress is not None and progress.last is not None and now - progress.last.t < MIN_INTERVAL_S:
            return progress.quiet_s(now)  # a clock tick over a short interval would read as work
        threads: dict[str, tuple[str, float]] = {}
        work = process_work(f"/proc/{pid}", threads=threads)
        if work is None:
            return None
        before, self._threads[rank] = self._threads.get(rank, {}), threads
        computing = any(state == "R" and before.get(t, ("", cpu))[0] == "R" and cpu - before[t][1] >= RUNNING_CPU_S
                        for t, (state, cpu) in threads.items())  # fmt: skip
        if progress is None:
            progress = self._seen[rank] = Progress(since=now)
        elif progress.last is not None:
            progress.last.running = computing  # ``moved`` asks for both looks
        progress.update(Sample(now, work[0], work[1], work[2], (), None, None, computing))
        return progress.quiet_s(now)

    def forget(self) -> None:
        self._seen.clear()
        self._threads.clear()
