"""Taps on the few points PyTorch offers no per-object hook for.

Design: one bracket per collective, at the one Python point where the training thread blocks for it.

- **Where it is waited on**: ``Work.wait``. Gloo's synchronous collectives (``distributed_c10d``
  issues, then waits), every ``async_op=True`` handle and the point-to-point operations of
  ``torch.distributed.pipelining`` (``batch_isend_irecv``) are waited on here; on CUDA it is where
  the current stream starts waiting for the collective's stream.
- **Where a functional collective is waited on**: ``torch.distributed._functional_collectives.wait_tensor``
  (a module attribute that DTensor's ``AsyncCollectiveTensor`` looks up at call time): tensor and
  sequence parallelism, and DTensor redistribution in eager mode. Their C++ issue passes through no
  Python; the wait is where the thread blocks. Inside code torch.compile traces, this tap steps aside.
- **Where a collective is issued without a** ``Work``: since torch 2.8 (pytorch PR #148590) a
  synchronous collective on NCCL runs on the *current* stream and the process group returns no
  ``Work``, so ``distributed_c10d`` never calls ``Work.wait`` for it. The ``ProcessGroup`` methods
  (:data:`ISSUE_METHODS`) are bracketed for that case only: an asynchronous launch (``opts.asyncOp``)
  is passed straight through, a call that returns a ``Work`` (gloo's synchronous ones) drops its
  bracket (the wait will be bracketed), one that returns None
  keeps it (the launch on the current stream, or a host that finished the collective inside the
  call). On the host the bracket is a clock read before the call, made into an interval only when
  kept; on CUDA the event before the launch must be recorded first, so it is a full bracket.
- **Where the loop calls it**, only when another tool wrapped the process group's methods after us
  (:class:`CallFallback` checks at step ends): the ``torch.distributed`` functions (:data:`CALL_FUNCTIONS`),
  so that a wait that tool makes above our issue bracket is inside one of ours.
- ``GradScaler.step``: a step GradScaler skips (inf/NaN gradients) never calls
  ``optimizer.step()``, so the optimizer hooks cannot see that an iteration ended.

So a collective costs the training thread one listener bracket (two calls and two clock reads),
plus a clock read where it was issued from Python; no per-collective work happens anywhere else
(``benchmarks/collective_cost.py`` measures it). Every bracket calls the same listener
(``comm_begin``/``comm_end``, ``issue_begin``/``issue_end``); brackets
nest (the probe counts the outermost) and the probe carves their union out of the step, so a
collective bracketed twice is counted once. DDP's gradient all-reduce is issued and waited for in
C++ and timed by autograd callbacks (``probes.py``). What no bracket sees (collectives inside
compiled graphs, C++ issuers that wait in C++) is found from PyTorch's own C++ record of every
collective (``collectives.py``) and reported, never silently counted as compute.

A tap is a wrapper set on the class (or module) while at least one listener (a probe) is
registered, and removed with the last one. Its listeners live on the wrapper itself, not in module
state, so several watched models in one process share it. A listener never raises (the probe
guards itself); a tap never raises into the training loop, and with no listener it is a plain
pass-through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

_LISTENERS = "__stragglerwatch_listeners__"


class CommListener(Protocol):
    def comm_begin(self) -> Any: ...
    def comm_end(self, token: Any) -> None: ...
    def issue_begin(self) -> Any: ...
    def issue_end(self, token: Any, kept: bool) -> None: ...


class ScalerListener(Protocol):
    def scaler_begin(self, optimizer: Any) -> Any: ...
    def scaler_end(self, token: Any, optimizer: Any) -> None: ...


#: ``ProcessGroup`` methods that issue a collective or a point-to-point operation (those this
#: torch has: older releases name some ``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``).
ISSUE_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
    "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "recv_anysource", "_end_coalescing",
)  # fmt: skip


def _begin(listener: Any) -> Any:
    try:
        return listener.comm_begin()
    except Exception:  # a listener of ours that failed: never the training loop's problem
        return None


def _end(listener: Any, token: Any) -> None:
    try:
        listener.comm_end(token)
    except Exception:
        pass


def _wait_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    """The call blocks until a collective is done: bracketed by every listener (one, nearly always,
    on a path without helper calls: this runs once per collective)."""

    def wait(*args: Any, **kwargs: Any) -> Any:
        if not listeners:
            return original(*args, **kwargs)
        if len(listeners) == 1:
            listener = listeners[0]
            try:
                token = listener.comm_begin()
            except Exception:
                token = None
            try:
                return original(*args, **kwargs)
            finally:
                if token is not None:
                    try:
                        listener.comm_end(token)
                    except Exception:
                        pass
        tokens = [_begin(listener) for listener in listeners]
        try:
            return original(*args, **kwargs)
        finally:
            for listener, token in zip(listeners, tokens, strict=False):
                if token is not None:
                    _end(listener, token)

    return wait


def _functional_wait_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    """``wait_tensor``: bracketed in eager mode; traced by torch.compile, the original alone."""
    wait = _wait_wrapper(original, listeners)
    try:
        from torch.compiler import is_compiling  # torch >= 2.3
    except ImportError:  # pragma: no cover

        def is_compiling() -> bool:
            return False

    def wait_tensor(tensor: Any) -> Any:
        if is_compiling():
            return original(tensor)
        return wait(tensor)

    return wait_tensor


def _issue_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    """A process-group call: a bracket only when it returns no ``Work`` (module docstring). The
    listener's ``issue_begin`` is a clock read on the host (the bracket, when kept, is made afterwards)
    and a full ``comm_begin`` where marks are device events that must precede the launch."""

    def issue(*args: Any, **kwargs: Any) -> Any:
        if not listeners or _asynchronous(args, kwargs):  # a launch only: no CUDA event spent on it
            return original(*args, **kwargs)
        if len(listeners) == 1:
            listener = listeners[0]
            try:
                token = listener.issue_begin()
            except Exception:
                token = None
            result = original(*args, **kwargs)
            if token is not None:
                try:
                    listener.issue_end(token, result is None)
                except Exception:
                    pass
            return result
        tokens = [_issue_begin(listener) for listener in listeners]
        result = original(*args, **kwargs)
        for listener, token in zip(listeners, tokens, strict=False):
            if token is not None:
                _issue_end(listener, token, result is None)
        return result

    return issue


def _asynchronous(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The process-group call was asked for an ``async_op=True`` collective (torch >= 2.8 passes
    ``opts.asyncOp``): it returns a ``Work`` whose wait is bracketed, so its issue is not."""
    opts = kwargs.get("opts", args[-1] if len(args) > 1 else None)
    return getattr(opts, "asyncOp", False) is True


#: ``torch.distributed`` functions (module attributes, looked up at call time by user code, SyncBatchNorm
#: and most wrappers), bracketed as a whole only as a fallback: when another tool wrapped the process
#: group's methods after us (:meth:`TapSet.overlaid`), what it does above our issue bracket (a wait of its
#: own, through an untapped ``Work.wait``) is inside this one.
CALL_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send", "recv", "send_object_list", "recv_object_list",
)  # fmt: skip


def _call_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    """A ``torch.distributed`` function: bracketed unless asynchronous or traced by torch.compile."""
    wait = _wait_wrapper(original, listeners)
    try:
        from torch.compiler import is_compiling  # torch >= 2.3
    except ImportError:  # pragma: no cover

        def is_compiling() -> bool:
            return False

    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op") is True or is_compiling():
            return original(*args, **kwargs)
        return wait(*args, **kwargs)

    return call


def _issue_begin(listener: Any) -> Any:
    try:
        return listener.issue_begin()
    except Exception:
        return None


def _issue_end(listener: Any, token: Any, kept: bool) -> None:
    try:
        listener.issue_end(token, kept)
    except Exception:
        pass


def _scaler_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners:
            return original(self, optimizer, *args, **kwargs)
        tokens = []
        for listener in listeners:
            try:
                tokens.append(listener.scaler_begin(optimizer))
            except Exception:
                tokens.append(None)
        result = original(self, optimizer, *args, **kwargs)  # on an error, no step ended
        for listener, token in zip(listeners, tokens, strict=False):
            try:
                listener.scaler_end(token, optimizer)
            except Exception:
                pass
        return result

    return step


class Tap:
    """One listener on one wrapped method; ``remove()`` takes it off again."""

    def __init__(self, owner: Any, name: str, build: Callable[..., Callable[..., Any]], listener: Any):
        self._owner, self._name, self._listener = owner, name, listener
        current = owner.__dict__.get(name) or getattr(owner, name)
        listeners = getattr(current, _LISTENERS, None)
        if listeners is None:  # first listener in this process: wrap the method
            listeners = []
            wrapper = build(current, listeners)
            setattr(wrapper, _LISTENERS, listeners)
            wrapper.__wrapped__ = current  # type: ignore[attr-defined]
            wrapper.__doc__ = getattr(current, "__doc__", None)
            setattr(owner, name, wrapper)
        listeners.append(listener)
        self._listeners: list[Any] | None = listeners

    def remove(self) -> None:
        listeners, self._listeners = self._listeners, None
        if listeners is None:
            return
        if self._listener in listeners:
            listeners.remove(self._listener)
        current = self._owner.__dict__.get(self._name)
        if not listeners and getattr(current, _LISTENERS, None) is listeners:
            setattr(self._owner, self._name, current.__wrapped__)  # type: ignore[union-attr]
        # else: wrapped again by somebody since; ours stays beneath as a pass-through


def work_class() -> type | None:
    """``torch.distributed.Work`` where this torch build has distributed support."""
    try:
        import torch.distributed as dist

        return dist.Work if dist.is_available() else None
    except Exception:
        return None


def scaler_class() -> type | None:
    """The GradScaler class every device's scaler inherits ``step`` from."""
    try:
        import torch

        amp = getattr(torch.amp, "GradScaler", None)  # torch >= 2.3
        return amp if amp is not None else torch.cuda.amp.GradScaler
    except Exception:
        return None


def process_group_class() -> type | None:
    """``torch.distributed.ProcessGroup`` where this torch build has distributed support."""
    try:
        import torch.distributed as dist

        return dist.ProcessGroup if dist.is_available() else None
    except Exception:
        return None


class TapSet:
    """Several taps of one listener, removed together."""

    def __init__(self, taps: list[Tap]):
        self.taps = taps

    def remove(self) -> None:
        for tap in self.taps:
            tap.remove()

    def overlaid(self) -> list[str]:
        """The process-group methods another tool wrapped after us (ours is no longer the class's)."""
        group = process_group_class()
        out = []
        for tap in self.taps:
            if tap._owner is group and tap._listeners is not None:
                current = group.__dict__.get(tap._name)
                if getattr(current, _LISTENERS, None) is not tap._listeners:
                    out.append(tap._name)
        return out


class CallFallback:
    """Watches for another tool wrapping the process group after us, and then brackets the
    ``torch.distributed`` functions too (:data:`CALL_FUNCTIONS`): checked at step ends (every one of the
    first 100, then every 100th), a few dictionary look-ups each. ``on_install`` is told which methods
    were wrapped, once."""

    def __init__(self, taps: TapSet, listener: CommListener, on_install: Callable[[list[str]], None]):
        self._taps, self._listener, self._on_install = taps, listener, on_install
        self.installed: TapSet | None = None

    def __call__(self, step: int) -> None:
        if self.installed is not None or (step >= 100 and step % 100):
            return
        names = self._taps.overlaid()
        if not names:
            return
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self.installed = TapSet([Tap(module, name, _call_wrapper, self._listener) for module in (dist, distributed_c10d)
                                 for name in CALL_FUNCTIONS if callable(module.__dict__.get(name))])  # fmt: skip
        self._on_install(names)

    def remove(self) -> None:
        if self.installed is not None:
            self.installed.remove()


def functional_module() -> Any:
    """``torch.distributed._functional_collectives`` where this torch has it (None otherwise)."""
    try:
        from torch.distributed import _functional_collectives

        return _functional_collectives if callable(getattr(_functional_collectives, "wait_tensor", None)) else None
    except Exception:
        return None


def tap_collectives(listener: CommListener) -> TapSet | None:
    """Bracket every collective where the training thread blocks for it (module docstring)."""
    work, group = work_class(), process_group_class()
    if work is None or group is None:
        return None
    taps = [Tap(work, "wait", _wait_wrapper, listener)]
    taps += [Tap(group, name, _issue_wrapper, listener) for name in ISSUE_METHODS
             if callable(getattr(group, name, None))]  # fmt: skip
    functional = functional_module()
    if functional is not None:
        taps.append(Tap(functional, "wait_tensor", _functional_wait_wrapper, listener))
    return TapSet(taps)


def tap_scaler(listener: ScalerListener) -> Tap | None:
    owner = scaler_class()
    return Tap(owner, "step", _scaler_wrapper, listener) if owner is not None else None
