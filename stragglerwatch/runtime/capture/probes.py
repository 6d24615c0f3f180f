"""Hooks on an unchanged training loop that append time marks to the current step.

Design: every hook does O(1) work — read a clock (or record a CUDA event) and
append to a list of the current :class:`~stragglerwatch.runtime.capture.timing.StepMarks`.
There is no synchronisation, no ``.item()``, no collective, no I/O and no
allocation beyond the mark itself (and a training forward's work count). A finished
step's marks are handed to a ``sink`` (the event log's queue) when the step ends.

Boundaries:
- forward: the (DDP) module's ``forward`` is shadowed by a timing wrapper
  (an instance attribute, removed on close; ``shadows.py``). Module forward hooks would do the
  same but push every call onto ``nn.Module``'s slow path. A forward without
  grad, or of a module in eval mode, belongs to an evaluation pass: consecutive
  ones form one ``eval`` interval, which is not training work. A training forward's
  work (its main input's elements or tokens, and the elements of its shape: ``work.py``, never a
  GPU sync) is kept with it; what the loop notes (``note_work``) replaces the first for the step;
- backward start: a hook on the gradient of every tensor of the output that
  needs one (found through nested containers and dataclasses), which also
  queues an autograd-engine callback that fires when the backward graph is done;
- all-reduce done: that callback queues a second one, which the engine runs
  after DDP's own end-of-backward callback (queued when the last bucket became
  ready) has waited for every bucket's all-reduce. This times the exposed
  gradient communication with DDP's built-in C++ all-reduce left untouched;
- every other collective: DDP's buffer broadcast (its ``_sync_module_buffers``
  shadowed per instance, like forward) and every collective issued or waited
  on from Python (``taps.py``: the ``ProcessGroup`` methods and ``Work.wait``;
  a synchronous NCCL collective returns no ``Work``), on the training thread
  or inside its backward. Their intervals are carved out of the phase they sit in;
- gradient buckets (optional): a DDP communication hook that wraps the
  all-reduce (or the user's own hook) and marks when each bucket is ready and
  when its all-reduce completed (in the future's ``then`` callback, in stream
  order on GPU). A Python comm hook costs host time per bucket, hence opt-in;
- step end: the optimizer step post-hook of the optimizer that steps last in an
  iteration. With several optimizers it is learned from the first iteration (a
  step ends after the last optimizer to step before the first one steps again;
  that first step is cut retroactively), or given as ``attach(optimizer=)``.
  Every optimizer's ``step()`` is optimizer time, including a closure's
  forward/backward only where they are not already forward/backward. A step
  that GradScaler skipped counts as a step of zero optimizer time. Under
  ``no_sync()`` accumulation several forwards/backwards belong to one step.

On CUDA each mark is an event on the current stream of the device the model computes on
(``devices.CudaMarks``, pinned to that device by ``placement.PinnedMarks``: not the current device's
stream when the two differ, nor that of whichever thread records); the latest ones are also kept
with the phase the stream runs from there (``device_trail``), so that at a stall the watchdog can
tell where the GPU is, not only where the host is.

When a part of the signal cannot be seen (no output needing a gradient, no
backward from the outputs, compiled autograd, a multi-rank job with no
communication seen), the probe notes the reason once in ``unavailable``.

Recording on/off at run time (``recording``, set from any thread by ``control.py``) is
applied by the training thread at step ends only, so no step is ever cut: turned off, the
step in progress is still recorded and the hooks go idle after it ends (``where`` says
``idle``, so the watchdog waits too); while off, the end of each step is still counted by
the optimizer post-hook (the step numbers of later records stay those of the peers);
turned on again, recording resumes with the step that starts at the next step end.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from threading import get_ident
from typing import Any

import torch
from torch.utils import _pytree

from stragglerwatch.runtime.capture.placement import PinnedMarks, cuda_index
from stragglerwatch.runtime.capture.timing import StepMarks
from stragglerwatch.runtime.capture.work import DeviceCounts, Work, forward_work
from stragglerwatch.runtime.log import Problems

try:
    from torch.compiler import is_compiling  # torch >= 2.3
except ImportError:  # pragma: no cover

    def is_compiling() -> bool:
        return False


Sink = Callable[[StepMarks], None]


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that never raises into the training loop: a failure of ours is counted and
    reported (one line per minute at most), and the hook returns None."""

    @functools.wraps(hook)
    def guarded(self: StepProbe, *args: Any) -> Any:
        try:
            return hook(self, *args)
        except Exception as exc:
            self._hook_failed(hook.__name__, exc)
            return None

    return guarded


_NESTED = object()  # token of a collective inside another timed one (counted once, by the outer)
#: Training forwards in one step before the step is closed anyway: a loop whose optimizer steps we never
#: see (a hand-written update, an unusual framework) would otherwise grow one step without end.
MAX_MICRO_BATCHES = 1000
#: Marks of one kind in one step (collectives, loader waits, optimizer calls) kept; more are counted.
MAX_MARKS = 10_000
_UNCOUNTED: Work = (float("nan"), "", float("nan"))  # a training forward whose input could not be counted
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_SCALARS = (str, bytes, int, float, bool, type(None))


def _grad_tensors(output: Any, most: int = 64) -> list[torch.Tensor]:
    """Tensors needing a gradient anywhere in a forward's output: containers pytree knows
    (dict, list, tuple, namedtuple, registered types such as Hugging Face's ModelOutput),
    mappings and dataclasses, nested; at most ``most``, each once."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    found: dict[int, torch.Tensor] = {}
    stack, visited = [output], 0
    while stack and len(found) < most and visited < 10_000:
        x = stack.pop()
        visited += 1
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.setdefault(id(x), x)
        elif isinstance(x, _SCALARS):
            continue
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            stack.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
        else:
            node = _pytree.SUPPORTED_NODES.get(type(x))
            if node is not None:
                stack.extend(node.flatten_fn(x)[0])
    return list(found.values())


def _compiled_autograd_active() -> bool:
    """Compiled autograd is on (the flag reads False while it traces a backward, the region flag True)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(
        getattr(module, "compiled_autograd_enabled", False) or getattr(module, "in_compiled_autograd_region", False)
    )


class StepProbe:
    """The hook callbacks of one watched model. Not thread-safe by design: the
    training thread drives it; the all-reduce ``then`` callbacks and, on CUDA,
    the autograd engine's device threads only append to the current step's lists."""

    def __init__(
        self,
        sink: Sink,
        mark: Callable[[], Any] | None = None,
        syncing: Callable[[], bool] | None = None,
        *,
        ender: int | None = None,
        params: set[int] | None = None,
        expect_comm: bool = False,
        on_unavailable: Callable[[str], None] | None = None,
        problems: Problems | None = None,
        device_counts: DeviceCounts | None = None,
    ):
        self._sink = sink
        self._syncing = syncing  # DDP: does this backward all-reduce (not under no_sync())?
        self._now = time.perf_counter
        self._pin = PinnedMarks(mark) if mark is not None else None  # CUDA: marks on the model's device
        self._mark: Callable[[], Any] = self._pin if self._pin is not None else self._now
        self._host = mark is None
        self._data_from_gap = True
        self._cur: StepMarks | None = None
        self._next_step = 0
        self._fwd_open = False
        self._eval_fwd = False  # the forward now running is an evaluation forward
        self._eval_open = False  # consecutive evaluation forwards extend one eval interval
        self._in_backward = False
        self._tid = threading.get_ident()  # the training thread (that of the latest training forward)
        self._stream: Any = None  # CUDA: the compute stream (the pinned device's) of the latest training forward
        self.forward_nesting = 0  # timed forwards running now (shadows.py): only the outermost is timed
        self._fwd_seen = False
        self._comm_depth = 0
        self._ender = ender  # id of the optimizer whose step ends a training step (None: learn it)
        self._params = params  # ids of the watched model's parameters: whose optimizers are ours (None: all)
        self._owners: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._owner_seen = False  # an optimizer holding the model's parameters has stepped
        self._manual = False  # steps are ended by hand (``Watch.step``), not by an optimizer
        self.dropped_marks = 0  # marks past MAX_MARKS in a step
        self._stepped: set[int] = set()  # optimizers stepped in the current step
        self._cut: tuple[tuple[int, ...], Any, float, int] | None = None  # last optimizer end, ender unknown
        self._opt_depth = 0
        self._opt_calls = 0
        self._expect_comm = expect_comm  # multi-rank model without DDP: is any communication seen?
        self._on_unavailable = on_unavailable
        self.problems = problems or Problems()
        self.faults = 0  # failures of our own hooks, never raised into the loop
        self.unavailable: dict[str, str] = {}  # what of the signal cannot be seen, and why
        self.work_notes: dict[str, str] = {}  # how the work count falls short, and why (said once each)
        self._counts = device_counts  # CUDA: counts of device masks, copied without a sync
        self._noted: list[tuple[float, str]] = []  # noted before the first step began
        self.step_hooks: list[Callable[[int], None]] = []  # called at each step end (a few look-ups at most)
        self.enabled = True
        self.recording = True  # wanted (runtime control); applied by the training thread at a step end
        self._paused = False  # recording is off: hooks idle, step ends only counted
        # where the training thread is, for the watchdog thread: (step, phase, since), one
        # tuple assigned at once so that a reader never sees a torn update
        self.where: tuple[int, str, float] = (0, "idle", self._now())
        self.recent_steps: deque[float] = deque(maxlen=32)  # host seconds of the last steps
        self.last_step_end: float | None = None  # perf_counter time the last step ended
        # on the device: the latest marks (event, step, phase the stream runs from there), for the
        # watchdog to tell where the GPU is at a stall (``devices.device_progress``)
        self.device_trail: deque[tuple[Any, int, str]] | None = None if self._host else deque(maxlen=64)

    @property
    def steps(self) -> int:
        """Optimizer steps completed so far."""
        return self._next_step

    @property
    def thread(self) -> int:
        """The training thread's id (that of the latest training forward)."""
        return self._tid

    @property
    def paused(self) -> bool:
        """Recording is off (``recording``, applied at a step end): the hooks idle, steps only counted."""
        return self._paused

    def sampled(self) -> tuple[int, int, str] | None:
        """(training thread id, step, phase) for the code sampler, from any thread; None while no
        step is under way (before the first, recording off)."""
        step, phase, _ = self.where
        if not self.enabled or phase == "idle" or self._cur is None:
            return None
        return self._tid, step, phase

    def _at(self, host: float, phase: str | None = None) -> Any:
        """A mark for host time ``host`` (the host clock itself, or a new device event); on the
        device, ``phase`` is what the stream runs from the mark on (for :attr:`device_trail`)."""
        if self._host:
            return host
        ev = self._mark()
        if phase is not None:
            self.device_trail.append((ev, self._next_step, phase))  # type: ignore[union-attr]
        return ev

    def _dmark(self, phase: str) -> Any:
        """A mark now (host clock or device event), on the device also kept in :attr:`device_trail`."""
        ev = self._mark()
        if self.device_trail is not None:
            self.device_trail.append((ev, self._next_step, phase))
        return ev

    def _begin(self, host: float | None = None) -> StepMarks:
        host = self._now() if host is None else host
        self._cur = StepMarks(self._next_step, self._at(host, self._gap_phase()), host, self._data_from_gap)
        if self._noted:
            self._cur.noted, self._noted = self._noted, []
        return self._cur

    def _gap_phase(self) -> str:
        return "data_wait" if self._data_from_gap else "other"

    def note_unavailable(self, key: str, reason: str) -> None:
        """Record once that part of the signal cannot be measured, and why."""
        if key in self.unavailable:
            return
        self.unavailable[key] = reason
        if self._on_unavailable is not None:
            self._on_unavailable(reason)

    def note_work_shortfall(self, key: str, reason: str) -> None:
        """Say once that the work count is not what it should be (not busy time: ``unavailable``)."""
        if key not in self.work_notes:
            self.work_notes[key] = reason
            self.problems.report(f"work-{key}", f"work per step: {reason}")

    @_guarded
    def note_work(self, n: float, unit: str) -> None:
        """The loop's own count of the current step's work (``Watch.note_work``, validated there)."""
        if not self.enabled:
            return
        noted = self._cur.noted if self._cur is not None else self._noted
        if len(noted) < MAX_MARKS:
            noted.append((n, unit))
        else:
            self.dropped_marks += 1

    def _forward_work(self, args: Any, kwargs: Any) -> Work:
        try:
            found = forward_work(args, kwargs, self._counts, self.note_work_shortfall)
        except Exception as exc:
            self.note_work_shortfall("input", f"a forward's input could not be counted ({type(exc).__name__}: {exc})")
            found = None
        return found if found is not None else _UNCOUNTED

    # -- data -------------------------------------------------------------
    def wrap(self, iterable: Iterable[Any]) -> TimedIterable:
        """``iterable`` with each ``next()`` timed as data wait (re-iterable per epoch)."""
        self.exact_data()
        return TimedIterable(self, iterable)

    def exact_data(self) -> None:
        """Data wait is timed where batches are fetched, not taken as the gap before forward."""
        if not self._data_from_gap:
            return
        self._data_from_gap = False
        if self._cur is not None:
            self._cur.data_from_gap = False

    def timed_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        it = iter(iterable)
        while True:
            token = self.data_begin()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.data_end(token)
            yield item

    def data_begin(self) -> Any:
        """The training thread starts waiting for a batch (a wrapped loader, a marked fetch, a
        framework's fetch). Returns a token for :meth:`data_end`; never raises. A fetch on another
        thread (a prefetcher's) is not the training thread's wait: None."""
        t0 = self._now()
        try:
            if not self.enabled or threading.get_ident() != self._tid:
                return None
            m = self._cur or self._begin(t0)  # the first step starts here
            phase = self.where[1]  # where the thread goes back to when the fetch is done
            self.where = (self._next_step, "data_wait", t0)
            return (m, self._at(t0, "data_wait"), phase)
        except Exception:
            return None

    def data_end(self, token: Any) -> None:
        if token is None:
            return
        try:
            m, start, phase = token
            t1 = self._now()
            back = "other" if phase in ("data_wait", "idle") else phase
            self.where = (self._next_step, back, t1)
            if len(m.data) < MAX_MARKS:
                m.data.append((start, self._at(t1, back)))
            else:
                self.dropped_marks += 1
        except Exception:
            self.faults += 1

    # -- forward ----------------------------------------------------------
    @_guarded
    def on_forward_pre(self, module: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
        if not self.enabled:
            return
        now = self._now()
        if not (module.training and torch.is_grad_enabled()):  # evaluation: not training work
            self.where = (self._next_step, "eval", now)
            m = self._cur
            if m is not None and not self._fwd_open:
                if not self._eval_open:
                    m.evals.append([self._at(now, "eval"), None])
                    self._eval_open = True
                self._eval_fwd = True
            return
        self.where = (self._next_step, "forward", now)
        self._tid = threading.get_ident()
        self._fwd_seen = True
        if self._pin is not None:
            self._pin.learn_parameters(module)
            self._stream = self._pin.stream()
        m = self._cur or self._begin(now)
        if len(m.fwd_start) >= MAX_MICRO_BATCHES:
            m = self._close_unended(now)
        self._eval_open = self._eval_fwd = False
        if self._fwd_open:  # the previous forward raised: drop its dangling start
            m.fwd_start.pop()
            if len(m.work) > len(m.fwd_start):
                m.work.pop()
        self._fwd_open = True
        m.fwd_start.append(self._at(now, "forward"))
        m.work.append(self._forward_work(args, kwargs))

    @_guarded
    def on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        now = self._now()
        self.where = (self._next_step, "other", now)
        if self._eval_fwd:
            self._eval_fwd = False
            if self._cur is not None and self._cur.evals:
                self._cur.evals[-1][1] = self._at(now, "other")
            return
        if not self._fwd_open:
            return
        self._fwd_open = False
        tensors = _grad_tensors(output)
        if self._pin is not None:  # where backward starts: the end mark goes there already
            self._pin.learn(cuda_index(tensors))
        self._cur.fwd_end.append(self._at(now, "other"))  # type: ignore[union-attr]
        if _compiled_autograd_active():
            self.note_unavailable(
                "compiled_autograd", "compiled autograd runs the backward: the gradient all-reduce wait is not seen"
            )
            return
        for t in tensors:
            t.register_hook(self._on_output_grad)
        if not tensors and self._syncing is not None:
            self.note_unavailable(
                "no_grad_output",
                "no tensor of the model's output needs a gradient, so backward and the gradient "
                "all-reduce wait cannot be timed",
            )

    # -- backward ---------------------------------------------------------
    @_guarded
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        m = self._cur
        if self._in_backward or m is None or not self.enabled or is_compiling() or _compiled_autograd_active():
            return  # traced by compiled autograd: noted at forward end
        self._in_backward = True
        self._eval_open = False
        self.where = (self._next_step, "backward", self._now())
        if self._pin is not None:  # on autograd's thread of the device backward runs on
            self._pin.learn_gradient(grad)
        m.bwd_start.append(self._dmark("backward"))
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    @_guarded
    def _on_backward_end(self) -> None:
        self._in_backward = False
        m = self._cur
        if m is None:
            return
        syncing = self._syncing is not None and self._syncing()
        m.bwd_end.append(self._dmark("allreduce_wait" if syncing else "other"))
        if syncing:
            self.where = (self._next_step, "allreduce_wait", self._now())
            torch.autograd.Variable._execution_engine.queue_callback(self._on_synced)
        else:
            self.where = (self._next_step, "other", self._now())

    @_guarded
    def _on_synced(self) -> None:
        m = self._cur
        if m is not None and m.bwd_end:
            self.where = (self._next_step, "other", self._now())
            m.sync.append((m.bwd_end[-1], self._dmark("other")))

    # -- every other collective ------------------------------------------
    # The three calls below run once per collective: lean, and guarded inline (no decorator's frame).
    def comm_begin(self) -> Any:
        """A collective starts being waited for (``taps``, DDP's buffer sync). Returns a token (None:
        not this step's wait); never raises."""
        try:
            if self._cur is None or not self.enabled:
                return None
            if get_ident() != self._tid and _graph_task_id() < 0:
                return None  # another thread's collective (not inside our backward): not this step's
            if self._stream is not None and self._pin is not None and self._pin.stream() != self._stream:
                return None  # waited for on a side stream (FSDP2's all-gather stream): not the compute stream's wait
            self._comm_depth += 1
            if self._comm_depth > 1:
                return _NESTED
            step, phase, since = self.where
            now = self._now()
            self.where = (step, "collective_wait", now)
            return (now if self._host else self._at(now, "collective_wait"), phase, since)
        except Exception as exc:
            self._hook_failed("comm_begin", exc)
            return None

    def comm_end(self, token: Any) -> None:
        try:
            self._comm_depth -= 1 if self._comm_depth > 0 else 0
            if token is _NESTED:
                return
            start, phase, _ = token
            now = self._now()
            m = self._cur
            if m is not None and len(m.comm) < MAX_MARKS:
                m.comm.append((start, now if self._host else self._at(now, phase)))
            elif m is not None:
                self.dropped_marks += 1
            self.where = (self._next_step, phase, now)
        except Exception as exc:
            self._hook_failed("comm_end", exc)

    def issue_begin(self) -> Any:
        """Before a process-group call (``taps``): a clock read on the host, a full bracket on the device."""
        return self._now() if self._host else self.comm_begin()

    def issue_end(self, token: Any, kept: bool) -> None:
        """After it: ``kept`` when the call returned no ``Work`` (it blocked, or launched on the current
        stream); otherwise its wait is bracketed where it happens and this one times nothing."""
        try:
            if self._host:
                if kept and self._cur is not None and self.enabled and self._comm_depth == 0 \
                        and (get_ident() == self._tid or _graph_task_id() >= 0):  # fmt: skip
                    self._cur.comm.append((token, self._now()))
                return
            if kept:
                self.comm_end(token)
                return
            self._comm_depth -= 1 if self._comm_depth > 0 else 0
            if token is not _NESTED:
                self.where = (self._next_step, token[1], token[2])
        except Exception as exc:
            self._hook_failed("issue_end", exc)

    def _hook_failed(self, name: str, exc: Exception) -> None:
        self.faults += 1
        self.problems.report("probe", f"a hook of ours failed ({name}: {type(exc).__name__}: {exc}); "
                             "training continues, this step's timings may be incomplete")  # fmt: skip

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
            ready = self._bucket_ready(bucket)
            if ready is None:
                return launch(bucket).then(unwrap)
            idx, done, at = ready

            def on_done(fut: torch.futures.Future) -> Any:
                try:
                    done.append((idx, mark()))
                except Exception:
                    self.faults += 1
                return unwrap(fut)

            fut = launch(bucket)
            self._bucket_issued(at)  # the hook's own work on the stream, up to its collective: communication
            return fut.then(on_done)

        hook.__qualname__ = f"stragglerwatch({getattr(inner, '__qualname__', 'allreduce')})"
        return hook

    @_guarded
    def _bucket_ready(self, bucket: Any) -> tuple[int, list[tuple[int, Any]], Any] | None:
        """Mark a gradient bucket ready; its index, the list its all-reduce end goes to, and the mark."""
        m = self._cur
        if m is None or not self.enabled:
            return None
        idx, at = bucket.index(), self._mark()
        m.ready.append((idx, at))
        return idx, m.done, at

    @_guarded
    def _bucket_issued(self, ready: Any) -> None:
        """The hook issued its bucket's collective: from ``ready`` to here the stream ran the hook's work."""
        m = self._cur
        if m is not None and len(m.hooked) < MAX_MARKS:
            m.hooked.append((ready, self._mark()))

    # -- optimizer and step end -------------------------------------------
    def _ours(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s steps are the watched model's: it was named (``attach(optimizer=)``),
        it holds one of the model's parameters, or none that does has stepped yet (an optimizer of
        master copies of the weights). Another model's optimizer in the same process is not."""
        if self._params is None:
            return True
        try:
            known = self._owners.get(optimizer)
        except TypeError:  # not weak-referenceable: looked at every time
            known = None
        if known is None:
            groups = getattr(optimizer, "param_groups", None) or []
            known = id(optimizer) == self._ender or any(id(p) in self._params for g in groups
                                                        for p in g.get("params", ()))  # fmt: skip
            try:
                self._owners[optimizer] = known
            except TypeError:
                pass
        if known:
            self._owner_seen = True
        return known or not self._owner_seen

    def _close_unended(self, host: float) -> StepMarks:
        """A step that no optimizer step ended in MAX_MICRO_BATCHES forwards: closed here, and said."""
        self.note_unavailable(
            "no_optimizer_step",
            f"no optimizer step ended a step in {MAX_MICRO_BATCHES} training forwards (a hand-written update?): "
            "steps cannot be told apart; mark each step's end with watch.step()",
        )
        return self._end_step(host)

    def _end_step(self, host: float) -> StepMarks:
        """End the current step now; returns the next one, begun here."""
        m = self._cur or self._begin(host)
        end = self._at(host, self._gap_phase())
        m.end = end
        self._cur = StepMarks(m.step + 1, end, host, self._data_from_gap)
        self.where = (m.step + 1, self._gap_phase(), host)
        self._emit(m, host)
        return self._cur

    @_guarded
    def mark_step(self) -> None:
        """The loop ends a step here (``Watch.step``): from now on this, not an optimizer, ends steps."""
        self._manual = True
        if self._paused:
            self._paused_step_end()
            return
        if not self.enabled or self._cur is None:
            return  # before the first step: from now on, these calls alone end steps
        host = self._now()
        self._end_step(host)
        if not self.recording:
            self._pause(host)

    @_guarded
    def on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._ours(optimizer):
            return
        if not self.enabled:
            if self._paused:
                self._opt_calls += 1  # GradScaler's skip check (scaler_end) counts calls while paused too
            return
        self._opt_depth += 1
        if self._opt_depth > 1:  # stepped by another optimizer's step (a wrapper): counted once
            return
        self._opt_calls += 1
        if not self._manual and self._ender is None and self._cut is not None and id(optimizer) in self._stepped:
            self._end_at_cut()  # an optimizer steps again: the iteration ended at the last one
        now = self._now()
        m = self._cur or self._begin(now)
        self._eval_open = False
        self.where = (self._next_step, "optimizer", now)
        if len(m.opt) >= MAX_MARKS:
            del m.opt[: MAX_MARKS // 2]  # keep the latest (the open one among them)
            self.dropped_marks += MAX_MARKS // 2
        m.opt.append([self._at(now, "optimizer"), None])

    @_guarded
    def on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._ours(optimizer):
            return
        if not self.enabled or self._opt_depth == 0:
            if self._paused and id(optimizer) == self._ender and not self._manual:
                self._paused_step_end()
            return
        self._opt_depth -= 1
        m = self._cur
        if self._opt_depth or m is None or not m.opt:
            return
        host = self._now()
        end = self._at(host, "other")
        m.opt[-1][1] = end
        oid = id(optimizer)
        self._stepped.add(oid)
        self.where = (self._next_step, "other", host)
        if self._manual:
            return  # Watch.step() ends the steps
        if self._ender == oid:
            m.end = end
            self._cur = StepMarks(m.step + 1, end, host, self._data_from_gap)
            self.where = (m.step + 1, "data_wait" if self._data_from_gap else "other", host)
            self._emit(m, host)
            if not self.recording:
                self._pause(host)
        elif self._ender is None:
            self._cut = (m.lengths(), end, host, oid)

    @_guarded
    def scaler_begin(self, optimizer: Any) -> Any:
        return self._opt_calls if self.enabled or self._paused else None

    @_guarded
    def scaler_end(self, token: Any, optimizer: Any) -> None:
        """After ``GradScaler.step``: an optimizer it skipped (inf/NaN) still ended an iteration."""
        active = self.enabled or self._paused
        if token is not None and active and self._opt_calls == token and self._opt_depth == 0:
            self.on_optimizer_pre(optimizer, (), {})
            self.on_optimizer_post(optimizer, (), {})

    def _pause(self, host: float) -> None:
        """Recording turned off, at a step end: the hooks go idle (the watchdog with them)."""
        self._paused, self.enabled, self._cur = True, False, None
        self.where = (self._next_step, "idle", host)

    def _paused_step_end(self) -> None:
        """A step ended while recording is off: count it; resume if recording is wanted again,
        with the step that starts now (a clean boundary, as at any step end)."""
        self._next_step += 1
        host = self._now()
        if not self.recording:
            self.where = (self._next_step, "idle", host)
            return
        self._fwd_open = self._eval_fwd = self._eval_open = self._in_backward = False
        self._comm_depth = self._opt_depth = 0
        self._stepped.clear()
        self._cur = StepMarks(self._next_step, self._at(host, self._gap_phase()), host, self._data_from_gap)
        self.where = (self._next_step, self._gap_phase(), host)
        self._paused, self.enabled = False, True

    def _end_at_cut(self) -> None:
        cut, end, host, oid = self._cut  # type: ignore[misc]
        self._ender, self._cut = oid, None
        m = self._cur
        if m is None:
            return
        self._cur = m.split(cut, end, host)
        self._emit(m, host)

    @_guarded
    def finish_pending(self) -> None:
        """At close: a step whose end is known but not yet confirmed (ender still unknown)."""
        if self._ender is None and self._cut is not None:
            self._end_at_cut()

    def _emit(self, m: StepMarks, host: float) -> None:
        self._next_step = m.step + 1
        self._stepped.clear()
        self._in_backward = False
        self.recent_steps.append(host - m.host_start)
        self.last_step_end = host
        if self._syncing is not None and m.fwd_start and not m.bwd_start:
            self.note_unavailable(
                "no_backward",
                "no backward was seen from the model's outputs (is the loss computed from them?), "
                "so the gradient all-reduce wait cannot be timed",
            )
        if not self._fwd_seen and m.step >= 3:
            self.note_unavailable(
                "no_forward",
                "no forward of the watched model was seen in 3 steps: attach the module the training loop "
                "calls (a model compiled after attach hides its forward: attach after torch.compile)",
            )
        if self._expect_comm:
            if m.comm or m.sync:
                self._expect_comm = False
            elif m.step >= 10:
                self._expect_comm = False
                self.note_unavailable(
                    "no_comm",
                    "a multi-rank job whose model is not DistributedDataParallel, and no collective was "
                    "seen in 10 steps: its communication is not visible to stragglerwatch",
                )
        for hook in self.step_hooks:
            try:
                hook(m.step)
            except Exception as exc:
                self._hook_failed("step_hooks", exc)
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
