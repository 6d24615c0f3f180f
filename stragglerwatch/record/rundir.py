"""The run dir's layout and its metadata files: :class:`RunInfo` (a rank's identity in the run), and the
readers and atomic writers of the JSON files.

Files of a run dir:
- ``run.json``: written once by rank 0 (run id, world size, versions, config);
- ``rank-NNNNN.json``: per rank (host, local rank, pid, device, timing clock, role,
  ``busy_unavailable``: why this rank's busy time cannot be trusted, when it cannot, ``coverage``: what
  communication no bracket sees and how the analysis finds it, and ``loader``:
  the first DataLoader the loop wrapped, its ``num_workers``, ``pin_memory``, ``persistent_workers``
  and ``prefetch_factor``);
- ``rank-NNNNN.arrows`` / ``.parquet``: the step log (``steplog.py``);
- ``events-NNNNN.jsonl``: stalls, diagnoses, recoveries, shutdowns (``events.py``);
- ``context-NNNNN.arrows`` / ``.parquet``: the rank's host and GPU context, sampled about once a
  second (``context.py``); ``code-NNNNN.arrows`` / ``.parquet``: where in the code it was (``codelog.py``).

How a rank comes to know who it is (and writes ``run.json``) is the runtime's
(``stragglerwatch.runtime.identity``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RUN_META = "run.json"
MAX_RANKS = 1 << 24  # more ranks than any job has: a larger rank or world size is a damaged file


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_dir: Path
    rank: int
    local_rank: int
    world_size: int
    host: str
    restart: int = 0  # torchrun's restart count of this worker group (TORCHELASTIC_RESTART_COUNT)
    attach: int = 0  # how many attach() this process made before this one


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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
    if not 0 < meta["world_size"] <= MAX_RANKS:  # a damaged file: no job has this many ranks
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
