"""What to try about a straggler, from what was measured of it. Pure.

Design: :func:`advise` turns one straggler of the report into short "what to try" lines
(``StragglerEntry.hints``). Every line is keyed on a measured signal, and without its signal there
is no line: never a generic checklist. The inputs are the straggler (``cause``, ``excess_ms``,
``where``, ``host`` and the context signals ``explain.py`` named), the other stragglers (their
hosts and causes), its own context medians over its flagged span (``explain.span_values``), its
rank's metadata (``device``, ``timing`` and ``loader``: the wrapped DataLoader's settings) and the
host of every rank. The keys and thresholds:

- untimed time (``where``): mark the fetch, or wrap the loader (:func:`hints`);
- data: workers busy at least :data:`WORKERS_BUSY` of a CPU each -> raise ``num_workers``; the
  process and its workers using :data:`CPUS_FULL` of its CPUs -> more CPUs, not more workers;
  workers at most :data:`WORKERS_IDLE` busy -> the loading waits on I/O; no worker
  (``num_workers=0``, or no child process) -> ``num_workers`` > 0; ``pin_memory=False`` on a CUDA
  rank -> ``pin_memory=True``; two or more data stragglers on one host and none on the others ->
  that node's storage or network;
- any cause, from the context signals named: GPU errors, hardware and thermal slowdowns -> their
  check and "replace or drain this node"; power cap, power limit, clock settings, a lower SM clock
  without a reason; CPU contention by other processes or by its own threads, steal, fewer CPUs,
  memory pressure or swap, loader workers switched out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

WORKERS_BUSY = 0.8  # CPU-seconds per second per loader worker: it cannot keep up
WORKERS_IDLE = 0.3  # at most this busy while the rank waited: the workers wait on I/O
CPUS_FULL = 0.9  # share of its CPUs the process and its workers used: no CPU left for more workers
OTHERS_BUSY = 0.25  # CPUs other processes used of the rank's: they contend with it
OTHERS_NONE = 0.1  # at most this: its waits come from its own threads

#: Context signals that are the GPU's or the node's hardware: a node to replace or drain.
HARDWARE = ("xid", "ecc_uncorrected", "ecc_corrected", "pcie_replays", "nvlink_errors", "gpu_hw_slowdown",
            "gpu_hw_power_brake_slowdown", "gpu_hw_thermal_slowdown", "gpu_sw_thermal_slowdown",
            "temperature")  # fmt: skip
_THERMAL = ("gpu_hw_thermal_slowdown", "gpu_sw_thermal_slowdown", "temperature")
_MARK = "mark the fetch (get_batch = watch.data(get_batch), or with watch.data(): ...)"


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def hints(cause: str, where: str | None) -> list[str]:
    """What to try when the excess lies in untimed time (``stages.where_excess``)."""
    if where is None:
        return []
    if cause == "data":
        return ["no fetch is timed, so its data wait is the untimed gap before the forward (with whatever "
                f"else the loop does there): {_MARK} or wrap the loader (watch.wrap(loader)) to time it "
                "exactly"]  # fmt: skip
    return [f"its extra time is untimed code {where}: if the loop fetches data there, {_MARK} to count it as "
            "data wait; the code locations say what else runs there"]  # fmt: skip


def advise(
    entry: Any,
    stragglers: Sequence[Any] = (),
    own: Mapping[str, float] | None = None,
    meta: Mapping[str, Any] | None = None,
    hosts: Mapping[int, str | None] | None = None,
) -> list[str]:
    """What to try about ``entry`` (a ``StragglerEntry`` or its JSON object), from what was measured.
    ``stragglers``: every straggler of the report (``rank``, ``host``, ``cause``); ``own``: its
    context medians over its span (``explain.span_values``); ``meta``: its rank's metadata;
    ``hosts``: every rank's host."""
    cause, where = str(_get(entry, "cause")), _get(entry, "where")
    lines = hints(cause, where)
    if cause == "data":
        lines += _data(entry, own or {}, meta or {})
        lines += _same_host(entry, stragglers, hosts or {})
    found = {str(_get(s, "signal")): s for s in _get(entry, "context") or []}
    lines += _context(found, own or {}, _get(entry, "host"))
    return lines


def _data(entry: Any, own: Mapping[str, float], meta: Mapping[str, Any]) -> list[str]:
    loader = meta.get("loader") if isinstance(meta.get("loader"), Mapping) else {}
    waited = f"{float((_get(entry, 'excess_ms') or {}).get('data', 0.0)):.1f} ms/step"
    configured = loader.get("num_workers") if isinstance(loader.get("num_workers"), int) else None
    workers, busy = _num(own.get("workers")), _num(own.get("workers_cpu_time"))
    lines = []
    if configured == 0 or (configured is None and busy is not None and workers == 0):
        said = "num_workers=0" if configured == 0 else "no data-loader worker process ran"
        lines.append(f"it loads its batches in the training process ({said}) and waited {waited} longer for them "
                     "than its peers: set the DataLoader's num_workers > 0, so that batches are prepared while it "
                     "computes")  # fmt: skip
    elif workers is not None and workers >= 1 and busy is not None:
        n, each = round(workers), busy / workers
        cpus, used = _num(own.get("affinity_cpus")), busy + (_num(own.get("cpu_time")) or 0.0)
        now = f" (now {configured})" if configured else ""
        if cpus and used >= CPUS_FULL * cpus:
            lines.append(f"its process and its {n} data-loader workers kept all its {cpus:.0f} CPU(s) busy "
                         f"({used:.2f} CPU-s/s) while it waited {waited} for data: more workers will not help; give "
                         "the rank more CPUs (its affinity or cgroup) or make each batch cheaper to prepare "
                         "(pre-process offline)")  # fmt: skip
        elif each >= WORKERS_BUSY:
            lines.append(f"its {n} data-loader workers were each busy {each:.0%} of a CPU while it waited {waited} "
                         f"for data: they cannot keep up; raise num_workers{now} or make each batch cheaper to "
                         "prepare")  # fmt: skip
        elif each <= WORKERS_IDLE:
            lines.append(f"its {n} data-loader workers were busy only {each:.0%} of a CPU each while it waited "
                         f"{waited} for data: the loading waits on I/O (storage, network), not on CPU; read from a "
                         "local copy or cache, pre-tokenised memory-mapped data, or a streaming dataset that "
                         "prefetches")  # fmt: skip
    cuda = meta.get("timing") == "cuda" or str(meta.get("device", "")).startswith("cuda")
    if cuda and loader.get("pin_memory") is False:
        lines.append("its DataLoader has pin_memory=False on a CUDA rank: with pin_memory=True (and "
                     ".to(device, non_blocking=True)) batches are copied to the GPU from page-locked memory, faster "
                     "and without blocking the host")  # fmt: skip
    return lines


def _same_host(entry: Any, stragglers: Sequence[Any], hosts: Mapping[int, str | None]) -> list[str]:
    host = _get(entry, "host")
    if not host:
        return []
    data = [s for s in stragglers if _get(s, "cause") == "data"]
    here = sorted(int(_get(s, "rank")) for s in data if _get(s, "host") == host)
    others = {h for h in hosts.values() if h and h != host}
    if len(here) < 2 or not others or any(_get(s, "host") in others for s in data):
        return []
    ranks = ", ".join(str(r) for r in here)
    return [f"ranks {ranks} of host {host} wait for data and no rank of the {len(others)} other host(s) does: this "
            "node's storage or network path is slower than the others' (check its disks, its filesystem mount "
            "and its NIC, or stage the data on local disk)"]  # fmt: skip


#: How the hardware signals are named in the "replace or drain" line.
_FAULT = {"xid": "XID errors", "ecc_uncorrected": "uncorrected ECC errors", "ecc_corrected": "corrected ECC errors",
          "pcie_replays": "PCIe replays", "nvlink_errors": "NVLink errors", "gpu_hw_slowdown": "hardware slowdown",
          "gpu_hw_power_brake_slowdown": "power brake", "gpu_hw_thermal_slowdown": "thermal slowdown",
          "gpu_sw_thermal_slowdown": "thermal slowdown", "temperature": "heat"}  # fmt: skip


def _context(found: Mapping[str, Any], own: Mapping[str, float], host: str | None) -> list[str]:
    node = f"this node ({host})" if host else "this node"
    on = f" on {host}" if host else ""
    lines = []
    if any(k in found for k in _THERMAL):
        lines.append(f"its GPU throttles for heat: check the cooling of {node} (fans, airflow, inlet temperature; "
                     "nvidia-smi -q -d TEMPERATURE,PERFORMANCE)")  # fmt: skip
    if "gpu_hw_slowdown" in found or "gpu_hw_power_brake_slowdown" in found:
        lines.append("the hardware slows its GPU (HW_SLOWDOWN or power brake: a power supply or thermal event): "
                     f"check the power and cooling of {node}")  # fmt: skip
    if "pcie_replays" in found:
        lines.append("its GPU's PCIe link replays: check the link's width and speed (nvidia-smi -q -d PCIE, "
                     "lspci -vv), reseat or replace the card or its riser")  # fmt: skip
    if "nvlink_errors" in found:
        lines.append("its GPU's NVLink links report errors: check them (nvidia-smi nvlink -e)")
    if any(k in found for k in ("xid", "ecc_uncorrected", "ecc_corrected")):
        lines.append("its GPU reports errors (XID or ECC): run the GPU diagnostics (dcgmi diag -r 3) and read the "
                     "kernel log for its XIDs")  # fmt: skip
    faults = list(dict.fromkeys(_FAULT[k] for k in HARDWARE if k in found))
    if faults:
        lines.append(f"replace or drain {node}: its GPU shows {', '.join(faults)} where its peers' do not")
    if "power_limit" in found:
        peers = _num(_get(found["power_limit"], "peers"))
        to = f" (nvidia-smi -pl {peers:.0f})" if peers else ""
        lines.append(f"its GPU's power limit is lower than its peers': set it back to theirs{to}")
    elif "gpu_sw_power_cap" in found:
        lines.append(f"its GPU runs at its power cap more often than its peers': check its power limit and the power "
                     f"draw of {node} (nvidia-smi -q -d POWER,PERFORMANCE)")  # fmt: skip
    if "gpu_applications_clocks_setting" in found or "gpu_sync_boost" in found:
        lines.append("a clock setting holds its GPU's clocks down: reset the application clocks (nvidia-smi -rac) "
                     "and locked clocks (nvidia-smi -rgc)")  # fmt: skip
    if "sm_clock" in found and not any(k.startswith("gpu_") or k == "power_limit" for k in found):
        lines.append(f"its SM clock is lower than its peers' with no slowdown reason from NVML: compare nvidia-smi -q "
                     f"-d CLOCK,PERFORMANCE{on} with a healthy node's")  # fmt: skip
    return lines + _cpu(found, own, host)


def _cpu(found: Mapping[str, Any], own: Mapping[str, float], host: str | None) -> list[str]:
    on, at = (f" on {host}", f"on {host}: ") if host else ("", "")
    lines = []
    if any(k in found for k in ("others_cpu", "run_delay", "invol_switches")):
        others, cpus = _num(own.get("others_cpu")), _num(own.get("affinity_cpus"))
        mine = f"its {cpus:.0f} CPU(s)" if cpus else "its CPUs"
        if others is not None and others >= OTHERS_BUSY:
            lines.append(f"other processes used {others:.2f} CPU of {mine}: find them ({at}top, ps -eLo "
                         "pid,psr,pcpu,comm) and stop or move them, or pin the ranks and the other work to disjoint "
                         "CPUs (numactl, taskset, a cpuset)")  # fmt: skip
        elif others is not None and others <= OTHERS_NONE:
            lines.append(f"no other process used its CPUs ({others:.2f} CPU), so its own threads compete for {mine} "
                         "(torch's intra-op threads, its data-loader workers): lower torch.set_num_threads / "
                         "OMP_NUM_THREADS or num_workers, or give the rank more CPUs")  # fmt: skip
        else:
            lines.append(f"its training thread waits for its CPU: look for other processes on {mine} ({at}top, "
                         "ps -eLo pid,psr,pcpu,comm)")  # fmt: skip
    elif "cpu_pressure" in found or "load_per_cpu" in found:
        lines.append(f"its host runs more than its peers' hosts: find what else runs there ({at}top)")
    if "steal" in found:
        lines.append("its VM shares its physical host with others (steal): move the rank to another or a dedicated "
                     "instance")  # fmt: skip
    if "affinity_cpus" in found:
        lines.append("it may run on fewer CPUs than its peers: fix its CPU binding (the launcher's, numactl or "
                     "taskset, the container's cpuset)")  # fmt: skip
    if "workers_invol_switches" in found:
        lines.append("its data-loader workers share their CPUs with other work: give them CPUs of their own or run "
                     "fewer per CPU")  # fmt: skip
    if "memory_pressure" in found or "swap_used" in found:
        lines.append(f"its host is short of memory: free memory{on} (other processes, fewer data-loader workers or a "
                     "lower prefetch_factor) or add memory")  # fmt: skip
    if "io_pressure" in found:
        lines.append(f"tasks on its host wait for storage: look for what else reads or writes there{on} (iotop, "
                     "iostat -x), or stage its data on a faster local disk")  # fmt: skip
    return lines
