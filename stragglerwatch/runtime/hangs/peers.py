"""What the ranks tell each other at a stall, through the job's own c10d store.

Design: the watchdog of a stalled rank publishes a note (step, phase, when, and per process
group the collectives issued so far) under ``stragglerwatch/<run>/where/<rank>`` and reads
every rank's. Every rank writes a start-up note when its watchdog starts, so all keys exist
and a read is two store operations (``check`` and ``multi_get``) whatever the world size.
The client is our own connection with a short timeout: a dead store costs seconds, never a
hang, and no collective is ever issued.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any


def collective_counts() -> dict[str, int]:
    """Collectives issued so far in each process group of this process, by group name.

    The groups' own sequence numbers (c10d counts every collective at issue, DDP's
    C++ ones included); read off the training thread, at stall time only."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return {}
        c10d = dist.distributed_c10d
        out = {}
        for pg in list(c10d._world.pg_map):
            try:
                out[str(c10d._get_process_group_name(pg))] = int(pg._get_sequence_number_for_group())
            except Exception:
                continue
        return out
    except Exception:
        return {}


def collective_progress() -> dict[str, dict[str, int]]:
    """``{"started": {group: n}, "completed": {group: n}}``: the last collective each process group
    of this process started and completed, from Flight Recorder's status (no entries read: about
    0.1 ms). A count Flight Recorder does not track (-1: NCCL's "started" without timing, any count
    with Flight Recorder off) is left out; empty where this torch has no Flight Recorder."""
    try:
        import pickle

        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace

        if not (dist.is_available() and dist.is_initialized()):
            return {}
        status = pickle.loads(_dump_fr_trace(includeCollectives=False, includeStackTraces=False)).get("pg_status")
    except Exception:
        return {}
    out: dict[str, dict[str, int]] = {"started": {}, "completed": {}}
    for group, st in (status or {}).items():
        for key, field in (("started", "last_started_collective"), ("completed", "last_completed_collective")):
            try:
                value = int(st.get(field, -1))
            except (TypeError, ValueError, AttributeError):
                continue
            if value >= 0:
                out[key][str(group)] = value
    return {k: v for k, v in out.items() if v}


def default_store_address() -> tuple[str, int] | None:
    """Host and port of the default process group's TCPStore (under any prefix stores), or None."""
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return str(store.host), int(store.port)
    except Exception:
        return None


class PeerBoard:
    """This job's progress notes in its c10d store: ``stragglerwatch/<run>/where/<rank>``."""

    def __init__(self, run_id: str, rank: int, world_size: int, timeout_s: float = 5.0):
        self.prefix = f"stragglerwatch/{run_id}/where/"
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.errors = 0
        self.operations = 0  # store operations made to read the peers (for the load benchmark)
        self._client: Any = None
        self._address: tuple[str, int] | None = default_store_address()

    def _store(self) -> Any:
        if self._client is None and self._address is not None:
            import torch.distributed as dist

            host, port = self._address
            self._client = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
        return self._client

    def publish(self, state: dict[str, Any]) -> bool:
        try:
            store = self._store()
            if store is None:
                return False
            store.set(self.prefix + str(self.rank), json.dumps(state))
            return True
        except Exception:
            self.errors += 1
            return False

    def read(self, ranks: list[int] | None = None) -> dict[int, dict[str, Any] | None] | None:
        """Every rank's latest note, or those of ``ranks`` (None where there is none); None if the store is
        unreachable.

        Two store operations whatever the world size (``check`` and ``multi_get`` of every
        rank's key, which each rank set when its watchdog started); one key at a time only on
        a store without ``multi_get`` or when a rank never published."""
        try:
            store = self._store()
            if store is None:
                return None
            wanted = list(range(self.world_size)) if ranks is None else list(ranks)
            keys = [self.prefix + str(r) for r in wanted]
            self.operations += 1
            if hasattr(store, "multi_get") and store.check(keys):
                self.operations += 1
                return {r: _note(v) for r, v in zip(wanted, store.multi_get(keys), strict=True)}
            out: dict[int, dict[str, Any] | None] = {}
            for r, key in zip(wanted, keys, strict=True):
                self.operations += 1
                if store.check([key]):
                    self.operations += 1
                    out[r] = _note(store.get(key))
                else:
                    out[r] = None
            return out
        except Exception:
            self.errors += 1
            return None


def _note(raw: bytes) -> dict[str, Any] | None:
    try:
        note = json.loads(raw)
    except (ValueError, TypeError):
        return None
    return note if isinstance(note, dict) else None
