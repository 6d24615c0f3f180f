"""The demo's training job, run from a checkout: a small DDP job on CPU (gloo) or GPU (NCCL), watched
by stragglerwatch, with an optional injected straggler.

    torchrun --nproc_per_node 4 examples/train_ddp.py --steps 60 \
        --slow-rank 2 --delay 0.02 --cause compute --from-step 10

The job ships in the package (``stragglerwatch/cli/demo_job.py``; installed, ``torchrun --nproc_per_node 4
-m stragglerwatch.cli.demo_job ...``): this script runs it, and ``--help`` lists its injections.
"""

from __future__ import annotations

from stragglerwatch.cli.demo_job import Injection, Net, SlowLoader, _Slow, main, parse_args

__all__ = ["Injection", "Net", "SlowLoader", "_Slow", "main", "parse_args"]

if __name__ == "__main__":
    main()
