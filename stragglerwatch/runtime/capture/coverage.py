"""What of the signal stragglerwatch can see, and the reasons when it cannot.

Design: when a part of the signal cannot be measured, say so — a
message once, the reason in the run metadata (``busy_unavailable`` in ``rank-NNNNN.json``),
and "busy time unavailable: <reason>" in every report — never a silent "no straggler".
Reasons known at attach time come from :func:`unseen_communication`; those found while
training come from the probe and are written by :class:`UnavailableNotes` on the log thread.
A wrapper ``attach`` does not support is refused instead (:func:`refusal`): it says one line and
returns an inert handle, so that no report stands on timings it cannot vouch for.
It also writes the settings of the first DataLoader the loop wraps (``loader``: ``num_workers``,
``pin_memory``, ``persistent_workers``, ``prefetch_factor``), which the report's advice reads.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

from stragglerwatch.record.rundir import RunInfo, write_rank_meta
from stragglerwatch.runtime.capture.probes import StepProbe

#: Wrappers whose communication is timed on the CPU, where the host waits for every collective, but not on an
#: accelerator, where they wait for it on streams of their own (by class name: none is imported).
STREAM_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP1 (FullyShardedDataParallel) on {device}: its all-gathers and reduce-scatters run "
    "on FSDP's own streams, and where the compute stream waits for them is not timed (FSDP2, fully_shard, is)",
}

#: Wrappers ``attach`` refuses, with the one line it says instead of watching (by class name: none is imported).
REFUSED_WRAPPERS = {
    "DeepSpeedEngine": "DeepSpeed (DeepSpeedEngine) is not supported: its ZeRO communication is not timed where "
    "ZeRO overlaps it on streams of its own, so no straggler verdict would be honest; training goes on unwatched. "
    "To have the job watched, shard with FSDP2 (fully_shard) or use DDP: see the Frameworks page of the docs",
}


def _named(module: Any, names: dict[str, str]) -> str | None:
    """What ``names`` says of ``module``'s class or of one of its bases (by name), or None."""
    return next((names[cls.__name__] for cls in type(module).__mro__ if cls.__name__ in names), None)


def refusal(*models: Any) -> str | None:
    """The one line ``attach`` says instead of watching a model it refuses (any of ``models``: the model
    given, the one inside its wrappers), or None."""
    return next((found for m in models if m is not None and (found := _named(m, REFUSED_WRAPPERS))), None)


def unseen_communication(model: torch.nn.Module, device_type: str = "cpu") -> str | None:
    """Why the model's communication cannot be timed on ``device_type``, when that is known at attach time."""
    if device_type != "cpu":
        for module in model.modules():  # FSDP1 units may sit below a plain root
            found = _named(module, STREAM_WRAPPERS)
            if found is not None:
                return found.format(device=device_type)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and getattr(getattr(dynamo, "config", None), "compiled_autograd", False):
        return "compiled autograd is enabled: the gradient all-reduce wait is not seen"
    return None


def coverage_notes(model: torch.nn.Module, compiled: bool, world_size: int) -> list[str]:
    """What of the job's communication no bracket of ours sees, though it is not lost: said in the
    rank's metadata (``coverage``) and in every report. Empty where every collective is bracketed."""
    if world_size < 2:
        return []
    notes = []
    distributed_params = False
    try:
        from torch.distributed.tensor import DTensor

        distributed_params = any(isinstance(p, DTensor) for p in model.parameters())
    except Exception:
        pass
    if compiled and distributed_params:
        notes.append("collectives inside compiled code (DTensor's functional collectives under torch.compile) are "
                     "waited on in C++, where no bracket of ours sees them: their waits are found from the arrival "
                     "order at the collectives, within groups on one host")  # fmt: skip
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # noqa: F401
    except ImportError:
        notes.append("this torch has no Flight Recorder: no arrival order at the collectives, and a wait that no "
                     "bracket sees (inside compiled code) counts as busy time")  # fmt: skip
    return notes


class UnavailableNotes:
    """Writes the reasons the probe found during training into the rank's metadata (log thread)."""

    def __init__(self, info: RunInfo, rank_meta: dict[str, Any], probe: StepProbe):
        self.info, self.rank_meta, self.probe = info, rank_meta, probe
        self.written = 0  # of the probe's reasons

    def __call__(self, records: list[Any]) -> None:
        reasons = list(self.probe.unavailable.values())
        if len(reasons) == self.written:
            return
        self.written = len(reasons)
        known = self.rank_meta.setdefault("busy_unavailable", [])
        known += [r for r in reasons if r not in known]
        write_rank_meta(self.info, self.rank_meta)

    def note_loader(self, iterable: Any) -> None:
        """Record the settings of the first wrapped DataLoader (``iterable`` or one it holds) in the
        rank's metadata; never raises (a metadata file that cannot be written loses only this)."""
        if "loader" in self.rank_meta:
            return
        settings = loader_settings(iterable)
        if settings is None:
            return
        self.rank_meta["loader"] = settings
        try:
            write_rank_meta(self.info, self.rank_meta)
        except OSError:
            pass

    def reasons(self) -> list[str]:
        """Every reason known now (attach time and training), for the exporter and ``stats()``."""
        known = list(self.rank_meta.get("busy_unavailable", []))
        return known + [r for r in self.probe.unavailable.values() if r not in known]


def loader_settings(obj: Any) -> dict[str, Any] | None:
    """``num_workers``, ``pin_memory``, ``persistent_workers`` and ``prefetch_factor`` of the
    ``torch.utils.data.DataLoader`` that ``obj`` is or holds as an attribute (a wrapper's
    ``self.loader``); None when there is none."""
    found = obj if isinstance(obj, DataLoader) else None
    for value in () if found is not None else getattr(obj, "__dict__", {}).values():
        if isinstance(value, DataLoader):
            found = value
            break
    if found is None:
        return None
    return {"num_workers": int(found.num_workers), "pin_memory": bool(found.pin_memory),
            "persistent_workers": bool(getattr(found, "persistent_workers", False)),
            "prefetch_factor": getattr(found, "prefetch_factor", None)}  # fmt: skip
