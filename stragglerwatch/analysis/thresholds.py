"""Every threshold of detection, in one frozen dataclass (:class:`DetectConfig`): what each stage
(``stages``, ``consistency``, ``intermittent``) and the verdict (``detect``) read. Its own module, so
that the stages below ``detect`` need not import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DetectConfig:
    window: int = 16  # steps of the short median a flag needs to persist over
    level_window: int = 64  # steps of the level median and of a rank's own baseline
    confirm: int = 3  # consecutive steps a test must hold to flag (and fail to clear)
    # smallest change of a rank's busy time that is flagged; None: from the run's noise (``floors``):
    # ``noise_multiple`` x the per-step jitter, within [``least_slowdown``, ``most_slowdown``]
    min_slowdown: float | None = None
    # a rank up to this much slower than its peers for ever is healthy; None: 5/6 of the smallest change
    tolerance: float | None = None
    least_slowdown: float = 0.02  # the smallest change ever flagged on a quiet run
    most_slowdown: float = 0.06  # on a noisy run, the fixed floor of earlier releases
    noise_multiple: float = 3.0  # the smallest change flagged, in per-step noise units
    z: float = 5.0  # noise margin of the level test, in standard errors of its median
    decision: float = 14.0  # CUSUM alarm level in nats (log-likelihood ratio of a change of the floor to a third of it)
    clip: float = 4.0  # largest weight of one step in the CUSUM, in noise units
    off_ratio: float = 0.5  # a flag clears below this fraction of its threshold
    # the excess must also cost at least this fraction of the step; None: half the smallest change
    min_step_fraction: float | None = None
    # a flagged stretch is reported when fixing its rank would save the job at least this share of its time
    # while it lasts (``cost.py``); 0: every flag that passes the statistical tests
    min_cost_share: float = 0.005
    comm_bound_fraction: float = 0.5  # bottleneck rank waiting this much of its step: comm-bound
    group_min_slowdown: float = 0.10  # a group this much busier than the others: imbalance
    imbalance_min_slowdown: float = 0.02  # unequal work costing the job this much (S - 1): reported


@dataclass(frozen=True)
class Floors:
    """The thresholds a run's noise sets (:func:`floors`): what is flagged, what is healthy."""

    slowdown: float  # smallest change flagged
    tolerance: float  # a rank this much slower for ever is healthy
    step_fraction: float  # the least share of the step an excess must cost


def floors(noise: float, cfg: DetectConfig) -> Floors:
    """The run's floors from its per-step noise (the robust jitter of a rank's excess over its peers): on a
    quiet cluster a 3% straggler is many standard deviations of its noise and costs the job what it costs;
    on a noisy one the fixed floor of earlier releases holds. A setting that is not None wins."""
    derived = min(cfg.most_slowdown, max(cfg.least_slowdown, cfg.noise_multiple * noise))
    slowdown = derived if cfg.min_slowdown is None else cfg.min_slowdown
    tolerance = slowdown * 5.0 / 6.0 if cfg.tolerance is None else cfg.tolerance
    fraction = slowdown / 2.0 if cfg.min_step_fraction is None else cfg.min_step_fraction
    return Floors(slowdown, tolerance, fraction)


def classic_floors(cfg: DetectConfig) -> Floors:
    """The fixed floor of earlier releases (``most_slowdown``), or the one set: a flag at it stands whatever
    it costs (the floors below it flag only what costs the job, ``cost.py``)."""
    return floors(float("inf"), cfg)
