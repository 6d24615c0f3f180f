"""Synthetic run dirs in the real event-log format, for tests, benchmarks and demos
at scales a small machine cannot run for real.

Model: each rank's busy time per step is a base step split into phases (data 5%,
forward 30%, backward 55%, optimizer 5%, other 5%), scaled by a per-(step, rank)
log-normal jitter (``noise``) and a per-step job-wide drift; transient spikes hit
random (step, rank) cells; optionally the noise of real clusters (persistent per-rank
offsets, heavy-tailed spikes, periodic job-wide stalls, noise shared by a host's ranks,
slow per-rank drift, per-step residuals resampled from real healthy runs); an injected
straggler adds ``slowdown`` x base to its cause's phase from ``onset`` to ``end``; held-out kinds, also
off by default: two-mode steps, slow drift shared by a host's ranks, stragglers that come and go or move
between ranks, and excess split between phases as real causes mix. The all-reduce barrier makes every
rank's step the busiest rank's busy time plus the transfer time, so each rank's
exposed wait is ``step - busy`` — the same arithmetic as a real run.

Load imbalance (``tokens`` > 0, off by default): each rank draws its own batch every step, a few
sequences of log-normal lengths, so a different rank is the heaviest each step (``token_mode``
"variable"); or every rank gets the step's token count ("balanced", token-based dynamic batches);
or one rank's shard is always heavier ("static"). Forward and backward grow with the tokens
(``token_share`` of them at the mean, linearly, ``attn_share`` of that quadratically in the
sequence lengths); the record carries ``work`` (tokens) and ``work_unit`` "tokens". A compute
straggler is slower for the same work (its excess grows with its tokens); a data straggler waits
as long whatever its batch. :func:`imbalance_truth` gives the time the unequal work truly cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stragglerwatch.record.rundir import RunInfo, write_json_atomic
from stragglerwatch.record.schema import SCHEMA_VERSION, STEP_SCHEMA

PHASE_SHARES = {"data_wait_s": 0.05, "forward_s": 0.30, "backward_s": 0.55, "optimizer_s": 0.05, "other_s": 0.05}
CAUSE_PHASES = {"compute": ("forward_s", "backward_s"), "data": ("data_wait_s",),
                "optimizer": ("optimizer_s",), "other": ("other_s",)}  # fmt: skip


@dataclass
class Injection:
    """One injected straggler: ``rank`` is ``slowdown`` (0.2 = 20%) busier from ``onset``."""

    rank: int
    slowdown: float
    onset: int = 0
    cause: str = "compute"
    end: int | None = None  # first healthy step again; None = until the end
    # held-out kinds, all off by default (an injection without them is simulated exactly as before):
    mix: dict[str, float] | None = None  # phase column -> share of the excess (normalised); None: ``cause``'s phases
    period: int = 0  # on-off: slow for the first ``duty`` steps of every ``period`` steps from ``onset``
    duty: int = 0
    moves: tuple[int, ...] = ()  # moving: every ``move_every`` steps the slow rank becomes the next of these
    move_every: int = 0  # (cycling through ``rank``, *moves)

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``RANK:SLOWDOWN[:ONSET[:CAUSE[:END]]]``, e.g. ``7:0.2:500:data``."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 5:
            raise ValueError(f"straggler {text!r}: expected RANK:SLOWDOWN[:ONSET[:CAUSE[:END]]]")
        try:
            rank, slowdown = int(parts[0]), float(parts[1])
            onset = int(parts[2]) if len(parts) > 2 and parts[2] else 0
            cause = parts[3] if len(parts) > 3 and parts[3] else "compute"
            end = int(parts[4]) if len(parts) > 4 and parts[4] else None
        except ValueError:
            raise ValueError(f"straggler {text!r}: RANK, ONSET and END are integers, SLOWDOWN a number") from None
        if cause not in CAUSE_PHASES:
            raise ValueError(f"straggler {text!r}: cause must be one of {', '.join(CAUSE_PHASES)}")
        return cls(rank, slowdown, onset, cause, end)

    def plain(self) -> bool:
        """No held-out option: one rank, steady, its cause's phases in their usual proportions."""
        return self.mix is None and not (self.period and self.duty) and not (self.moves and self.move_every)

    def expand(self, steps: int) -> list[Injection]:
        """A moving straggler as one injection per stint (rank and steps), none of them moving; any
        other injection as itself. An on-off pattern restarts at each stint's onset."""
        if not (self.moves and self.move_every):
            return [self]
        path, every, out = (self.rank, *self.moves), max(1, self.move_every), []
        stop = steps if self.end is None else min(steps, self.end)
        for k, start in enumerate(range(max(0, self.onset), stop, every)):
            out.append(replace(self, rank=path[k % len(path)], onset=start, end=min(start + every, stop), moves=(),
                               move_every=0))  # fmt: skip
        return out

    def active(self, steps: int) -> np.ndarray:
        """Steps at which this (non-moving) injection adds its excess, as a boolean array."""
        on = np.zeros(steps, dtype=bool)
        on[slice(max(0, self.onset), self.end)] = True
        if self.period and self.duty:
            on &= (np.arange(steps) - self.onset) % self.period < self.duty
        return on

    def shares(self) -> dict[str, float]:
        """Phase column -> share of the excess: ``mix`` normalised, or ``cause``'s phases by their usual size."""
        if self.mix is None:
            phases = CAUSE_PHASES[self.cause]
            return {c: PHASE_SHARES[c] / sum(PHASE_SHARES[p] for p in phases) for c in phases}
        bad = [c for c in self.mix if c not in PHASE_SHARES]
        total = sum(self.mix.values())
        if bad or not total > 0 or min(self.mix.values()) < 0:
            raise ValueError(f"straggler mix {self.mix}: non-negative shares of {', '.join(PHASE_SHARES)}")
        return {c: v / total for c, v in self.mix.items()}

    def main_cause(self) -> str:
        """The cause (``CAUSE_PHASES``) that holds most of the excess."""
        shares = self.shares()
        return max(CAUSE_PHASES, key=lambda c: sum(shares.get(col, 0.0) for col in CAUSE_PHASES[c]))


@dataclass
class SimConfig:
    ranks: int
    steps: int
    seed: int = 0
    step_ms: float = 100.0  # base busy time per step
    comm_ms: float = 10.0  # pure transfer time of the all-reduce
    noise: float = 0.03  # per-(step, rank) relative jitter (log-normal sigma)
    drift: float = 0.02  # per-step job-wide relative variation
    spike_prob: float = 0.002  # chance of a transient spike per (step, rank)
    spike_mag: float = 1.0  # a spike adds this x base busy time (to "other")
    injections: list[Injection] = field(default_factory=list)
    groups: int = 1  # peer groups (e.g. pipeline stages): rank r is in group r * groups // ranks
    # realistic noise, all off by default (drawn from a second generator: the above stay as they were)
    offset: float = 0.0  # persistent per-rank relative offset, uniform in [-offset, +offset]: heterogeneous hardware
    spike_tail: float = 0.0  # > 0: spike magnitudes Pareto-distributed with this shape (heavy tail)
    stall_every: int = 0  # every N steps all ranks stall together (GC, checkpoint, evaluation)
    stall_mag: float = 0.5  # ... by this x base busy time
    host_noise: float = 0.0  # per-(step, host) relative jitter shared by the ranks of a host
    ranks_per_host: int = 8
    rank_drift: float = 0.0  # per-rank slow drift (mean-reverting, log scale): its standard deviation
    drift_steps: int = 3000  # ... and its correlation time in steps (5 minutes of 100 ms steps)
    bootstrap: str = ""  # file of real healthy per-step residuals (see ``read_residuals``) to resample
    bootstrap_block: int = 25  # steps per resampled block (keeps the real runs' short-range correlation)
    # held-out noise kinds, all off by default (each drawn from a generator of its own)
    bimodal_prob: float = 0.0  # two-mode steps: a (step, rank) is in the slow mode with this probability
    bimodal_mag: float = 0.3  # ... which makes every phase this much longer (relative)
    bimodal_hold: int = 1  # mean run of slow-mode steps (1: independent per step; > 1: a two-state Markov chain)
    host_drift: float = 0.0  # slow drift shared by a host's ranks (mean-reverting, log scale): its sd
    host_drift_steps: int = 3000  # ... and its correlation time in steps
    # load imbalance, off by default (drawn from generators of its own: the above stay as they were)
    tokens: float = 0.0  # mean tokens per rank per step; 0: no imbalance model, no work recorded
    token_cv: float = 0.25  # spread of a rank's tokens per step: their coefficient of variation
    token_seqs: int = 8  # sequences per rank per step (log-normal lengths)
    token_mode: str = "variable"  # "variable", "balanced" (same tokens on every rank) or "static" (a heavy shard)
    heavy_rank: int = 0  # with "static": the rank whose sequences are always longer ...
    heavy_share: float = 0.2  # ... by this much (0.2 = 20% more tokens)
    token_share: float = 0.8  # share of forward + backward that grows with the tokens (at the mean); the rest is fixed
    attn_share: float = 0.0  # of that share, the part quadratic in the sequence lengths (attention)


@dataclass
class JobSteps:
    """What every rank of a job shares at each step, for a run simulated a block of ranks at a time:
    the job-wide variation, the all-reduce's transfer time and the slowest rank's busy time."""

    drift: np.ndarray
    comm: np.ndarray
    peak: np.ndarray
    tokens: np.ndarray | None = None  # with ``token_mode`` "balanced": every rank's tokens at each step


def simulate_arrays(cfg: SimConfig, job: JobSteps | None = None) -> dict[str, np.ndarray]:
    """Steps x ranks arrays of every column of the step log: every phase, ``busy_s``, ``step_s``
    and ``comm_wait_s`` (here the gradient all-reduce's, the only collective simulated); with the
    imbalance model on, ``work`` too (tokens)."""
    work = draw_work(cfg, job)
    out = _simulate(cfg, job, None if work is None else work[1])
    if work is not None:
        out["work"] = work[0]
    return out


COMPUTE = ("forward_s", "backward_s")  # the phases that grow with a rank's work
WORK_UNIT = "tokens"  # the unit of the simulated work


def _simulate(cfg: SimConfig, job: JobSteps | None, load: np.ndarray | None) -> dict[str, np.ndarray]:
    """The arrays of :func:`simulate_arrays` with each rank's compute scaled by ``load`` (steps x
    ranks; None: 1): every random draw is the same whatever ``load`` is."""
    rng = np.random.default_rng(cfg.seed)
    shape = (cfg.steps, cfg.ranks)
    base = cfg.step_ms / 1000.0
    scale = np.exp(cfg.noise * rng.standard_normal(shape, dtype=np.float32)).astype(np.float64)
    drift = np.exp(cfg.drift * rng.standard_normal(cfg.steps))
    scale *= (job.drift if job else drift)[:, None]
    out = {col: base * share * scale for col, share in PHASE_SHARES.items()}
    if load is not None:
        for col in COMPUTE:
            out[col] *= load
    spikes = rng.random(shape, dtype=np.float32) < cfg.spike_prob
    out["other_s"] += spikes * (cfg.spike_mag * base)
    _realistic_noise(cfg, out, spikes, base)
    _heldout_noise(cfg, out)
    for inj in cfg.injections:
        if not 0 <= inj.rank < cfg.ranks:
            raise ValueError(f"straggler rank {inj.rank} outside 0..{cfg.ranks - 1}")
        if not inj.plain():
            _inject(inj, out, cfg.ranks, base, load)
            continue
        rows = slice(max(0, inj.onset), inj.end)
        phases = CAUSE_PHASES[inj.cause]
        for col in phases:
            add = inj.slowdown * base * PHASE_SHARES[col] / sum(PHASE_SHARES[c] for c in phases)
            if load is not None and col in COMPUTE:  # slower for the same work: the excess grows with the work
                add = add * load[rows, inj.rank]
            out[col][rows, inj.rank] += add
    busy = sum(out[c] for c in PHASE_SHARES)
    comm = cfg.comm_ms / 1000.0 * np.exp(cfg.noise * rng.standard_normal(cfg.steps))
    step = np.maximum(busy.max(axis=1), job.peak) + job.comm if job else busy.max(axis=1) + comm
    out["busy_s"] = busy
    out["step_s"] = np.broadcast_to(step[:, None], shape).copy()
    out["allreduce_wait_s"] = out["step_s"] - busy
    out["comm_wait_s"] = out["allreduce_wait_s"]
    out["collective_wait_s"] = np.zeros(shape)
    out["eval_s"] = np.zeros(shape)
    return out


def _inject(inj: Injection, out: dict[str, np.ndarray], ranks: int, base: float, load: np.ndarray | None = None
            ) -> None:  # fmt: skip
    """An injection with held-out options (mixed phases, on-off, moving), in place."""
    steps = len(out["other_s"])
    shares = inj.shares()
    for part in inj.expand(steps):
        if not 0 <= part.rank < ranks:
            raise ValueError(f"straggler rank {part.rank} outside 0..{ranks - 1}")
        on = part.active(steps)
        for col, share in shares.items():
            add = inj.slowdown * base * share
            out[col][on, part.rank] += add * load[on, part.rank] if load is not None and col in COMPUTE else add


TOKEN_MODES = ("variable", "balanced", "static")


def _check_work(cfg: SimConfig, whole: bool = True) -> None:
    """The imbalance options make sense (``whole``: ``cfg`` is the whole job, not a block of its ranks)."""
    if cfg.token_mode not in TOKEN_MODES:
        raise ValueError(f"token mode {cfg.token_mode!r}: one of {', '.join(TOKEN_MODES)}")
    if not (cfg.tokens >= 0 and cfg.token_cv >= 0 and cfg.token_seqs >= 1 and cfg.heavy_share > -1):
        raise ValueError("tokens and token spread must be >= 0, sequences >= 1, heavy share > -1")
    if not (0 <= cfg.token_share <= 1 and 0 <= cfg.attn_share <= 1):
        raise ValueError("token share and attention share must lie in [0, 1]")
    if whole and cfg.token_mode == "static" and not 0 <= cfg.heavy_rank < cfg.ranks:
        raise ValueError(f"heavy rank {cfg.heavy_rank} outside 0..{cfg.ranks - 1}")


def _lengths(rng: np.random.Generator, cfg: SimConfig, shape: tuple[int, ...]) -> np.ndarray:
    """One sequence's length (in tokens, not yet rounded) per cell of ``shape``: log-normal, of mean
    ``tokens / token_seqs`` and of a spread that makes the sum of ``token_seqs`` of them spread by ``token_cv``."""
    n = max(1, cfg.token_seqs)
    sigma2 = float(np.log1p(cfg.token_cv**2 * n))
    draw = rng.standard_normal(shape, dtype=np.float32).astype(np.float64)
    return np.exp(np.sqrt(sigma2) * draw - sigma2 / 2) * (cfg.tokens / n)


def balanced_tokens(cfg: SimConfig) -> np.ndarray | None:
    """With ``token_mode`` "balanced": the job's tokens per rank at each step (one batch's worth of
    sequences, the same on every rank); else None."""
    if not cfg.tokens or cfg.token_mode != "balanced":
        return None
    rng = np.random.default_rng([cfg.seed, 6])
    return np.maximum(1.0, np.rint(_lengths(rng, cfg, (cfg.steps, max(1, cfg.token_seqs))))).sum(axis=1)


def draw_work(cfg: SimConfig, job: JobSteps | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Steps x ranks tokens and compute load (a rank's forward + backward over what they take at the
    mean batch, before noise), or None with the imbalance model off (``tokens`` 0)."""
    if not cfg.tokens:
        return None
    _check_work(cfg, whole=job is None)
    rng = np.random.default_rng([cfg.seed, 5])
    shape, n = (cfg.steps, cfg.ranks), max(1, cfg.token_seqs)
    tokens, squares = np.zeros(shape), np.zeros(shape)
    for _ in range(n):
        length = _lengths(rng, cfg, shape)
        if cfg.token_mode == "static" and 0 <= cfg.heavy_rank < cfg.ranks:
            length[:, cfg.heavy_rank] *= 1.0 + cfg.heavy_share
        length = np.maximum(1.0, np.rint(length))
        tokens += length
        squares += length**2
    if cfg.token_mode == "balanced":  # every rank's sequences cut or padded to the step's token count
        step_tokens = job.tokens if job is not None and job.tokens is not None else balanced_tokens(cfg)
        ratio = step_tokens[:, None] / tokens  # type: ignore[index]
        tokens, squares = np.broadcast_to(step_tokens[:, None], shape).astype(float), squares * ratio**2  # type: ignore[index]
    mean_len = cfg.tokens / n
    mean_squares = n * mean_len**2 * (1.0 + cfg.token_cv**2 * n)  # E[sum of squared lengths]
    work = (1.0 - cfg.attn_share) * tokens / cfg.tokens + cfg.attn_share * squares / mean_squares
    return tokens, (1.0 - cfg.token_share) + cfg.token_share * work


@dataclass
class ImbalanceTruth:
    """What unequal work truly cost a simulated job: each step as simulated, and as it would have
    been had every rank of a peer group been given the group's mean work of the step (its tokens
    and its attention cost alike), with the same noise and stragglers."""

    step_s: np.ndarray  # per step, as simulated
    balanced_step_s: np.ndarray  # per step, with the work spread evenly

    @property
    def lost_seconds(self) -> float:
        """Job time lost to the imbalance: sum over steps of (step as simulated - step balanced)."""
        return float((self.step_s - self.balanced_step_s).sum())

    @property
    def slowdown(self) -> float:
        """S caused by the imbalance alone: job time over job time with the work balanced."""
        return float(self.step_s.sum() / self.balanced_step_s.sum())

    def to_dict(self) -> dict:
        job, balanced = float(self.step_s.sum()), float(self.balanced_step_s.sum())
        return {"lost_seconds": self.lost_seconds, "slowdown": self.slowdown, "job_seconds": job,
                "balanced_seconds": balanced}  # fmt: skip


def _spread_evenly(load: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Each rank's load replaced by the mean load of its peer group (``group``: each rank's) at that step."""
    out = np.empty_like(load)
    for g in np.unique(group):
        cols = group == g
        out[:, cols] = load[:, cols].mean(axis=1, keepdims=True)
    return out


def imbalance_truth(cfg: SimConfig, job: JobSteps | None = None) -> ImbalanceTruth | None:
    """The imbalance's true cost (the truth :func:`injected` is for stragglers), or None with the
    imbalance model off. Peer groups (``groups``) each balance their own work. ``job``: the job's
    shared steps when already computed (a run simulated a block of ranks at a time)."""
    if not cfg.tokens:
        return None
    group = np.arange(cfg.ranks) * max(1, cfg.groups) // cfg.ranks
    blocks = _rank_blocks(cfg)
    if len(blocks) == 1:
        _, load = draw_work(cfg)  # type: ignore[misc]
        actual = _simulate(cfg, None, load)["step_s"][:, 0]
        return ImbalanceTruth(actual, _simulate(cfg, None, _spread_evenly(load, group))["step_s"][:, 0])
    job = job or _job_steps(cfg, blocks)
    groups = int(group.max()) + 1
    sums = np.zeros((cfg.steps, groups))
    for lo, size in blocks.items():  # the groups' mean loads, over every block
        _, load = draw_work(_block_config(cfg, lo, size), job)  # type: ignore[misc]
        for g in np.unique(group[lo : lo + size]):
            sums[:, g] += load[:, group[lo : lo + size] == g].sum(axis=1)
    mean = sums / np.bincount(group, minlength=groups)
    peak = np.zeros(cfg.steps)
    alone = replace(job, peak=np.zeros(cfg.steps))
    for lo, size in blocks.items():
        even = mean[:, group[lo : lo + size]]
        peak = np.maximum(peak, _simulate(_block_config(cfg, lo, size), alone, even)["busy_s"].max(axis=1))
    return ImbalanceTruth(job.peak + job.comm, peak + job.comm)


def injected(cfg: SimConfig) -> np.ndarray:
    """Steps x ranks: the slowdown the injections add at each step (0.2 = 20% of the base step), their truth."""
    truth = np.zeros((cfg.steps, cfg.ranks))
    for inj in cfg.injections:
        for part in inj.expand(cfg.steps):
            if not 0 <= part.rank < cfg.ranks:
                raise ValueError(f"straggler rank {part.rank} outside 0..{cfg.ranks - 1}")
            truth[part.active(cfg.steps), part.rank] += inj.slowdown
    return truth


def _mean_reverting(rng: np.random.Generator, steps: int, series: int, sd: float, tau: int) -> np.ndarray:
    """Steps x series of an Ornstein-Uhlenbeck process (log scale): sd ``sd``, correlation time ``tau`` steps."""
    phi = float(np.exp(-1.0 / max(1, tau)))
    kick = rng.standard_normal((steps, series)) * sd * np.sqrt(1.0 - phi**2)
    level = rng.standard_normal(series) * sd
    out = np.empty((steps, series))
    for s in range(steps):
        level = phi * level + kick[s]
        out[s] = level
    return out


def two_mode(rng: np.random.Generator, steps: int, series: int, prob: float, hold: int) -> np.ndarray:
    """Steps x series booleans, True in the slow mode (probability ``prob``): independent per step, or for
    ``hold`` > 1 a two-state Markov chain whose slow runs last ``hold`` steps on average."""
    if hold <= 1:
        return rng.random((steps, series)) < prob
    leave = 1.0 / hold
    enter = min(1.0, prob * leave / max(1e-12, 1.0 - prob))
    draws = rng.random((steps, series))
    slow = np.empty((steps, series), dtype=bool)
    state = rng.random(series) < prob
    for s in range(steps):
        state = np.where(state, draws[s] >= leave, draws[s] < enter)
        slow[s] = state
    return slow


def _heldout_noise(cfg: SimConfig, out: dict[str, np.ndarray]) -> None:
    """The held-out noise kinds (two-mode steps, host drift), in place; each from a generator of its own,
    so that switching one on changes nothing else of the simulation."""
    if not (cfg.bimodal_prob or cfg.host_drift):
        return
    steps, ranks = out["other_s"].shape
    factor = np.ones((steps, ranks))
    if cfg.host_drift:
        hosts = np.arange(ranks) // max(1, cfg.ranks_per_host)
        level = _mean_reverting(np.random.default_rng([cfg.seed, 3]), steps, int(hosts[-1]) + 1, cfg.host_drift,
                                cfg.host_drift_steps)  # fmt: skip
        factor *= np.exp(level)[:, hosts]
    if cfg.bimodal_prob:
        slow = two_mode(np.random.default_rng([cfg.seed, 4]), steps, ranks, cfg.bimodal_prob, cfg.bimodal_hold)
        factor *= 1.0 + cfg.bimodal_mag * slow
    for col in PHASE_SHARES:
        out[col] *= factor


def _realistic_noise(cfg: SimConfig, out: dict[str, np.ndarray], spikes: np.ndarray, base: float) -> None:
    """The noise of real clusters that independent jitter lacks (the fields of SimConfig after
    ``groups``), applied in place; a generator of its own keeps the base simulation unchanged."""
    if not (cfg.offset or cfg.spike_tail or cfg.stall_every or cfg.host_noise or cfg.rank_drift or cfg.bootstrap):
        return
    rng = np.random.default_rng([cfg.seed, 1])
    steps, ranks = spikes.shape
    factor = np.ones((steps, ranks))
    if cfg.offset:
        factor *= 1.0 + rng.uniform(-cfg.offset, cfg.offset, ranks)[None, :]
    if cfg.host_noise:
        hosts = np.arange(ranks) // max(1, cfg.ranks_per_host)
        factor *= np.exp(cfg.host_noise * rng.standard_normal((steps, int(hosts[-1]) + 1)))[:, hosts]
    if cfg.rank_drift:  # Ornstein-Uhlenbeck: wanders, but stays within a few standard deviations
        phi = float(np.exp(-1.0 / max(1, cfg.drift_steps)))
        kick = rng.standard_normal((steps, ranks)) * cfg.rank_drift * np.sqrt(1.0 - phi**2)
        level = rng.standard_normal(ranks) * cfg.rank_drift
        for s in range(steps):
            level = phi * level + kick[s]
            factor[s] *= np.exp(level)
    if cfg.bootstrap:
        factor *= np.exp(_resample(read_residuals(cfg.bootstrap), steps, ranks, cfg.bootstrap_block, rng))
    for col in PHASE_SHARES:
        out[col] *= factor
    if cfg.spike_tail:  # replace the fixed spikes by heavy-tailed ones of the same mean
        tail = (
            cfg.spike_mag
            * base
            * (rng.pareto(cfg.spike_tail, size=spikes.shape) + 1)
            * (cfg.spike_tail - 1)
            / cfg.spike_tail
        )
        out["other_s"] += spikes * (tail - cfg.spike_mag * base)
    if cfg.stall_every:
        rows = np.arange(cfg.stall_every - 1, steps, cfg.stall_every)
        jitter = np.exp(0.05 * rng.standard_normal((len(rows), ranks)))
        out["other_s"][rows] += cfg.stall_mag * base * jitter


def read_residuals(path: str | Path) -> np.ndarray:
    """Steps x series of log residuals (a rank's busy time over its step's median across ranks) from a
    CSV with one column per series, as written by ``benchmarks/record_noise.py``."""
    try:
        values = pd.read_csv(path).to_numpy(dtype=float)
    except (OSError, ValueError) as exc:
        raise ValueError(f"bootstrap residuals {path}: {exc}") from None
    if values.ndim != 2 or values.shape[0] < 2 or not np.isfinite(values).any():
        raise ValueError(f"bootstrap residuals {path}: no numeric columns of two steps or more")
    return values


def _resample(series: np.ndarray, steps: int, ranks: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """Steps x ranks: each rank a concatenation of random blocks of random real series (block bootstrap)."""
    block = max(1, min(block, series.shape[0]))
    out = np.empty((steps, ranks))
    for start in range(0, steps, block):
        n = min(block, steps - start)
        cols = rng.integers(series.shape[1], size=ranks)
        rows = rng.integers(series.shape[0] - n + 1, size=ranks)[None, :] + np.arange(n)[:, None]
        out[start : start + n] = series[rows, cols[None, :]]
    return np.nan_to_num(out - np.nanmedian(series))


def to_frame(cfg: SimConfig, arrays: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """A ``load_run``-shaped frame of a simulation (no files), for the detection core."""
    arrays = arrays or simulate_arrays(cfg)
    steps, ranks = np.meshgrid(np.arange(cfg.steps), np.arange(cfg.ranks), indexing="ij")
    frame = pd.DataFrame({"rank": ranks.ravel(), "step": steps.ravel()})
    for col, values in arrays.items():
        frame[col] = values.ravel()
    if "work" in arrays:
        frame["work_unit"] = WORK_UNIT
    frame["world_size"] = cfg.ranks
    return frame


#: Steps x ranks records simulated at once; a larger run is simulated a block of ranks at a time.
BLOCK_RECORDS = 1 << 25


def _rank_blocks(cfg: SimConfig) -> dict[int, int]:
    """First rank -> size of each block of ranks simulated together (whole hosts)."""
    if cfg.ranks * cfg.steps <= BLOCK_RECORDS:
        return {0: cfg.ranks}
    per_host = max(1, cfg.ranks_per_host)
    size = max(per_host, BLOCK_RECORDS // cfg.steps // per_host * per_host)
    return {lo: min(size, cfg.ranks - lo) for lo in range(0, cfg.ranks, size)}


def _block_config(cfg: SimConfig, lo: int, size: int) -> SimConfig:
    """The simulation of ranks ``lo:lo+size``: its own noise, the job's stragglers among them."""
    parts = [p for i in cfg.injections for p in (i.expand(cfg.steps) if not i.plain() else [i])]
    injections = [replace(i, rank=i.rank - lo) for i in parts if lo <= i.rank < lo + size]
    return replace(cfg, ranks=size, seed=cfg.seed * 1_000_003 + lo + 1, injections=injections,
                   heavy_rank=cfg.heavy_rank - lo)  # fmt: skip


def _job_steps(cfg: SimConfig, blocks: dict[int, int]) -> JobSteps:
    """The job's shared per-step values; the slowest rank's busy time over every block (each block is
    simulated twice, so that no more than one is in memory)."""
    for injection in (p for i in cfg.injections for p in i.expand(cfg.steps)):
        if not 0 <= injection.rank < cfg.ranks:
            raise ValueError(f"straggler rank {injection.rank} outside 0..{cfg.ranks - 1}")
    if cfg.tokens:
        _check_work(cfg)
    rng = np.random.default_rng([cfg.seed, 2])
    job = JobSteps(np.exp(cfg.drift * rng.standard_normal(cfg.steps)),
                   cfg.comm_ms / 1000.0 * np.exp(cfg.noise * rng.standard_normal(cfg.steps)),
                   np.zeros(cfg.steps), balanced_tokens(cfg))  # fmt: skip
    for lo, size in blocks.items():
        job.peak = np.maximum(job.peak, simulate_arrays(_block_config(cfg, lo, size), job)["busy_s"].max(axis=1))
    return job


def rank_table(arrays: dict[str, np.ndarray], rank: int, column: int, start_time: np.ndarray) -> pa.Table:
    """Rank ``rank``'s step log (a ``STEP_SCHEMA`` table) from column ``column`` of simulated arrays."""
    n = len(start_time)
    empty_lists = {
        name: pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], type=typ.value_type))
        for name, typ in ((f.name, f.type) for f in STEP_SCHEMA if pa.types.is_list(f.type))
    }
    columns = {
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "step": pa.array(np.arange(n, dtype=np.int64)),
        "start_time": pa.array(start_time),
        "micro_batches": pa.array(np.ones(n, dtype=np.int32)),
        "restart": pa.array(np.zeros(n, dtype=np.int32)),
        "attach": pa.array(np.zeros(n, dtype=np.int32)),
        "timing": pa.repeat(pa.scalar("host"), n),
        **empty_lists,
    }
    for col, values in arrays.items():
        columns[col] = pa.array(np.ascontiguousarray(values[:, column]))
    if "work_unit" in STEP_SCHEMA.names:
        columns["work_unit"] = pa.repeat(pa.scalar(WORK_UNIT if "work" in arrays else ""), n)
    for f in STEP_SCHEMA:  # what a simulation does not model (where its untimed time lay, the batches'
        if f.name not in columns and pa.types.is_floating(f.type):  # shapes; work with the model off): NaN
            columns[f.name] = pa.array(np.full(n, np.nan))
    return pa.Table.from_pydict({f.name: columns[f.name] for f in STEP_SCHEMA}, schema=STEP_SCHEMA)


#: Options added for held-out evaluation: left out of run.json while at their defaults (as before them).
_HELDOUT_SIM = {"bimodal_prob": 0.0, "bimodal_mag": 0.3, "bimodal_hold": 1, "host_drift": 0.0, "host_drift_steps": 3000}
_HELDOUT_INJ = {"mix": None, "period": 0, "duty": 0, "moves": (), "move_every": 0}
#: The imbalance model's options: left out of run.json while it is off.
_IMBALANCE_FIELDS = ("tokens", "token_cv", "token_seqs", "token_mode", "heavy_rank", "heavy_share", "token_share",
                     "attn_share")  # fmt: skip


def _as_recorded(cfg: SimConfig) -> dict:
    """``asdict(cfg)`` without the held-out options that are at their defaults."""

    def trim(d: dict, defaults: dict) -> dict:
        return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}

    sim = trim(asdict(cfg), _HELDOUT_SIM)
    if not cfg.tokens:
        sim = {k: v for k, v in sim.items() if k not in _IMBALANCE_FIELDS}
    sim["injections"] = [trim(i, _HELDOUT_INJ) for i in sim["injections"]]
    return sim


def write_run(out_dir: str | Path, cfg: SimConfig, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a complete run dir (run.json, rank-*.json, rank-*.parquet) for ``cfg``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks = _rank_blocks(cfg)
    job = _job_steps(cfg, blocks) if len(blocks) > 1 else None
    arrays = simulate_arrays(cfg) if job is None else None
    step = arrays["step_s"][:, 0] if arrays is not None else job.peak + job.comm  # type: ignore[union-attr]
    t0 = time.time() - float(step.sum())
    start_time = t0 + np.concatenate(([0.0], np.cumsum(step[:-1])))
    run_id = f"sim-{out.resolve().name}"
    sim = _as_recorded(cfg)
    truth = imbalance_truth(cfg, job)
    if truth is not None:  # the straggler's truth is its injection; the imbalance's is its cost
        sim["imbalance_truth"] = truth.to_dict()
    write_json_atomic(
        out / "run.json",
        {"run_id": run_id, "world_size": cfg.ranks, "created": time.time(), "schema": "stragglerwatch-run",
         "versions": {"schema": SCHEMA_VERSION}, "config": {"simulated": True}, "simulation": sim},
    )  # fmt: skip
    for rank in range(cfg.ranks):
        if job is not None and rank in blocks:
            arrays = simulate_arrays(_block_config(cfg, rank, blocks[rank]), job)
        column = rank - (max(b for b in blocks if b <= rank) if job is not None else 0)
        info = RunInfo(run_id, out, rank, rank % 8, cfg.ranks, f"sim-node-{rank // 8:04d}")
        meta = {k: v for k, v in asdict(info).items() if k != "run_dir"}
        if cfg.groups > 1:
            meta["role"] = f"group{rank * cfg.groups // cfg.ranks}"
        write_json_atomic(out / f"rank-{rank:05d}.json", {**meta, "device": "sim", "timing": "host"})
        pq.write_table(rank_table(arrays, rank, column, start_time), out / f"rank-{rank:05d}.parquet")  # type: ignore[arg-type]
        if progress:
            progress(rank + 1, cfg.ranks)
    return out


class GrowingRun:
    """A simulated run written as a live job writes it, for following it (tests, benchmarks): one
    Arrow stream per rank (``rank-NNNNN.arrows``), grown by :meth:`flush` and compacted into Parquet
    by :meth:`close`, as each rank's log does."""

    def __init__(self, out_dir: str | Path, cfg: SimConfig):
        self.out = Path(out_dir)
        write_run(self.out, replace(cfg, steps=1, injections=[]))  # run.json and the ranks' metadata
        for p in self.out.glob("rank-*.parquet"):
            p.unlink()
        arrays = simulate_arrays(cfg)
        step = arrays["step_s"][:, 0]
        start = time.time() + np.concatenate(([0.0], np.cumsum(step[:-1])))
        self.tables = [rank_table(arrays, r, r, start) for r in range(cfg.ranks)]
        self.sinks = [pa.OSFile(str(self.out / f"rank-{r:05d}.arrows"), "wb") for r in range(cfg.ranks)]
        self.writers = [pa.ipc.new_stream(s, STEP_SCHEMA) for s in self.sinks]
        self.written = [0] * cfg.ranks  # steps on disk, per rank

    def flush(self, upto: int, ranks: Iterable[int] | None = None) -> None:
        """Each of ``ranks`` (default: all) writes its steps up to ``upto`` (exclusive) in one batch."""
        for r in range(len(self.tables)) if ranks is None else ranks:
            if upto > self.written[r]:
                self.writers[r].write_table(self.tables[r].slice(self.written[r], upto - self.written[r]))
                self.sinks[r].flush()
                self.written[r] = upto

    def close(self) -> None:
        """The end of the job: each stream closed and compacted into ``rank-NNNNN.parquet``."""
        for r, (writer, sink) in enumerate(zip(self.writers, self.sinks, strict=True)):
            writer.close()
            sink.close()
            pq.write_table(self.tables[r].slice(0, self.written[r]), self.out / f"rank-{r:05d}.parquet")
            (self.out / f"rank-{r:05d}.arrows").unlink()
