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
  user's capture (the bug PyTorch fixed in its own NCCL watchdog). :class:`CaptureGate` taps
  ``CUDAGraph.capture_begin``/``capture_end`` (the class every torch capture path uses) and our
  threads query events only inside ``gate.quiet()``, which holds the gate's lock and yields False
  while any capture of the process is open; ``capture_begin`` takes the same lock (for at most
  ``BEGIN_WAIT_S``), so no query of ours is in flight when a capture starts.
- **No unbounded wait.** Resolution never calls ``synchronize()``; at close it polls until a
  deadline (``timing.resolve_cuda``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stragglerwatch.runtime.capture.taps import Tap
from stragglerwatch.runtime.capture.timing import CapturedMark

#: The most ``capture_begin`` waits for a query pass of ours to end before capturing anyway.
BEGIN_WAIT_S = 2.0


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


def _capture_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    begin = original.__name__ == "capture_begin"

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners:
            return original(self, *args, **kwargs)
        gates = list(listeners)
        if begin:
            for g in gates:
                g.opened()
            try:
                return original(self, *args, **kwargs)
            except BaseException:
                for g in gates:
                    g.closed()
                raise
        try:
            return original(self, *args, **kwargs)
        finally:
            for g in gates:
                g.closed()

    return method


def graph_class() -> type | None:
    """torch's ``CUDAGraph`` (a stand-in on a CPU build, never captured with)."""
    try:
        return torch.cuda.graphs.CUDAGraph
    except Exception:
        return None


class CaptureGate:
    """Knows whether a CUDA graph capture is open in this process; see the module docstring.

    ``quiet()`` is what our threads hold while they query events; ``waited_out`` counts the
    ``capture_begin`` calls that found a query pass longer than ``BEGIN_WAIT_S`` (they capture
    anyway; ``stats()["capture_gate_timeouts"]``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 0
        self.waited_out = 0
        self._taps: list[Tap] = []

    def install(self) -> CaptureGate:
        owner = graph_class()
        if owner is not None:
            self._taps = [Tap(owner, name, _capture_wrapper, self) for name in ("capture_begin", "capture_end")
                          if callable(getattr(owner, name, None))]  # fmt: skip
        return self

    def remove(self) -> None:
        for tap in self._taps:
            tap.remove()
        self._taps = []

    def opened(self) -> None:
        got = self._lock.acquire(timeout=BEGIN_WAIT_S)
        try:
            self.open += 1
        finally:
            if got:
                self._lock.release()
            else:
                self.waited_out += 1

    def closed(self) -> None:
        self.open = max(0, self.open - 1)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[bool]:
        """Held around a pass of event queries: yields True when no capture is open (query away),
        False while one is (query nothing now, try later)."""
        with self._lock:
            yield self.open == 0


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class CudaMarks:
    """Timing events on the current stream; ``mark()`` is the probe's clock on a CUDA job.

    A mark made while the current stream captures a graph is a :class:`CapturedMark` (counted in
    ``dropped``). The stream is asked only while a capture is open somewhere (the gate knows), so
    an ordinary step pays one attribute read per mark for it."""

    def __init__(self, gate: CaptureGate):
        self._gate = gate
        self.dropped = 0

    def mark(self) -> Any:
        if self._gate.open and _capturing():
            self.dropped += 1
            return CapturedMark()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
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
