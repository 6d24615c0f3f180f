"""The jitter tax as the job grows: what the slowest of more ranks would cost, from this run's noise. Pure.

Every step waits for the slowest rank, so even with nobody broken a job loses, at each step, the slowest
rank's excess over the typical one. The slowest of 512 ranks is further out than the slowest of 8: the
tax grows with the number of ranks, and how fast depends on the tails of the per-rank noise and on how
much a host's ranks vary together.

Method: per step, each healthy rank's deviation from the step's median busy time (relative, the rank's
lasting offset taken out: the tax of noise, not of a slower rank); per step and host, the largest of its
ranks' (a host's ranks drawn together keep their correlation). A job of ``M`` hosts draws ``M`` of these
at random (from any step): the expected largest of ``M`` independent draws from the pooled values is exact
from their sorted order (``E[max] = sum x_(i) ((i/n)^M - ((i-1)/n)^M)``). The share of the step is that
times the median busy time over the median step time. The uncertainty comes from resampling the run's
steps (blocks of steps, so that slow stretches stay together). A deviation counts up to one step's length, as
the job's lost time does. Where a projection draws more hosts than
the run has values, the run's largest deviation bounds it and the projection says so (``beyond_data``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from stragglerwatch.analysis.rounds import workers
from stragglerwatch.analysis.stages import nanmedian

#: The job sizes projected, as multiples of today's ranks.
SCALES = (1, 2, 8, 64)
#: Resamples of the run's steps for the uncertainty, and the steps per resampled block.
RESAMPLES, BLOCK = 40, 25


@dataclass
class Projection:
    ranks: int
    share: float  # expected share of each step lost to jitter alone
    low: float  # 5th and 95th percentiles over the resamples
    high: float
    beyond_data: bool = False  # draws more hosts than the run holds values: a lower bound


@dataclass
class JitterTax:
    ranks: int
    hosts: int  # the units drawn together (hosts, or ranks where hosts are not known)
    steps: int
    projections: list[Projection] = field(default_factory=list)
    method: str = ""
    note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


#: Order statistics whose weight in an expected maximum is below this are left out (their share of it is less).
NEGLIGIBLE = 1e-12


def expected_max(sorted_values: np.ndarray, draws: float) -> float:
    """The expected largest of ``draws`` independent draws from the (sorted) values."""
    return expected_maxes(sorted_values, np.ones(len(sorted_values)), [draws])[0]


def expected_maxes(sorted_values: np.ndarray, counts: np.ndarray, draws: list[float]) -> list[float]:
    """The expected largest of each of ``draws`` independent draws from the (sorted) values, each value
    ``counts`` times (a resample's multiset of a sorted pool, without sorting it again)."""
    counts = np.asarray(counts)
    return top_maxes(sorted_values, lambda k: counts[len(counts) - k :], float(counts.sum()), draws)


def top_maxes(sorted_values: np.ndarray, top_counts: Callable[[int], np.ndarray], total: float,
              draws: list[float]) -> list[float]:  # fmt: skip
    """:func:`expected_maxes` with the counts of the top ``k`` values given by ``top_counts(k)`` (of ``total``
    in all): a value's weight is ``F^M - (F - p)^M`` at its cumulative share ``F`` and own share ``p``, and only
    the values whose weight can exceed :data:`NEGLIGIBLE` count (the top ones, fewer the more draws), so
    only the top of the pool is looked at, from the largest down, until its lowest share lies below that."""
    n = len(sorted_values)
    if total <= 0 or not n:
        return [float("nan")] * len(draws)
    fewest = min((m for m in draws if m > 0), default=0.0)
    bar = NEGLIGIBLE ** (1.0 / fewest) if fewest > 0 else 0.0
    k = min(n, int(n * (1.0 - bar) * 1.25) + 4096)  # where the shares would lie with equal counts
    while True:
        c = top_counts(k).astype(np.float64)
        upper = (total - c.sum() + np.cumsum(c)) / total  # the top k's cumulative shares
        if k == n or upper[0] < bar:  # every value below the top k weighs nothing
            break
        k = min(n, 4 * k)
    lower = np.maximum(upper - c / total, 0.0)
    x = sorted_values[n - k :]
    first = int(np.searchsorted(upper, bar))
    with np.errstate(divide="ignore"):
        log_upper = np.log(upper[first:])  # F^M as exp(M log F): one logarithm for every M
    out = []
    for m in draws:
        start = max(first, int(np.searchsorted(upper, NEGLIGIBLE ** (1.0 / m)))) if m > 0 else first
        cum = np.exp(m * log_upper[start - first :])  # F^M; a value's (F - p)^M is the one below's F^M
        w = np.diff(cum, prepend=lower[start] ** m if start < k else 0.0)
        out.append(float(np.dot(w, x[start:])))
    return out


def host_deviations(relative: np.ndarray, hosts: np.ndarray, names: np.ndarray | None = None) -> np.ndarray:
    """Steps x hosts (``names``, default: the distinct ``hosts``): the largest deviation of a host's ranks,
    each rank's own lasting offset taken out (``relative``: steps x ranks, busy over the healthy peers'
    reference of the step; NaN: no record). Per-block results combine with ``np.fmax``."""
    offset = nanmedian(relative, axis=0)[None, :] if relative.size else relative[:1]
    names = np.unique(hosts) if names is None else names
    out = np.full((relative.shape[0], len(names)), np.nan)
    if not relative.shape[1] or not relative.shape[0]:
        return out
    here, inverse = np.unique(hosts, return_inverse=True)
    order = np.argsort(inverse, kind="stable")  # each host's ranks side by side
    starts = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
    with np.errstate(invalid="ignore"):
        dev = relative[:, order] - offset[:, order]  # a rank's lasting offset is not jitter
        largest = np.fmax.reduceat(dev, starts, axis=1)  # NaN only where none of the host's ranks recorded
    at = {str(name): k for k, name in enumerate(names)}
    for j, name in enumerate(here):
        if str(name) in at:  # (a rank block of the Ray engine holds some of the job's hosts)
            out[:, at[str(name)]] = largest[:, j]
    return out


def project(relative: np.ndarray, hosts: np.ndarray, busy_share: float, seed: int = 0) -> JitterTax:
    """The jitter tax at :data:`SCALES` times today's ranks. ``relative``: steps x ranks of the healthy ranks,
    busy time over the step's reference; ``hosts``: each column's host (or its rank, where hosts are not
    known); ``busy_share``: median busy time over median step time (a busy excess becomes a step's)."""
    return project_hosts(host_deviations(relative, hosts), relative.shape[1], busy_share, seed)


def project_hosts(per_host: np.ndarray, ranks: int, busy_share: float, seed: int = 0) -> JitterTax:
    """:func:`project` from the steps x hosts deviations (:func:`host_deviations`) of ``ranks`` ranks."""
    hosts_now = per_host.shape[1]
    tax = JitterTax(ranks=ranks, hosts=hosts_now, steps=per_host.shape[0],
                    method="expected slowest of N hosts, drawn from this run's per-step host deviations "
                    "(each rank's lasting offset removed), x median busy / median step; 90% range from "
                    f"{RESAMPLES} resamples of {BLOCK}-step blocks")  # fmt: skip
    if ranks < 2 or hosts_now < 1 or per_host.shape[0] < 2 * BLOCK:
        tax.note = "too few ranks or steps to measure the noise"
        return tax
    rng = np.random.default_rng(seed)
    # a step loses at most its own length to one slow rank (the job's loss is counted so, ``detect.verdict``)
    per_host = np.minimum(per_host, 1.0 / busy_share if busy_share > 0 else np.inf)
    n_blocks = max(1, per_host.shape[0] // BLOCK)
    # the pool sorted once; a resample of blocks is the same values, each as often as its block was drawn
    ok = np.isfinite(per_host)
    block_of = np.minimum(np.arange(per_host.shape[0]) // BLOCK, n_blocks)[:, None].repeat(hosts_now, axis=1)[ok]
    order = np.argsort(per_host[ok])  # ties telescope in the expected maximum: no stable order needed
    pool, block_of = per_host[ok][order], block_of[order]
    draws = [hosts_now * scale for scale in SCALES]
    points = expected_maxes(pool, np.ones(len(pool)), draws)
    picks = [rng.integers(0, n_blocks, size=n_blocks) for _ in range(RESAMPLES)]

    sizes = np.bincount(block_of, minlength=n_blocks + 1)

    def resample(pick: np.ndarray) -> list[float]:
        times = np.bincount(pick, minlength=n_blocks + 1)
        times[n_blocks] = 0  # the steps after the last whole block: in the point, not the resamples
        return top_maxes(pool, lambda k: times[block_of[len(pool) - k :]], float(np.dot(times, sizes)), draws)

    with ThreadPoolExecutor(workers()) as threads:  # numpy's loops release the interpreter lock
        samples = list(threads.map(resample, picks))
    for k, scale in enumerate(SCALES):
        point = points[k] * busy_share
        low, high = np.percentile([sample[k] * busy_share for sample in samples], [5, 95])
        tax.projections.append(Projection(ranks=ranks * scale, share=round(max(0.0, point), 6),
                                          low=round(max(0.0, float(low)), 6), high=round(max(0.0, float(high)), 6),
                                          beyond_data=draws[k] > len(pool)))  # fmt: skip
    return tax
