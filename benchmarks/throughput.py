"""Analysis throughput on a large simulated run (not a pytest test).

Writes (once) a simulated run of 1024 ranks x 10,000 steps (10.24 M step records,
one Parquet file per rank, two stragglers), then times in separate processes:
``stragglerwatch analyze RUN --format json`` and a plain pyarrow read of the same
files, reporting wall time, peak memory (max RSS) and their ratio.

    python benchmarks/throughput.py [--ranks 1024 --steps 10000] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_READ = """
import sys, glob, pyarrow as pa, pyarrow.parquet as pq
t = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(sys.argv[1] + '/rank-*.parquet'))])
print(t.num_rows)
"""


def measure(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in GiB and stdout of one child process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 2**20, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--run-dir", help="simulated run to use/create (default: a temporary directory)")
    args = p.parse_args()
    tmp = None
    if args.run_dir:
        run = Path(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory()
        run = Path(tmp.name) / "run"
    if not (run / "run.json").exists():
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "stragglerwatch.cli", "simulate", str(run), "--ranks", str(args.ranks),
             "--steps", str(args.steps), "--straggler", "17:0.15:2000:data", "--straggler", "900:0.1:6000"],
            check=True,
        )  # fmt: skip
        print(f"simulated {args.ranks} x {args.steps} in {time.perf_counter() - t0:.1f} s")
    records = args.ranks * args.steps
    wall, rss, out = measure([sys.executable, "-m", "stragglerwatch.cli", "analyze", str(run), "--format", "json"])
    report = json.loads(out)
    found = [(s["rank"], s["cause"], s["first_step"]) for s in report["stragglers"]]
    print(f"analyze --format json: {wall:.1f} s, peak RSS {rss:.2f} GiB, {records / wall / 1e6:.2f} M records/s")
    print(f"  stragglers found: {found}")
    pwall, prss, _ = measure([sys.executable, "-c", PLAIN_READ, str(run)])
    print(f"plain pyarrow read of the same files: {pwall:.1f} s, peak RSS {prss:.2f} GiB")
    print(f"ratio analyze / plain read: {wall / pwall:.1f}x time, {rss / prss:.1f}x memory")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
