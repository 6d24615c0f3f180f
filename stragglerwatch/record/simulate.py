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
between ranks, and excess split between phases as real causes mix. Ranks that differ by design, also off
by default: a duty of rank 0 (or of every host's first rank) each step, such as writing a metrics line
(``duty_ms``, in the gap before the next forward: the data wait a loop without a timed loader shows), and
pipeline stages (``groups``) that are busier than each other (``group_skew``) and may go unlabelled
(``roles=False``). A restart (``restart_at``) records the later steps as a second attempt, its ranks
moved to other hosts (``restart_move``); ``context_every`` writes host and GPU context samples, in
which an injection's ``evidence`` shows (a slower SM clock, thermal slowdown, steal, I/O pressure on
its host). The all-reduce barrier makes every
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

from stragglerwatch._units import parse_slowdown
from stragglerwatch.record.rundir import RunInfo, write_json_atomic
from stragglerwatch.record.schema import SCHEMA_VERSION, STEP_SCHEMA

PHASE_SHARES = {"data_wait_s": 0.05, "forward_s": 0.30, "backward_s": 0.55, "optimizer_s": 0.05, "other_s": 0.05}
CAUSE_PHASES = {"compute": ("forward_s", "backward_s"), "data": ("data_wait_s",),
                "optimizer": ("optimizer_s",), "other": ("other_s",)}  # fmt: skip


@dataclass
class Injection:
    """One injected straggler: ``rank`` is ``slowdown`` (a fraction here: 0.2 = 20 %, ``1.2x``) busier from
    ``onset``; :meth:`parse` reads it as the ratio the command line and the reports use."""

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
    evidence: str = ""  # with ``context_every``: what its context shows while it is slow (``EVIDENCE``)

    @classmethod
    def parse(cls, text: str) -> Injection:
        """``RANK:SLOWDOWN[:ONSET[:CAUSE[:END]]]``, e.g. ``7:1.2:500:data``: SLOWDOWN a ratio (``1.2``, ``1.2x`` or
        ``20%``), as every slowdown is given."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 5:
            raise ValueError(f"straggler {text!r}: expected RANK:SLOWDOWN[:ONSET[:CAUSE[:END]]]")
        try:
            rank = int(parts[0])
            onset = int(parts[2]) if len(parts) > 2 and parts[2] else 0
            cause = parts[3] if len(parts) > 3 and parts[3] else "compute"
            end = int(parts[4]) if len(parts) > 4 and parts[4] else None
        except ValueError:
            raise ValueError(f"straggler {text!r}: RANK, ONSET and END are integers") from None
        try:
            slowdown = parse_slowdown("SLOWDOWN", parts[1], hi=100.0) - 1.0
        except ValueError as exc:
            raise ValueError(f"straggler {text!r}: {exc}") from None
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
    # ranks that differ by design, all off by default (the above stay as they were)
    duty_ms: float = 0.0  # extra ms each step on the duty ranks (logging, ``.item()``), in ``duty_phase``
    duty_ranks: str = "rank0"  # "rank0", or "local0": every host's first rank
    duty_phase: str = "data_wait_s"  # where the duty shows: the gap before the next forward (data) or other_s
    duty_evidence: str = ""  # with ``context_every``: what the duty ranks' context shows (``EVIDENCE``)
    group_skew: float = 0.0  # group g (of ``groups``) is busier by ``group_skew * g / (groups - 1)``
    roles: bool = True  # record each rank's group as its role (False: stages nobody labelled)
    restart_at: int = 0  # > 0: the steps from this one are a second attempt (restart 1), numbered from 0
    restart_move: int = 0  # ... on which rank r runs on the host of rank r + restart_move * ranks_per_host
    context_every: int = 0  # > 0: a context sample of every rank every this many steps (context-NNNNN.parquet)
    first_rank: int = 0  # internal: the first rank of a block of a large job, and the job's ranks
    job_ranks: int = 0


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
    _by_design(cfg, out, base)
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


def duty_ranks(cfg: SimConfig) -> np.ndarray:
    """The job's ranks that carry ``duty_ms``: rank 0, or every host's first rank."""
    ranks = cfg.job_ranks or cfg.ranks
    if cfg.duty_ranks == "local0":
        return np.arange(0, ranks, max(1, cfg.ranks_per_host))
    if cfg.duty_ranks != "rank0":
        raise ValueError(f"duty ranks {cfg.duty_ranks!r}: 'rank0' or 'local0'")
    return np.zeros(1, dtype=np.int64)


def _by_design(cfg: SimConfig, out: dict[str, np.ndarray], base: float) -> None:
    """Ranks busier by design (a duty of rank 0, stages of unequal work), in place; the duty's jitter from
    a generator of its own."""
    if not (cfg.duty_ms or cfg.group_skew):
        return
    steps, ranks = out["other_s"].shape
    mine = np.arange(cfg.first_rank, cfg.first_rank + ranks)
    if cfg.group_skew and cfg.groups > 1:
        group = mine * cfg.groups // (cfg.job_ranks or cfg.ranks)
        factor = 1.0 + cfg.group_skew * group / (cfg.groups - 1)
        for col in PHASE_SHARES:
            out[col] *= factor[None, :]
    if cfg.duty_ms:
        if cfg.duty_phase not in PHASE_SHARES:
            raise ValueError(f"duty phase {cfg.duty_phase!r}: one of {', '.join(PHASE_SHARES)}")
        cols = np.flatnonzero(np.isin(mine, duty_ranks(cfg)))
        rng = np.random.default_rng([cfg.seed, 5])
        jitter = np.exp(cfg.noise * rng.standard_normal((steps, len(cols))))
        out[cfg.duty_phase][:, cols] += cfg.duty_ms / 1000.0 * jitter


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
                   heavy_rank=cfg.heavy_rank - lo, first_rank=lo, job_ranks=cfg.ranks)  # fmt: skip


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


def rank_table(arrays: dict[str, np.ndarray], rank: int, column: int, start_time: np.ndarray, restart_at: int = 0
               ) -> pa.Table:  # fmt: skip
    """Rank ``rank``'s step log (a ``STEP_SCHEMA`` table) from column ``column`` of simulated arrays; with
    ``restart_at``, the steps from it are restart 1's, numbered from 0."""
    n = len(start_time)
    later = np.arange(n) >= restart_at if restart_at > 0 else np.zeros(n, dtype=bool)
    empty_lists = {
        name: pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], type=typ.value_type))
        for name, typ in ((f.name, f.type) for f in STEP_SCHEMA if pa.types.is_list(f.type))
    }
    columns = {
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "step": pa.array(np.arange(n, dtype=np.int64) - np.where(later, restart_at, 0)),
        "start_time": pa.array(start_time),
        "micro_batches": pa.array(np.ones(n, dtype=np.int32)),
        "restart": pa.array(later.astype(np.int32)),
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
_HELDOUT_INJ = {"mix": None, "period": 0, "duty": 0, "moves": (), "move_every": 0, "evidence": ""}
#: Options of ranks that differ by design, restarts and context: left out of run.json at their defaults.
_DESIGN_SIM = {"duty_ms": 0.0, "duty_ranks": "rank0", "duty_phase": "data_wait_s", "duty_evidence": "",
               "group_skew": 0.0, "roles": True, "restart_at": 0, "restart_move": 0, "context_every": 0,
               "first_rank": 0, "job_ranks": 0}  # fmt: skip
#: The imbalance model's options: left out of run.json while it is off.
_IMBALANCE_FIELDS = ("tokens", "token_cv", "token_seqs", "token_mode", "heavy_rank", "heavy_share", "token_share",
                     "attn_share")  # fmt: skip


def _as_recorded(cfg: SimConfig) -> dict:
    """``asdict(cfg)`` without the held-out options that are at their defaults."""

    def trim(d: dict, defaults: dict) -> dict:
        return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}

    sim = trim(trim(asdict(cfg), _HELDOUT_SIM), _DESIGN_SIM)
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
        info = RunInfo(run_id, out, rank, rank % 8, cfg.ranks, sim_host(cfg, rank, 0))
        meta = {k: v for k, v in asdict(info).items() if k != "run_dir"}
        if cfg.restart_at > 0:  # the later attempt's identity, and where each attempt ran (``rundir``)
            meta["attempts"] = [{"restart": a, "attach": 0, "host": sim_host(cfg, rank, a), "local_rank": rank % 8}
                                for a in (0, 1)]  # fmt: skip
            meta.update(restart=1, host=sim_host(cfg, rank, 1))
        if cfg.groups > 1 and cfg.roles:
            meta["role"] = f"group{rank * cfg.groups // cfg.ranks}"
        write_json_atomic(out / f"rank-{rank:05d}.json", {**meta, "device": "sim", "timing": "host"})
        table = rank_table(arrays, rank, column, start_time, cfg.restart_at)  # type: ignore[arg-type]
        pq.write_table(table, out / f"rank-{rank:05d}.parquet")
        if cfg.context_every > 0:
            write_context(out, cfg, rank, start_time, step)
        if progress:
            progress(rank + 1, cfg.ranks)
    return out


def sim_host(cfg: SimConfig, rank: int, attempt: int) -> str:
    """The host rank ``rank`` runs on in ``attempt`` (0, or 1 after ``restart_at``)."""
    moved = rank + (cfg.restart_move * cfg.ranks_per_host if attempt else 0)
    return f"sim-node-{moved % cfg.ranks // max(1, cfg.ranks_per_host):04d}"


#: What an injection's ``evidence`` shows in its context while it is slow: column -> value (``*``: times the
#: healthy value; ``|``: bits set); the signals ``explain`` names from them. ``io`` is its whole host's.
EVIDENCE = {
    "sm_clock": {"sm_clock_mhz": "*0.72"},
    "thermal": {"sm_clock_mhz": "*0.8", "clock_reasons": "|64", "temperature_c": "*1.4"},
    "steal": {"steal": 0.25},
    "io": {"io_pressure": 0.45},
}
#: A healthy rank's context: the value and its relative jitter.
_HEALTHY_CONTEXT = {
    "cpu_pressure": (0.02, 0.3), "memory_pressure": (0.0, 0.0), "io_pressure": (0.01, 0.3), "load1": (24.0, 0.05),
    "steal": (0.0, 0.0), "cores_busy": (0.5, 0.05), "run_delay": (0.01, 0.2), "invol_switches": (20.0, 0.2),
    "cpu_time": (1.0, 0.05), "workers_cpu_time": (0.5, 0.1), "workers_invol_switches": (30.0, 0.2),
    "swap_used_bytes": (0.0, 0.0), "mem_available_bytes": (1e11, 0.01), "sm_clock_mhz": (1980.0, 0.005),
    "sm_clock_max_mhz": (1980.0, 0.0), "temperature_c": (60.0, 0.03), "power_w": (500.0, 0.05),
    "power_limit_w": (700.0, 0.0), "gpu_util": (0.95, 0.02), "ecc_uncorrected": (0.0, 0.0),
    "ecc_corrected": (0.0, 0.0), "pcie_replays": (0.0, 0.0), "nvlink_errors": (0.0, 0.0),
}  # fmt: skip


def write_context(out: Path, cfg: SimConfig, rank: int, start_time: np.ndarray, step_s: np.ndarray) -> None:
    """Rank ``rank``'s context samples (``context-NNNNN.parquet``), one every ``context_every`` steps: healthy
    values with a little jitter, and what the evidence of an injection (or of the duty) on it or on its host
    shows while it holds."""
    from stragglerwatch.record.context import CONTEXT_SCHEMA, EMPTY

    rows = np.arange(cfg.context_every - 1, cfg.steps, cfg.context_every)
    times = start_time[rows] + step_s[rows]
    rng = np.random.default_rng([cfg.seed, 6, rank])
    n = len(rows)
    cols: dict[str, np.ndarray] = {k: v * np.exp(j * rng.standard_normal(n)) for k, (v, j) in _HEALTHY_CONTEXT.items()}
    cols["clock_reasons"] = np.zeros(n, dtype=np.int64)
    host = sim_host(cfg, rank, 0)
    found: list[tuple[str, np.ndarray]] = []
    for inj in (p for i in cfg.injections for p in i.expand(cfg.steps)):
        whose = inj.rank == rank or (inj.evidence == "io" and sim_host(cfg, inj.rank, 0) == host)
        if inj.evidence and whose:
            found.append((inj.evidence, inj.active(cfg.steps)[rows]))
    if cfg.duty_evidence and rank in duty_ranks(cfg).tolist():
        found.append((cfg.duty_evidence, np.ones(n, dtype=bool)))
    for name, on in found:
        for col, value in EVIDENCE[name].items():
            if isinstance(value, str) and value[0] == "*":
                cols[col] = np.where(on, cols[col] * float(value[1:]), cols[col])
            elif isinstance(value, str):
                cols[col] = np.where(on, cols[col] | int(value[1:]), cols[col])
            else:
                cols[col] = np.where(on, value, cols[col])
    data = {"rank": np.full(n, rank, dtype=np.int32), "time": times, "interval_s": np.diff(times, prepend=times[0]),
            "sample_s": np.full(n, 2e-4), "cpus": np.full(n, 64, dtype=np.int32), "affinity": [""] * n,
            "affinity_cpus": np.full(n, 8, dtype=np.int32), "workers": np.full(n, 2, dtype=np.int32),
            "gpu": np.full(n, rank % 8, dtype=np.int32), "gpu_uuid": [f"GPU-sim-{rank}"] * n, **cols}  # fmt: skip
    arrays = [pa.array(data[f.name], type=f.type) if f.name in data else pa.array([EMPTY[f.name]] * n, type=f.type)
              for f in CONTEXT_SCHEMA]  # fmt: skip
    pq.write_table(pa.Table.from_arrays(arrays, schema=CONTEXT_SCHEMA), out / f"context-{rank:05d}.parquet")


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
