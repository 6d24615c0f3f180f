"""Per-instance shadows of a watched model's methods: forward, DDP's buffer broadcast, FSDP2's waits.

Design: a method is shadowed by an instance attribute wrapping it (module forward hooks
would push every call onto ``nn.Module``'s slow path, and DDP's buffer sync has no hook at
all). ``remove()`` deletes the attribute again, unless somebody shadowed it since. The
wrappers only call the probe around the original; they never change arguments or results.

``torch.compile``: a wrapper that torch.compile traces (the model was compiled *after*
attach) steps aside (``is_compiling()``), so it adds no graph break; its timing is then lost,
which the probe reports ("no forward seen"). Attached after compile, the forward wrapper sits
on the compiled module, outside compiled code, and the buffer-broadcast wrapper, which
compiled DDP code calls, is marked to run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stragglerwatch.runtime.capture.datamark import mark_fetch
from stragglerwatch.runtime.capture.models import ModelInfo
from stragglerwatch.runtime.capture.probes import StepProbe, is_compiling


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, and all it calls, never traced by torch.compile (where compiled code calls it, Dynamo
    runs it between two graphs)."""
    try:
        import torch._dynamo

        return torch._dynamo.disable(fn)
    except Exception:
        return fn


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


def time_as_forward(obj: Any, name: str, module: torch.nn.Module, probe: StepProbe) -> Shadow:
    """``obj.<name>`` shadowed by a wrapper calling the probe's forward hooks around it; ``module``'s
    train/eval mode tells training from evaluation. Forwards nest (DDP calling its module, a
    training step calling the model): only the outermost is timed."""
    pre, post = probe.on_forward_pre, probe.on_forward

    def wrapper(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if is_compiling() or probe.forward_nesting:
                return inner(*args, **kwargs)
            probe.forward_nesting += 1
            try:
                pre(module, args, kwargs)
                output = inner(*args, **kwargs)
                post(module, args, output)
                return output
            finally:
                probe.forward_nesting -= 1

        # called from compiled DDP code, Dynamo compiles this frame with the module's forward
        # inlined: the same graph as without it (is_compiling() is constant there)
        return forward

    return Shadow(obj, name, wrapper)


def time_forward(info: ModelInfo, probe: StepProbe) -> list[Shadow]:
    """The forward of the module the loop calls; for DDP also the wrapped module's, for the
    forwards that bypass DDP (``model.module(x)``: evaluation on one rank, generation)."""
    model = info.outer
    # wrappers (DDP, a compiled module) keep their own train/eval flag, which frameworks may leave
    # untouched (Lightning sets its module's): the innermost module's mode tells training from evaluation
    shadows = [time_as_forward(model, info.forward_attr, info.target or model, probe)]
    inner_module = getattr(info.ddp, "module", None)
    if isinstance(inner_module, torch.nn.Module):
        shadows.append(time_as_forward(inner_module, "forward", inner_module, probe))
    return shadows


def _as_communication(probe: StepProbe, eager: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():
                return inner(*args, **kwargs)
            token = probe.comm_begin()
            try:
                return inner(*args, **kwargs)
            finally:
                probe.comm_end(token)

        return run_eagerly(timed) if eager else timed

    return wrap


#: DDP's per-instance entry points of its forward buffer broadcast, newest first.
BUFFER_SYNC_METHODS = ("_sync_module_buffers", "_sync_buffers", "_sync_params")


def time_buffer_sync(info: ModelInfo, probe: StepProbe) -> Shadow | None:
    """DDP's buffer broadcast (C++, waited for there) timed as a collective; None if not found."""
    model = info.ddp
    name = next((n for n in BUFFER_SYNC_METHODS if callable(getattr(model, n, None))), None)
    if model is None or name is None:
        return None
    return Shadow(model, name, _as_communication(probe, eager=info.compiled))


#: FSDP2's points where the compute stream waits for its collectives' streams (CUDA).
FSDP_GROUP_WAITS = ("wait_for_unshard", "post_backward")
FSDP_STATE_WAITS = ("_root_post_backward_final_callback",)


def time_fsdp_waits(info: ModelInfo, probe: StepProbe) -> list[Shadow]:
    """FSDP2 on CUDA: the all-gathers and reduce-scatters run on their own streams; the compute
    stream waits for them where FSDP2 uses their results: in ``wait_for_unshard`` (all-gather,
    forward and backward), ``post_backward`` (the previous reduce-scatter, before issuing the
    next) and the end-of-backward callback (the last reduce-scatters, HSDP's all-reduce).
    Timed as communication with events on the compute stream; the host-side ``Work.wait`` in
    FSDP2's collective streams is not the compute stream's and is not counted (``probes.py``).
    On the CPU the collectives are waited for by the host, where ``taps.py`` sees them."""
    shadows = []
    for obj, names in [(g, FSDP_GROUP_WAITS) for g in info.fsdp_groups] + [(s, FSDP_STATE_WAITS)
                                                                            for s in info.fsdp_states]:  # fmt: skip
        for name in names:
            if callable(getattr(obj, name, None)):
                shadows.append(Shadow(obj, name, _as_communication(probe, eager=True)))
    return shadows


def time_fetch(obj: Any, begin: str, end: str | None, probe: StepProbe) -> list[Shadow]:
    """A framework's "fetch starts" and "fetch ended" callbacks (methods ``begin`` and ``end`` of
    ``obj``), or its fetch method ``begin`` itself (``end=None``), shadowed to time each batch
    fetch as data wait, as a wrapped loader would."""
    probe.exact_data()
    if end is None:
        return [Shadow(obj, begin, lambda inner: mark_fetch(probe, inner))]
    pending: list[Any] = []

    def on_begin(inner: Callable[..., Any]) -> Callable[..., Any]:
        def before(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            pending[:] = [probe.data_begin()]
            return result

        return before

    def on_end(inner: Callable[..., Any]) -> Callable[..., Any]:
        def after(*args: Any, **kwargs: Any) -> Any:
            if pending:
                probe.data_end(pending.pop())
            return inner(*args, **kwargs)

        return after

    return [Shadow(obj, begin, on_begin), Shadow(obj, end, on_end)]
