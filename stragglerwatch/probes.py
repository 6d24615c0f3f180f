"""Hooks on an unchanged training loop that append time marks to the current step.

Design: every hook does O(1) work — read a clock (or record a CUDA event) and
append to a list of the current :class:`~stragglerwatch.timing.StepMarks`.
There is no synchronisation, no ``.item()``, no collective, no I/O and no
allocation beyond the mark itself. A finished step's marks are handed to a
``sink`` (the event log's queue) at the optimizer step's post-hook.

Boundaries:
- forward: the (DDP) module's ``forward`` is shadowed by a timing wrapper
  (an instance attribute, removed on close). Module forward hooks would do the
  same but push every call onto ``nn.Module``'s slow path, which costs more
  than all the rest of the probe. Counted only with grad enabled (evaluation
  forwards fall into ``other``);
- backward start: a hook on the model output's gradient, which also queues an
  autograd-engine callback that fires when the backward graph is done;
- all-reduce done: that callback queues a second one, which the engine runs
  after DDP's own end-of-backward callback (queued when the last bucket became
  ready) has waited for every bucket's all-reduce. This times the exposed
  communication with DDP's built-in C++ all-reduce left untouched;
- gradient buckets (optional): a DDP communication hook that wraps the
  all-reduce (or the user's own hook) and marks when each bucket is ready and
  when its all-reduce completed (in the future's ``then`` callback, in stream
  order on GPU). A Python comm hook costs host time per bucket, hence opt-in;
- step end: the optimizer's step post-hook. Under ``no_sync()`` accumulation
  several forwards/backwards belong to one optimizer step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .timing import StepMarks

Sink = Callable[[StepMarks], None]


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors requiring grad at the top level of a forward's output."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        values: Iterable[Any] = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    else:
        return []
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def cuda_mark() -> torch.cuda.Event:
    """A timing event recorded on the current CUDA stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class StepProbe:
    """The hook callbacks of one watched model. Not thread-safe by design: the
    training thread drives it; only the all-reduce ``then`` callbacks run
    elsewhere, and they only append to the list of the step they belong to."""

    def __init__(self, sink: Sink, mark: Callable[[], Any] | None = None, syncing: Callable[[], bool] | None = None):
        self._sink = sink
        self._syncing = syncing  # DDP: does this backward all-reduce (not under no_sync())?
        self._now = time.perf_counter
        self._mark = mark or self._now
        self._data_from_gap = True
        self._cur: StepMarks | None = None
        self._next_step = 0
        self._fwd_open = False
        self._in_backward = False
        self._optimizer_id: int | None = None
        self.enabled = True
        # where the training thread is, for the watchdog thread: (step, phase, since), one
        # tuple assigned at once so that a reader never sees a torn update
        self.where: tuple[int, str, float] = (0, "idle", self._now())
        self.recent_steps: deque[float] = deque(maxlen=32)  # host seconds of the last steps
        self.last_step_end: float | None = None  # perf_counter time the last step ended

    @property
    def steps(self) -> int:
        """Optimizer steps completed so far."""
        return self._next_step

    def _begin(self, host: float | None = None) -> StepMarks:
        host = self._now() if host is None else host
        mark = host if self._mark is self._now else self._mark()
        self._cur = StepMarks(self._next_step, mark, host, self._data_from_gap)
        return self._cur

    # -- data -------------------------------------------------------------
    def wrap(self, iterable: Iterable[Any]) -> TimedIterable:
        """``iterable`` with each ``next()`` timed as data wait (re-iterable per epoch)."""
        self._data_from_gap = False
        if self._cur is not None:
            self._cur.data_from_gap = False
        return TimedIterable(self, iterable)

    def timed_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        now = self._now
        it = iter(iterable)
        while True:
            t0 = now()
            m = self._cur or self._begin(t0) if self.enabled else None  # the first step starts here
            self.where = (self._next_step, "data_wait", t0)
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = now()
            self.where = (self._next_step, "other", t1)
            if m is not None:
                m.data_wait_s += t1 - t0
            yield item

    # -- forward ----------------------------------------------------------
    def on_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self.enabled:
            return
        self.where = (self._next_step, "forward", self._now())  # evaluation forwards are progress too
        if not torch.is_grad_enabled():
            return
        m = self._cur or self._begin()
        if self._fwd_open:  # the previous forward raised: drop its dangling start
            m.fwd_start.pop()
        self._fwd_open = True
        m.fwd_start.append(self._mark())

    def on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.enabled:
            self.where = (self._next_step, "other", self._now())
        if not self._fwd_open:
            return
        self._fwd_open = False
        self._cur.fwd_end.append(self._mark())  # type: ignore[union-attr]
        for t in _grad_tensors(output):
            t.register_hook(self._on_output_grad)

    # -- backward ---------------------------------------------------------
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        m = self._cur
        if self._in_backward or m is None or not self.enabled:
            return
        self._in_backward = True
        self.where = (self._next_step, "backward", self._now())
        m.bwd_start.append(self._mark())
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._in_backward = False
        m = self._cur
        if m is None:
            return
        m.bwd_end.append(self._mark())
        if self._syncing is not None and self._syncing():
            self.where = (self._next_step, "allreduce_wait", self._now())
            torch.autograd.Variable._execution_engine.queue_callback(self._on_synced)
        else:
            self.where = (self._next_step, "other", self._now())

    def _on_synced(self) -> None:
        m = self._cur
        if m is not None and m.bwd_end:
            self.where = (self._next_step, "other", self._now())
            m.sync.append((m.bwd_end[-1], self._mark()))

    def comm_hook(self, inner: Callable[[Any, Any], torch.futures.Future] | None, state: Any) -> Callable:
        """A DDP communication hook timing ``inner(state, bucket)``; ``inner=None``
        times an averaging all-reduce on process group ``state`` (issued on the
        group directly: the Python ``dist.all_reduce`` wrapper costs host time)."""
        mark = self._mark

        def launch(bucket: Any) -> torch.futures.Future:
            if inner is not None:
                return inner(state, bucket)
            buf = bucket.buffer()
            buf.div_(state.size())
            return state.allreduce([buf]).get_future()

        def unwrap(fut: torch.futures.Future) -> Any:
            value = fut.value()
            return value[0] if inner is None else value

        # DDP inspects the signature: the parameter must be named ``bucket`` and
        # carry no (string) annotation, hence none here.
        def hook(_state, bucket):  # type: ignore[no-untyped-def]
            m = self._cur
            if m is None or not self.enabled:
                return launch(bucket).then(unwrap)
            idx = bucket.index()
            m.ready.append((idx, mark()))
            done = m.done

            def on_done(fut: torch.futures.Future) -> Any:
                done.append((idx, mark()))
                return unwrap(fut)

            return launch(bucket).then(on_done)

        hook.__qualname__ = f"stragglerwatch({getattr(inner, '__qualname__', 'allreduce')})"
        return hook

    # -- optimizer --------------------------------------------------------
    def _is_tracked(self, optimizer: Any) -> bool:
        if self._optimizer_id is None:
            self._optimizer_id = id(optimizer)
        return self._optimizer_id == id(optimizer)

    def on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled or not self._is_tracked(optimizer):
            return
        m = self._cur or self._begin()
        self.where = (self._next_step, "optimizer", self._now())
        m.opt_start = self._mark()

    def on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        m = self._cur
        if not self.enabled or m is None or m.opt_start is None or not self._is_tracked(optimizer):
            return
        host = self._now()
        end = host if self._mark is self._now else self._mark()
        m.end = end
        self._next_step += 1
        self._cur = StepMarks(self._next_step, end, host, self._data_from_gap)
        self._in_backward = False
        self.where = (self._next_step, "data_wait" if self._data_from_gap else "other", host)
        self.recent_steps.append(host - m.host_start)
        self.last_step_end = host
        self._sink(m)


class TimedIterable:
    """What :meth:`StepProbe.wrap` returns: iterates like the wrapped object."""

    def __init__(self, probe: StepProbe, iterable: Iterable[Any]):
        self._probe = probe
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return self._probe.timed_iter(self._iterable)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # e.g. loader.sampler, loader.dataset
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._iterable, name)


class ForwardTimer:
    """Shadows ``model.forward`` with a wrapper calling the probe around it; ``remove()`` undoes it."""

    def __init__(self, model: torch.nn.Module, probe: StepProbe):
        self._model = model
        self._previous = model.__dict__.get("forward")  # somebody else's instance-level forward
        inner = model.forward
        pre, post = probe.on_forward_pre, probe.on_forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            pre(model, args)
            output = inner(*args, **kwargs)
            post(model, args, output)
            return output

        self._wrapper = forward
        model.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._model.__dict__.get("forward") is not self._wrapper:
            return  # replaced since: leave the newer one alone
        if self._previous is None:
            del self._model.forward
        else:
            self._model.forward = self._previous  # type: ignore[method-assign]
