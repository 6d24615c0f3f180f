"""Who this process is in the job, which run it belongs to, and the run's metadata files.

Design: identity comes from ``torch.distributed`` when it is initialised, else from
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``). All ranks must
write into one run dir, so they agree on one run id once, at attach time (never
in the hot path): ``$STRAGGLERWATCH_RUN_ID`` if set, else rank 0 makes one and
publishes it through the process group's existing c10d store.

Files of a run dir:
- ``run.json``: written once by rank 0 (run id, world size, versions, config);
- ``rank-NNNNN.json``: per rank (host, local rank, pid, device, timing clock, role, and
  ``busy_unavailable``: why this rank's busy time cannot be trusted, when it cannot);
- ``rank-NNNNN.arrows`` / ``.parquet``: the step log (``eventlog.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import socket
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

RUN_META = "run.json"
_STORE_TIMEOUT = timedelta(seconds=120)
_attach_counter = itertools.count()  # per-process attach number: keys the run-id handshake


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_dir: Path
    rank: int
    local_rank: int
    world_size: int
    host: str


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _agree_run_id(dist: Any, rank: int) -> str:
    key = f"stragglerwatch/run_id/{next(_attach_counter)}"
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            run_id = new_run_id()
            store.set(key, run_id)
            return run_id
        store.wait([key], _STORE_TIMEOUT)
        return store.get(key).decode()
    except Exception as exc:  # store unreachable: fall back to what torchrun gives every rank
        fallback = os.environ.get("TORCHELASTIC_RUN_ID", "")
        run_id = f"job-{fallback}" if fallback and fallback != "none" else "job-" + time.strftime("%Y%m%d")
        message = f"stragglerwatch: could not agree on a run id through the store ({exc}); using {run_id}"
        warnings.warn(message, stacklevel=3)
        return run_id


def discover(run_dir: str | os.PathLike[str] | None = None) -> RunInfo:
    """This process's identity and the run dir every rank writes to."""
    dist = _dist()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    run_dir = run_dir or os.environ.get("STRAGGLERWATCH_RUN_DIR") or None
    run_id = os.environ.get("STRAGGLERWATCH_RUN_ID") or None
    if run_dir is not None:
        path = Path(run_dir)
        run_id = run_id or path.resolve().name
    else:
        if run_id is None:
            if dist is not None and world > 1:
                run_id = _agree_run_id(dist, rank)
            elif world > 1:
                raise RuntimeError(
                    "stragglerwatch: WORLD_SIZE > 1 but torch.distributed is not initialised; "
                    "call attach() after init_process_group(), or set STRAGGLERWATCH_RUN_DIR"
                )
            else:
                run_id = new_run_id()
        path = Path("stragglerwatch-runs") / run_id
    return RunInfo(run_id, path, rank, local_rank, world, socket.gethostname())


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_meta(info: RunInfo, config: dict[str, Any], rank_meta: dict[str, Any]) -> None:
    """Write ``run.json`` (rank 0, once) and this rank's ``rank-NNNNN.json``."""
    import torch

    info.run_dir.mkdir(parents=True, exist_ok=True)
    if info.rank == 0 and not (info.run_dir / RUN_META).exists():
        from . import __version__

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


def write_rank_meta(info: RunInfo, rank_meta: dict[str, Any]) -> None:
    """(Re)write this rank's ``rank-NNNNN.json``: identity, pid and ``rank_meta``."""
    own = {k: v for k, v in asdict(info).items() if k != "run_dir"}
    write_json_atomic(info.run_dir / f"rank-{info.rank:05d}.json", {**own, "pid": os.getpid(), **rank_meta})


def read_run_meta(run_dir: Path) -> dict[str, Any] | None:
    """``run.json`` as a dict, or None when it is missing or not ours."""
    try:
        meta = json.loads((run_dir / RUN_META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
        return None
    return meta


def read_rank_meta(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every readable ``rank-NNNNN.json``, by rank."""
    out = {}
    for p in sorted(run_dir.glob("rank-*.json")):
        try:
            meta = json.loads(p.read_text())
            out[int(meta["rank"])] = meta
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
