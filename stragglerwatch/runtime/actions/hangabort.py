"""``on_hang="abort"``: a rank whose stall outlasts its diagnosis leaves the job, so that the job restarts.

Design: the watchdog thread of every rank decides for itself, from its own stall, so that no store, no
peer and no collective is needed when the job is stuck. ``hang_abort_s`` (default twice the watchdog's
threshold) bounds the time from the rank's diagnosis to its exit:

1. For the first half nothing happens: a stall that ends then (a long checkpoint, a slow peer that
   catches up) is left alone.
2. Then the rank records an ``action`` event (fsynced, after the stall's stacks and Flight Recorder dump)
   and flushes its step log; under torchrun's shared store, deletes the process groups' keys from it
   (:func:`forget_group_keys`: else the restarted group may read this attempt's addresses); sends itself
   SIGTERM where a Python handler is installed (ours, which runs the application's handler it chained to
   and then exits with :data:`HANG_EXIT_STATUS`; or the application's own, installed after ``attach``);
   and aborts every process group of the process (PyTorch's ``ProcessGroup.abort()``, NCCL's
   communicators inside one group call as in ``torch.distributed.distributed_c10d._abort_process_group``),
   on a thread of its own, bounded. On NCCL the abort makes a collective (or a host sync behind one)
   return with an error, so that the main thread runs Python again, and with it the SIGTERM handler (a
   checkpoint). Gloo's abort does not wake a rank blocked in a collective: such a rank runs its handler
   only once a peer has left (its connection closes), which the culprit, deciding at the same time,
   usually does.
3. At the bound, a rank still alive ends with ``os._exit(HANG_EXIT_STATUS)`` after flushing stdout and
   stderr. A rank that ends by itself before (its handler called ``sys.exit``) ends with the same status:
   ours turns a status of 0 into it, and where the application's handler replaced ours the exit hook does
   (``Watch._at_exit``), so that ``torchrun --max-restarts`` counts the rank as failed and restarts the
   group.

A rank stuck in native code holding the GIL runs none of this (no Python thread runs); for it the watchdog
keeps ``faulthandler``'s timer armed with ``exit=True`` and its threshold + 2 s + the bound
(``nativestacks.py``): its stacks are dumped and it ends with status 1 about when its peers leave,
instead of waiting for its launcher's SIGKILL (torchrun's comes 30 s after its SIGTERM).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from stragglerwatch.runtime.log import LOGGER

#: The exit status of a rank that the hang policy ended (``EX_TEMPFAIL``: try again).
HANG_EXIT_STATUS = 75
#: The most the abort of the process groups is waited for (an NCCL abort can itself block).
ABORT_WAIT_S = 2.0


def restart_caveat(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """What stands in the way of the restart the hang policy is for, read from torchrun's variables, or None.

    torchrun's c10d rendezvous shares one store with the workers of every attempt (since torch 2.5); the
    process group keys of an attempt that ended are still there when the next one forms its group, and a
    rank that reads them connects to addresses of processes that are gone (gloo: "connectFullMesh failed
    ... Connection refused", or a hang; NCCL: a stale unique id), in about half the restarts measured
    here (pytorch/pytorch#135712). The hang policy deletes those keys when it ends a rank
    (:func:`forget_group_keys`); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a store of its
    own, which also covers a restart after any other failure."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return None
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun shares its store across restarts, and a restarted process group can read the previous "
                "attempt's addresses and fail to form (pytorch/pytorch#135712): the hang policy deletes them when it "
                "ends a rank, but a restart after any other failure can still fail; set "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment")
    return None


#: Where ``torch.distributed`` keeps the keys its process groups form with, in the default store.
GROUP_KEYS_PREFIX = "default_pg/"


def forget_group_keys(environ: dict[str, str] | os._Environ[str], timeout_s: float = ABORT_WAIT_S) -> str:
    """Under torchrun's shared store (``TORCHELASTIC_USE_AGENT_STORE``), delete this attempt's process-group
    keys from it, so that the restarted attempt's ranks wait for each other's new addresses instead of
    reading these (:func:`restart_caveat`). The restart begins only once every rank of this attempt has
    exited (torchrun's agents meet again first), so no new key is deleted. Bounded; what happened."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "the store is not shared across restarts"
    outcome: list[str] = []

    def run() -> None:
        try:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            keys = [k for k in store.list_keys() if k.startswith(GROUP_KEYS_PREFIX)]
            outcome.append(f"{sum(bool(store.delete_key(k)) for k in keys)} process-group key(s) deleted")
        except Exception as exc:
            outcome.append(f"process-group keys kept ({type(exc).__name__}: {exc})"[:200])

    worker = threading.Thread(target=run, name="stragglerwatch-forget-keys", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else f"the store had not answered after {timeout_s:g} s"


def abort_process_groups(timeout_s: float = ABORT_WAIT_S) -> str:
    """Abort every process group of this process, on a thread of its own waited for at most ``timeout_s``;
    what happened, in a few words, for the event. The groups stay registered: the application's own
    handler may still call ``destroy_process_group``."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "no torch.distributed"
    if not (dist.is_available() and dist.is_initialized()):
        return "no process group"
    c10d = dist.distributed_c10d
    groups = sorted(c10d._world.pg_names, key=lambda pg: c10d._world.pg_names[pg], reverse=True)
    outcome: list[str] = []

    def run() -> None:
        nccl = None
        try:
            backend = c10d._get_default_group()._get_backend(torch.device("cuda"))
            if c10d.is_nccl_available() and isinstance(backend, c10d.ProcessGroupNCCL):
                nccl = backend
        except Exception:
            nccl = None
        aborted = 0
        try:
            if nccl is not None:  # one group call for all communicators: their aborts cannot deadlock each other
                nccl._group_start()
            for pg in groups:
                try:
                    pg.abort()
                    aborted += 1
                except Exception as exc:
                    outcome.append(f"{type(exc).__name__}: {exc}"[:200])
            if nccl is not None:
                nccl._group_end()
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}"[:200])
        outcome.insert(0, f"aborted {aborted} of {len(groups)} process group(s)")

    worker = threading.Thread(target=run, name="stragglerwatch-abort", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return f"the abort of {len(groups)} process group(s) had not returned after {timeout_s:g} s"
    return "; ".join(outcome)


def exit_now(status: int = HANG_EXIT_STATUS) -> None:
    """End the process at once, stdout and stderr flushed first (``os._exit`` skips that)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


class HangAbort:
    """The abort of one rank; the watchdog calls :meth:`due` at every poll of a stall and :meth:`run` once."""

    def __init__(self, bound_s: float | None, terminate: Callable[[], str], stopped: threading.Event,
                 abort: Callable[[], str] = abort_process_groups, exit: Callable[[int], None] = exit_now,
                 forget: Callable[[], str] = lambda: forget_group_keys(os.environ)):  # fmt: skip
        self.bound_s = bound_s  # None: twice the threshold at the stall
        self.terminate = terminate  # sends this process SIGTERM where a Python handler runs it; says which, or none
        self.stopped = stopped  # set when the Watch closes: the process is ending by itself
        self._abort, self._exit, self._forget = abort, exit, forget
        self.started = False

    def bound(self, threshold_s: float) -> float:
        return float(self.bound_s) if self.bound_s else 2.0 * threshold_s

    def due(self, diagnosed: float, threshold_s: float, now: float) -> bool:
        """Whether a stall diagnosed at ``diagnosed`` (perf-counter seconds) has lasted half the bound."""
        return not self.started and now - diagnosed >= self.bound(threshold_s) / 2

    def run(self, diagnosed: float, threshold_s: float, now: float, record: Callable[..., Any]) -> None:
        """Record the action, signal, abort the groups, then wait for the process to end by itself until the
        bound, and end it there. Returns only when the Watch closed first (the process is exiting)."""
        self.started = True
        bound = self.bound(threshold_s)
        wait = max(0.0, diagnosed + bound - now)
        record(exit_status=HANG_EXIT_STATUS, bound_s=round(bound, 3), exit_within_s=round(wait, 3))
        keys = self._forget()
        handler = self.terminate()
        groups = self._abort()
        LOGGER.warning("stragglerwatch: hang policy: stalled %.1f s past the diagnosis; %s; SIGTERM: %s; %s; exit "
                       "status %d within %.1f s", now - diagnosed, keys, handler, groups, HANG_EXIT_STATUS, wait)
        if self.stopped.wait(wait):
            return
        self._exit(HANG_EXIT_STATUS)
