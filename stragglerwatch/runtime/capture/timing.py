"""Raw time marks of one step, and the pure arithmetic that turns them into a record.

Design: the probes (``probes.py``) only *append* marks to a :class:`StepMarks`
while the step runs; a mark is a ``time.perf_counter()`` float on the host path
or a recorded ``torch.cuda.Event`` on the GPU path. Nothing is computed on the
training thread. The event-log thread later resolves device marks lazily
(:func:`resolve_cuda` returns ``None`` until every event has completed: it
uses ``Event.query()``, never a synchronisation) and calls :func:`anatomy`,
which is the single definition of the step anatomy (docs/run-dir.md, "What is recorded"). Events are timed only
against events of their own device: a step whose marks straddle two devices (marks made
before the probe learned where the model computes: ``placement.py``) cannot be resolved,
and :func:`resolve_cuda` raises :class:`UnresolvableStep` for it; the log drops and counts
such a step, and any other whose resolution raises, and goes on with the next.

The marks are intervals, and they nest: a collective sits inside forward (DDP's
buffer broadcast, SyncBatchNorm) or backward, a closure's forward and backward
inside ``optimizer.step``. :func:`anatomy` gives every instant of the step to
the most specific interval covering it, in this order:

    communication (gradient all-reduce wait, every other collective)
    > evaluation passes > forward, backward, wrapped-loader waits
    > optimizer > the gap before each micro-batch's forward (data, without a wrapped loader)
    > other (the rest)

so the phases partition the step exactly. ``busy = step - communication - eval``
is the straggler signal. The time no interval covers is also split by where it lies
(:func:`gaps`: before a forward, between forward and backward, between backward and the
optimizer, after the optimizer), so that a report can say where an ``other`` excess sits.
Data waits the loop marks (``Watch.data``, a wrapped loader) rank just below communication and
evaluation: a fetch between forward and backward is data wait, not other. Per-bucket ready/all-reduce marks are optional
(``bucket_timings``).

The work of the step rides along: one ``(count, unit, elements)`` per training forward (``work``; the
count of a CUDA mask is a :class:`~stragglerwatch.runtime.capture.work.PendingCount` until :func:`resolve_cuda`
reads it, once the event recorded after its copy, on the stream of the mask's device, has completed
too) and what the loop noted (``noted``, ``Watch.note_work``), which replaces the forwards'
count (:func:`step_work`) but not their elements, always those of the inputs' shapes
(:func:`step_elements`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from typing import Any

from stragglerwatch.record.schema import GAPS, StepRecord
from stragglerwatch.runtime.capture.intervals import carve_and_untimed

#: The list-valued marks of a step, in the order :meth:`StepMarks.lengths` reports them.
_LISTS = ("fwd_start", "fwd_end", "bwd_start", "bwd_end", "ready", "done", "sync", "hooked", "comm", "evals", "opt",
          "data", "work", "noted")  # fmt: skip


class StepMarks:
    """Marks of one optimizer step of one rank (host floats or CUDA events)."""

    __slots__ = ("step", "start", "host_start", "end", "data_from_gap", *_LISTS)

    def __init__(self, step: int, start: Any, host_start: float, data_from_gap: bool = True):
        self.step = step
        self.start = start
        self.host_start = host_start  # perf_counter seconds, for the wall-clock start time
        self.end: Any = None
        self.data_from_gap = data_from_gap  # no wrapped loader: data wait = gap before forward
        self.fwd_start: list[Any] = []  # training forwards (grad enabled, module in training mode)
        self.fwd_end: list[Any] = []
        self.bwd_start: list[Any] = []
        self.bwd_end: list[Any] = []
        self.ready: list[tuple[int, Any]] = []  # (bucket index, grads ready)
        self.done: list[tuple[int, Any]] = []  # (bucket index, all-reduce done); other thread
        self.sync: list[tuple[Any, Any]] = []  # (graph done, all-reduces waited for) per synced pass
        # (bucket ready, its collective issued) per bucket of a comm hook of ours: the hook's own work on the
        # stream (a user hook's compression, say), communication that the stream waits for inside backward
        self.hooked: list[tuple[Any, Any]] = []
        self.comm: list[tuple[Any, Any]] = []  # every other collective waited for: (start, end)
        self.evals: list[list[Any]] = []  # [start, end] of each evaluation pass (end None while open)
        self.opt: list[list[Any]] = []  # [start, end] of each optimizer.step() (end None while open)
        self.data: list[tuple[Any, Any]] = []  # blocked fetching: a wrapped loader, a marked fetch
        self.work: list[tuple[Any, str, float]] = []  # (count, unit, shape's elements) of each training forward
        self.noted: list[tuple[float, str]] = []  # (count, unit) the loop noted (Watch.note_work)

    def lengths(self) -> tuple[int, ...]:
        """How many marks each list holds now (a cut point for :meth:`split`)."""
        return tuple(len(getattr(self, name)) for name in _LISTS)

    def split(self, cut: tuple[int, ...], end: Any, host_end: float) -> StepMarks:
        """End this step at ``end`` (marks up to ``cut``); the marks after the cut start the next one."""
        tail = StepMarks(self.step + 1, end, host_end, self.data_from_gap)
        for name, n in zip(_LISTS, cut, strict=True):
            marks = getattr(self, name)
            setattr(tail, name, marks[n:])
            del marks[n:]
        self.end = end
        return tail

    def events(self) -> list[Any]:
        """Every device mark of the step, in no particular order."""
        marks = [self.start, self.end, *self.fwd_start, *self.fwd_end, *self.bwd_start, *self.bwd_end]
        marks += [m for _, m in self.ready] + [m for _, m in self.done]
        for pairs in (self.sync, self.hooked, self.comm, self.evals, self.opt, self.data):
            marks += [m for pair in pairs for m in pair if m is not None]
        return marks


def _pair_buckets(
    ready: list[tuple[int, float]], done: list[tuple[int, float]], start: float
) -> tuple[list[int], list[float], list[float]]:
    """Match each bucket's ready mark with its done mark (in order, per index)."""
    pending: dict[int, list[float]] = {}
    for idx, t in done:
        pending.setdefault(idx, []).append(t)
    indices, ready_s, allreduce_s = [], [], []
    for idx, t in ready:
        queue = pending.get(idx)
        t_done = queue.pop(0) if queue else float("nan")
        indices.append(idx)
        ready_s.append(t - start)
        allreduce_s.append(t_done - t)
    return indices, ready_s, allreduce_s


def _closed(pairs: Iterable[Any]) -> list[tuple[float, float]]:
    return [(a, b) for a, b in pairs if b is not None]


def gap_anchors(m: StepMarks) -> list[tuple[float, str]]:
    """The training marks that name an untimed stretch, sorted (see :func:`gaps`)."""
    return sorted(
        [(t, "F") for t in m.fwd_start] + [(t, "f") for t in m.fwd_end] + [(t, "B") for t in m.bwd_start]
        + [(t, "b") for t in m.bwd_end] + [(b, "b") for _, b in m.sync]
        + [(a, "O") for a, _ in m.opt] + [(b, "o") for _, b in m.opt if b is not None]
    )  # fmt: skip


def gaps(anchors: list[tuple[float, str]], stretches: list[tuple[float, float, float]]) -> dict[str, float]:
    """The untimed seconds of ``stretches`` ((start, end, seconds), sorted, disjoint) per
    :data:`~stragglerwatch.record.schema.GAPS` entry: each stretch is named by the training marks
    around it (:func:`gap_anchors`; a forward next: before the forward; after a forward: between
    forward and backward; after a backward: between backward and the optimizer; after an
    optimizer step: after the optimizer). Pure."""
    times = [t for t, _ in anchors]
    out = dict.fromkeys(GAPS, 0.0)
    for a, b, seconds in stretches:
        i = bisect.bisect_right(times, a) - 1  # the last mark at or before the stretch
        j = bisect.bisect_left(times, b)  # the first mark at or after it
        prev = anchors[i][1] if i >= 0 else None
        if prev is None or (j < len(anchors) and anchors[j][1] == "F"):
            out["before_forward"] += seconds
        elif prev in "Ff":
            out["forward_backward"] += seconds
        elif prev in "Bb":
            out["backward_optimizer"] += seconds
        else:
            out["after_optimizer"] += seconds
    return out


def _data_gaps(m: StepMarks) -> list[tuple[float, float]]:
    """Without a wrapped loader, the loop fetches a batch before each micro-batch's forward: the
    gap before the first forward, and under accumulation each gap between a backward's end and
    the next forward (what else happens there is carved out by the layers above)."""
    if not m.fwd_start:
        return []
    gaps = [(m.start, m.fwd_start[0])]
    ends = sorted(m.bwd_end)
    for f in m.fwd_start[1:]:
        before = [b for b in ends if b <= f]
        if before:
            gaps.append((before[-1], f))
    return gaps


def _count(value: Any) -> float:
    """A count: a number, or what a pending device count reads (NaN when it was lost)."""
    read = getattr(value, "read", None)
    return float(read() if read is not None else value)


def step_work(m: StepMarks) -> tuple[float, str]:
    """The step's work and its unit: the sum of what the loop noted, else of its training forwards'
    counts; (NaN, "") when none was measured, a count was lost, or the units differ. Pure."""
    entries = m.noted or m.work
    units = {e[1] for e in entries}
    if len(units) != 1:
        return float("nan"), ""
    return sum(_count(e[0]) for e in entries), units.pop()


def step_elements(m: StepMarks) -> float:
    """The elements of the step's training forwards' input shapes, summed over those counted (what
    the loop noted does not replace them); NaN when none was. Pure."""
    counted = [e for _, _, e in m.work if e == e]
    return float(sum(counted)) if counted else float("nan")


def anatomy(
    m: StepMarks, rank: int, wall_anchor: float, timing: str = "host", restart: int = 0, attach: int = 0
) -> StepRecord:
    """The step record of resolved (float, seconds) marks. Pure.

    ``wall_anchor`` is ``time.time() - time.perf_counter()`` taken once, so that
    ``start_time`` is wall-clock without calling ``time.time()`` in the hot path.
    """
    start, end = m.start, m.end
    step_s = max(0.0, end - start)
    gap = _data_gaps(m) if m.data_from_gap else []
    layers: list[tuple[str, list[tuple[float, float]]]] = [
        ("allreduce_wait", [*m.sync, *m.hooked]),
        ("collective_wait", list(m.comm)),
        ("eval", _closed(m.evals)),
        ("data_wait", list(m.data)),
        ("forward", list(zip(m.fwd_start, m.fwd_end, strict=False))),
        ("backward", list(zip(m.bwd_start, m.bwd_end, strict=False))),
        ("optimizer", _closed(m.opt)),
    ]
    anchors = gap_anchors(m)
    sec, stretches = carve_and_untimed([*layers, ("data_wait", gap)], len(layers), start, end, [t for t, _ in anchors])
    untimed = gaps(anchors, stretches)
    get = sec.get
    allreduce_wait_s, collective_wait_s = get("allreduce_wait", 0.0), get("collective_wait", 0.0)
    eval_s = get("eval", 0.0)
    accounted = sum(sec.values())
    indices, ready_s, allreduce_s = _pair_buckets(m.ready, m.done, start)
    comm_wait_s = allreduce_wait_s + collective_wait_s
    work, work_unit = step_work(m)
    return StepRecord(
        rank=rank,
        step=m.step,
        start_time=wall_anchor + m.host_start,
        data_wait_s=get("data_wait", 0.0),
        forward_s=get("forward", 0.0),
        backward_s=get("backward", 0.0),
        allreduce_wait_s=allreduce_wait_s,
        collective_wait_s=collective_wait_s,
        eval_s=eval_s,
        optimizer_s=get("optimizer", 0.0),
        other_s=max(0.0, step_s - accounted),
        step_s=step_s,
        busy_s=max(0.0, step_s - comm_wait_s - eval_s),
        comm_wait_s=comm_wait_s,
        micro_batches=len(m.fwd_start),
        timing=timing,
        bucket_index=indices,
        bucket_ready_s=ready_s,
        bucket_allreduce_s=allreduce_s,
        restart=restart,
        attach=attach,
        **{f"gap_{g}_s": v for g, v in untimed.items()},
        work=work,
        work_unit=work_unit if work == work else "",
        work_elements=step_elements(m),
    )


#: What a resolver returns for a step that can never be resolved (a mark made inside a CUDA graph
#: capture): the step is dropped and counted, not kept waiting.
DROPPED = object()


class UnresolvableStep(Exception):
    """A step whose marks can never be resolved (events of two devices): drop it, count it."""


class CapturedMark:
    """Stands in for a CUDA event that was not recorded: the stream was capturing a CUDA graph,
    where an event would be part of the graph and never complete (``devices.py``)."""

    __slots__ = ()


def _ready(events: list[Any], deadline: float | None) -> bool:
    """Whether every event has completed; with a ``deadline`` (``time.monotonic()``), polls until
    then. Never ``synchronize()``: a GPU that never finishes must not hold the caller."""
    while True:
        if all(ev.query() for ev in events):
            return True
        if deadline is None or time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _devices(events: list[Any]) -> set[Any]:
    """The devices ``events`` were recorded on (``torch.cuda.Event.device``; None: not known)."""
    return {getattr(ev, "device", None) for ev in events} - {None}


def _landed(m: StepMarks) -> list[Any]:
    """The events after the copies of the step's device counts (``work.PendingCount.landed``)."""
    return [ev for n, _, _ in m.work if (ev := getattr(n, "landed", None)) is not None]


def resolve_cuda(m: StepMarks, deadline: float | None = None) -> Any:
    """Float marks (seconds after the step's start event) once every event completed.

    Returns ``None`` while any event (or the copy of a device count) is still pending (with a
    ``deadline``, used only at close, off the hot path, it polls until then), and :data:`DROPPED`
    for a step with a mark made inside a CUDA graph capture; raises :class:`UnresolvableStep` for a
    step whose events are on more than one device (``elapsed_time`` would raise for it, now and
    forever). Data waits are device marks too: the device's time between the fetch's start and end
    marks is what it idled for the fetch (nothing, when queued work kept it busy while the host
    fetched).
    """
    events = m.events()
    if any(isinstance(ev, CapturedMark) for ev in events):
        return DROPPED
    devices = _devices(events)
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise UnresolvableStep(f"its marks are on {names}: events of different devices cannot be timed "
                               "against each other")  # fmt: skip
    if not _ready(events + _landed(m), deadline):
        return None
    base = m.start

    def sec(ev: Any) -> float:
        return base.elapsed_time(ev) / 1000.0

    def pairs(marks: list[Any]) -> list[Any]:
        return [(sec(a), sec(b)) for a, b in marks if b is not None]

    r = StepMarks(m.step, 0.0, m.host_start, m.data_from_gap)
    r.fwd_start = [sec(e) for e in m.fwd_start]
    r.fwd_end = [sec(e) for e in m.fwd_end]
    r.bwd_start = [sec(e) for e in m.bwd_start]
    r.bwd_end = [sec(e) for e in m.bwd_end]
    r.ready = [(i, sec(e)) for i, e in m.ready]
    r.done = [(i, sec(e)) for i, e in m.done]
    r.sync, r.comm, r.evals, r.opt = pairs(m.sync), pairs(m.comm), pairs(m.evals), pairs(m.opt)
    r.hooked = pairs(m.hooked)
    r.end = sec(m.end)
    r.data = pairs(m.data)
    r.work = [(_count(n), unit, e) for n, unit, e in m.work]  # their copies have landed (_landed)
    r.noted = list(m.noted)
    return r
