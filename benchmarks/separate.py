"""Separate-process A/B for the overhead benchmarks (not a benchmark itself).

A run is a process of the benchmark's own script that prints one ``RESULT {json}`` line; runs of
the variants take turns, and which goes first alternates, so that a drift of the shared machine
falls on every variant alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any


def in_turns(rounds: int, variants: Sequence[str]) -> Iterator[tuple[int, str]]:
    """``(round, variant)`` for every variant in every round, the order reversed every other round."""
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            yield r, variant


def result(cmd: list[str], timeout_s: float = 900) -> dict[str, Any]:
    """The RESULT line of a run (one thread per process, ``OMP_NUM_THREADS=1``); a failed run ends
    the benchmark with one line saying so and its stderr's last lines."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[W"))[-3000:]
        sys.exit(f"a run failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return json.loads(lines[-1][7:])


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def step_summary(times: Sequence[float], wall: float | None = None) -> dict[str, float]:
    """Mean, median and p99 of per-step times (and the loop's wall time, if given)."""
    out = {"mean_s": statistics.fmean(times), "median_s": statistics.median(times), "p99_s": p99(times),
           "steps": len(times)}  # fmt: skip
    if wall is not None:
        out["wall_s"] = wall
    return out
