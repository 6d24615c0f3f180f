"""Training loops written the way their authors' documentation teaches, as a new user writes them.

Run under torchrun (gloo, CPU), one loop per ``--shape``; each is instrumented only with
``watch = stragglerwatch.attach(model, run_dir)`` right after the DDP wrap (``--mark`` adds the
data marker where a shape has one). One injection per job: from step ``--from-step`` on, rank
``--slow-rank`` is ``--delay`` seconds a step slower, in the place a real straggler of that
kind would be slow. The shapes, and why people write loops so:

``nanogpt``
    nanoGPT's ``train.py``: no DataLoader; ``get_batch(split)`` slices a ``np.memmap`` of uint16
    tokens (re-opened each call, as nanoGPT does against a memory leak), and the next batch is
    fetched between the micro-step's forward and its backward (``logits, loss = model(X, Y);
    X, Y = get_batch('train'); loss.backward()``), so that host I/O overlaps the GPU's work.
    Gradient accumulation toggles ``model.require_backward_grad_sync`` instead of ``no_sync()``,
    then ``clip_grad_norm_``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``.
    Slow rank: its ``get_batch`` sleeps (slow storage). ``--mark``: ``get_batch =
    watch.data(get_batch)``, the marker the README gives for such loops.
``accum_toggle``
    A plain DataLoader loop (not wrapped) accumulating gradients by toggling
    ``require_backward_grad_sync`` (the DDP attribute many scripts set rather than entering
    ``no_sync()``). Slow rank: a layer of its model (``slow_layer``) is slow (compute).
``eval_ckpt``
    The usual "evaluate and checkpoint on the master process" block: every ``--eval-every``
    steps, step 0 included (before the first training step), rank 0 alone runs a few validation
    batches through ``model.module`` in ``model.eval()`` under ``torch.no_grad()`` and saves
    ``model.module.state_dict()``; the other ranks go on and wait for it in the next all-reduce.
    Slow rank (not rank 0): ``slow_layer`` (compute). ``--slow-rank -1``: a healthy job.
``amp_cpu``
    The mixed-precision recipe of PyTorch's AMP docs on CPU: ``torch.autocast("cpu",
    dtype=torch.bfloat16)`` around the forward and a ``torch.amp.GradScaler("cpu",
    enabled=False)`` (disabled, as scripts do when not training in fp16) with
    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``. Slow rank:
    ``slow_layer`` (compute).
``streaming``
    An ``IterableDataset`` streaming samples (each with a read latency of its own, ``time.sleep``
    in ``__iter__``, as from object storage or a socket) through a DataLoader with
    ``num_workers=0``. Slow rank: its stream's latency is higher (data).
``workers``
    A map-style Dataset whose ``__getitem__`` reads each sample (a sleep: network storage),
    loaded by a DataLoader with ``num_workers=2`` and a DistributedSampler. Slow rank: its reads are
    so slow that its two workers cannot keep up with the training (data). The classic symptom: the
    DataLoader hands out batches in order, each worker's in turn, and the two workers (busy all the
    time) finish theirs at about the same moment, so the slow rank waits long every other step and
    hardly at all in between (with N workers, every N-th step).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

import stragglerwatch

SHAPES = ("nanogpt", "accum_toggle", "eval_ckpt", "amp_cpu", "streaming", "workers")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--work-dir", default=None, help="data files and checkpoints (default: beside the run dir)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.02, help="seconds a step the slow rank loses")
    p.add_argument("--from-step", type=int, default=10)
    p.add_argument("--mark", action="store_true", help="nanogpt: get_batch = watch.data(get_batch)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--code-hz", type=float, default=0.0, help="attach(code_sample_hz=...) when non-zero")
    return p.parse_args(argv)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """attach()'s keyword arguments: the stack sampler's rate only when asked for."""
    return {"code_sample_hz": args.code_hz} if args.code_hz else {}


def slow_layer(delay: float) -> None:
    """The injected compute straggler: this rank's layer takes ``delay`` seconds longer."""
    time.sleep(delay)


class SlowLayer(nn.Module):
    """Identity, but ``delay`` seconds slow in each training forward once ``after`` of them have run."""

    def __init__(self, delay: float, after: int):
        super().__init__()
        self.delay, self.after, self.calls = delay, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            if self.delay and self.calls >= self.after:
                slow_layer(self.delay)
            self.calls += 1
        return x


class MLP(nn.Module):
    def __init__(self, slow: SlowLayer | None = None, features: int = 64, hidden: int = 256, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.slow = slow if slow is not None else SlowLayer(0.0, 0)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.slow(self.inp(x)))


def synthetic(n: int, seed: int, features: int = 64, classes: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def work_dir(args: argparse.Namespace) -> Path:
    return Path(args.work_dir) if args.work_dir else Path(args.run_dir).parent / f"{args.shape}-work"


# --- nanogpt ---------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 1, n_head: int = 2, n_embd: int = 64):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd),
            "wpe": nn.Embedding(block_size, n_embd),
            "h": nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            "ln_f": nn.LayerNorm(n_embd),
        })  # fmt: skip
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt(args: argparse.Namespace, rank: int) -> None:
    batch_size, block_size, vocab_size = 4, 32, 256
    gradient_accumulation_steps = 2
    max_iters, grad_clip, learning_rate = args.steps, 1.0, 6e-4
    master_process = rank == 0
    data_dir = work_dir(args)
    if master_process:  # what nanoGPT's data/*/prepare.py leaves behind
        data_dir.mkdir(parents=True, exist_ok=True)
        tokens = np.random.default_rng(0).integers(0, vocab_size, 50_000, dtype=np.uint16)
        tokens.tofile(data_dir / "train.bin")
    dist.barrier()
    iter_num = 0
    slow = rank == args.slow_rank

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        # We recreate np.memmap every batch to avoid a memory leak, as per nanoGPT
        data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        if slow and iter_num >= args.from_step:  # the injection: this rank's storage is slow
            time.sleep(args.delay / gradient_accumulation_steps)
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x, y

    model = GPT(vocab_size, block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    model = DDP(model)
    watch = stragglerwatch.attach(model, args.run_dir, **settings(args))
    if args.mark:
        get_batch = watch.data(get_batch)

    def get_lr(it: int) -> float:
        return learning_rate * 0.5 * (1.0 + math.cos(math.pi * it / max_iters))

    X, Y = get_batch("train")  # fetch the very first batch
    t0 = time.time()
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(gradient_accumulation_steps):
            # in DDP training we only need to sync gradients at the last micro step
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            # immediately async prefetch next batch while model is doing the forward pass on the GPU
            X, Y = get_batch("train")
            loss.backward()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % 10 == 0 and master_process:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1
        if iter_num >= max_iters:
            break
    watch.close()


# --- accum_toggle ----------------------------------------------------------------------------------


def injected(args: argparse.Namespace, rank: int, micro_batches: int = 1) -> SlowLayer:
    """The model's slow layer: ``slowdown`` a step on the slow rank from ``from_step`` on, none elsewhere."""
    delay = args.delay / micro_batches if rank == args.slow_rank else 0.0
    return SlowLayer(delay, args.from_step * micro_batches)


def sharded(args: argparse.Namespace, batch_size: int, micro_batches: int = 1) -> tuple[DistributedSampler, DataLoader]:
    """This rank's share of a synthetic training set of ``--steps`` steps: the sampler and the loader."""
    dataset = synthetic(args.steps * micro_batches * batch_size * dist.get_world_size(), seed=0)
    sampler = DistributedSampler(dataset)
    return sampler, DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def watched(module: nn.Module, args: argparse.Namespace) -> tuple[DDP, stragglerwatch.Watch]:
    """The module wrapped in DDP and attached right after, as the README says."""
    model = DDP(module)
    return model, stragglerwatch.attach(model, args.run_dir, **settings(args))


def accum_toggle(args: argparse.Namespace, rank: int) -> None:
    accumulation_steps, batch_size = 2, 32
    sampler, loader = sharded(args, batch_size, accumulation_steps)
    model, watch = watched(MLP(injected(args, rank, accumulation_steps)), args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    sampler.set_epoch(0)
    for i, (inputs, labels) in enumerate(loader):
        sync = (i + 1) % accumulation_steps == 0
        model.require_backward_grad_sync = sync  # all-reduce only on the last micro-batch
        loss = criterion(model(inputs), labels) / accumulation_steps
        loss.backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()
    watch.close()


# --- eval_ckpt -------------------------------------------------------------------------------------


def eval_ckpt(args: argparse.Namespace, rank: int) -> None:
    sampler, train_loader = sharded(args, batch_size=32)
    val_loader = DataLoader(synthetic(4 * 64, seed=1), batch_size=64)
    ckpt_dir = work_dir(args)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model, watch = watched(MLP(injected(args, rank)), args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    sampler.set_epoch(0)
    for step, (inputs, labels) in enumerate(train_loader):
        if step % args.eval_every == 0 and rank == 0:
            model.eval()
            with torch.no_grad():
                val_loss = sum(criterion(model.module(x), y).item() for x, y in val_loader) / len(val_loader)
            model.train()
            print(f"step {step}: val loss {val_loss:.4f}")
            torch.save(model.module.state_dict(), ckpt_dir / "ckpt.pt")
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
    watch.close()


# --- amp_cpu ---------------------------------------------------------------------------------------


def amp_cpu(args: argparse.Namespace, rank: int) -> None:
    sampler, loader = sharded(args, batch_size=32)
    model, watch = watched(MLP(injected(args, rank)), args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp16 only; bf16 needs no loss scaling
    sampler.set_epoch(0)
    for inputs, target in loader:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            output = model(inputs)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    watch.close()


# --- streaming -------------------------------------------------------------------------------------


class TokenStream(IterableDataset):
    """Samples streamed from remote storage, each after ``latency_s`` (``slow_latency_s`` once
    ``slow_after`` samples have come, on the slow rank); this rank's share of ``n`` samples."""

    def __init__(self, n: int, rank: int, world: int, latency_s: float, slow_latency_s: float, slow_after: int):
        super().__init__()
        self.n, self.rank, self.world = n, rank, world
        self.latency_s, self.slow_latency_s, self.slow_after = latency_s, slow_latency_s, slow_after

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.rank)
        for count, _ in enumerate(range(self.rank, self.n, self.world)):
            time.sleep(self.slow_latency_s if count >= self.slow_after else self.latency_s)
            yield torch.randn(64, generator=g), torch.randint(0, 8, (), generator=g)


def streaming(args: argparse.Namespace, rank: int) -> None:
    batch_size, latency_s = 16, 0.0002
    world = dist.get_world_size()
    slow_latency_s = latency_s + args.delay / batch_size if rank == args.slow_rank else latency_s
    stream = TokenStream(args.steps * batch_size * world, rank, world, latency_s, slow_latency_s,
                         args.from_step * batch_size)  # fmt: skip
    loader = DataLoader(stream, batch_size=batch_size, num_workers=0)
    model, watch = watched(MLP(), args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    watch.close()


# --- workers ---------------------------------------------------------------------------------------


class RemoteFiles(Dataset):
    """A map-style dataset whose ``__getitem__`` reads a sample from (network) storage in ``read_s``;
    ``slow_read_s`` once this worker has read ``slow_after`` of them."""

    def __init__(self, n: int, read_s: float, slow_read_s: float, slow_after: int):
        self.data = synthetic(n, seed=0)
        self.read_s, self.slow_read_s, self.slow_after = read_s, slow_read_s, slow_after
        self.reads = 0  # per worker process (each has its copy)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.slow_read_s if self.reads >= self.slow_after else self.read_s)
        self.reads += 1
        return self.data[i]


def workers(args: argparse.Namespace, rank: int) -> None:
    batch_size, num_workers, read_s = 16, 2, 0.0002
    # the slow rank's two workers together deliver a batch every `slowdown` + ~10 ms: the step waits for them
    slow_read_s = (args.delay + 0.01) * num_workers / batch_size if rank == args.slow_rank else read_s
    dataset = RemoteFiles(args.steps * batch_size * dist.get_world_size(), read_s, slow_read_s,
                          args.from_step * batch_size // num_workers)  # fmt: skip
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
    model, watch = watched(MLP(), args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    sampler.set_epoch(0)
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    watch.close()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1337 + rank)
    globals()[args.shape](args, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
