"""A DDP job (gloo, CPU) whose ranks draw batches of variable-length sequences, as a language model's
loader does without padding or packing: a different rank holds the heaviest batch each step.

Each step every rank draws ``--seqs`` sequence lengths (log-normal around ``--mean-len``; with
``--balanced`` every rank draws the same lengths, so the tokens per step are equal across ranks)
and runs a forward over the packed tokens: a small real model, plus ``--us-per-token`` microseconds
of device-like time per token (a sleep: on a GPU the host waits the same way), so that the step's
cost follows its tokens. ``--mask`` passes a padded ``{"input_ids", "attention_mask"}`` mapping
instead of the packed ids (the model computes only the unmasked tokens; with ``--pad-compute`` its
device-like time follows the padded shape instead, as a model run over the padding does). ``--slow-rank`` is slow per
token by ``--slowdown`` (a ratio: its device time per token is that many times longer) from ``--from-step`` on;
``--data-rank`` waits ``--data-ms`` more for each batch. Rank 0 writes to ``--truth`` the true cost of
the imbalance per step: the slowest rank's device-like time and extra data wait, against the
slowest had every rank been given the step's mean tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

VOCAB = 32  # small: the real compute per token is small beside the injected time per token


class TokenNet(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, vocab))
        self.us_per_token = 0.0
        self.pad_compute = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
        time.sleep(self.us_per_token * (input_ids.numel() if self.pad_compute else ids.numel()) * 1e-6)
        return self.body(self.embed(ids))


def lengths(args: argparse.Namespace, rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([args.seed, step, 0 if args.balanced else rank])
    return np.maximum(8, rng.lognormal(np.log(args.mean_len), args.spread, args.seqs)).astype(int)


def batch(args: argparse.Namespace, lens: np.ndarray, vocab: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    total = int(lens.sum())
    if not args.mask:
        return {"input_ids": torch.randint(0, vocab, (total,))}, torch.randint(0, vocab, (total,))
    width = int(lens.max())
    mask = (torch.arange(width)[None, :] < torch.as_tensor(lens)[:, None]).long()
    return {"input_ids": torch.randint(0, vocab, (len(lens), width)), "attention_mask": mask}, torch.randint(
        0, vocab, (total,)
    )


def true_cost(args: argparse.Namespace, world: int, step: int) -> float:
    """The step's cost of unequal tokens: the slowest rank's injected time against the slowest with
    the step's mean tokens on every rank (the same slowness and extra data wait kept)."""
    later = step >= args.from_step
    lens = [lengths(args, r, step) for r in range(world)]
    tokens = np.array([len(n) * n.max() if args.pad_compute else n.sum() for n in lens], dtype=float)
    per = np.array([args.slowdown if later and r == args.slow_rank else 1.0 for r in range(world)])
    per *= args.us_per_token * 1e-6
    data = np.array([args.data_ms * 1e-3 if later and r == args.data_rank else 0.0 for r in range(world)])
    return float((per * tokens + data).max() - (per * tokens.mean() + data).max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--mean-len", type=float, default=256)
    p.add_argument("--spread", type=float, default=0.6, help="sigma of the log-normal lengths")
    p.add_argument("--us-per-token", type=float, default=20.0)
    p.add_argument("--balanced", action="store_true")
    p.add_argument("--mask", action="store_true")
    p.add_argument("--pad-compute", action="store_true", help="with --mask: the time follows the padded shape")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slowdown", type=float, default=1.5)
    p.add_argument("--data-rank", type=int, default=-1)
    p.add_argument("--data-ms", type=float, default=6.0)
    p.add_argument("--from-step", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truth", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = TokenNet()
    net.pad_compute = args.pad_compute
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, args.run_dir, optimizer=optimizer, code_sample_hz=0)
    loss_fn = nn.CrossEntropyLoss()
    truth = []
    for step in range(args.steps):
        lens = lengths(args, rank, step)
        with watch.data():
            if rank == args.data_rank and step >= args.from_step:
                time.sleep(args.data_ms * 1e-3)
            inputs, target = batch(args, lens, VOCAB)
        slow = rank == args.slow_rank and step >= args.from_step
        net.us_per_token = args.us_per_token * (args.slowdown if slow else 1.0)
        loss_fn(model(**inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and args.truth:
            truth.append(true_cost(args, world, step))
    watch.close()
    if rank == 0 and args.truth:
        Path(args.truth).write_text(json.dumps({"per_step_s": truth}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
