"""What a stall leaves behind besides its event: the Python stacks of every thread
(:func:`thread_stacks`), and PyTorch's Flight Recorder record of the rank's last collectives
(:func:`dump_flight_recorder`, ``flightrec-NNNNN.pkl``). Both are bounded and never raise.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path


def thread_stacks(limit: int = 40) -> dict[str, str]:
    """Python stack of every thread, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        out[f"{names.get(ident, 'thread')} ({ident})"] = "".join(traceback.format_stack(frame, limit=limit))
    return out


def dump_flight_recorder(path: Path) -> int | None:
    """Write this process's Flight Recorder buffer to ``path`` (torch's pickle, replaced atomically);
    the number of entries, or None when there is no multi-rank job, no Flight Recorder in this torch,
    or nothing recorded. Without the stacks of the entries: symbolising them holds the GIL for up to
    a second at a time (seconds in all), while the dump without them takes ~25 ms for 2,000 entries."""
    try:
        import pickle

        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None  # a buffer left by an earlier group of this process says nothing of this job
    data = _dump_fr_trace(includeStackTraces=False)
    entries = len(pickle.loads(data, fix_imports=False).get("entries") or [])  # torch's own bytes, no classes
    if not entries:
        return None
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return entries
