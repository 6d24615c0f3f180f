"""Time from a hang to the restarted job's first step, with ``on_hang="abort"`` and without it.

A 2-rank gloo job under ``torchrun --standalone --nproc_per_node 2 --max-restarts 1`` (the worker of
``tests/workers/policies.py``, mode ``hang``): at step 8 of the first attempt rank 1 stops making
progress in a Python sleep while rank 0 waits for it in the gradient all-reduce; the application's
SIGTERM handler saves a checkpoint. Each run measures from the moment rank 1 stopped to the end of the
restarted attempt's first step (both ranks). Variants, in turns (the order alternating):

- ``abort, defaults``: ``on_hang="abort"`` with every other setting at its default (the adaptive
  watchdog threshold: 10 s here; ``hang_abort_s``: twice that);
- ``abort, 2 s / 4 s``: ``watchdog_timeout_s=2``, ``hang_abort_s=4`` (what the tests use);
- ``no policy``: the job waits for the collective timeout, set to ``--timeout`` seconds (60 by default;
  PyTorch's defaults are 10 minutes for NCCL and 30 for gloo).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set for every variant (without it a restarted gloo group
fails to form about half the time: the Policies page).

    python benchmarks/restart_time.py [--rounds 3] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from separate import in_turns

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "policies.py"
VARIANTS = {
    "abort, defaults": ({"STRAGGLERWATCH_ON_HANG": "abort"}, ["--watchdog", "-1"]),
    "abort, 2 s / 4 s": ({"STRAGGLERWATCH_ON_HANG": "abort", "STRAGGLERWATCH_HANG_ABORT_S": "4"}, ["--watchdog", "2"]),
    "no policy": ({}, ["--watchdog", "2"]),
}


def run(variant: str, timeout_s: float) -> tuple[float, float | None]:
    env, args = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", str(WORKER), "hang", str(out), "--handler", "after",
               "--pg-timeout", str(timeout_s), *args]  # fmt: skip
        full = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 300, env=full, cwd=ROOT)
        firsts = [out / f"first-1-{r}" for r in (0, 1)]
        if proc.returncode or not all(f.exists() for f in firsts):
            sys.exit(f"{variant}: the job did not restart (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        hang = float((out / "hang-1").read_text())
        actions = [json.loads(line)["detected_at"] for f in (out / "run").glob("events-*.jsonl") for line in f.open()
                   if '"action"' in line]  # fmt: skip
        return max(float(f.read_text()) for f in firsts) - hang, (min(actions) - hang if actions else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="the collective timeout of the no-policy variant (s)")
    args = p.parse_args()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    acted: dict[str, list[float]] = {v: [] for v in VARIANTS}
    t0 = time.perf_counter()
    for r, variant in in_turns(args.rounds, list(VARIANTS)):
        restarted, action = run(variant, args.timeout)
        times[variant].append(restarted)
        if action is not None:
            acted[variant].append(action)
        print(f"round {r + 1}: {variant}: {restarted:.1f} s" + (f" (first action {action:.1f} s)" if action else ""),
              flush=True)  # fmt: skip
    print(f"\nhang -> restarted job's first step (2 gloo ranks, torchrun --max-restarts 1, collective timeout "
          f"{args.timeout:g} s; {args.rounds} runs each, {time.perf_counter() - t0:.0f} s in all):")
    for variant, values in times.items():
        print(f"  {variant:<18} median {statistics.median(values):6.1f} s  (runs: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    print("hang -> the first rank's action (the policy's own delay, without the restart):")
    for variant, values in acted.items():
        if values:
            print(f"  {variant:<18} median {statistics.median(values):6.1f} s  (runs: "
                  f"{', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
