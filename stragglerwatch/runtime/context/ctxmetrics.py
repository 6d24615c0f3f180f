"""The rank's host and GPU context on its Prometheus exporter: the latest sample, read at scrape time.

Series (labels ``run``, ``rank`` and ``host`` on all of them; GPU series also ``gpu`` (NVML index),
``UUID`` and ``Hostname``, the labels of NVIDIA's DCGM exporter, so that they join its series):

- host: ``stragglerwatch_host_cpu_pressure_ratio``, ``..._host_memory_pressure_ratio``,
  ``..._host_load1``, ``..._host_swap_used_bytes``, ``..._host_cpu_steal_ratio`` (over the rank's CPUs);
- the rank: ``stragglerwatch_process_run_delay_ratio`` (share of time its training thread waited
  for a CPU), ``..._process_involuntary_switches_per_second`` (its training thread),
  ``..._process_cpu_ratio`` (CPU seconds per second, all threads), ``..._process_affinity_cpus``,
  ``stragglerwatch_workers`` and ``..._workers_cpu_ratio``, ``..._workers_involuntary_switches_per_second``
  (its child processes: data-loader workers);
- GPU: ``stragglerwatch_gpu_sm_clock_hertz`` and ``..._sm_clock_max_hertz``,
  ``..._gpu_clock_event_reason{reason}`` (1 while NVML gives that reason for the clocks, else 0),
  ``..._gpu_temperature_celsius``, ``..._gpu_power_watts``, ``..._gpu_power_limit_watts``,
  ``..._gpu_utilization_ratio``, and the counters ``..._gpu_ecc_errors_total{type}`` (volatile),
  ``..._gpu_pcie_replays_total``, ``..._gpu_nvlink_errors_total``, ``..._gpu_xid_events_total``,
  with ``..._gpu_last_xid`` (the last XID seen; 0: none);
- the sampler itself: ``stragglerwatch_context_samples_total``, ``..._context_sample_seconds``.

A value the rank does not know (no ``/proc/pressure``, no GPU) is not exported.

Lean mode (``lean=True``, the exporter's ``prometheus_mode="lean"``) keeps what the dashboards read
(:data:`LEAN`, the GPU error counters and ``..._context_samples_total``) and exports
``..._gpu_clock_event_reason{reason}`` only for the slowdown reasons (``gpuctx.SLOWDOWNS``) while
they hold (value 1): a series per reason that holds the clocks down, none on a healthy GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stragglerwatch.record.context import REASONS, SLOWDOWNS, decode_reasons

#: (metric, sample field, scale, help) of the gauges.
HOST = (
    ("host_cpu_pressure_ratio", "cpu_pressure", 1.0, "Share of time some task waited for a CPU (PSI some avg10)"),
    ("host_memory_pressure_ratio", "memory_pressure", 1.0, "Share of time some task waited for memory (PSI)"),
    ("host_load1", "load1", 1.0, "One-minute load average of the host"),
    ("host_swap_used_bytes", "swap_used_bytes", 1.0, "Swap in use on the host"),
    ("host_cpu_steal_ratio", "steal", 1.0, "Share of the rank's CPUs' time stolen by the hypervisor"),
    ("process_run_delay_ratio", "run_delay", 1.0, "Share of time the rank's training thread waited, runnable, "
     "for a CPU"),
    ("process_involuntary_switches_per_second", "invol_switches", 1.0, "Involuntary context switches of the "
     "rank's training thread per second"),
    ("process_cpu_ratio", "cpu_time", 1.0, "CPU seconds per second of the rank's process"),
    ("process_affinity_cpus", "affinity_cpus", 1.0, "CPUs the rank's process may run on"),
    ("workers", "workers", 1.0, "Child processes of the rank (data-loader workers)"),
    ("workers_cpu_ratio", "workers_cpu_time", 1.0, "CPU seconds per second of the rank's child processes"),
    ("workers_involuntary_switches_per_second", "workers_invol_switches", 1.0, "Involuntary context switches "
     "of the rank's child processes per second"),
)  # fmt: skip
GPU = (
    ("gpu_sm_clock_hertz", "sm_clock_mhz", 1e6, "SM clock of the rank's GPU"),
    ("gpu_sm_clock_max_hertz", "sm_clock_max_mhz", 1e6, "Maximum SM clock of the rank's GPU"),
    ("gpu_temperature_celsius", "temperature_c", 1.0, "Temperature of the rank's GPU"),
    ("gpu_power_watts", "power_w", 1.0, "Power draw of the rank's GPU"),
    ("gpu_power_limit_watts", "power_limit_w", 1.0, "Enforced power limit of the rank's GPU"),
    ("gpu_utilization_ratio", "gpu_util", 1.0, "Share of time a kernel ran on the rank's GPU"),
    ("gpu_last_xid", "xid", 1.0, "The last XID critical error NVML reported for the rank's GPU (0: none)"),
)
#: The gauges lean mode keeps: those the dashboards' context panels read.
LEAN = frozenset({
    "host_cpu_pressure_ratio", "host_cpu_steal_ratio", "process_run_delay_ratio",
    "process_involuntary_switches_per_second", "workers_involuntary_switches_per_second",
    "gpu_sm_clock_hertz", "gpu_temperature_celsius", "gpu_power_watts", "gpu_power_limit_watts",
})  # fmt: skip
COUNTERS = (
    ("gpu_pcie_replays", "pcie_replays", "PCIe replays of the rank's GPU (a degraded link replays)"),
    ("gpu_nvlink_errors", "nvlink_errors", "NVLink errors (replay, recovery, CRC) of the rank's GPU's links"),
    ("gpu_xid_events", "xid_events", "XID critical errors NVML reported for the rank's GPU"),
)


def _known(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class ContextCollector(Collector):
    """The context metric families of one rank, from ``sampler.latest`` at scrape time."""

    def __init__(self, sampler: Any, run_id: str, rank: int, host: str, lean: bool = False):
        self.sampler = sampler
        self.labels = {"run": run_id, "rank": str(rank), "host": host}
        self.lean = lean
        self.errors = 0

    def _kept(self, metric: str) -> bool:
        return not self.lean or metric in LEAN

    def collect(self) -> Iterator[Any]:
        try:
            families = list(self._families())
        except Exception as exc:  # a scrape must not fail for the context: the rest is served
            self.errors += 1
            self.sampler.problems.report("context-metrics", f"context metrics: {type(exc).__name__}: {exc}")
            families = []
        yield from families

    def _families(self) -> Iterator[Any]:
        row = self.sampler.latest
        names, values = list(self.labels), list(self.labels.values())
        n = CounterMetricFamily("stragglerwatch_context_samples", "Context samples taken", labels=names)
        n.add_metric(values, float(self.sampler.samples))
        yield n
        if row is None:
            return
        if not self.lean:
            g = GaugeMetricFamily("stragglerwatch_context_sample_seconds", "Cost of the last context sample",
                                  labels=names)  # fmt: skip
            g.add_metric(values, float(row.get("sample_s", 0.0)))
            yield g
        for metric, field, scale, doc in HOST:
            if self._kept(metric) and _known(row.get(field)):
                g = GaugeMetricFamily(f"stragglerwatch_{metric}", doc, labels=names)
                g.add_metric(values, float(row[field]) * scale)
                yield g
        if int(row.get("gpu", -1)) < 0:
            return
        gnames = [*names, "gpu", "UUID", "Hostname"]
        gvalues = [*values, str(row["gpu"]), str(row.get("gpu_uuid", "")), self.labels["host"]]
        for metric, field, scale, doc in GPU:
            if self._kept(metric) and _known(row.get(field)):
                g = GaugeMetricFamily(f"stragglerwatch_{metric}", doc, labels=gnames)
                g.add_metric(gvalues, float(row[field]) * scale)
                yield g
        mask = int(row.get("clock_reasons", -1))
        if mask >= 0:
            active = set(decode_reasons(mask))
            doc = "1 while NVML gives this reason for the GPU's clocks (clock event / throttle reasons)"
            r = GaugeMetricFamily("stragglerwatch_gpu_clock_event_reason", doc, labels=[*gnames, "reason"])
            for reason in REASONS.values():
                if not self.lean:
                    r.add_metric([*gvalues, reason], 1.0 if reason in active else 0.0)
                elif reason in active and reason in SLOWDOWNS:
                    r.add_metric([*gvalues, reason], 1.0)
            yield r
        ecc = CounterMetricFamily("stragglerwatch_gpu_ecc_errors", "Volatile ECC errors of the rank's GPU",
                                  labels=[*gnames, "type"])  # fmt: skip
        for kind in ("uncorrected", "corrected"):
            if _known(row.get(f"ecc_{kind}")):
                ecc.add_metric([*gvalues, kind], float(row[f"ecc_{kind}"]))
        yield ecc
        for metric, field, doc in COUNTERS:
            if _known(row.get(field)):
                c = CounterMetricFamily(f"stragglerwatch_{metric}", doc, labels=gnames)
                c.add_metric(gvalues, float(row[field]))
                yield c
