"""Which device's stream a CUDA mark goes on (:class:`PinnedMarks`).

Design: a CUDA event measures only the work of the stream it is recorded on, and can be timed only
against an event of the same device (``elapsed_time`` raises otherwise). ``Event.record()`` without
a stream uses the *current device's* current stream, which is not always where the model computes:

- a loop that moves the model with ``.to(local_rank)`` without ``torch.cuda.set_device`` computes on
  device N while the training thread's current device stays 0;
- the autograd engine runs the backward of device N on a thread of its own whose current device is
  N, while the engine's final callbacks run on the thread that called ``backward()``;
- a ``device_map="auto"`` model spans devices.

Marks made that way land on two devices (the forward's on device 0's idle stream, the backward's on
device N's): the step cannot be resolved. So the probe's clock is pinned to one device, the one the
model computes on, and every mark is recorded on *that* device's current stream of the recording
thread (inside ``torch.cuda.device(pinned)`` when the thread's current device is another; autograd's
and the final callbacks' streams are then those the engine synchronised with the backward's work).

The pin is learned from the training forwards, each signal as soon as it is seen: the device of the
watched model's first CUDA parameter (looked at once, at the first training forward), then the
device of the forward's outputs that need a gradient (where backward starts), and the device of the
gradient the output hook receives, or, for a gradient not on CUDA, the current device of the thread
autograd runs that hook on. On a real GPU the last two agree; a model whose parameters start on
another device than its outputs (``device_map="auto"``) moves the pin once. The steps whose marks
straddle the move cannot be resolved: the log drops and counts them (``timing.resolve_cuda``,
``writer.EventLogWriter.unresolvable_dropped_steps``) and goes on with the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# torch.cuda.current_stream() and current_device() check CUDA's lazy initialisation, resolve the device
# through several Python calls (an environment lookup among them) and build a new Stream object each time:
# tens of microseconds, and a mark needs them once or twice, a collective's wait two marks (measured on an
# H200: a 32-layer FSDP2 step made about 200 marks). The C calls beneath them answer in a microsecond. They
# are used where this torch has them and torch.cuda's own functions are the ones imported (a stand-in, as a
# test's fake CUDA is, is never bypassed).
_C_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_C_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_CURRENT_STREAM, _CURRENT_DEVICE = torch.cuda.current_stream, torch.cuda.current_device


def current_device() -> int:
    """``torch.cuda.current_device()``, by the C call where it may be used."""
    if _C_DEVICE is not None and torch.cuda.current_device is _CURRENT_DEVICE:
        return int(_C_DEVICE())
    return torch.cuda.current_device()


def stream_key(index: int | None = None) -> tuple[int, int, int] | None:
    """(stream id, device index, device type) of the current stream of device ``index`` (None: the current
    device) on this thread, by the C call; None where it may not be used."""
    if _C_STREAM is None or torch.cuda.current_stream is not _CURRENT_STREAM:
        return None
    return tuple(_C_STREAM(current_device() if index is None else index))  # type: ignore[return-value]


def cuda_index(tensors: Iterable[Any]) -> int | None:
    """The device index of the first CUDA tensor among ``tensors``, or None."""
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None and device.type == "cuda":
            return device.index if device.index is not None else torch.cuda.current_device()
    return None


class PinnedMarks:
    """The probe's CUDA clock: ``mark()`` (the un-pinned clock, ``devices.CudaMarks.mark``) called with
    the pinned device current. ``index`` None: not learned yet (the current device's stream)."""

    def __init__(self, mark: Callable[[], Any]):
        self._mark = mark
        self.index: int | None = None
        self.moves = 0  # times the pin changed after it was first learned
        self._looked = False  # the model's parameters were looked at (once)

    def __call__(self) -> Any:
        index = self.index
        if index is None or current_device() == index:
            return self._mark()
        with torch.cuda.device(index):
            return self._mark()

    def learn(self, index: int | None) -> None:
        """The model computes on device ``index`` (None: this signal says nothing)."""
        if index is None or index == self.index:
            return
        if self.index is not None:
            self.moves += 1
        self.index = index

    def learn_parameters(self, module: torch.nn.Module) -> None:
        """At a training forward: the device of ``module``'s first CUDA parameter, looked for once
        (every forward would cost a walk over the parameters), and only while nothing was learned."""
        if self._looked or self.index is not None:
            return
        self._looked = True
        self.learn(cuda_index(module.parameters()))

    def learn_gradient(self, grad: Any) -> None:
        """In the output's gradient hook: the gradient's device, else the hook thread's current device
        (autograd runs a device's backward on a thread whose current device it is)."""
        index = cuda_index((grad,))
        self.learn(index if index is not None else torch.cuda.current_device())

    def stream(self) -> Any:
        """The current stream of the pinned device on the calling thread (the compute stream), as something
        that compares equal for the same stream: its key (:func:`stream_key`), else the Stream."""
        key = stream_key(self.index)
        return key if key is not None else torch.cuda.current_stream(self.index)
