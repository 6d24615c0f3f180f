"""Cost of the code sampler on the training thread (not a pytest test).

One process, one model, attached throughout; only the code sampler's rate changes between blocks:
``code_sample_hz=0`` (off) against each rate asked for, interleaved in blocks whose order rotates
(a shared machine is noisy), so the rest of stragglerwatch is in every block alike. Two models:
``python`` (many small layers: the training thread runs Python most of the time, so every sample
must wait for the interpreter lock and takes it from the training thread) and ``native`` (a few
large matrix products: the thread is mostly in native code that releases the lock). Prints per
model and rate the median step time, the ratio of medians to the unsampled blocks, the median of
per-round ratios, and the sampler's own cost per sample (``CodeSampler.cost_s / samples``).

    python benchmarks/code_sampler_cost.py                     # rates 20 and 100, 8 rounds
    python benchmarks/code_sampler_cost.py --rates 20 50 200 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import stragglerwatch


def model_of(kind: str) -> nn.Module:
    if kind == "python":
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(60)])
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))


def block(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - t0)
    return out


def run(kind: str, rates: list[float], rounds: int, steps: int) -> None:
    torch.manual_seed(0)
    model = model_of(kind)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32 if kind == "python" else 1024)
    block(model, opt, x, steps)  # warm-up
    times: dict[float, list[float]] = {r: [] for r in [0.0, *rates]}
    per_round: dict[float, list[float]] = {r: [] for r in rates}
    cost: dict[float, list[float]] = {r: [] for r in rates}
    order = [0.0, *rates]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            medians = {}
            for rate in order[k % len(order):] + order[: k % len(order)]:
                watch = stragglerwatch.attach(model, f"{tmp}/{kind}-{k}-{rate}", code_sample_hz=rate,
                                              context_interval_s=0, watchdog_timeout_s=0)  # fmt: skip
                got = block(model, opt, x, steps)
                sampler = watch._code
                if sampler is not None and sampler.samples:
                    cost[rate].append(sampler.cost_s / sampler.samples)
                watch.close()
                times[rate] += got
                medians[rate] = statistics.median(got)
            for rate in rates:
                per_round[rate].append(medians[rate] / medians[0.0])
    base = statistics.median(times[0.0])
    print(f"{kind}: unsampled median step {base * 1e3:.3f} ms ({len(times[0.0])} steps)")
    for rate in rates:
        med = statistics.median(times[rate])
        each = statistics.median(cost[rate]) * 1e6 if cost[rate] else float("nan")
        print(f"  {rate:g} Hz: median step {med * 1e3:.3f} ms, ratio {med / base:.3f}, "
              f"median of per-round ratios {statistics.median(per_round[rate]):.3f}, {each:.1f} us per sample")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 100.0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=150, help="steps per block")
    p.add_argument("--models", nargs="+", default=["python", "native"], choices=("python", "native"))
    args = p.parse_args()
    torch.set_num_threads(1)
    for kind in args.models:
        run(kind, args.rates, args.rounds, args.steps)


if __name__ == "__main__":
    main()
