#!/usr/bin/env bash
# Set up, then run the demo: a 4-rank CPU DDP job with rank 2 made 20 ms a step slower (compute)
# from step 50, under the live dashboard (the URL is printed); the analysis is printed when the job
# ends, and the dashboard stays up until Ctrl-C. Extra arguments go to `stragglerwatch demo`
# (see --help), e.g. --hang, --prometheus, --cause data, --exit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/stragglerwatch demo "$@"
