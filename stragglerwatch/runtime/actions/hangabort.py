"""``on_hang="abort"``: a rank whose stall outlasts its diagnosis, while the rank it waits for makes no
progress, leaves the job, so that the job restarts.

Design: the watchdog thread of every rank decides for itself, from its own stall and the notes its peers
leave in the job's store (``analysis.hangs.confirm``: the culprits show no progress, ``progress.py``), so
that no collective is needed when the job is stuck. ``hang_abort_s`` (default twice the watchdog's
threshold) bounds the time from the rank's decision to act to its exit:

1. For the first half of the bound after the diagnosis nothing happens; after it, the rank acts only once
   every culprit has made no progress for that long (a long checkpoint, a recompile or a slow peer that
   catches up is left alone, and the report says what it was doing).
2. Then the rank records an ``action`` event (fsynced, after the stall's stacks and Flight Recorder dump)
   and flushes its step log; under torchrun's shared store, deletes the process groups' keys from it
   (:func:`forget_group_keys`: else the restarted group may read this attempt's addresses). What follows
   depends on the backend (:func:`device_backend`):

   - **A host-blocking backend (gloo, MPI)**: the main thread is blocked in the collective and nothing
     was queued behind it, so the model and optimizer state are those of the last finished step. The
     rank sends itself SIGTERM where a Python handler is installed (ours, which runs the application's
     handler it chained to and then exits with :data:`HANG_EXIT_STATUS`; or the application's own,
     installed after ``attach``) and aborts every process group (``ProcessGroup.abort()``) on a thread of
     its own, bounded. Gloo's abort does not wake a rank blocked in a collective: such a rank runs its
     handler only once a peer has left (its connection closes), which the culprit usually does. Where the
     culprit left before this rank's policy acted, the collective's error reaches the exception hook first,
     and the hook takes the action (:meth:`HangAbort.failed`, ``Watchdog.collective_failed``).
   - **A backend that runs collectives on the device (NCCL and the like)**: the host has usually queued the
     optimizer step and the next forward behind the stuck collective; after an abort those kernels would
     run on half-reduced buffers, and PyTorch itself says no user code may run after a failed NCCL
     operation. So no SIGTERM is sent, no process group is aborted (an abort would make the blocked call
     return into the application's ``except``/``finally`` code) and the rank ends at once with
     ``os._exit(HANG_EXIT_STATUS)``: no checkpoint is saved from that state. An application that wants to
     act anyway gives ``hang_handler``, a callable run on the watchdog thread first, bounded, and told
     ``state_suspect=True``.

3. At the bound, a rank still alive ends with ``os._exit(HANG_EXIT_STATUS)`` after flushing stdout and
   stderr. A rank that ends by itself before (its handler called ``sys.exit``) ends with the same status:
   ours turns a status of 0 into it, and where the application's handler replaced ours the exit hook does
   (``Watch._at_exit``), so that ``torchrun --max-restarts`` counts the rank as failed and restarts the
   group.

A rank stuck in native code holding the GIL runs none of this (no Python thread runs). Where the user
chose ``hang_abort_s``, the watchdog keeps ``faulthandler``'s timer armed with ``exit=True`` at its
threshold + 2 s + that bound (``nativestacks.py``): its stacks are dumped and it ends with status 1 about
when its peers leave. By default the timer only dumps stacks: a rank that holds the GIL in a long pickle
is working, and nothing in the process can tell it from a stuck one.
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
#: Why a victim sent SIGTERM in its diagnosed stall was ended by the policy (torchrun's teardown as a peer left).
TORN_DOWN = "SIGTERM while it waited (the job torn down as a peer left)"
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


#: Backend names whose collectives run on a device, asynchronously to the host (``torch.distributed``'s
#: names): an abort there leaves the work queued behind the collective running on corrupted data.
DEVICE_BACKENDS = ("nccl", "xccl", "hccl", "cncl", "mccl", "ucc")


def device_backend() -> str | None:
    """The name of a backend of this process's groups that runs collectives on a device (NCCL), or None
    where every group blocks the host (gloo, MPI) or there is no group."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        c10d = dist.distributed_c10d
        for pg in list(c10d._world.pg_map):
            try:
                name = str(c10d.get_backend(pg)).lower()
            except Exception:
                continue
            found = next((b for b in DEVICE_BACKENDS if b in name), None)
            if found:
                return found
    except Exception:
        return None
    return None


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
                 forget: Callable[[], str] = lambda: forget_group_keys(os.environ),
                 backend: Callable[[], str | None] = device_backend,
                 handler: Callable[[dict[str, Any]], Any] | None = None):  # fmt: skip
        self.bound_s = bound_s  # None: twice the threshold at the stall (not chosen by the user)
        self.terminate = terminate  # sends this process SIGTERM where a Python handler runs it; says which, or none
        self.stopped = stopped  # set when the Watch closes: the process is ending by itself
        self._abort, self._exit, self._forget = abort, exit, forget
        self._backend, self.handler = backend, handler
        self.started = False
        self._claim = threading.Lock()
        self.deadline: float | None = None  # perf-counter seconds the rank ends by, once the action is recorded

    @property
    def chosen(self) -> bool:
        """Whether the user chose the bound (``hang_abort_s``): only then may faulthandler end the process."""
        return bool(self.bound_s)

    def bound(self, threshold_s: float) -> float:
        return float(self.bound_s) if self.bound_s else 2.0 * threshold_s

    def due(self, diagnosed: float, threshold_s: float, now: float) -> bool:
        """Whether a stall diagnosed at ``diagnosed`` (perf-counter seconds) has lasted half the bound."""
        return not self.started and now - diagnosed >= self.bound(threshold_s) / 2

    def claim(self) -> bool:
        """Take the action for the caller, once: False where it was already taken (by the other thread)."""
        with self._claim:
            if self.started:
                return False
            self.started = True
            return True

    def left_s(self, now: float, threshold_s: float) -> float:
        """Seconds until the rank ends, once the action is taken (the whole bound before it is recorded)."""
        return max(0.0, self.deadline - now) if self.deadline is not None else self.bound(threshold_s)

    def host_blocking(self) -> bool:
        """Whether this process's groups all block the host (gloo, MPI): where a handler may still run."""
        return self._backend() is None

    def _begin(self, diagnosed: float, threshold_s: float, now: float, record: Callable[..., Any],
               info: dict[str, Any] | None, **fields: Any) -> tuple[str | None, float, str, str]:  # fmt: skip
        """Record the action (``fields`` added), forget the group keys, call ``hang_handler``: the device
        backend (None: host), the seconds left to the bound, and what the last two did."""
        self.started = True  # claimed by the caller, or by this call: never again
        bound = self.bound(threshold_s)
        wait = max(0.0, diagnosed + bound - now)
        self.deadline = now + wait
        device = self._backend()
        record(exit_status=HANG_EXIT_STATUS, bound_s=round(bound, 3), exit_within_s=round(wait, 3),
               backend=device or "host", state_suspect=bool(device), **fields)  # fmt: skip
        keys = self._forget()
        told = self._call_handler({**(info or {}), "backend": device or "host", "state_suspect": bool(device)},
                                  wait)  # fmt: skip
        return device, wait, keys, told

    def run(self, diagnosed: float, threshold_s: float, now: float, record: Callable[..., Any],
            info: dict[str, Any] | None = None) -> None:  # fmt: skip
        """From the watchdog thread, the action claimed (:meth:`claim`): record it, then end the rank as its
        backend allows (the module's docstring); ``info`` is what ``hang_handler`` is told. Returns only when
        the Watch closed first (the process is exiting)."""
        device, wait, keys, told = self._begin(diagnosed, threshold_s, now, record, info)
        if device:  # nothing of the application's runs after this: its state may be corrupted
            LOGGER.warning("stragglerwatch: hang policy: stalled %.1f s past the diagnosis on %s; %s; %s; no SIGTERM "
                           "and no abort (queued device work would run on corrupted data); exit status %d now",
                           now - diagnosed, device, keys, told, HANG_EXIT_STATUS)  # fmt: skip
            self._exit(HANG_EXIT_STATUS)
            return
        handler = self.terminate()
        groups = self._abort()
        LOGGER.warning("stragglerwatch: hang policy: stalled %.1f s past the diagnosis; %s; %s; SIGTERM: %s; %s; exit "
                       "status %d within %.1f s", now - diagnosed, keys, told, handler, groups, HANG_EXIT_STATUS,
                       wait)  # fmt: skip
        if self.stopped.wait(wait):
            return
        self._exit(HANG_EXIT_STATUS)

    def failed(self, diagnosed: float, threshold_s: float, now: float, record: Callable[..., Any],
               info: dict[str, Any] | None, error: str) -> float:  # fmt: skip
        """From the main thread of a rank on a host-blocking backend, the action claimed: the call it was
        blocked in, waiting for the stall's culprits, raised ``error`` (a culprit left the job, or the
        collective timed out), so the rank leaves as :meth:`run` would have made it. Records the action
        (``error`` in it), forgets the group keys, calls ``hang_handler``, and arms the exit at the bound on a
        thread of its own (the caller then runs the application's SIGTERM handler); the seconds left."""
        _, wait, keys, told = self._begin(diagnosed, threshold_s, now, record, info, error=error[:300])
        LOGGER.warning("stragglerwatch: hang policy: the collective this rank waited in failed %.1f s past the "
                       "diagnosis (%s); %s; %s; running the application's SIGTERM handler; exit status %d within "
                       "%.1f s", now - diagnosed, error[:120], keys, told, HANG_EXIT_STATUS, wait)  # fmt: skip

        def bound() -> None:
            if not self.stopped.wait(wait):
                self._exit(HANG_EXIT_STATUS)

        threading.Thread(target=bound, name="stragglerwatch-hang-bound", daemon=True).start()
        return wait

    def _call_handler(self, info: dict[str, Any], timeout_s: float) -> str:
        """Run ``hang_handler`` (opt-in) on a thread of its own, waited for at most ``timeout_s``."""
        if self.handler is None:
            return "no hang_handler"
        outcome: list[str] = []

        def call() -> None:
            try:
                self.handler(dict(info))  # type: ignore[misc]
                outcome.append("hang_handler returned")
            except BaseException as exc:  # its sys.exit too: the exit is ours
                outcome.append(f"hang_handler raised {type(exc).__name__}: {exc}"[:200])

        worker = threading.Thread(target=call, name="stragglerwatch-hang-handler", daemon=True)
        worker.start()
        worker.join(timeout_s)
        return outcome[0] if outcome else f"hang_handler had not returned after {timeout_s:g} s"
