"""Shared-file-system metadata operations of the control file, per second per 1,000 ranks (not a pytest test).

N simulated ranks (``--ranks``, default 64) spread over H simulated hosts (``--hosts``, default 8: 8 ranks
a host, as on a GPU node) each run the real :class:`ControlFile` thread on one run dir, at
``--interval`` (default 1 s, the attach default), for ``--seconds`` (default 10), with ``--requests``
control requests (default 1) written during the run; each host's node-local directory is a directory of
its own. Two ways, one after the other:

- ``every rank``: each rank looks at the shared ``control.json`` itself (as before the relay; now
  what a rank does where it cannot share a node-local directory);
- ``relay``: one rank per host looks at the shared file and copies it for the others.

The calls of ``os.stat`` and ``open`` on the shared ``control.json`` are counted where they are made
(each is one system call: ``newfstatat``/``statx`` and ``openat``), and the ranks' looks at their
node-local copies (not shared-file-system operations). Prints, for each way, the shared-file-system
operations per second per 1,000 ranks, and checks that every rank applied every request. The
operations a rank makes once at attach (one ``stat``, one read) and its acknowledgement of a request (a
write and a rename in the run dir) are the same both ways and not counted.

    python benchmarks/control_polling.py
    python benchmarks/control_polling.py --ranks 256 --hosts 32 --seconds 20
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stragglerwatch.record.rundir import write_json_atomic
from stragglerwatch.runtime.controls.controlfile import ControlFile, write_request
from stragglerwatch.runtime.log import Problems


class Surface:
    """What a ``ControlFile`` needs of a rank's controls: ``apply``, which here only counts."""

    def __init__(self) -> None:
        self.applied = 0

    def apply(self, settings: Mapping[str, Any], source: str = "") -> dict[str, Any]:
        self.applied += 1
        return {"applied": dict(settings), "errors": []}


class Counter:
    """Counts the ``os.stat`` and ``open`` calls on one path while installed (the calls go on)."""

    def __init__(self, path: Path):
        self.target = os.path.abspath(path)
        self.stat = self.open = 0
        self.paused = False  # while the operator's command writes a request
        self._real = (os.stat, io.open)

    def __enter__(self) -> Counter:
        real_stat, real_open = self._real

        def stat(p: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.paused and isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == self.target:
                self.stat += 1
            return real_stat(p, *args, **kwargs)

        def open_(p: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.paused and isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == self.target:
                self.open += 1
            return real_open(p, *args, **kwargs)

        os.stat, io.open = stat, open_
        return self

    def __exit__(self, *exc: object) -> None:
        os.stat, io.open = self._real


def measure(root: Path, ranks: int, hosts: int, interval_s: float, seconds: float, requests: int,
            relay: bool) -> dict[str, float]:  # fmt: skip
    """One way, on a fresh run dir: the counted operations, per second per 1,000 ranks."""
    run = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    write_json_atomic(run / "run.json", {"run_id": run.name, "world_size": ranks, "schema": "stragglerwatch-run"})
    problems = Problems()
    surfaces = [Surface() for _ in range(ranks)]
    files = [ControlFile(surfaces[r], run, r, interval_s, problems, run_id=run.name, relay=relay,
                         node_dir=root / f"{run.name}-host{r * hosts // ranks}") for r in range(ranks)]  # fmt: skip
    for f in files:
        f.start()
    time.sleep(interval_s / 2)  # counted from between two looks: whole intervals
    with Counter(run / "control.json") as counted:
        t0 = time.monotonic()
        for i in range(requests):
            time.sleep(seconds / (requests + 1))
            counted.paused = True
            write_request(run, {"recording": "off" if i % 2 == 0 else "on"})
            counted.paused = False
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        elapsed = time.monotonic() - t0
    relays = sum(f.role == "relay" for f in files)
    for f in files:
        f.close()
    missed = sum(requests - s.applied for s in surfaces)
    per = 1000.0 / ranks / elapsed
    return {"stat": counted.stat * per, "open": counted.open * per, "ops": (counted.stat + counted.open) * per,
            "local": sum(f.local_looks for f in files) * per, "relays": relays,
            "missed": missed, "problems": problems.total}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=1)
    args = parser.parse_args()
    print(f"{args.ranks} ranks on {args.hosts} hosts, control_interval_s={args.interval:g}, {args.seconds:g} s, "
          f"{args.requests} request(s); per second per 1,000 ranks:")  # fmt: skip
    print(f"{'way':<11} {'stat':>8} {'open':>7} {'shared-FS ops':>14} {'node-local looks':>17} {'relays':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, relay in (("every rank", False), ("relay", True)):
            r = measure(Path(tmp), args.ranks, args.hosts, args.interval, args.seconds, args.requests, relay)
            print(f"{name:<11} {r['stat']:>8.1f} {r['open']:>7.1f} {r['ops']:>14.1f} {r['local']:>17.1f} "
                  f"{r['relays']:>7}")  # fmt: skip
            if r["missed"] or r["problems"]:
                print(f"  {r['missed']} request(s) not applied, {r['problems']} problem(s)")


if __name__ == "__main__":
    main()
