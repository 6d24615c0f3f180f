"""Training jobs written the way each framework's documentation teaches, instrumented only as the
README says. Run on 2 CPU ranks (gloo) with the variables torchrun sets (``conftest.launch``).

``--framework``: ``lightning`` (Trainer, ``strategy="ddp"``, validation, ``self.log(sync_dist=True)``),
``hf`` (transformers Trainer with evaluation and logging), ``accelerate`` (``accelerator.prepare``,
``accelerator.accumulate``), ``fsdp2`` (``fully_shard`` per block and on the root), ``fsdp1``
(``FullyShardedDataParallel`` units the same way, ``no_sync()`` to accumulate), ``compile``
(``torch.compile(DDP(model))``), ``tp`` (FSDP2 on the ``dp`` dimension of a dp x tp mesh, the MLP's first
layer column-wise and its second row-wise; ``--compile-tp`` compiles it), ``pipeline`` (a GPipe or 1F1B schedule
of two stages on the ``pp`` dimension of a dp x pp mesh, a DDP-style gradient all-reduce on ``dp`` or FSDP2 per
stage; the role is left to attach to find unless ``--role`` is given).
``--accumulate N`` accumulates gradients over N micro-batches.
Injection from step ``--from-step`` on ``--slow-rank``: ``compute`` sleeps in forward and backward,
``data`` sleeps in the batch collation (in the fetch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stragglerwatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_ddp import _Slow as Slow  # noqa: E402 - sleeps in forward and backward

FEATURES, HIDDEN = 16, 64


class Injection:
    """A delay on one rank from one optimizer step on, counted in micro-batches."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.on = rank == args.slow_rank
        self.cause, self.delay = args.cause, args.delay
        self.from_batch = args.from_step * args.accumulate
        self.batches = {"compute": 0, "data": 0}

    def __call__(self, cause: str) -> float:
        if cause != self.cause or not self.on:
            return 0.0
        self.batches[cause] += 1
        return self.delay if self.batches[cause] > self.from_batch else 0.0


class Injected(nn.Module):
    """A model with the compute injection: ``slow(h)`` sleeps in forward and backward when due."""

    def __init__(self, injection: Injection):
        super().__init__()
        self.injection = injection

    @torch.compiler.disable  # the injection is not the model: never compiled
    def slow(self, h: torch.Tensor) -> torch.Tensor:
        delay = self.injection("compute")
        return Slow.apply(h, delay) if delay else h


class Net(Injected):
    """A small MLP with BatchNorm (buffers DDP broadcasts at every forward)."""

    def __init__(self, injection: Injection):
        super().__init__(injection)
        self.inp = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()) for _ in range(2))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.training and torch.is_grad_enabled():
            h = self.slow(h)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class Points(Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Collate:
    """Stack the batch; the data injection sleeps here, inside the fetch."""

    def __init__(self, injection: Injection):
        self.injection = injection

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        time.sleep(self.injection("data"))
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def batches_needed(args: argparse.Namespace) -> int:
    return args.steps * args.accumulate * args.batch


def run_lightning(args: argparse.Namespace, injection: Injection) -> None:
    import lightning as L

    from stragglerwatch.integrations.lightning import StragglerWatch

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(injection)
            self.automatic_optimization = not args.manual

        def training_step(self, batch: dict, idx: int) -> torch.Tensor:
            loss = nn.functional.mse_loss(self.net(batch["x"]), batch["labels"])
            self.log("train_loss", loss, sync_dist=True)
            if args.manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch: dict, idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.net(batch["x"]), batch["labels"]), sync_dist=True)

        def configure_model(self) -> None:
            if args.mesh == "lightning-fsdp2":  # Lightning's ModelParallelStrategy: FSDP2 applied here
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.net.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    collate = Collate(injection)
    train = DataLoader(Points(batches_needed(args) * 2), batch_size=args.batch, collate_fn=collate)
    val = DataLoader(Points(64, seed=1), batch_size=args.batch, collate_fn=collate)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.nproc, max_steps=args.steps,
        strategy=L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=args.nproc, tensor_parallel_size=1)
        if args.mesh == "lightning-fsdp2" else "ddp",
        accumulate_grad_batches=args.accumulate, val_check_interval=args.eval_every * args.accumulate,
        limit_val_batches=2, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=5,
        logger=L.pytorch.loggers.CSVLogger(args.trainer_logs, name="lt") if args.trainer_logs else False,
        callbacks=[StragglerWatch(args.run_dir, log_to_trainer=bool(args.trainer_logs), watchdog_timeout_s=0)],
    )  # fmt: skip
    trainer.fit(Lit(), train, val)


def run_hf(args: argparse.Namespace, injection: Injection) -> None:
    from transformers import Trainer, TrainingArguments

    from stragglerwatch.integrations.transformers import StragglerWatchCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(injection)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            out = self.net(x)
            loss = nn.functional.mse_loss(out, labels) if labels is not None else None
            return {"loss": loss, "logits": out}

    callback = StragglerWatchCallback(args.run_dir, log_to_trainer=bool(args.trainer_logs), watchdog_timeout_s=0)
    targs = TrainingArguments(
        output_dir=str(Path(args.run_dir).parent / "hf-out"), per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, max_steps=args.steps, gradient_accumulation_steps=args.accumulate,
        learning_rate=0.01, logging_steps=10, eval_strategy="steps", eval_steps=args.eval_every, save_strategy="no",
        report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=Model(), args=targs, train_dataset=Points(batches_needed(args) * 2), eval_dataset=Points(16, seed=1),
        data_collator=Collate(injection),
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    if args.trainer_logs and trainer.is_world_process_zero():
        assert callback.verdict is not None and callback.verdict.join(60), "the verdict, off the critical path"
        Path(args.trainer_logs).mkdir(parents=True, exist_ok=True)
        (Path(args.trainer_logs) / "log_history.json").write_text(json.dumps(trainer.state.log_history))


def run_accelerate(args: argparse.Namespace, injection: Injection) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    model = Net(injection)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(batches_needed(args) * args.nproc), batch_size=args.batch, collate_fn=Collate(injection))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # shards the batches over the ranks
    stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=0)
    model.train()
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(batch["x"]), batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if i % 10 == 0:
            accelerator.gather_for_metrics(loss.detach()).mean()  # what logging does: a collective


def run_fsdp2(args: argparse.Namespace, injection: Injection) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if args.mesh == "hsdp":  # replicate across pairs, shard within them
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    elif args.mesh == "dp,tp":  # FSDP on the dp dimension of a 2-D mesh (the tp dimension left to the model)
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Net(injection)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(batches_needed(args)), batch_size=args.batch, collate_fn=Collate(injection))
    for i, batch in enumerate(loader):
        model.set_requires_gradient_sync((i + 1) % args.accumulate == 0)
        nn.functional.mse_loss(model(batch["x"]), batch["labels"]).backward()
        if (i + 1) % args.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()


def run_fsdp1(args: argparse.Namespace, injection: Injection) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    net = Net(injection)
    # an FSDP unit per Sequential (the input layer, each block) and one at the root; no_sync() to accumulate
    model = FSDP(net, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(batches_needed(args)), batch_size=args.batch, collate_fn=Collate(injection))
    for i, batch in enumerate(loader):
        syncing = (i + 1) % args.accumulate == 0
        with contextlib.nullcontext() if syncing else model.no_sync():
            nn.functional.mse_loss(model(batch["x"]), batch["labels"]).backward()
        if syncing:
            optimizer.step()
            optimizer.zero_grad()


def run_compile(args: argparse.Namespace, injection: Injection) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.compile(DDP(Net(injection)), backend=args.backend)
    stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=0)  # after torch.compile, as the README says
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(batches_needed(args)), batch_size=args.batch, collate_fn=Collate(injection))
    for batch in loader:
        nn.functional.mse_loss(model(batch["x"]), batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad()


class TPNet(Injected):
    """An MLP whose ``up`` (column-wise) and ``down`` (row-wise) layers are tensor parallel: the compute
    injection sleeps between them, inside the TP block, so the TP partner waits in the row-wise all-reduce."""

    def __init__(self, injection: Injection):
        super().__init__(injection)
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(torch.relu(self.inp(x))))
        if self.training and torch.is_grad_enabled():
            h = self.slow(h)
        return self.out(torch.relu(self.down(h)))


def run_tp(args: argparse.Namespace, injection: Injection) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model: nn.Module = TPNet(injection)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    if args.compile_tp:
        model = torch.compile(model, backend=args.backend)
    stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # every rank of a TP group must see the same batch: the loader is seeded by the dp coordinate
    dp = mesh["dp"].get_local_rank()
    loader = DataLoader(Points(batches_needed(args), seed=dp), batch_size=args.batch, collate_fn=Collate(injection))
    for batch in loader:
        nn.functional.mse_loss(model(batch["x"]), batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad()


class Stage(Injected):
    """One pipeline stage: two layers, the compute injection between them; a heavier stage (by design, on
    every rank of it) does ``extra_s`` more work in each micro-batch's forward."""

    def __init__(self, injection: Injection, first: bool, last: bool, extra_s: float = 0.0):
        super().__init__(injection)
        self.a = nn.Linear(FEATURES if first else HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 1 if last else HIDDEN)
        self.extra_s = extra_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_s:
            time.sleep(self.extra_s)
        return self.b(self.slow(torch.relu(self.a(x))))


def run_pipeline(args: argparse.Namespace, injection: Injection) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "pp"))
    stage_index, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    microbatches = args.microbatches
    if args.cause == "compute":  # the compute injection counts stage forwards: one per micro-batch
        injection.from_batch *= microbatches
    torch.manual_seed(stage_index)
    extra = args.heavy_ms * 1e-3 if stage_index == args.heavy_stage else 0.0
    module = Stage(injection, first=stage_index == 0, last=stage_index == 1, extra_s=extra)
    if args.stage_fsdp:  # FSDP2 per stage on the dp dimension (the torchtitan recipe)
        fully_shard(module, mesh=mesh["dp"])
    # the role (this rank's stage) comes from the pipeline stage, built before attach or after; --role overrides it
    role = {"role": args.role.format(stage=stage_index)} if args.role else {}
    if args.attach_first:
        watch = stragglerwatch.attach(module, args.run_dir, watchdog_timeout_s=0, **role)
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule = schedules[args.schedule](stage, microbatches, loss_fn=nn.functional.mse_loss)
    if not args.attach_first:
        watch = stragglerwatch.attach(module, args.run_dir, watchdog_timeout_s=0, **role)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    dp_group = mesh["dp"].get_group()
    loader = DataLoader(Points(batches_needed(args), seed=dp), batch_size=args.batch, collate_fn=Collate(injection))
    for batch in watch.wrap(loader):
        if stage_index == 0:
            schedule.step(batch["x"])
        else:
            schedule.step(target=batch["labels"])
        if not args.stage_fsdp:
            for p in module.parameters():  # data parallel across the replicas of this stage
                dist.all_reduce(p.grad, group=dp_group)
        optimizer.step()
        optimizer.zero_grad()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--framework", required=True, choices=["lightning", "hf", "accelerate", "fsdp2", "fsdp1", "compile",
                                                                "tp", "pipeline"])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--cause", choices=["compute", "data"], default="compute")
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--from-step", type=int, default=8)
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    p.add_argument("--compile-tp", action="store_true", help="tp: torch.compile the tensor-parallel model")
    p.add_argument(
        "--mesh",
        choices=["1d", "hsdp", "dp,tp", "lightning-fsdp2"],
        default="1d",
        help="FSDP2's device mesh; lightning-fsdp2: Lightning's ModelParallelStrategy",
    )
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe", help="pipeline: the schedule")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline: micro-batches a step")
    p.add_argument("--stage-fsdp", action="store_true", help="pipeline: FSDP2 per stage on dp (else all-reduce)")
    p.add_argument("--attach-first", action="store_true", help="pipeline: attach before building the stage")
    p.add_argument("--heavy-stage", type=int, default=-1, help="pipeline: the stage heavier by design")
    p.add_argument("--heavy-ms", type=float, default=3.0, help="pipeline: its extra ms a micro-batch")
    p.add_argument("--role", help="pipeline: attach's role=, '{stage}' the stage index (default: from the stage)")
    p.add_argument("--trainer-logs", help="Lightning/HF: log to the trainer's loggers, written under this dir")
    p.add_argument("--manual", action="store_true", help="Lightning: manual optimization")
    p.add_argument("--pin-peers", type=int, default=0, metavar="K",
                   help="pin each rank to the CPUs of its peer group (rank mod K): peers then share their CPUs, "
                   "so that how the scheduler spreads more ranks than cores over them slows no rank alone")  # fmt: skip
    args = p.parse_args(argv)
    args.nproc = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if args.pin_peers and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        group = int(os.environ.get("RANK", "0")) % args.pin_peers
        mine = [c for i, c in enumerate(cpus) if i % args.pin_peers == group] or cpus
        os.sched_setaffinity(0, mine)
    if args.framework in ("fsdp2", "fsdp1", "compile", "tp", "pipeline"):  # the others init the process group
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    injection = Injection(args, rank)
    runner: Any = globals()[f"run_{args.framework}"]
    runner(args, injection)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
