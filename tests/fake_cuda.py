"""A fake CUDA layer with the semantics of ``torch.cuda`` that stragglerwatch's GPU path relies on.

This machine has no GPU, yet the CUDA path (lazy resolution of events, the pending queue, the
bounded close, the capture gate, the stream filter, where the GPU is at a stall) must run on every
CI run. :func:`install` puts these stand-ins where the code looks them up (``torch.cuda.Event``,
``current_stream``, ``stream``, ``device``, ``current_device``, ``is_current_stream_capturing``,
``graphs.CUDAGraph``, ...).

The semantics kept, as CUDA has them:

- A stream runs its work in order; its work ends at a host time (``tail``). Host code returns at
  once from ``spin(ms)``, as from ``torch.cuda._sleep``, and the stream is busy that long. ``hang()``
  makes everything enqueued afterwards never finish (a stuck kernel).
- ``Event.record()`` puts the event at the end of the stream's work (the current stream of the
  thread's current device when no stream is given); ``query()`` is False until the stream got there,
  True for an event never recorded; ``elapsed_time`` raises unless both events were recorded and
  completed, and unless both were recorded on the same device; ``synchronize()`` blocks until
  completion (forever on a hung stream); ``Stream.wait_event`` makes a stream wait for an event.
- Several devices (``install(devices=2)``): each has its own default stream and its own current
  stream per thread, and each host thread has its own current device (0 until it sets one:
  ``torch.cuda.set_device``, ``torch.cuda.device(i)``, ``torch.cuda.stream(s)``), as CUDA's runtime
  keeps one per thread. The autograd engine runs a device's backward on a thread of its own whose
  current device is that device: with ``autograd_device`` set, the hooks registered on tensors
  (``Tensor.register_hook``) run on that device's :class:`AutogradThread` while the thread that called
  ``backward()`` waits, and the final callbacks they queue run on the calling thread at the end of
  the backward, where the engine runs them.
- Graph capture (``CUDAGraph.capture_begin``/``capture_end``, in ``"global"`` mode by default): an
  event recorded on a capturing stream is part of the graph and never completes outside it; an
  event query from *another* thread while a global capture is open invalidates the capture and
  raises "operation not permitted when stream is capturing" (``invalidated`` keeps it).

:func:`install` returns device 0 (what a single-device test drives); all of them are in its ``cuda``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
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
        return f"FakeStream(cuda:{self.device.index} {self.name})"


class FakeDevice:
    """One fake GPU: its default stream, the current stream of each thread, its capture state."""

    def __init__(self, cuda: FakeCuda, index: int = 0) -> None:
        self.cuda, self.index = cuda, index
        self.default = FakeStream(self, "default")
        self._local = threading.local()
        self.capturing: dict[FakeStream, tuple[str, int]] = {}  # stream -> (mode, capturing thread)
        self.queries = 0

    @property
    def invalidated(self) -> list[str]:
        """Captures broken by a query from another thread (on any device of the process)."""
        return self.cuda.invalidated

    def current_stream(self, device: Any = None) -> FakeStream:
        """This device's current stream on the calling thread."""
        return getattr(self._local, "stream", self.default)

    def set_stream(self, s: FakeStream) -> None:
        self._local.stream = s

    def stream(self, s: FakeStream) -> contextlib.AbstractContextManager[FakeStream]:
        return self.cuda.stream(s)

    def is_current_stream_capturing(self) -> bool:
        return self.cuda.is_current_stream_capturing()

    def check_query(self) -> None:
        self.cuda.check_query()


class AutogradThread:
    """The autograd engine's worker thread of one device: runs the hooks it is handed with that
    device current, in order, while the thread that runs the backward waits for each."""

    def __init__(self, cuda: FakeCuda, index: int):
        self.index = index
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(cuda,), name=f"fake-autograd-cuda:{index}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        self.ident = self._thread.ident

    def _serve(self, cuda: FakeCuda) -> None:
        cuda.set_device(self.index)
        while True:
            fn, args, out, done = self._tasks.get()
            cuda._local.callbacks = []  # final callbacks queued here: the calling thread queues them
            try:
                out.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the thread running the backward
                out.append((False, exc))
            out.append(cuda._local.callbacks)
            cuda._local.callbacks = None
            done.set()

    def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, list[Callable[[], None]]]:
        """``fn(*args)`` on this thread: its result and the final callbacks it queued."""
        out: list[Any] = []
        done = threading.Event()
        self._tasks.put((fn, args, out, done))
        done.wait()
        (ok, value), callbacks = out
        if not ok:
            raise value
        return value, callbacks


class _Engine:
    """torch's autograd engine, but a final callback queued on an :class:`AutogradThread` is kept
    for the thread that runs the backward (the engine runs them there, after the graph)."""

    def __init__(self, real: Any, cuda: FakeCuda):
        self._real, self._cuda = real, cuda

    def queue_callback(self, callback: Callable[[], None]) -> None:
        kept = getattr(self._cuda._local, "callbacks", None)
        if kept is None:
            self._real.queue_callback(callback)
        else:
            kept.append(callback)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class FakeCuda:
    """The process's fake GPUs, and the current device of each host thread."""

    def __init__(self, count: int = 1) -> None:
        self._local = threading.local()
        self.invalidated: list[str] = []  # captures broken by a query from another thread
        self.devices = [FakeDevice(self, i) for i in range(count)]
        self.autograd_device: int | None = None  # set: tensors' hooks run on that device's autograd thread
        self._autograd: dict[int, AutogradThread] = {}
        self._engine: _Engine | None = None

    def index(self, device: Any = None) -> int:
        """The index of ``device`` (an int, a ``torch.device``, a string; None: the current device)."""
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            device = device.index
        index = self.current_device() if device is None else int(device)
        if not 0 <= index < len(self.devices):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: Any) -> None:
        self._local.device = self.index(device)

    def exchange_device(self, index: int) -> int:
        """``torch.cuda._exchange_device``: make ``index`` current (a negative one: nothing); the previous."""
        if index < 0:
            return -1
        previous = self.current_device()
        self.set_device(index)
        return previous

    def device_count(self) -> int:
        return len(self.devices)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.devices[self.index(device)].current_stream()

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[FakeStream]:
        """``torch.cuda.stream``: the stream's device current, the stream current on it."""
        device, previous = s.device, self.current_device()
        prev_stream = device.current_stream()
        self.set_device(device.index)
        device.set_stream(s)
        try:
            yield s
        finally:
            device.set_stream(prev_stream)
            self.set_device(previous)

    def is_current_stream_capturing(self) -> bool:
        s = self.current_stream()
        return s in s.device.capturing

    def check_query(self) -> None:
        """CUDA's rule for a potentially unsafe call: a global capture open on another thread breaks."""
        me = threading.get_ident()
        for device in self.devices:
            for stream, (mode, thread) in device.capturing.items():
                if mode == "global" and thread != me:
                    self.invalidated.append(f"query from thread {me} during a global capture on {stream}")
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def autograd_thread(self, index: int) -> AutogradThread:
        if index not in self._autograd:
            self._autograd[index] = AutogradThread(self, index)
        return self._autograd[index]

    def _on_autograd_thread(self, hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """``hook`` as the engine calls it for a tensor of device ``autograd_device``: on its thread."""
        index = self.autograd_device
        if index is None:
            return hook
        worker = self.autograd_thread(index)

        def on_device_thread(grad: torch.Tensor) -> Any:
            result, callbacks = worker.run(hook, grad)
            for callback in callbacks:
                self._engine._real.queue_callback(callback)  # type: ignore[union-attr]
            return result

        return on_device_thread


class FakeEvent:
    cuda: FakeCuda  # set by install()

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.t: float | None = None  # None: never recorded
        self._device: FakeDevice | None = None  # where it was first recorded

    @property
    def device(self) -> torch.device | None:
        """As ``torch.cuda.Event.device``: the device it was recorded on, None before."""
        return None if self._device is None else torch.device("cuda", self._device.index)

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        if self._device is not None and stream.device is not self._device:
            raise RuntimeError(f"Event device cuda:{self._device.index} does not match recording stream's device "
                               f"cuda:{stream.device.index}.")  # fmt: skip
        self._device = stream.device
        self.t = NEVER if stream in stream.device.capturing else stream._end_of_work()

    def query(self) -> bool:
        self.cuda.check_query()
        (self._device or self.cuda.devices[self.cuda.current_device()]).queries += 1
        return self.t is None or time.perf_counter() >= self.t

    def elapsed_time(self, end: FakeEvent) -> float:
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.t is None or end.t is None or not (self.query() and end.query()):
            raise RuntimeError("Both events must be recorded and completed before calculating elapsed time.")
        if self._device is not end._device:
            raise RuntimeError("CUDA error: invalid resource handle (both events must be recorded on the same "
                               "device)")  # fmt: skip
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.001)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current_stream()).wait_event(self)


class FakeGraph:
    """``torch.cuda.CUDAGraph``: opens and closes a capture on the current stream."""

    cuda: FakeCuda  # set by install()

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._stream = self.cuda.current_stream()
        self._stream.device.capturing[self._stream] = (capture_error_mode, threading.get_ident())

    def capture_end(self) -> None:
        self._stream.device.capturing.pop(self._stream, None)

    def replay(self) -> None:
        pass


def install(monkeypatch: Any = None, devices: int = 1) -> FakeDevice:
    """Put ``devices`` fake GPUs in place of ``torch.cuda``'s parts that stragglerwatch calls; returns
    device 0 (``.cuda`` holds them all). With pytest's ``monkeypatch`` it is undone after the test;
    without (a spawned worker), for the process. With more than one device, ``Tensor.register_hook``
    and the autograd engine's ``queue_callback`` are stood in for too (``FakeCuda.autograd_device``)."""
    cuda = FakeCuda(devices)
    event = type("Event", (FakeEvent,), {"cuda": cuda})
    graph = type("CUDAGraph", (FakeGraph,), {"cuda": cuda})
    stand_ins = [
        (torch.cuda, "Event", event),
        (torch.cuda, "current_stream", cuda.current_stream),
        (torch.cuda, "stream", cuda.stream),
        (torch.cuda, "is_current_stream_capturing", cuda.is_current_stream_capturing),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "current_device", cuda.current_device),
        (torch.cuda, "set_device", cuda.set_device),
        (torch.cuda, "_exchange_device", cuda.exchange_device),
        (torch.cuda, "_maybe_exchange_device", cuda.exchange_device),
        (torch.cuda.graphs, "CUDAGraph", graph),
    ]
    if devices > 1:
        register_hook = torch.Tensor.register_hook
        cuda._engine = _Engine(torch.autograd.Variable._execution_engine, cuda)

        def on_autograd_thread(tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
            return register_hook(tensor, cuda._on_autograd_thread(hook))

        stand_ins += [
            (torch.cuda, "device_count", cuda.device_count),
            (torch.Tensor, "register_hook", on_autograd_thread),
            (torch.autograd.Variable, "_execution_engine", cuda._engine),
        ]
    for owner, name, value in stand_ins:
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, value)
        else:
            setattr(owner, name, value)
    return cuda.devices[0]
