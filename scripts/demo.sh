#!/usr/bin/env bash
# Set up, run a 4-rank CPU DDP job with rank 2 made 20 ms a step slower from step 10,
# then print the analysis of its event log (verdict and per-rank table).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir="stragglerwatch-runs/demo-$(date +%Y%m%d-%H%M%S)"
echo "demo: 4 ranks, 80 steps, rank 2 slowed by 20 ms/step (compute) from step 10 -> $run_dir"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 examples/train_ddp.py \
  --steps 80 --slow-rank 2 --slowdown 0.02 --cause compute --from-step 10 --run-dir "$run_dir" "$@"
.venv/bin/stragglerwatch analyze "$run_dir"
echo "demo: HTML report: .venv/bin/stragglerwatch analyze $run_dir --format html --out report.html"
