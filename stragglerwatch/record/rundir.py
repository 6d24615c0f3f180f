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
    agent: int | None = None  # the pid of the node's torchrun agent (its workers' parent); None without one


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


#: The attempts a ``rank-NNNNN.json`` remembers where its rank ran (the latest ones).
MAX_ATTEMPTS = 64


def write_rank_meta(info: RunInfo, rank_meta: dict[str, Any]) -> None:
    """(Re)write this rank's ``rank-NNNNN.json``: identity, pid and ``rank_meta``, and ``attempts``: where the
    rank ran in each attempt of the run (``restart``, ``attach``, ``host``, ``local_rank``, ``agent``: the node's
    torchrun agent, ``world_size``), kept from the file an earlier attempt wrote, since a restarted rank may run
    on another node, in a job of another size."""
    path = info.run_dir / f"rank-{info.rank:05d}.json"
    own = {k: v for k, v in asdict(info).items() if k != "run_dir"}
    this = {"restart": info.restart, "attach": info.attach, "host": info.host, "local_rank": info.local_rank,
            "agent": info.agent, "world_size": info.world_size}
    try:
        before = json.loads(path.read_text()).get("attempts") or []
    except (OSError, ValueError, AttributeError):
        before = []
    attempts = [a for a in before if isinstance(a, dict) and (a.get("restart"), a.get("attach")) !=
                (info.restart, info.attach)][-(MAX_ATTEMPTS - 1):] + [this]  # fmt: skip
    write_json_atomic(path, {**own, "pid": os.getpid(), **rank_meta, "attempts": attempts})


def where_ran(meta: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """Where a rank ran, by attempt ``(restart, attach)``: ``{"host", "local_rank", "agent", "world_size"}`` (the
    last two None where an earlier release wrote the file), from its ``rank-NNNNN.json`` (one written before
    ``attempts`` was kept gives its latest attempt only)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for a in [*(meta.get("attempts") or []), meta]:
        if isinstance(a, dict) and a.get("host"):
            key = (_int(a.get("restart")) or 0, _int(a.get("attach")) or 0)
            out.setdefault(key, {"host": str(a["host"]), "local_rank": _int(a.get("local_rank")),
                                 "agent": _int(a.get("agent")), "world_size": _int(a.get("world_size"))})
    return out


def _int(value: Any) -> int | None:
    """An integer field of a metadata file, None where it is missing or damaged."""
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


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
