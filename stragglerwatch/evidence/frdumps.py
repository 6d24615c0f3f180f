"""Read PyTorch Flight Recorder dumps, in the formats the supported torch releases write.

Flight Recorder keeps, per process, a ring buffer of the last collectives of every process group
(``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``). It is written:

- by ProcessGroupNCCL on a watchdog timeout, to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (formerly
  ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``~/.cache/torch/comm_lib_trace_rank_<rank>``, in
  older releases ``/tmp/nccl_trace_rank_<rank>``), as a pickle;
- on demand by ``torch._C._distributed_c10d._dump_fr_trace()`` (pickle bytes) or
  ``_dump_fr_trace_json()`` (JSON), which also serve the debug server's ``fr_trace_json`` page;
- by stragglerwatch's watchdog at a stall, with torch's own writer, to ``flightrec-NNNNN.pkl`` in
  the run dir (ProcessGroupGloo records into Flight Recorder too, so this works on CPU jobs).

Design: one tolerant reader, no torch import. A pickle is loaded with an unpickler that refuses
every global (torch writes plain dicts, lists, strings and numbers), so a dump cannot run code.
Fields differ between releases (``seq_id`` before ``collective_seq_id``, no ``process_group``,
``pg_config`` or ``pg_status`` in the oldest, strings instead of numbers in JSON, 0 instead of None
for unknown times): every entry is normalised into an :class:`Entry` and a missing field stays
None. The rank comes from the dump (JSON from the debug server has ``rank``), else from the digits
that end the file name. A file that is not a dump is skipped with its reason; nothing raises.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MAX_FILE = 1 << 30  # bytes: a dump of 2,000 entries with stacks is a few MB
_RUN_FILE = re.compile(  # what a run dir holds besides dumps
    r"^(run\.json|report\.html|(rank|events|stacks|context)-\d+\.(json|jsonl|parquet|arrows|txt)|.*\.tmp)$"
)
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.(?:pkl|pickle|json|bin|txt))?(?:\.gz)?$")


class _PlainUnpickler(pickle.Unpickler):
    """Loads only the built-in containers and scalars: a dump that names any class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


@dataclass(frozen=True)
class Entry:
    """One recorded operation, normalised across releases."""

    group: str  # the process group's name (``process_group[0]``, else the pg id)
    desc: str | None  # its description, e.g. "default_pg"
    pg_id: int | None
    seq: int | None  # the group's collective sequence number (counts from 1)
    p2p: bool
    op: str  # profiling name without the backend, e.g. "all_reduce", "send 0->1"
    backend: str | None  # "nccl", "gloo", ...
    in_sizes: tuple | None
    out_sizes: tuple | None
    in_dtypes: tuple | None
    out_dtypes: tuple | None
    state: str | None  # "scheduled", "started", "completed"
    retired: bool | None
    created_ns: int | None
    started_ns: int | None
    completed_ns: int | None
    timeout_ms: int | None
    where: str | None  # the innermost frame outside torch, "file:line in function"


@dataclass
class Dump:
    """One rank's dump."""

    rank: int
    file: str
    version: str | None
    entries: list[Entry]
    groups: dict[str, dict[str, Any]]  # pg_config: name -> {"desc", "ranks" (list or None)}
    status: dict[str, dict[str, int | None]]  # group name -> last enqueued/started/completed collective
    mtime: float


@dataclass
class Dumps:
    """The dumps found under a path, by rank, and the files that were not dumps."""

    source: str
    by_rank: dict[int, Dump] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    duplicates: int = 0  # older dumps of a rank that has a newer one


def _int(v: Any) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


def _sizes(v: Any) -> tuple | None:
    if not isinstance(v, list | tuple):
        return None
    return tuple(tuple(x) if isinstance(x, list | tuple) else x for x in v)


def _where(frames: Any) -> str | None:
    """The innermost frame of user code: the first that is not inside torch itself."""
    if not isinstance(frames, list):
        return None
    for f in frames:
        if isinstance(f, dict):
            path = str(f.get("filename", ""))
            if "/torch/" not in path and "\\torch\\" not in path and path:
                return f"{path}:{f.get('line')} in {f.get('name')}"
    return None


def normalise_entry(raw: dict[str, Any]) -> Entry | None:
    """An :class:`Entry` from one raw entry of any release; None when it has no profiling name."""
    name = raw.get("profiling_name")
    if not isinstance(name, str) or not name:
        return None
    backend, _, op = name.partition(":") if ":" in name else (None, "", name)
    pg = raw.get("process_group")
    pg_id = _int(raw.get("pg_id"))
    if isinstance(pg, list | tuple) and pg:
        group, desc = str(pg[0]), (str(pg[1]) if len(pg) > 1 and pg[1] is not None else None)
    else:
        group, desc = str(pg_id if pg_id is not None else 0), None
    seq = _int(raw.get("collective_seq_id", raw.get("seq_id")))
    p2p = bool(raw.get("is_p2p")) or bool(re.match(r"(send|recv)\b", op))

    def ns(key: str) -> int | None:
        v = _int(raw.get(key))
        return v if v else None  # JSON writes 0 for "not yet"

    def dtypes(key: str) -> tuple | None:
        v = raw.get(key)
        return tuple(str(x) for x in v) if isinstance(v, list | tuple) else None

    return Entry(
        group=group, desc=desc, pg_id=pg_id, seq=seq, p2p=p2p, op=op.strip(), backend=backend,
        in_sizes=_sizes(raw.get("input_sizes")), out_sizes=_sizes(raw.get("output_sizes")),
        in_dtypes=dtypes("input_dtypes"), out_dtypes=dtypes("output_dtypes"),
        state=str(raw["state"]) if raw.get("state") is not None else None,
        retired=bool(raw["retired"]) if raw.get("retired") is not None else None,
        created_ns=ns("time_created_ns"), started_ns=ns("time_discovered_started_ns"),
        completed_ns=ns("time_discovered_completed_ns"), timeout_ms=_int(raw.get("timeout_ms")),
        where=_where(raw.get("frames")),
    )  # fmt: skip


def _ranks_list(v: Any) -> list[int] | None:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return None
    if isinstance(v, list | tuple):
        ranks = [r for r in (_int(x) for x in v) if r is not None]
        return ranks or None
    return None


def _groups(pg_config: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if isinstance(pg_config, dict):
        for key, cfg in pg_config.items():
            if not isinstance(cfg, dict):
                continue
            name = str(cfg.get("name") or key)
            if name:
                out[name] = {"desc": cfg.get("desc") or None, "ranks": _ranks_list(cfg.get("ranks"))}
    return out


def _status(pg_status: Any, entries: list[Entry]) -> dict[str, dict[str, int | None]]:
    """pg_status is keyed by the group's id; the entries tell which name that id has."""
    names = {str(e.pg_id): e.group for e in entries if e.pg_id is not None}
    out: dict[str, dict[str, int | None]] = {}
    if isinstance(pg_status, dict):
        for key, st in pg_status.items():
            if isinstance(st, dict):
                out[names.get(str(key), str(key))] = {
                    k: _int(st.get(f"last_{k}_collective")) for k in ("enqueued", "started", "completed")
                }
    return out


def _decode(data: bytes) -> dict[str, Any]:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        obj = json.loads(data)
    elif data[:1] == b"\x80":
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    else:
        raise ValueError("not a Flight Recorder dump (neither pickle nor JSON)")
    if not isinstance(obj, dict) or "entries" not in obj and "version" not in obj:
        raise ValueError("not a Flight Recorder dump (no 'entries' or 'version')")
    return obj


def read_dump(path: Path) -> Dump:
    """One dump file; ValueError (one line) when it is not one."""
    try:
        size = path.stat().st_size
        if size > _MAX_FILE:
            raise ValueError(f"too large for a dump ({size} bytes)")
        obj = _decode(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read: {exc.strerror or exc}") from None
    except (pickle.UnpicklingError, EOFError, UnicodeDecodeError, json.JSONDecodeError, gzip.BadGzipFile) as exc:
        raise ValueError(f"not a readable dump ({type(exc).__name__}: {str(exc)[:80]})") from None
    rank = _int(obj.get("rank"))
    if rank is None:
        m = _RANK_SUFFIX.search(path.name)
        rank = int(m.group(1)) if m else None
    if rank is None or rank < 0:
        raise ValueError("no rank in the dump nor at the end of its file name")
    raw = obj.get("entries") or []
    entries = [e for e in (normalise_entry(x) for x in raw if isinstance(x, dict)) if e is not None]
    version = obj.get("version")
    return Dump(rank=rank, file=str(path), version=str(version) if version is not None else None, entries=entries,
                groups=_groups(obj.get("pg_config")), status=_status(obj.get("pg_status"), entries),
                mtime=path.stat().st_mtime)  # fmt: skip


def load_dumps(source: str | os.PathLike[str], pattern: str = "*") -> Dumps:
    """Every dump under ``source`` (a file, or a directory searched recursively for ``pattern``);
    per rank the newest file wins. A run dir's own files are passed over in silence. ValueError
    (one line) when ``source`` does not exist."""
    root = Path(source)
    if not root.exists():
        raise ValueError(f"{root}: no such file or directory")
    files = [root] if root.is_file() else sorted(p for p in root.rglob(pattern) if p.is_file())
    out = Dumps(str(root))
    for path in files:
        if path.name.startswith(".") or _RUN_FILE.match(path.name):
            continue
        try:
            dump = read_dump(path)
        except ValueError as exc:
            out.skipped.append((str(path), str(exc)))
            continue
        old = out.by_rank.get(dump.rank)
        if old is not None:
            out.duplicates += 1
            if old.mtime >= dump.mtime:
                continue
        out.by_rank[dump.rank] = dump
    return out
