"""The CUDA side of timing: which clock a model needs, marks that never harm a graph capture,
and a gate that keeps our threads' event queries out of the user's captures.

Design: every CUDA call of ours goes through ``torch.cuda`` looked up at call time (so a test's
fake CUDA layer stands in for it), and each rule below exists because the obvious call breaks a
user's GPU work:

- **Which clock.** A model computes on CUDA when its device mesh says so (FSDP2, also with
  ``CPUOffloadPolicy``, whose parameters live on the CPU between steps), when DDP was built for a
  CUDA device, when any parameter or buffer is on CUDA, or, for a model with none there, when the
  job's default process group is NCCL (the current device computes). The first parameter alone
  is not enough: an offloaded or partly-CPU model would get host timing, i.e. kernel launches.
- **Marks inside a capture.** A CUDA event recorded on a stream that is capturing a CUDA graph
  becomes part of the graph and never completes outside it: such a mark is not recorded; it is a
  :class:`~stragglerwatch.runtime.capture.timing.CapturedMark`, and its step is dropped and counted.
- **Queries during a capture.** ``torch.cuda.graph`` and ``make_graphed_callables`` capture in
  ``"global"`` mode by default, in which a ``cudaEventQuery`` from *another* thread invalidates the
  user's capture (the bug PyTorch fixed in its own NCCL watchdog); ``Event.elapsed_time`` queries
  both events first. :class:`CaptureGate` taps ``capture_begin``/``capture_end`` where every
  capture passes through Python (:func:`graph_taps`): ``torch._C._CUDAGraph``, the pybind base of
  ``torch.cuda.CUDAGraph`` (so ``torch.cuda.graph``, ``make_graphed_callables``, torch.compile's
  CUDA graphs, a subclass and a raw ``_CUDAGraph`` alike), and ``torch._C._acceleratorGraph``, that
  of ``torch.accelerator.Graph``. Our events (:meth:`CaptureGate.event_class`) take the gate's lock
  for each query alone, and query nothing while a capture is open (``query()`` says "not yet";
  ``elapsed_time`` waits for the capture to end, at most ``RESOLVE_WAIT_S``); ``capture_begin``
  takes the same lock before it counts the capture open (for at most ``BEGIN_WAIT_S``, then it
  captures anyway, counted and logged), so it waits for one query of ours at most, never for the
  arithmetic around it. A pass of queries first asks ``gate.quiet()`` (no capture open in the
  process, none on this thread's current stream: ``is_current_stream_capturing``) and skips
  itself otherwise.
- **Replays.** A job that replays a captured whole step fires none of our hooks; the same taps
  count ``replay`` calls (``CaptureGate.replays``, ``last_replay``), without a lock or a sync, for
  the watchdog to tell a replaying rank from a silent one.
- **No unbounded wait.** Resolution never calls ``synchronize()``; at close it polls until a
  deadline (``timing.resolve_cuda``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stragglerwatch.runtime.capture.placement import stream_key
from stragglerwatch.runtime.capture.taps import Tap
from stragglerwatch.runtime.capture.timing import CapturedMark
from stragglerwatch.runtime.log import Problems

#: The most ``capture_begin`` waits for a query of ours in flight (microseconds) before capturing
#: anyway: a query stuck in the driver must not hold the user's capture.
BEGIN_WAIT_S = 2.0

#: The most ``elapsed_time`` on one of our events waits for a capture to end: one that began after
#: the step's events were queried and before their times were read.
RESOLVE_WAIT_S = 5.0

#: The graph methods tapped: a capture opens and ends, a replay is counted.
GRAPH_METHODS = ("capture_begin", "capture_end", "replay")

_OPEN = object()  # a query not made: a capture is open


def _cuda_of(device: Any) -> torch.device | None:
    try:
        d = torch.device(device)
    except Exception:
        return None
    return d if d.type == "cuda" else None


def _current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def compute_device(model: torch.nn.Module, mesh: Any = None, ddp: Any = None) -> torch.device:
    """The device ``model`` computes on (see the module docstring for the order of the rules)."""
    mesh_type = getattr(mesh, "device_type", None)
    if mesh_type is not None:
        return _current_cuda() if mesh_type == "cuda" else torch.device(mesh_type)
    if ddp is not None:
        ids = getattr(ddp, "device_ids", None) or []
        for d in [*ids, getattr(ddp, "device", None)]:
            found = _cuda_of(d) if not isinstance(d, int) else torch.device("cuda", d)
            if found is not None:
                return found
    tensors = [*model.parameters(), *model.buffers()]
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    if _nccl_job() and all(t.device.type in ("cpu", "meta") for t in tensors):
        return _current_cuda()
    return tensors[0].device if tensors else torch.device("cpu")


def _nccl_job() -> bool:
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        return "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available()
    except Exception:
        return False


def _begin_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners:
            return original(self, *args, **kwargs)
        gates = list(listeners)
        for g in gates:
            g.opened(self)
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            for g in gates:
                g.closed(self)
            raise

    return capture_begin


def _end_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            for g in list(listeners):
                g.closed(self)

    return capture_end


def _replay_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        for g in listeners:
            g.replayed()
        return original(self, *args, **kwargs)

    return replay


_WRAPPERS = {"capture_begin": _begin_wrapper, "capture_end": _end_wrapper, "replay": _replay_wrapper}


def graph_class() -> type | None:
    """torch's ``CUDAGraph`` (a stand-in on a CPU build, never captured with)."""
    try:
        return torch.cuda.graphs.CUDAGraph
    except Exception:
        return None


def _accelerator_graph_class() -> type | None:
    """``torch.accelerator.Graph`` (torch >= 2.10), whose captures bypass ``torch._C._CUDAGraph``."""
    try:
        return torch.accelerator.Graph
    except Exception:
        return None


def graph_taps() -> list[tuple[type, str]]:
    """Where every graph capture and replay passes through Python: for each graph class
    (``torch.cuda.graphs.CUDAGraph``, looked up now so that a test's fake stands in, and
    ``torch.accelerator.Graph``), the lowest class of its MRO that defines each of
    :data:`GRAPH_METHODS`. On a CUDA build those are the pybind bases ``torch._C._CUDAGraph`` and
    ``torch._C._acceleratorGraph`` (their methods can be replaced): ``torch.cuda.graph``,
    ``make_graphed_callables``, torch.compile's CUDA graphs, any subclass (an override captures only
    through ``super()``) and a raw ``_CUDAGraph`` all pass there. On a CPU build, ``CUDAGraph``
    itself (its base is a stand-in that has none)."""
    out: list[tuple[type, str]] = []
    for root in (graph_class(), _accelerator_graph_class()):
        if not isinstance(root, type):
            continue
        for name in GRAPH_METHODS:
            owner = next((c for c in reversed(root.__mro__) if c is not object and name in c.__dict__), None)
            if owner is not None and callable(owner.__dict__[name]) and (owner, name) not in out:
                out.append((owner, name))
    return out


def _gated_event_class(base: type, gate: CaptureGate) -> type:
    """``base`` (``torch.cuda.Event``) whose queries go through ``gate`` (:meth:`CaptureGate.event_class`)."""

    def query(self: Any) -> bool:
        done = gate._query(base.query, self)
        return False if done is _OPEN else bool(done)

    def elapsed_time(self: Any, end_event: Any) -> float:
        return gate._elapsed(base.elapsed_time, self, end_event)

    doc = "A CUDA event of ours: each query takes the capture gate for itself alone (``devices.py``)."
    attrs = {"query": query, "elapsed_time": elapsed_time, "__doc__": doc, "__module__": __name__}
    return type(base.__name__, (base,), attrs)


class CaptureGate:
    """Knows whether a CUDA graph capture is open in this process, and counts graph replays; see
    the module docstring.

    ``quiet()`` is asked before a pass of event queries; each query of an event made from
    :meth:`event_class` holds the gate's lock for itself alone. ``waited_out`` counts the
    ``capture_begin`` calls that found a query of ours in flight longer than ``BEGIN_WAIT_S`` (they
    capture anyway; ``stats()["capture_gate_timeouts"]``, and a line in the log). ``replays`` counts
    the graph replays of the process and ``last_replay`` is the ``time.perf_counter()`` of the
    latest (0.0 before the first): plain attributes, written without a lock."""

    def __init__(self, problems: Problems | None = None) -> None:
        # held by each query of ours, and by capture_begin to count itself open; reentrant: an
        # ``elapsed_time`` may query its events through :meth:`event_class`'s ``query``
        self._lock = threading.RLock()
        self._state = threading.Condition()  # guards the open captures; notified when one ends
        self._open: set[int] = set()  # the graphs capturing now (ids)
        self.open = 0  # how many: read without a lock on the hot path (``CudaMarks.mark``)
        self.waited_out = 0
        self.replays = 0
        self.last_replay = 0.0
        self._problems = problems or Problems()
        self._events: tuple[type, type] | None = None  # (torch.cuda.Event, its gated subclass)
        self._taps: list[Tap] = []

    def install(self) -> CaptureGate:
        self._taps = [Tap(owner, name, _WRAPPERS[name], self) for owner, name in graph_taps()]
        return self

    def remove(self) -> None:
        for tap in self._taps:
            tap.remove()
        self._taps = []

    def opened(self, graph: Any = None) -> None:
        got = self._lock.acquire(timeout=BEGIN_WAIT_S)
        try:
            with self._state:
                self._open.add(id(graph))
                self.open = len(self._open)
        finally:
            if got:
                self._lock.release()
            else:
                self.waited_out += 1
                self._problems.report("capture-gate", f"a CUDA graph capture began although a query of ours "
                                      f"was in flight for over {BEGIN_WAIT_S:g} s (capture_gate_timeouts)")  # fmt: skip

    def closed(self, graph: Any = None) -> None:
        with self._state:
            self._open.discard(id(graph))
            self.open = len(self._open)
            self._state.notify_all()

    def replayed(self) -> None:
        self.replays += 1
        self.last_replay = time.perf_counter()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[bool]:
        """Around a pass of event queries: yields True when the pass may query (no capture open in
        the process, none on this thread's current stream, which catches a capture begun on this
        thread by a path that is not tapped), False when it should query nothing now and try later.
        Holds no lock: each query takes the gate for itself (:meth:`event_class`), so what the pass
        computes between its queries never delays a ``capture_begin``."""
        yield not self.open and not _capturing()

    def event_class(self) -> type:
        """``torch.cuda.Event`` (looked up now) whose ``query`` and ``elapsed_time`` hold the gate's
        lock for that one call, and make no CUDA call while a capture is open: ``query()`` is then
        False (not yet), ``elapsed_time`` waits for the capture to end (at most ``RESOLVE_WAIT_S``,
        then raises)."""
        base, events = torch.cuda.Event, self._events
        if events is None or events[0] is not base:
            events = self._events = (base, _gated_event_class(base, self))
        return events[1]

    def _query(self, call: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self.open:
                return _OPEN
            return call(*args)

    def _elapsed(self, call: Callable[..., float], start: Any, end: Any) -> float:
        deadline = time.monotonic() + RESOLVE_WAIT_S
        while True:
            ms = self._query(call, start, end)
            if ms is not _OPEN:
                return ms
            with self._state:
                if not self._state.wait_for(lambda: not self.open, deadline - time.monotonic()):
                    raise RuntimeError(f"a CUDA graph capture stayed open over {RESOLVE_WAIT_S:g} s while a step's "
                                       "event times were read")  # fmt: skip


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class CudaMarks:
    """Timing events on the current stream; ``mark()`` is the probe's clock on a CUDA job. The
    events are the gate's (:meth:`CaptureGate.event_class`): whoever queries them, never during a
    capture.

    A mark made while the current stream captures a graph is a :class:`CapturedMark` (counted in
    ``dropped``). The stream is asked only while a capture is open somewhere (the gate knows), so
    an ordinary step pays one attribute read per mark for it."""

    def __init__(self, gate: CaptureGate):
        self._gate = gate
        self.dropped = 0
        self._streams: dict[tuple[int, int, int], Any] = {}  # one Stream object per stream marked on

    def mark(self) -> Any:
        if self._gate.open and _capturing():
            self.dropped += 1
            return CapturedMark()
        ev = self._gate.event_class()(enable_timing=True)
        key = stream_key()
        if key is None:
            ev.record()
            return ev
        stream = self._streams.get(key)
        if stream is None:  # (a loop that makes streams without end: the cache starts over, bounded)
            if len(self._streams) >= 64:
                self._streams.clear()
            stream = self._streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                            device_type=key[2])  # fmt: skip
        ev.record(stream)  # the current stream, as ev.record() would take it, without its Python path
        return ev


def device_progress(trail: list[tuple[Any, int, str]]) -> dict[str, Any] | None:
    """Where the GPU is, from the probe's latest marks ``(event, step, phase begun there)``, oldest
    first: the phase begun at the newest completed event. Every event pending: the GPU has not yet
    reached the oldest mark kept (``behind``). Called under :meth:`CaptureGate.quiet`."""
    if not trail:
        return None
    for ev, step, phase in reversed(trail):
        if isinstance(ev, CapturedMark):
            continue
        if ev.query():
            return {"step": step, "phase": phase}
    step, phase = trail[0][1], trail[0][2]
    return {"step": step, "phase": "behind", "before": phase}
