"""Who this process is in the job and which run it belongs to (:func:`discover`), and the run's
metadata as the rank writes it (:func:`write_meta`).

Identity comes from ``torch.distributed`` when it is initialised, else from torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``). All ranks must write into one run dir, so they agree on
one run id once, at attach time (never in the hot path), through the job's store. Each record also
carries the restart count of torchrun's worker group and the number of this process's earlier
``attach`` calls, so restarts and re-attaches never make two records of one (rank, step). The files
themselves are the record format's (``stragglerwatch.record.rundir``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from stragglerwatch._version import __version__
from stragglerwatch.record.rundir import RUN_META, RunInfo, read_run_meta, write_json_atomic, write_rank_meta

LOGGER = logging.getLogger("stragglerwatch")


_STORE_TIMEOUT = timedelta(seconds=120)  # the most a rank waits for rank 0's run id (less if the store's own is less)


_attach_counter = itertools.count()  # this process's attach() calls: the records' `attach`


_scoped_attaches: dict[str, itertools.count[int]] = {}  # per scope (run dir, model class): the agreement keys


class AttachError(RuntimeError):
    """``attach`` was asked for something it cannot do; the message is one line for the user."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _agree(dist: Any, rank: int, key: str, make: Any, fallback: str) -> str:
    """A value rank 0 makes and every rank reads, through the job's store (once, at attach time);
    ``fallback`` (the same on every rank) when the store does not answer."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            value = make()
            store.set(key, value)
            return value
        own = getattr(store, "timeout", None)
        store.wait([key], min(_STORE_TIMEOUT, own) if isinstance(own, timedelta) else _STORE_TIMEOUT)
        return store.get(key).decode()
    except Exception as exc:
        LOGGER.warning("stragglerwatch: could not agree on a run id through the store (%s); using %s", exc, fallback)
        return fallback


def _job_suffix(dist: Any, rank: int, world: int, attach: str) -> str:
    """Six characters unique to this job, the same on every rank: from torchrun's run id (random per
    job in --standalone, the rendezvous id otherwise), else agreed through the store."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job and job != "none":
        return hashlib.sha1(job.encode()).hexdigest()[:6]
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    alike = hashlib.sha1(where.encode()).hexdigest()[:6]  # what every rank of the job sees alike
    if world > 1 and dist is not None:
        return _agree(dist, rank, f"stragglerwatch/run_suffix/{attach}", lambda: uuid.uuid4().hex[:6], alike)
    return alike if world > 1 else uuid.uuid4().hex[:6]


def discover(run_dir: str | os.PathLike[str] | None = None, run_id: str | None = None, scope: str = "") -> RunInfo:
    """This process's identity and the run dir every rank writes to.

    The run id is ``run_id`` if given; else, in a run dir that already has a ``run.json``, its run
    id (a restart or a second attach continues the run); else the run dir's name plus a suffix
    unique to the job (two jobs whose run dirs share a name never share labels or target files);
    without a run dir, a new id, agreed through the store, names the run dir too. The agreement's key
    counts the attaches of one ``scope`` (the run dir and model the caller names), so that ranks
    attaching other models a different number of times still agree on this one; a rank waits at most
    the store's own timeout (and 120 s), and on failure keeps an id of its own, said once."""
    dist = _dist()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    attach = next(_attach_counter)
    scope_key = f"{run_dir or ''}|{scope}"
    nth = next(_scoped_attaches.setdefault(scope_key, itertools.count()))
    agreement = hashlib.sha1(f"{scope_key}|{nth}".encode()).hexdigest()[:12]
    try:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)
    except ValueError:
        restart = 0
    if run_dir is not None:
        path = Path(run_dir)
        if run_id is None:
            existing = read_run_meta(path)
            run_id = str(existing["run_id"]) if existing and existing.get("run_id") else None
        run_id = run_id or f"{path.resolve().name}-{_job_suffix(dist, rank, world, agreement)}"
    else:
        if run_id is None:
            if dist is not None and world > 1:
                job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
                fallback = f"job-{job}" if job != "none" else "job-" + time.strftime("%Y%m%d")
                run_id = _agree(dist, rank, f"stragglerwatch/run_id/{agreement}", new_run_id, fallback)
            elif world > 1:
                raise AttachError(
                    "stragglerwatch: WORLD_SIZE > 1 but torch.distributed is not initialised; "
                    "call attach() after init_process_group(), or set STRAGGLERWATCH_RUN_DIR"
                )
            else:
                run_id = new_run_id()
        path = Path("stragglerwatch-runs") / run_id
    agent = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None  # torchrun's workers are its children
    return RunInfo(run_id, path, rank, local_rank, world, socket.gethostname(), restart, attach, agent)


def write_meta(info: RunInfo, config: dict[str, Any], rank_meta: dict[str, Any]) -> None:
    """Write ``run.json`` (rank 0, once) and this rank's ``rank-NNNNN.json``."""
    import torch

    info.run_dir.mkdir(parents=True, exist_ok=True)
    if info.rank == 0 and not (info.run_dir / RUN_META).exists():

        write_json_atomic(
            info.run_dir / RUN_META,
            {
                "run_id": info.run_id,
                "world_size": info.world_size,
                "created": time.time(),
                "schema": "stragglerwatch-run",
                "versions": {
                    "stragglerwatch": __version__,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                },
                "config": config,
            },
        )
    write_rank_meta(info, rank_meta)
