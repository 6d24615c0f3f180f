"""Taps on the few points PyTorch offers no per-object hook for.

Design: two calls see what the model's own hooks cannot.

- ``Work.wait``: every collective issued from Python is waited on here: the
  synchronous ``torch.distributed`` functions (``all_reduce``, ``broadcast``,
  ``all_gather(_into_tensor)``, ``reduce_scatter(_tensor)``, ``barrier``, the
  object collectives, ``send``/``recv`` ...) call it themselves, and so does
  user code that waits on an ``async_op=True`` handle. SyncBatchNorm's
  collectives are among them. On the host this is where the rank blocks; on
  CUDA it is where the current stream starts waiting for the collective's
  stream, so marks recorded on the current stream around it bracket the
  exposed wait. It is the one place that sees them whatever name the user
  imported them under. DDP's own collectives are issued and waited for in C++
  and are timed elsewhere (``probes.py``).
- ``GradScaler.step``: a step GradScaler skips (inf/NaN gradients) never calls
  ``optimizer.step()``, so the optimizer hooks cannot see that an iteration ended.

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


def _wait_wrapper(original: Callable[..., Any], listeners: list[Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners:
            return original(self, *args, **kwargs)
        tokens = []
        for listener in listeners:
            try:
                tokens.append(listener.comm_begin())
            except Exception:
                tokens.append(None)
        try:
            return original(self, *args, **kwargs)
        finally:
            for listener, token in zip(listeners, tokens, strict=False):
                if token is not None:
                    try:
                        listener.comm_end(token)
                    except Exception:
                        pass

    return wait


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


def tap_collectives(listener: CommListener) -> Tap | None:
    owner = work_class()
    return Tap(owner, "wait", _wait_wrapper, listener) if owner is not None else None


def tap_scaler(listener: ScalerListener) -> Tap | None:
    owner = scaler_class()
    return Tap(owner, "step", _scaler_wrapper, listener) if owner is not None else None
