"""Per-instance shadows of a watched model's methods: forward, and DDP's buffer broadcast.

Design: a method is shadowed by an instance attribute wrapping it (module forward hooks
would push every call onto ``nn.Module``'s slow path, and DDP's buffer sync has no hook at
all). ``remove()`` deletes the attribute again, unless somebody shadowed it since. The
wrappers only call the probe around the original; they never change arguments or results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .probes import StepProbe


class Shadow:
    """Shadows the method ``name`` of one object with ``wrap(method)``; ``remove()`` undoes it."""

    def __init__(self, obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]):
        self._obj, self._name = obj, name
        self._previous = obj.__dict__.get(name)  # somebody else's instance-level shadow
        self._wrapper = wrap(getattr(obj, name))
        setattr(obj, name, self._wrapper)

    def remove(self) -> None:
        if self._obj.__dict__.get(self._name) is not self._wrapper:
            return  # replaced since: leave the newer one alone
        if self._previous is None:
            delattr(self._obj, self._name)
        else:
            setattr(self._obj, self._name, self._previous)


def time_forward(model: torch.nn.Module, probe: StepProbe) -> list[Shadow]:
    """``model.forward`` shadowed by a wrapper calling the probe around it; for DDP also the
    wrapped module's, for the forwards that bypass DDP (``model.module(x)``: evaluation on one
    rank, generation). A forward inside another timed one (DDP calling its module) is not
    timed twice."""
    pre, post = probe.on_forward_pre, probe.on_forward
    depth = [0]

    def wrap(module: torch.nn.Module) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrapper(inner: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                if depth[0]:
                    return inner(*args, **kwargs)
                depth[0] += 1
                try:
                    pre(module, args)
                    output = inner(*args, **kwargs)
                    post(module, args, output)
                    return output
                finally:
                    depth[0] -= 1

            return forward

        return wrapper

    shadows = [Shadow(model, "forward", wrap(model))]
    inner_module = getattr(model, "module", None)
    if isinstance(model, DistributedDataParallel) and isinstance(inner_module, torch.nn.Module):
        shadows.append(Shadow(inner_module, "forward", wrap(inner_module)))
    return shadows


#: DDP's per-instance entry points of its forward buffer broadcast, newest first.
BUFFER_SYNC_METHODS = ("_sync_module_buffers", "_sync_buffers", "_sync_params")


def time_buffer_sync(model: torch.nn.Module, probe: StepProbe) -> Shadow | None:
    """DDP's buffer broadcast (C++, waited for there) timed as a collective; None if not found."""
    name = next((n for n in BUFFER_SYNC_METHODS if callable(getattr(model, n, None))), None)
    if name is None:
        return None

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        def sync(*args: Any, **kwargs: Any) -> Any:
            token = probe.comm_begin()
            try:
                return inner(*args, **kwargs)
            finally:
                probe.comm_end(token)

        return sync

    return Shadow(model, name, wrap)
