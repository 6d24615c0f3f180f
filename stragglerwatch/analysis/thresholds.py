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
    min_slowdown: float = 0.06  # smallest change of a rank's busy time that is flagged
    tolerance: float = 0.05  # a rank up to this much slower than its peers for ever is healthy
    z: float = 5.0  # noise margin of the level test, in standard errors of its median
    decision: float = 14.0  # CUSUM alarm level in nats (log-likelihood ratio of a 6% change to a 2% one)
    clip: float = 4.0  # largest weight of one step in the CUSUM, in noise units
    off_ratio: float = 0.5  # a flag clears below this fraction of its threshold
    min_step_fraction: float = 0.03  # excess must also cost at least this fraction of the step
    comm_bound_fraction: float = 0.5  # bottleneck rank waiting this much of its step: comm-bound
    group_min_slowdown: float = 0.10  # a group this much busier than the others: imbalance
    imbalance_min_slowdown: float = 0.02  # unequal work costing the job this much (S - 1): reported
