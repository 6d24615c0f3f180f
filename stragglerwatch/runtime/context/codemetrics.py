"""The code sampler's metric families for a rank's exporter, computed at scrape time.

Series (labels ``run``, ``rank``, plus ``phase`` and ``site`` on the share):

- ``stragglerwatch_code_samples_total``: code samples taken;
- ``stragglerwatch_code_sample_seconds_total``: the sampler's own time, in all;
- ``stragglerwatch_code_site_share``: of the latest window's samples (a few seconds), the share
  at each of its busiest code locations (``path:line function``, the innermost frame of the user's
  code) in each phase; at most :data:`~stragglerwatch.runtime.context.codesampler.TOP` series a rank, so the
  label values stay few. A rank's busiest location next to its peers' says where its time goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class CodeCollector(Collector):
    """The code metric families of one rank, from a ``CodeSampler`` at scrape time."""

    def __init__(self, sampler: Any, run_id: str, rank: int):
        self.sampler = sampler
        self.labels = {"run": run_id, "rank": str(rank)}

    def collect(self) -> Iterator[Any]:
        names, values = list(self.labels), list(self.labels.values())
        n = CounterMetricFamily("stragglerwatch_code_samples", "Code samples taken of the training thread",
                                labels=names)  # fmt: skip
        n.add_metric(values, float(self.sampler.samples))
        yield n
        cost = CounterMetricFamily("stragglerwatch_code_sample_seconds", "Seconds the code sampler spent sampling",
                                   labels=names)  # fmt: skip
        cost.add_metric(values, float(self.sampler.cost_s))
        yield cost
        share = GaugeMetricFamily("stragglerwatch_code_site_share",
                                  "Share of the latest window's code samples at a code location, by phase",
                                  labels=[*names, "phase", "site"])  # fmt: skip
        for entry in self.sampler.top():
            share.add_metric([*values, str(entry["phase"]), str(entry["site"])], float(entry["share"]))
        yield share
