"""What kind of model ``attach`` was given: the wrappers around it, and its peers on the device mesh.

Design: one pure look at the model, made once at attach time, so that the rest of ``attach``
asks plain questions (is it DDP? FSDP2? compiled?) instead of testing classes everywhere.
Nothing here registers a hook or imports an optional package: classes are recognised by
``isinstance`` against what this torch has, or by name for other libraries'.

- ``torch.compile``: an ``OptimizedModule`` is looked through to the module it compiles; our
  forward timing goes on the compiled wrapper itself, so it runs outside compiled code.
- DDP: the ``DistributedDataParallel`` instance (directly, or inside the compiled wrapper).
- FSDP2 (``fully_shard``): every FSDP state and parameter group under the model; their mesh
  gives the rank's peer group (``role``): the coordinates on the mesh dimensions that are not
  data-parallel. Ranks differing only in their data-parallel coordinates do the same work.
- ``torch.distributed.pipelining``: the ``PipelineStage`` that runs the model (found among the
  objects that hold it, only where that package is loaded) gives the rank's place in the pipeline,
  ``pp=<its rank in the pipeline group>``: ranks of one stage are peers, the stages are not.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

#: Mesh dimension names that are data parallel (ranks along them are replicas of each other).
DATA_PARALLEL_DIMS = {"dp", "ddp", "fsdp", "hsdp", "data", "data_parallel", "dp_replicate", "dp_shard", "dp_shard_cp",
                      "dp_cp", "replicate", "shard", "dp_shard_mod_ep", "dp_shard_in_ep", "efsdp", "batch"}  # fmt: skip


@dataclass
class ModelInfo:
    """The parts of a watched model that stragglerwatch instruments."""

    outer: torch.nn.Module  # what the training loop calls: forward is timed here
    forward_attr: str = "forward"  # the attribute timed: "_compiled_call_impl" after module.compile()
    target: torch.nn.Module | None = None  # the innermost model (inside DDP, compile): its train/eval mode counts
    ddp: DistributedDataParallel | None = None
    compiled: bool = False
    fsdp_states: list[Any] = field(default_factory=list)  # FSDP2 states (one per fully_shard call)
    fsdp_groups: list[Any] = field(default_factory=list)  # FSDP2 parameter groups
    mesh: Any = None  # the data-parallel device mesh (FSDP2, or DDP built with device_mesh=)

    @property
    def fsdp2(self) -> bool:
        return bool(self.fsdp_states)

    def modules(self) -> list[torch.nn.Module]:
        """The watched model's layers, outside in: what a pipeline stage may hold as its ``submod``."""
        return [m for m in (self.outer, self.ddp, self.target) if m is not None]


def _fsdp2_parts(module: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except Exception:
        return [], []
    states: list[Any] = []
    groups: list[Any] = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        try:
            state = sub._get_fsdp_state()
        except Exception:
            continue
        if any(state is s for s in states):
            continue
        states.append(state)
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # torch < 2.9: one group per state
            found = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        groups += list(found)
    return states, groups


def inspect_model(model: torch.nn.Module) -> ModelInfo:
    """Look through ``torch.compile`` and find the DDP or FSDP2 parts of ``model``."""
    inner = model
    compiled = False
    for _ in range(4):  # compiled wrappers nest at most a few deep
        orig = getattr(inner, "_orig_mod", None)
        if not isinstance(orig, torch.nn.Module):
            break
        inner, compiled = orig, True
    in_place = getattr(model, "_compiled_call_impl", None) is not None  # model.compile()
    compiled = compiled or in_place or getattr(inner, "_compiled_call_impl", None) is not None
    info = ModelInfo(outer=model, compiled=compiled, forward_attr="_compiled_call_impl" if in_place else "forward")
    if isinstance(inner, DistributedDataParallel):
        info.ddp = inner
        info.mesh = getattr(inner, "_device_mesh", None) or getattr(inner, "device_mesh", None)
        target = inner.module
    else:
        target = inner
    info.target = target
    info.fsdp_states, info.fsdp_groups = _fsdp2_parts(target)
    if info.fsdp_groups and info.mesh is None:
        mesh_info = getattr(info.fsdp_groups[0], "mesh_info", None)
        info.mesh = getattr(mesh_info, "mesh", None)
    return info


def mesh_role(mesh: Any) -> str | None:
    """This rank's peer group on a device mesh: its coordinates on the dimensions of the mesh's
    root that are neither in ``mesh`` (the data-parallel mesh) nor named as data parallel;
    ``None`` when every rank is a peer of every other (1-D data parallelism, HSDP)."""
    if mesh is None:
        return None
    try:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        names = root.mesh_dim_names
        coords = root.get_coordinate()
        if coords is None or root is mesh or not names:
            return None  # the data-parallel mesh is the whole mesh (or its dimensions are unnamed)
        own = set(mesh.mesh_dim_names or ())
        parts = [f"{name}={c}" for i, (name, c) in enumerate(zip(names, coords, strict=True))
                 if root.size(i) > 1 and name not in own and name not in DATA_PARALLEL_DIMS]  # fmt: skip
        return ",".join(parts) or None
    except Exception:
        return None


def pipeline_stage(*modules: Any) -> Any | None:
    """The ``torch.distributed.pipelining`` stage that runs one of ``modules`` (its ``submod``), or None.
    Looked for among the objects that refer to each module, only where the pipelining package is loaded
    (one pass over the referrers: a one-off cost at attach)."""
    loaded = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(loaded, "_PipelineStageBase", None)
    if base is None:
        return None
    for module in modules:
        if module is None:
            continue
        for ref in gc.get_referrers(module):
            if isinstance(ref, base) and getattr(ref, "submod", None) is module:
                return ref
            if isinstance(ref, dict) and ref.get("submod") is module:  # an instance's __dict__
                for owner in gc.get_referrers(ref):
                    if isinstance(owner, base) and getattr(owner, "__dict__", None) is ref:
                        return owner
    return None


def pipeline_role(stage: Any, mesh: Any = None) -> str | None:
    """The peer group of a rank running ``stage``: ``pp=<its rank in the pipeline group>`` (its stage;
    with interleaved schedules the rank's stages together), joined with the mesh's other coordinates
    (``mesh_role``), which give the stage themselves where the mesh has a ``pp`` dimension."""
    from_mesh = mesh_role(mesh)
    if stage is None or (from_mesh and any(part.startswith("pp=") for part in from_mesh.split(","))):
        return from_mesh
    try:
        place = int(stage.group_rank)
    except Exception:
        return from_mesh
    return ",".join([f"pp={place}", *([from_mesh] if from_mesh else [])])


class LateStageRole:
    """Takes the role from a pipeline stage built after ``attach``: once, at the first records the step log
    writes (on its thread), where the pipelining package is loaded by then; rewrites the rank's metadata."""

    def __init__(self, parts: ModelInfo, rank_meta: dict[str, Any], write: Callable[[], None]):
        self.parts, self.rank_meta, self.write = parts, rank_meta, write
        self.done = False

    def __call__(self, records: list[Any]) -> None:
        if self.done or not records:
            return
        self.done = True
        stage = pipeline_stage(*self.parts.modules())
        role = pipeline_role(stage, self.parts.mesh) if stage is not None else None
        if role is not None:
            self.rank_meta["role"] = role
            try:
                self.write()
            except OSError:
                pass  # the role stays unknown to the analysis, as before; training goes on
