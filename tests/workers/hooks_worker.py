"""Run under torchrun (gloo): checks of attach()/close() on real DDP; writes results as JSON.

Usage: torchrun --nproc_per_node 2 hooks_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import optimizer as optim_mod

import stragglerwatch


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def hooks(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    return [
        int("forward" in model.__dict__),
        len(model._forward_pre_hooks),
        len(model._forward_hooks),
        len(opt._optimizer_step_pre_hooks),
        len(opt._optimizer_step_post_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    ]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}

    # 1. close() removes every hook; the comm hook becomes a pass-through
    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res["hooks_before"] = hooks(model, opt)
    watch = stragglerwatch.attach(model, out / "close", optimizer=opt)
    res["hooks_attached"] = hooks(model, opt)
    steps(model, opt, 3)
    watch.close()
    res["hooks_after_close"] = hooks(model, opt)
    steps(model, opt, 3)
    res["rows_after_close"] = int((stragglerwatch.load_run(out / "close")["rank"] == rank).sum())
    res["run_id_close"] = watch.info.run_id

    # 2. default run dir: all ranks agree on one run id through the store
    os.chdir(out)
    model2 = DDP(nn.Linear(8, 2))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with stragglerwatch.attach(model2) as w2:  # run dir from STRAGGLERWATCH_RUN_DIR unset -> store id
        steps(model2, opt2, 2)
    res["agreed_run_dir"] = str(w2.run_dir)

    # 3. an existing comm hook is left alone by default, refused clearly for bucket timings
    model3 = DDP(nn.Linear(8, 2))
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1)
    model3.register_comm_hook(dist.group.WORLD, allreduce_hook)
    with stragglerwatch.attach(model3, out / "existing", optimizer=opt3):
        steps(model3, opt3, 2)
    df3 = stragglerwatch.load_run(out / "existing")
    res["existing_hook_rows"] = int((df3["rank"] == rank).sum())
    try:
        stragglerwatch.attach(model3, out / "refused", bucket_timings=True)
        res["conflict"] = "accepted"
    except RuntimeError as exc:
        res["conflict"] = str(exc)

    # 4. ... or composed when passed to attach()
    calls = []

    def my_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP inspects the signature
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model4 = DDP(nn.Linear(8, 2))
    opt4 = torch.optim.SGD(model4.parameters(), lr=0.1)
    with stragglerwatch.attach(model4, out / "composed", optimizer=opt4, comm_hook=(dist.group.WORLD, my_hook)):
        steps(model4, opt4, 3)
    res["user_hook_calls"] = len(calls)
    df = stragglerwatch.load_run(out / "composed")
    res["composed_buckets"] = df.loc[df["rank"] == rank, "bucket_index"].map(len).tolist()

    (out / f"result-{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
