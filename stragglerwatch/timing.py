"""Raw time marks of one step, and the pure arithmetic that turns them into a record.

Design: the probes (``probes.py``) only *append* marks to a :class:`StepMarks`
while the step runs; a mark is a ``time.perf_counter()`` float on the host path
or a recorded ``torch.cuda.Event`` on the GPU path. Nothing is computed on the
training thread. The event-log thread later resolves device marks lazily
(:func:`resolve_cuda` returns ``None`` until every event has completed: it
uses ``Event.query()``, never a synchronisation) and calls :func:`anatomy`,
which is the single definition of the step anatomy in DESIGN.md:

    start ── data wait ── forward ── backward compute ── all-reduce wait ── optimizer ── end
    (each phase summed over micro-batches; ``other`` is what is left)

``backward`` runs from the gradient of the model output (first backward node)
to the end of the autograd graph; ``allreduce_wait`` from that end until DDP's
own end-of-backward callback has waited for every bucket's all-reduce (zero
when communication was fully overlapped), summed over the synchronising
backward passes of the step; ``busy = step - allreduce_wait`` is the straggler
signal. Per-bucket ready/all-reduce marks are optional (``bucket_timings``).
"""

from __future__ import annotations

from typing import Any

from .schema import StepRecord


class StepMarks:
    """Marks of one optimizer step of one rank (host floats or CUDA events)."""

    __slots__ = (
        "step",
        "start",
        "host_start",
        "fwd_start",
        "fwd_end",
        "bwd_start",
        "bwd_end",
        "ready",
        "done",
        "sync",
        "opt_start",
        "end",
        "data_wait_s",
        "data_from_gap",
    )

    def __init__(self, step: int, start: Any, host_start: float, data_from_gap: bool = True):
        self.step = step
        self.start = start
        self.host_start = host_start  # perf_counter seconds, for the wall-clock start time
        self.fwd_start: list[Any] = []
        self.fwd_end: list[Any] = []
        self.bwd_start: list[Any] = []
        self.bwd_end: list[Any] = []
        self.ready: list[tuple[int, Any]] = []  # (bucket index, grads ready)
        self.done: list[tuple[int, Any]] = []  # (bucket index, all-reduce done); other thread
        self.sync: list[tuple[Any, Any]] = []  # (graph done, all-reduces waited for) per synced pass
        self.opt_start: Any = None
        self.end: Any = None
        self.data_wait_s = 0.0  # host seconds blocked in a wrapped loader
        self.data_from_gap = data_from_gap  # no wrapped loader: data wait = gap before forward

    def events(self) -> list[Any]:
        """Every mark of the step, in no particular order."""
        marks = [self.start, self.end, *self.fwd_start, *self.fwd_end, *self.bwd_start]
        marks += [*self.bwd_end, *(m for _, m in self.ready), *(m for _, m in self.done)]
        marks += [m for pair in self.sync for m in pair]
        if self.opt_start is not None:
            marks.append(self.opt_start)
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


def anatomy(m: StepMarks, rank: int, wall_anchor: float, timing: str = "host") -> StepRecord:
    """The step record of resolved (float, seconds) marks. Pure.

    ``wall_anchor`` is ``time.time() - time.perf_counter()`` taken once, so that
    ``start_time`` is wall-clock without calling ``time.time()`` in the hot path.
    """
    start, end = m.start, m.end
    step_s = max(0.0, end - start)
    forward_s = sum(e - s for s, e in zip(m.fwd_start, m.fwd_end, strict=False))
    backward_s = sum(e - s for s, e in zip(m.bwd_start, m.bwd_end, strict=False))
    allreduce_wait_s = sum(max(0.0, synced - graph_done) for graph_done, synced in m.sync)
    optimizer_s = end - m.opt_start if m.opt_start is not None else 0.0
    if m.data_from_gap:
        data_wait_s = m.fwd_start[0] - start if m.fwd_start else 0.0
    else:
        data_wait_s = m.data_wait_s
    data_wait_s = min(max(0.0, data_wait_s), step_s)
    accounted = data_wait_s + forward_s + backward_s + allreduce_wait_s + optimizer_s
    other_s = max(0.0, step_s - accounted)
    indices, ready_s, allreduce_s = _pair_buckets(m.ready, m.done, start)
    return StepRecord(
        rank=rank,
        step=m.step,
        start_time=wall_anchor + m.host_start,
        data_wait_s=data_wait_s,
        forward_s=forward_s,
        backward_s=backward_s,
        allreduce_wait_s=allreduce_wait_s,
        optimizer_s=optimizer_s,
        other_s=other_s,
        step_s=step_s,
        busy_s=step_s - allreduce_wait_s,
        micro_batches=len(m.fwd_start),
        timing=timing,
        bucket_index=indices,
        bucket_ready_s=ready_s,
        bucket_allreduce_s=allreduce_s,
    )


def resolve_cuda(m: StepMarks, block: bool = False) -> StepMarks | None:
    """Float marks (seconds after the step's start event) once every event completed.

    Returns ``None`` while any event is still pending, unless ``block`` (used
    only at close, off the hot path) lets it wait for them. The data wait is
    what the device saw: with a wrapped loader, the host's blocked time capped
    by the device's idle gap before the first forward.
    """
    events = m.events()
    if block:
        for ev in events:
            ev.synchronize()
    elif not all(ev.query() for ev in events):
        return None
    base = m.start

    def sec(ev: Any) -> float:
        return base.elapsed_time(ev) / 1000.0

    r = StepMarks(m.step, 0.0, m.host_start, m.data_from_gap)
    r.fwd_start = [sec(e) for e in m.fwd_start]
    r.fwd_end = [sec(e) for e in m.fwd_end]
    r.bwd_start = [sec(e) for e in m.bwd_start]
    r.bwd_end = [sec(e) for e in m.bwd_end]
    r.ready = [(i, sec(e)) for i, e in m.ready]
    r.done = [(i, sec(e)) for i, e in m.done]
    r.sync = [(sec(a), sec(b)) for a, b in m.sync]
    r.opt_start = None if m.opt_start is None else sec(m.opt_start)
    r.end = sec(m.end)
    gap = r.fwd_start[0] if r.fwd_start else m.data_wait_s
    r.data_wait_s = min(m.data_wait_s, max(0.0, gap))
    return r
