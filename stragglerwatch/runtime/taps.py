"""Taps on the few points PyTorch offers no per-object hook for.

Design: four calls see what the model's own hooks cannot.

- **Where a collective is called**: the ``torch.distributed`` functions themselves
  (:data:`CALL_FUNCTIONS`, as module attributes, which user code, SyncBatchNorm and most
  wrappers look up at call time), so that whatever lies beneath them holds the thread or the
  stream inside the bracket: NCCL's C++, or a process group that another tool wrapped after us.
  Skipped for ``async_op=True`` (the launch exposes nothing) and while torch.compile traces.

- **Where a collective is issued**: the methods of ``ProcessGroup`` that the
  ``torch.distributed`` functions call (``allreduce``, ``broadcast``,
  ``allgather``, ``all_gather_single``, ``reduce_scatter_single``, ``barrier``,
  ``send``/``recv`` ... :data:`ISSUE_METHODS`), whatever name the user
  imported the function under, SyncBatchNorm's collectives among them. Since
  torch 2.8 (pytorch PR #148590) a synchronous collective on NCCL runs on the
  *current* stream and the process group returns no ``Work``, so
  ``distributed_c10d`` never calls ``Work.wait`` for it: marks on the current
  stream before and after the launch bracket it there, and nowhere else. On
  the host a synchronous call that finishes the collective itself blocks
  inside this bracket.
- **Where it is waited on**: ``Work.wait``. Gloo's synchronous collectives
  (and those of NCCL before torch 2.8) and every ``async_op=True`` handle are
  waited on here; on CUDA it is where the current stream starts waiting for
  the collective's stream. An asynchronous launch (``opts.asyncOp``) exposes
  nothing and is not bracketed; its wait is the exposed part.
- ``GradScaler.step``: a step GradScaler skips (inf/NaN gradients) never calls
  ``optimizer.step()``, so the optimizer hooks cannot see that an iteration ended.

Every collective bracket calls the same listener (``comm_begin``/``comm_end``);
brackets nest (the probe counts the outermost) and the probe carves their
union out of the step, so a collective bracketed twice is counted once.
DDP's own collectives are issued and waited for in C++ and are timed
elsewhere (``probes.py``); the functional collectives of DTensor and
compiled code (C++ ops) are seen by none of these brackets.

A tap is a wrapper set on the class while at least one listener (a probe) is
registered, and removed with the last one. Its listeners live on the wrapper
itself, not in module state, so several watched models in one process share
it. A listener's failure is swallowed: a tap never raises into the training
loop, and with no listener it is a plain pass-through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

_LISTENERS = "__stragglerwatch_listeners__"


class CommListener(Protocol):
    def comm_begin(self) -> Any: ...
    def comm_end(self, token: Any) -> None: ...


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


#: ``torch.distributed`` functions bracketed as a whole where the loop calls them (module attributes:
#: looked up at call time by user code, SyncBatchNorm and most wrappers), so that whatever lies beneath
#: (NCCL's C++, a process group another tool wrapped after us) holds the thread or the stream inside it.
CALL_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "gather", "scatter", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send", "recv", "send_object_list", "recv_object_list",
)  # fmt: skip


def _bracket_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def bracketed(*args: Any, **kwargs: Any) -> Any:  # a method's self is args[0]
        if not listeners:
            return original(*args, **kwargs)
        tokens = []
        for listener in listeners:
            try:
                tokens.append(listener.comm_begin())
            except Exception:
                tokens.append(None)
        try:
            return original(*args, **kwargs)
        finally:
            for listener, token in zip(listeners, tokens, strict=False):
                if token is not None:
                    try:
                        listener.comm_end(token)
                    except Exception:
                        pass

    return bracketed


def _asynchronous(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The process-group call was asked for an ``async_op=True`` collective (torch >= 2.8 passes
    ``opts.asyncOp``): its launch exposes nothing; its wait is bracketed at ``Work.wait``."""
    opts = kwargs.get("opts", args[-1] if args else None)
    return getattr(opts, "asyncOp", False) is True


def _issue_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    bracketed = _bracket_wrapper(original, listeners)

    def issue(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners or _asynchronous(args, kwargs):
            return original(self, *args, **kwargs)
        return bracketed(self, *args, **kwargs)

    return issue


def _call_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    bracketed = _bracket_wrapper(original, listeners)
    try:
        from torch.compiler import is_compiling  # torch >= 2.3
    except ImportError:  # pragma: no cover

        def is_compiling() -> bool:
            return False

    def call(*args: Any, **kwargs: Any) -> Any:
        # traced by torch.compile: the original alone (Dynamo maps it to its functional collective)
        if not listeners or kwargs.get("async_op") is True or is_compiling():
            return original(*args, **kwargs)
        return bracketed(*args, **kwargs)

    return call


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

    def __init__(self, owner: type, name: str, build: Callable[..., Callable[..., Any]], listener: Any):
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


def tap_collectives(listener: CommListener) -> TapSet | None:
    """Bracket every collective where it is called, issued and waited on (module docstring)."""
    work, group = work_class(), process_group_class()
    if work is None or group is None:
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    taps = [Tap(work, "wait", _bracket_wrapper, listener)]
    taps += [Tap(group, name, _issue_wrapper, listener) for name in ISSUE_METHODS
             if callable(getattr(group, name, None))]  # fmt: skip
    taps += [Tap(module, name, _call_wrapper, listener) for module in (dist, distributed_c10d)
             for name in CALL_FUNCTIONS if callable(module.__dict__.get(name))]  # fmt: skip
    return TapSet(taps)


def tap_scaler(listener: ScalerListener) -> Tap | None:
    owner = scaler_class()
    return Tap(owner, "step", _scaler_wrapper, listener) if owner is not None else None
