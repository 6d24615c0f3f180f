"""A fake CUDA layer with the semantics of ``torch.cuda`` that stragglerwatch's GPU path relies on.

This machine has no GPU, yet the CUDA path (lazy resolution of events, the pending queue, the
bounded close, the capture gate, the stream filter, where the GPU is at a stall) must run on every
CI run. :func:`install` puts these stand-ins where the code looks them up (``torch.cuda.Event``,
``current_stream``, ``stream``, ``is_current_stream_capturing``, ``graphs.CUDAGraph``, ...).

The semantics kept, as CUDA has them:

- A stream runs its work in order; its work ends at a host time (``tail``). Host code returns at
  once from ``spin(ms)``, as from ``torch.cuda._sleep``, and the stream is busy that long. ``hang()``
  makes everything enqueued afterwards never finish (a stuck kernel).
- ``Event.record()`` puts the event at the end of the stream's work; ``query()`` is False until the
  stream got there, True for an event never recorded; ``elapsed_time`` raises unless both events
  were recorded and completed; ``synchronize()`` blocks until completion (forever on a hung stream);
  ``Stream.wait_event`` makes a stream wait for an event.
- Graph capture (``CUDAGraph.capture_begin``/``capture_end``, in ``"global"`` mode by default): an
  event recorded on a capturing stream is part of the graph and never completes outside it; an
  event query from *another* thread while a global capture is open invalidates the capture and
  raises "operation not permitted when stream is capturing" (``device.invalidated`` keeps it).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

NEVER = math.inf


class FakeStream:
    def __init__(self, device: FakeDevice, name: str):
        self.device, self.name = device, name
        self.tail = 0.0  # host time at which the work enqueued so far ends
        self.hung_at: float | None = None  # work enqueued after this never ends

    def _end_of_work(self) -> float:
        t = max(time.perf_counter(), self.tail)
        return NEVER if self.hung_at is not None and t >= self.hung_at else t

    def spin(self, ms: float) -> None:
        self.tail = max(time.perf_counter(), self.tail) + ms / 1000.0

    def hang(self) -> None:
        self.hung_at = max(time.perf_counter(), self.tail)

    def wait_event(self, event: FakeEvent) -> None:
        self.tail = max(self.tail, event.t if event.t is not None else 0.0)

    def synchronize(self) -> None:
        while self._end_of_work() > time.perf_counter():
            time.sleep(0.001)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeDevice:
    """One fake GPU and its capture state."""

    def __init__(self) -> None:
        self.default = FakeStream(self, "default")
        self._local = threading.local()
        self.capturing: dict[FakeStream, tuple[str, int]] = {}  # stream -> (mode, capturing thread)
        self.invalidated: list[str] = []  # captures broken by a query from another thread
        self.queries = 0

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[FakeStream]:
        prev = self.current_stream()
        self._local.stream = s
        try:
            yield s
        finally:
            self._local.stream = prev

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream() in self.capturing

    def check_query(self) -> None:
        """CUDA's rule for a potentially unsafe call: a global capture open on another thread breaks."""
        me = threading.get_ident()
        for stream, (mode, thread) in self.capturing.items():
            if mode == "global" and thread != me:
                self.invalidated.append(f"query from thread {me} during a global capture on {stream}")
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class FakeEvent:
    device: FakeDevice  # set by install()

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.t: float | None = None  # None: never recorded

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.device.current_stream()
        self.t = NEVER if stream in self.device.capturing else stream._end_of_work()

    def query(self) -> bool:
        self.device.check_query()
        self.device.queries += 1
        return self.t is None or time.perf_counter() >= self.t

    def elapsed_time(self, end: FakeEvent) -> float:
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.t is None or end.t is None or not (self.query() and end.query()):
            raise RuntimeError("Both events must be recorded and completed before calculating elapsed time.")
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.001)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.device.current_stream()).wait_event(self)


class FakeGraph:
    """``torch.cuda.CUDAGraph``: opens and closes a capture on the current stream."""

    device: FakeDevice  # set by install()

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._stream = self.device.current_stream()
        self.device.capturing[self._stream] = (capture_error_mode, threading.get_ident())

    def capture_end(self) -> None:
        self.device.capturing.pop(self._stream, None)

    def replay(self) -> None:
        pass


def install(monkeypatch: Any = None) -> FakeDevice:
    """Put a fake GPU in place of ``torch.cuda``'s parts that stragglerwatch calls. With pytest's
    ``monkeypatch`` it is undone after the test; without (a spawned worker), for the process."""
    device = FakeDevice()
    event = type("Event", (FakeEvent,), {"device": device})
    graph = type("CUDAGraph", (FakeGraph,), {"device": device})
    stand_ins = [
        (torch.cuda, "Event", event),
        (torch.cuda, "current_stream", device.current_stream),
        (torch.cuda, "stream", device.stream),
        (torch.cuda, "is_current_stream_capturing", device.is_current_stream_capturing),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda.graphs, "CUDAGraph", graph),
    ]
    for owner, name, value in stand_ins:
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, value)
        else:
            setattr(owner, name, value)
    return device
