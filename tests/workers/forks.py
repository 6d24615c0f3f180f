"""A trainer that forks helpers the ways real scripts do, with or without stragglerwatch attached.

Run as a plain process (one rank). While it trains it: terminates a busy fork ``Pool`` (SIGTERM to
its workers), cuts epochs of a fork-context ``DataLoader`` short while its workers are busy (the
loader terminates them with SIGTERM, new ones start the next epoch), forks a child that calls
``sys.exit`` (atexit and finalizers run in the child), and forks a child that it then terminates.
``--user-handler`` installs a SIGTERM handler before attach that notes which process ran it.
Prints one JSON line: the steps done and the pids whose handler ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.utils.data._utils as data_utils
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.3)
        return torch.randn(4)


def busy(x: int) -> int:
    t = time.monotonic()
    while time.monotonic() - t < 5:
        pass
    return x


def fork_and_exit() -> None:
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # atexit and finalizers run in the child
    os.waitpid(pid, 0)


def fork_and_terminate() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)


def pool_terminated() -> None:
    pool = mp.get_context("fork").Pool(2)
    pool.map_async(busy, range(4))
    time.sleep(0.5)
    pool.terminate()
    pool.join()


def loader_epochs(epochs: int = 2) -> None:
    data_utils.MP_STATUS_CHECK_INTERVAL = 0.2  # busy workers are terminated soon after an epoch is cut short
    loader = DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    for _ in range(epochs):
        for i, _batch in enumerate(loader):
            if i == 2:
                break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--plain", action="store_true", help="without stragglerwatch")
    p.add_argument("--user-handler", action="store_true")
    args = p.parse_args()
    handled = Path(args.run_dir) / "handled"
    handled.mkdir(parents=True, exist_ok=True)
    if args.user_handler:
        def on_sigterm(signum: int, frame: object) -> None:
            (handled / str(os.getpid())).write_text("checkpoint")
            os._exit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = None
    if not args.plain:
        import stragglerwatch

        watch = stragglerwatch.attach(model, args.run_dir, context_interval_s=1, watchdog_timeout_s=20)
    helpers = {3: pool_terminated, 6: loader_epochs, 9: fork_and_exit, 12: fork_and_terminate}
    steps = 0
    for step in range(16):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        if step in helpers:
            helpers[step]()
    if watch is not None:
        watch.close()
    by = sorted(int(p.name) for p in handled.iterdir())
    print(json.dumps({"steps": steps, "pid": os.getpid(), "handled_by": by}))


if __name__ == "__main__":
    main()
