"""The work of a training forward, read from what it receives, without waiting for the GPU.

Design: load imbalance (ranks given different work in the same step: variable-length sequences,
token-based batches) is told from a straggler by busy time *per unit of work*, so each training
forward's main input is counted (:func:`forward_work`):

- a mapping (the first positional argument that is one, a dict or Hugging Face's
  ``BatchEncoding``; else the keyword arguments, as the Trainer's ``model(**inputs)``): the ones of
  its ``attention_mask`` (tokens), else the elements of its ``input_ids`` (tokens), else of its
  first tensor;
- else the first tensor among the positional arguments (one level into a list or tuple: a
  Lightning batch): its elements; "tokens" when it is integer-typed (token ids). An
  ``attention_mask`` among the keyword arguments is counted instead, as above.

Each forward's input is also counted by its *shape* (``elements``, the step's ``work_elements``):
the elements of a mapping's ``input_ids``, else of its ``attention_mask``, else of its first tensor;
of the main tensor otherwise. With dynamic padding (each batch padded to its longest sequence) the
compute follows the padded shape, not the mask's ones, so the analysis is given both counts.

Counting elements reads host metadata (``numel``). Counting a mask's ones on the CPU is a small
reduction; on CUDA it must not sync the GPU: :class:`DeviceCounts` counts on the device and copies
the count, non-blocking, into a slot of a small pinned ring, which the log thread reads once the
copy has landed. The copy runs on the current stream of the *mask's* device, which need not be the
stream of the step's marks (a mask on device N while the thread's current device is 0): an event
recorded right after the copy, on that stream (:attr:`PendingCount.landed`), is what the read waits
for (``timing.resolve_cuda`` waits for it with the step's events). A slot overwritten before it was
read reads NaN. Whatever fails falls back to the elements of the tensor (``note`` says so once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from stragglerwatch.runtime.capture.devices import CaptureGate, _capturing

#: Slots of the pinned ring: mask counts of training forwards queued before the log thread read them.
SLOTS = 4096
Note = Callable[[str, str], None]
#: A forward's (count, unit, elements): the count a float or a :class:`PendingCount`.
Work = tuple[Any, str, float]
#: Tensors of token ids (and of masks).
INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class PendingCount:
    """A count on its way from the device into a slot of a :class:`DeviceCounts` ring."""

    __slots__ = ("_ring", "_slot", "_gen", "landed")

    def __init__(self, ring: DeviceCounts, slot: int, gen: int, landed: Any = None):
        self._ring, self._slot, self._gen = ring, slot, gen
        self.landed = landed  # an event after the copy on its stream (None: the copy was synchronous)

    def read(self) -> float:
        """The count (call once the copy completed); NaN when its slot was reused since."""
        return self._ring.read(self._slot, self._gen)


class DeviceCounts:
    """Counts the nonzeros of device tensors into a pinned ring, without a synchronisation. The ring
    is allocated at the first count (``pinned=False``: pageable, for tests on the CPU)."""

    def __init__(self, gate: CaptureGate | None = None, slots: int = SLOTS, pinned: bool = True):
        self._gate = gate
        self._slots = slots
        self._pinned = pinned
        self._views: list[torch.Tensor] = []  # one 0-d view per slot: the copies' destinations
        self._values: Any = None  # the ring as a numpy array: read without torch's dispatch
        self._gen = [0] * slots  # how many counts each slot has been given
        self._next = 0

    def count(self, t: torch.Tensor) -> PendingCount:
        """Queue the count of ``t``'s nonzeros on the current stream of ``t``'s device, and an event
        after it; raises inside a CUDA graph capture (where the copy would be part of the graph)."""
        if self._gate is not None and self._gate.open and _capturing():
            raise RuntimeError("a CUDA graph capture is open")
        if not self._views:
            buf = torch.zeros(self._slots, dtype=torch.int64, pin_memory=self._pinned)
            self._values = buf.numpy()
            self._views = list(buf.unbind())
        i = self._next % self._slots
        self._next += 1
        self._gen[i] += 1
        self._views[i].copy_(torch.count_nonzero(t), non_blocking=True)
        return PendingCount(self, i, self._gen[i], self._landed(t))

    def _landed(self, t: torch.Tensor) -> Any:
        """An event recorded after the copy of ``t``'s count, on the stream that runs it: the current
        stream of ``t``'s device (the current device's for a tensor not on CUDA). None without CUDA."""
        if not (t.is_cuda or torch.cuda.is_available()):
            return None
        event = (self._gate.event_class() if self._gate is not None else torch.cuda.Event)()
        event.record(torch.cuda.current_stream(t.device if t.is_cuda else None))
        return event

    def read(self, slot: int, gen: int) -> float:
        if self._gen[slot] != gen:
            return float("nan")
        value = float(self._values[slot])
        return value if self._gen[slot] == gen else float("nan")  # reused while we read


def _elements(t: torch.Tensor) -> tuple[float, str]:
    return float(t.numel()), "tokens" if t.dtype in INTEGER_DTYPES else "elements"


def _ones(mask: torch.Tensor, counts: DeviceCounts | None, note: Note) -> tuple[Any, str]:
    """The ones of an attention mask (tokens); its elements when they cannot be counted here."""
    try:
        if mask.device.type == "cpu":
            return float(mask.sum()), "tokens"
        if mask.is_cuda and counts is not None:
            return counts.count(mask), "tokens"
        why = " (host timing: no CUDA events to wait for)" if mask.device.type == "cuda" else ""
        reason = f"an attention mask on {mask.device.type} cannot be counted without waiting for the device{why}"
    except Exception as exc:
        reason = f"the attention mask could not be counted ({type(exc).__name__}: {exc})"
    note("mask", f"{reason}: work counts its elements, padding included")
    return float(mask.numel()), "tokens"


def _mask(mapping: Mapping[str, Any]) -> torch.Tensor | None:
    mask = mapping.get("attention_mask")
    return mask if isinstance(mask, torch.Tensor) and mask.dim() <= 2 else None  # not a 4-d attention bias


def _from_mapping(mapping: Mapping[str, Any], counts: DeviceCounts | None, note: Note) -> Work | None:
    mask = _mask(mapping)
    ids = mapping.get("input_ids")
    if mask is not None:
        n, unit = _ones(mask, counts, note)
        return n, unit, float((ids if isinstance(ids, torch.Tensor) else mask).numel())
    if isinstance(ids, torch.Tensor):
        n = float(ids.numel())
        return n, "tokens", n
    for value in mapping.values():
        if isinstance(value, torch.Tensor):
            n, unit = _elements(value)
            return n, unit, n
    return None


def _main_input(args: Any) -> Any:
    """The first tensor or mapping among ``args`` (one level into a list or tuple), or None."""
    for a in args or ():
        if isinstance(a, (torch.Tensor, dict)):  # the common cases first: a Mapping check costs more
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, (torch.Tensor, Mapping)):
                    return b
        elif isinstance(a, Mapping):
            return a
    return None


def forward_work(args: Any, kwargs: Mapping[str, Any] | None, counts: DeviceCounts | None,
                 note: Note) -> Work | None:  # fmt: skip
    """(count, unit, elements) of a training forward called with ``args`` and ``kwargs``: the count a
    float, or a :class:`PendingCount` of a CUDA mask; ``elements`` those of the main input's shape
    (padding included). None when it receives no tensor. Never syncs."""
    main = _main_input(args)
    if isinstance(main, Mapping):
        return _from_mapping(main, counts, note)
    if isinstance(main, torch.Tensor):
        mask = _mask(kwargs) if kwargs else None
        if mask is None:
            n, unit = _elements(main)
            return n, unit, n
        n, unit = _ones(mask, counts, note)
        return n, unit, float(main.numel())
    return _from_mapping(kwargs, counts, note) if kwargs else None
