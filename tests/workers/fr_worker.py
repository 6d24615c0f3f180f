"""A small gloo job that leaves real Flight Recorder dumps (torch's own writer) for the tests.

Every rank runs a few collectives on the world group and on a subgroup of ranks 0 and 1, then
one of these endings; a thread writes this rank's Flight Recorder buffer as torch's pickle
(``_dump_fr_trace``) and JSON (``_dump_fr_trace_json``) into OUT_DIR and ends the process,
since a hung collective never returns:

- ``skip``: rank ``--culprit`` never issues the last all-reduce (it sleeps); the others wait in it;
- ``mismatch``: rank 1 issues a broadcast where the others issue an all-reduce;
- ``slow``: rank 1 enters each of 12 more all-reduces 50 ms after the others, then all finish;
- ``order``: rank 1 issues an all-reduce on the subgroup where the others issue one on the world
  (collectives in another order: ranks 0 and 1 each wait for the other);
- ``chain``: rank 1 never issues the first broadcast of a new group of ranks 0 and 1 (it sleeps): rank 0
  waits in that broadcast, rank 2 in the next world all-reduce, which ranks 0 and 1 never reach. Gloo
  records no group members, and rank 1's dump never mentions the new group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json


def settled(timeout_s: float = 30.0) -> None:
    """Until this rank's recorder holds every collective as completed (each group's last completed one its
    last enqueued, every entry retired): gloo's worker thread records a completion after the call has
    returned, so on a loaded machine a dump taken at once can still show the last barrier pending (a hang
    that never was)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dump = json.loads(_dump_fr_trace_json())
        status = dump.get("pg_status") or {}
        if all(int(st.get("last_completed_collective", -1)) >= int(st.get("last_enqueued_collective", -1))
               for st in status.values()) and all(e.get("retired") for e in dump.get("entries", [])):  # fmt: skip
            return
        time.sleep(0.05)


def dump_and_exit(out: Path, rank: int, after_s: float, wait_settled: bool = False) -> None:
    time.sleep(after_s)
    if wait_settled:
        settled()
    (out / f"pickle/rank_{rank}").write_bytes(_dump_fr_trace())
    (out / f"json/rank_{rank}.json").write_bytes(_dump_fr_trace_json())
    time.sleep(1.0)  # every rank has dumped before any leaves (a leaving peer fails the others' collectives)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("mode", choices=("skip", "mismatch", "slow", "order", "chain"))
    p.add_argument("--culprit", type=int, default=1)
    args = p.parse_args()
    out = Path(args.out_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    (out / "pickle").mkdir(parents=True, exist_ok=True)
    (out / "json").mkdir(parents=True, exist_ok=True)
    sub = dist.new_group([0, 1])
    x = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(x)
        if rank in (0, 1):
            dist.broadcast(x, 0, group=sub)
    if args.mode == "slow":
        for _ in range(12):
            if rank == 1:
                time.sleep(0.05)
            dist.all_reduce(x)
        dist.barrier()
    fresh = dist.new_group([0, 1]) if args.mode == "chain" else None
    slow = args.mode == "slow"  # every collective finishes: the dumps are taken once all are recorded so
    threading.Thread(target=dump_and_exit, args=(out, rank, 0.5 if slow else 2.0, slow), daemon=True).start()
    try:
        if args.mode == "skip":
            if rank == args.culprit:
                time.sleep(60)
            else:
                dist.all_reduce(x)
        elif args.mode == "order":
            dist.all_reduce(x, group=sub if rank == 1 else None)
        elif args.mode == "chain":
            if rank == 0:
                dist.broadcast(x, 0, group=fresh)
            if rank == 1:
                time.sleep(60)
            dist.all_reduce(x)
        elif args.mode == "mismatch":
            if rank == 1:
                dist.broadcast(x, 1)
            else:
                dist.all_reduce(x)
    except RuntimeError:
        pass  # a peer left after dumping; the dump thread ends the process
    time.sleep(60)


if __name__ == "__main__":
    main()
