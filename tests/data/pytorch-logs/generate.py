"""Produce real PyTorch failure messages on CPU (gloo, c10d TCPStore) for the fixtures in this folder.

    OMP_NUM_THREADS=1 TORCH_DISTRIBUTED_DEBUG=DETAIL python -m torch.distributed.run --standalone \\
        --nproc_per_node=N generate.py worker op|size|dtype|barrier|hang|crash
    python generate.py store clients|wait|connect

``worker``: one matching all_reduce, then the last rank runs a different collective (op, barrier), a
different shape or dtype, or comes 35 s late (hang; the group's timeout is 20 s); or rank 1 raises
(crash: a shape error) while the others all-reduce. ``store``: a TCPStore
whose clients never come, a wait on keys nobody sets, a client with no server; the error is printed.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(case: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    t = torch.ones(4)
    dist.all_reduce(t)  # one matching collective first
    if case == "op":
        if rank == last:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
    elif case == "size":
        dist.all_reduce(torch.ones(4, 5) if rank == last else torch.ones(4, 3))
    elif case == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == last else torch.float32))
    elif case == "barrier":
        if rank == last:
            dist.barrier()
        else:
            dist.all_reduce(t)
    elif case == "hang":
        if rank == last:
            time.sleep(35)
        dist.all_reduce(t)
    elif case == "crash":
        if rank == 1:
            t = t @ torch.ones(3)  # a shape bug: torch raises, the process exits
        dist.all_reduce(t)
    dist.destroy_process_group()


def store(case: str) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=2)
    try:
        if case == "clients":
            dist.TCPStore("127.0.0.1", _free_port(), 2, True, timeout=timeout, wait_for_workers=True)
        elif case == "wait":
            dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=timeout).wait(["missing_key", "other"])
        elif case == "connect":
            dist.TCPStore("127.0.0.1", _free_port(), 2, False, timeout=timeout)
    except Exception as exc:  # print it the way an uncaught exception's last line reads
        print(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    {"worker": worker, "store": store}[sys.argv[1]](sys.argv[2])
