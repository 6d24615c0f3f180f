"""Per-step noise of real healthy runs, for ``simulate``'s bootstrap noise model (not a pytest test).

For each run dir, each rank's log busy time over the median of all ranks at that step: the
per-step residuals a healthy job shows (its jitter, tails and short-range correlation). Writes
one CSV column per (run, rank), cut to the shortest run. Record a run without stragglers first:

    torchrun --standalone --nproc_per_node 4 examples/train_ddp.py --steps 600 --run-dir /tmp/h4
    python benchmarks/record_noise.py /tmp/h4 --out benchmarks/data/healthy-residuals.csv

``SimConfig(bootstrap="benchmarks/data/healthy-residuals.csv")`` then resamples them in blocks.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from stragglerwatch.analysis.detect import to_matrix
from stragglerwatch.record.steplog import RunDirError, load_run


def residuals(run_dir: str) -> pd.DataFrame:
    mat = to_matrix(load_run(run_dir))
    busy = mat.values["busy_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(busy / np.nanmedian(busy, axis=1, keepdims=True))
    return pd.DataFrame(r, columns=[f"{run_dir.rstrip('/').split('/')[-1]}:{int(k)}" for k in mat.ranks])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", help="run dirs of healthy multi-rank runs")
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--skip", type=int, default=10, help="first steps to drop (warm-up, default 10)")
    args = p.parse_args()
    try:
        frames = [residuals(d).iloc[args.skip :].reset_index(drop=True) for d in args.run_dirs]
    except RunDirError as exc:
        sys.exit(f"record_noise: {exc}")
    n = min(len(f) for f in frames)
    out = pd.concat([f.iloc[:n] for f in frames], axis=1)
    out.round(5).to_csv(args.out, index=False)
    r = out.to_numpy()
    print(f"{args.out}: {r.shape[1]} series x {n} steps; sd {np.nanstd(r):.3f}, "
          f"robust sd {1.4826 * np.nanmedian(np.abs(r - np.nanmedian(r))):.3f}, "
          f"p99 |r| {np.nanpercentile(np.abs(r), 99):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
