"""Make gloo's process-group calls behave as NCCL's do since torch 2.8 (pytorch PR #148590).

On NCCL a collective called with ``async_op=False`` runs on the current stream and the process
group returns no ``Work``; ``distributed_c10d`` then never calls ``Work.wait()`` ("the backend has
sync'ed at CPP level"). Here each process-group method given options with ``asyncOp`` False
finishes the collective itself, through the *original* ``Work.wait`` (taken before anything taps
it), and returns None, as NCCL's C++ does below every Python-level tap. Install it before
``stragglerwatch.attach``: it must sit beneath our taps, where NCCL sits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

#: Process-group methods whose options carry ``asyncOp`` (those this torch has are wrapped).
METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
           "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "gather",
           "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "alltoall",
           "all_to_all_single", "barrier")  # fmt: skip


class Emulation:
    """Counts the synchronous calls it finished itself (``finished``) and the ``Work`` it gave back."""

    def __init__(self) -> None:
        self.finished = 0
        self.returned = 0


def _sync_requested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for value in (*args, *kwargs.values()):
        if hasattr(value, "asyncOp"):
            return not value.asyncOp
    return False


def _wrap(original: Callable[..., Any], wait: Callable[..., Any], seen: Emulation) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        if work is None or not _sync_requested(args, kwargs):
            seen.returned += work is not None
            return work
        wait(work)  # the original Work.wait: no Python-level tap sees it
        seen.finished += 1
        return None

    return method


def emulate(above_taps: bool = False) -> Emulation:
    """Install the emulation for the rest of the process; returns its counters. ``above_taps``: installed
    after ``attach`` (the worst case for us: it waits through the untapped ``Work.wait``, above our
    process-group taps), as another tool wrapping the process group after us might."""
    group, work = dist.ProcessGroup, dist.Work
    wait = work.__dict__["wait"]
    if getattr(wait, "__wrapped__", None) is not None and not above_taps:
        raise RuntimeError("install the NCCL emulation before anything taps Work.wait")
    while getattr(wait, "__wrapped__", None) is not None:
        wait = wait.__wrapped__
    seen = Emulation()
    for name in METHODS:
        original = group.__dict__.get(name)
        if original is not None:
            setattr(group, name, _wrap(original, wait, seen))
    return seen
