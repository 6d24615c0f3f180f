"""Store load when every rank of a job reads its peers' progress at a stall (not a pytest test).

A real TCPStore server holds the notes of N simulated peers (64, 128, 256). Readers, each on its
own client connection and all at once as at a job-wide stall, read every note two ways:

- per key (how stragglerwatch read before): ``check`` then ``get`` for each peer, 2N operations;
- in one go (now, ``PeerBoard.read``): ``check`` of all keys and one ``multi_get``, 2 operations.

Prints, per N, the operations one reader makes, the median and worst time of one read while
the others read too, and the operations the whole job sends the store (N readers).

    python benchmarks/store_load.py [--readers 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from stragglerwatch.runtime.hangs.peers import PeerBoard


def per_key(store: dist.TCPStore, keys: list[str]) -> int:
    for key in keys:
        if store.check([key]):
            json.loads(store.get(key))
    return 2 * len(keys)


def in_one_go(board: PeerBoard) -> int:
    board.operations = 0
    board.read()
    return board.operations


def measure(port: int, world: int, readers: int, how: str) -> tuple[int, list[float]]:
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)) for _ in range(readers)]
    keys = [f"stragglerwatch/bench-{world}/where/{r}" for r in range(world)]
    times: list[float] = []
    ops: list[int] = []
    start = threading.Barrier(readers)

    def read(client: dist.TCPStore, rank: int) -> None:
        board = PeerBoard(f"bench-{world}", rank, world)
        board._client = client
        start.wait()
        t0 = time.perf_counter()
        ops.append(per_key(client, keys) if how == "per key" else in_one_go(board))
        times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=read, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ops[0], times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readers", type=int, default=16, help="ranks reading at the same moment (default 16)")
    args = p.parse_args()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    writer = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    print(f"store_load: real TCPStore on loopback, {args.readers} readers at once, each on its own connection")
    for world in (64, 128, 256):
        note = json.dumps({"step": 1234, "phase": "allreduce_wait", "at": time.time(), "collectives": {"0": 5678}})
        for r in range(world):
            writer.set(f"stragglerwatch/bench-{world}/where/{r}", note)
        for how in ("per key", "in one go"):
            ops, times = measure(master.port, world, args.readers, how)
            print(f"store_load: N={world:4d} {how:9s}: {ops:4d} operations a reader; one read "
                  f"{statistics.median(times) * 1e3:7.1f} ms median, {max(times) * 1e3:7.1f} ms worst; "
                  f"a job of N ranks sends the store {ops * world:6d} operations")  # fmt: skip


if __name__ == "__main__":
    main()
