"""Host context of one rank: is its CPU contended, and by what? Read from ``/proc`` at each sample.

Design: :class:`HostSampler` reads a handful of small ``/proc`` files (about 10 µs each) and turns
the cumulative counters among them into rates over the time since its previous sample:

- machine: CPU pressure (``/proc/pressure/cpu``, "some avg10"), memory pressure
  (``/proc/pressure/memory``), I/O pressure (``/proc/pressure/io``: some task waited for storage),
  load average, swap in use, available memory;
- the rank's CPUs (its affinity): steal time and how busy they were (``/proc/stat``);
- the rank's training (main) thread: involuntary context switches per second (``status``) and
  the share of time it waited, runnable, for a CPU (``schedstat``: the run queue delay);
- the rank's process: CPU time per second (``stat``, all threads);
- its child processes (data-loader workers): how many, their CPU time and involuntary switches.

A field the machine does not have (no ``/proc/pressure`` before Linux 4.20 or with ``psi=0``, a
``/proc`` restricted in a container) is NaN: normal and silent. A file that is there but cannot be
parsed is skipped and counted in ``unreadable``, and ``on_unreadable`` says so (once a minute, see
``log.Problems``). Without ``/proc`` at all (not Linux), psutil gives what it can. Nothing here raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAN = float("nan")
#: /proc/stat columns of a CPU line: user nice system idle iowait irq softirq steal
_STAT_FIELDS = 8


def cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (the kernel's CPU list format); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def cpu_list_text(cpus: frozenset[int] | set[int]) -> str:
    """The inverse of :func:`cpu_list`: {0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _pressure(text: str) -> float:
    """The "some avg10" share (0..1) of a ``/proc/pressure/*`` file."""
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            return float(fields["avg10"]) / 100.0
    raise ValueError("no 'some' line")


def _proc_stat_cpu_ticks(text: str) -> float:
    """utime + stime (clock ticks, all threads) of a ``/proc/<pid>/stat`` line."""
    rest = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return float(rest[11]) + float(rest[12])


def _status(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def _cpu_lines(text: str) -> dict[int, tuple[float, float, float]]:
    """Per CPU of ``/proc/stat``: (total, idle incl. iowait, steal) ticks."""
    out = {}
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            v = [float(x) for x in values[:_STAT_FIELDS]] + [0.0] * (_STAT_FIELDS - len(values[:_STAT_FIELDS]))
            out[int(name[3:])] = (sum(v), v[3] + v[4], v[7])
    if not out:
        raise ValueError("no per-CPU lines")
    return out


def _meminfo(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("MemAvailable", "SwapTotal", "SwapFree"):
            out[key] = float(value.split()[0]) * 1024.0
    if "SwapTotal" not in out:
        raise ValueError("no SwapTotal")
    return out


class HostSampler:
    """Samples the host context of process ``pid`` (default: this one) from ``proc`` (default ``/proc``)."""

    def __init__(
        self,
        proc: str | os.PathLike[str] = "/proc",
        pid: int | None = None,
        on_unreadable: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.proc = Path(proc)
        self._root = str(self.proc)
        self.pid = pid or os.getpid()
        self.on_unreadable = on_unreadable
        self.unreadable: dict[str, int] = {}  # file -> times it could not be parsed
        self._clock = clock
        self._prev: tuple[float, dict[str, Any]] | None = None
        try:
            self._ticks = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError, AttributeError):
            self._ticks = 100.0
        self._linux = (self.proc / str(self.pid)).is_dir()

    def _read(self, rel: str) -> str | None:
        try:
            with open(f"{self._root}/{rel}", "rb") as f:
                return f.read().decode("ascii", "replace")
        except OSError:  # absent, or not ours to read: the field is simply unknown
            return None

    def _parse(self, rel: str, parse: Callable[[str], Any], text: str | None = None) -> Any:
        text = self._read(rel) if text is None else text
        if text is None:
            return None
        try:
            return parse(text)
        except (ValueError, IndexError, KeyError) as exc:
            self.unreadable[rel] = self.unreadable.get(rel, 0) + 1
            if self.on_unreadable is not None:
                self.on_unreadable(rel, f"{type(exc).__name__}: {exc}")
            return None

    def sample(self) -> dict[str, Any]:
        """The context now: levels as read, rates since the previous call (NaN on the first)."""
        now = self._clock()
        row, counters = self._read_all() if self._linux else _psutil_sample(self.pid)
        if self._prev is not None:
            then, before = self._prev
            _rates(row, before, counters, max(now - then, 1e-9))
        self._prev = (now, counters)
        return row

    def _read_all(self) -> tuple[dict[str, Any], dict[str, Any]]:
        me = str(self.pid)
        row: dict[str, Any] = dict.fromkeys(RATE_FIELDS, NAN)
        cpu_p = self._parse("pressure/cpu", _pressure)
        mem_p = self._parse("pressure/memory", _pressure)
        io_p = self._parse("pressure/io", _pressure)
        load = self._parse("loadavg", lambda t: float(t.split()[0]))
        mem = self._parse("meminfo", _meminfo) or {}
        status_text = self._read(f"{me}/status")
        status = self._parse(f"{me}/status", _status, status_text) or {}
        affinity = self._parse(f"{me}/status", lambda t: cpu_list(status["Cpus_allowed_list"]), status_text)
        cpus = self._parse("stat", _cpu_lines)
        row.update(
            cpu_pressure=_nan(cpu_p), memory_pressure=_nan(mem_p), io_pressure=_nan(io_p), load1=_nan(load),
            cpus=len(cpus) if cpus else (os.cpu_count() or 0),
            affinity=cpu_list_text(affinity) if affinity else "", affinity_cpus=len(affinity) if affinity else 0,
            swap_used_bytes=mem["SwapTotal"] - mem["SwapFree"] if "SwapFree" in mem else NAN,
            mem_available_bytes=mem.get("MemAvailable", NAN),
        )  # fmt: skip
        counters: dict[str, Any] = {
            "proc_cpu": self._cpu_seconds(me),
            "invol": _int(status.get("nonvoluntary_ctxt_switches")),
            "run_delay": self._parse(f"{me}/schedstat", lambda t: float(t.split()[1])),
        }
        if cpus:
            mine = [cpus[c] for c in (affinity or cpus) if c in cpus] or list(cpus.values())
            counters["cpus"] = tuple(sum(x[i] for x in mine) for i in range(3))
            counters["mine"] = affinity
        workers = {}
        for child in self._children(me):
            cpu = self._cpu_seconds(child)
            invol = _int((self._parse(f"{child}/status", _status) or {}).get("nonvoluntary_ctxt_switches"))
            if cpu is not None:
                workers[child] = (cpu, invol)
        row["workers"] = len(workers)
        counters["workers"] = workers
        return row, counters

    def _cpu_seconds(self, pid: str) -> float | None:
        ticks = self._parse(f"{pid}/stat", _proc_stat_cpu_ticks)
        return None if ticks is None else ticks / self._ticks

    def _children(self, me: str) -> set[str]:
        """The pids of this process's children, from every thread's ``children`` file (psutil's scan
        of all processes where the kernel has no such file)."""
        try:
            tasks = os.listdir(f"{self._root}/{me}/task")
        except OSError:
            tasks = []
        out: set[str] = set()
        found = False
        for tid in tasks:
            text = self._read(f"{me}/task/{tid}/children")
            found = found or text is not None
            if text:
                out.update(p for p in text.split() if p.isdigit())
        if not found and self._root == "/proc":
            try:
                import psutil

                out = {str(c.pid) for c in psutil.Process(self.pid).children()}
            except Exception:
                pass
        return out


#: Fields computed from two samples (NaN on the first).
RATE_FIELDS = ("steal", "cores_busy", "run_delay", "invol_switches", "cpu_time", "workers_cpu_time",
               "workers_invol_switches")  # fmt: skip


def _rates(row: dict[str, Any], before: dict[str, Any], now: dict[str, Any], dt: float) -> None:
    def delta(key: str) -> float | None:
        a, b = before.get(key), now.get(key)
        return None if a is None or b is None or b < a else b - a

    if before.get("cpus") is not None and now.get("cpus") is not None and before["mine"] == now["mine"]:
        total, idle, steal = (b - a for a, b in zip(before["cpus"], now["cpus"], strict=True))
        if total > 0:
            row["steal"] = max(0.0, steal / total)
            row["cores_busy"] = min(1.0, max(0.0, (total - idle) / total))
    for key, field, scale in (("proc_cpu", "cpu_time", 1.0), ("invol", "invol_switches", 1.0),
                              ("run_delay", "run_delay", 1e-9)):  # fmt: skip
        d = delta(key)
        if d is not None:
            row[field] = d * scale / dt
    if "workers" not in before or "workers" not in now:
        return
    old, new = before["workers"], now["workers"]
    both = [p for p in new if p in old]
    row["workers_cpu_time"] = sum(max(0.0, new[p][0] - old[p][0]) for p in both) / dt
    invol = [(old[p][1], new[p][1]) for p in both if old[p][1] is not None and new[p][1] is not None]
    row["workers_invol_switches"] = sum(max(0, b - a) for a, b in invol) / dt if len(invol) == len(both) else NAN


def _nan(x: float | None) -> float:
    return NAN if x is None else float(x)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _psutil_sample(pid: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Without ``/proc`` (not Linux): what psutil gives (process CPU and switches, children, load, swap)."""
    row: dict[str, Any] = dict.fromkeys(RATE_FIELDS, NAN)
    row.update(cpu_pressure=NAN, memory_pressure=NAN, io_pressure=NAN, load1=NAN, cpus=os.cpu_count() or 0, affinity="",
               affinity_cpus=0, swap_used_bytes=NAN, mem_available_bytes=NAN, workers=0)  # fmt: skip
    counters: dict[str, Any] = {}
    try:
        import psutil

        row["load1"] = os.getloadavg()[0]
        row["swap_used_bytes"] = float(psutil.swap_memory().used)
        row["mem_available_bytes"] = float(psutil.virtual_memory().available)
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        counters["proc_cpu"] = t.user + t.system
        counters["invol"] = proc.num_ctx_switches().involuntary
        workers = {}
        for child in proc.children():
            ct = child.cpu_times()
            workers[str(child.pid)] = (ct.user + ct.system, child.num_ctx_switches().involuntary)
        counters["workers"] = workers
        row["workers"] = len(workers)
    except Exception:  # psutil missing, a process gone, a platform without a field: unknown, silently
        pass
    return row, counters
