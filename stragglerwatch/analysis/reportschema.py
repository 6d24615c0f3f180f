"""The analysis report's typed schema (``stragglerwatch-report/2``): what ``analyze --format json``
prints, the text and HTML renderers and the dashboard read. Field order is the JSON's key order.

``Report.to_dict()`` is the JSON object (``run_dir``, ``events`` and ``attempts`` are there for a run
dir, the ``log_*`` keys with ``--logs``; ``extra`` holds what an op-level trace adds), and
``Report.from_dict()`` reads one back, so a program that consumes reports gets types, not keys.
A change that removes or retypes a field raises the schema's version.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

REPORT_SCHEMA = "stragglerwatch-report/2"


@dataclass
class ContextSignal:
    """A host or GPU signal in which a straggler differed from its peers while it was slow."""

    signal: str
    value: float
    peers: float  # the peers' median
    text: str


@dataclass
class CodeSite:
    """A code location holding part of a straggler's excess (``codeprofile.py``)."""

    site: str  # the innermost frame of the user's code: "path:line function"
    leaf: str  # the innermost frame of all (a library's, often)
    native: bool  # inside a call into native code there: Python cannot see further
    share: float  # of the excess the sites with an excess hold
    excess_ms: float  # per step, over its peers' median


@dataclass
class StragglerEntry:
    rank: int
    cause: str  # data, compute, optimizer or other
    slowdown: float  # its busy time over its healthy peers'
    first_step: int
    last_step: int | None  # None while still slow at the end of the data
    detected_step: int
    lost_seconds: float | None
    excess_ms: dict[str, float]  # per cause
    episodes: list[list[int | None]]  # [first, last, detected] step of each flagged stretch (last None: open)
    host: str | None = None
    lost_gpu_seconds: float | None = None
    time_span: list[float] | None = None  # Unix seconds, its first flagged step's start to its last's end
    context: list[ContextSignal] = field(default_factory=list)
    where: str | None = None  # where in the step the excess lies, e.g. "between forward and backward"
    gap_ms: dict[str, float] = field(default_factory=dict)  # excess per gap of untimed time
    code: list[CodeSite] = field(default_factory=list)  # the code locations of its excess, best first
    code_note: str | None = None  # why ``code`` is empty
    hints: list[str] = field(default_factory=list)  # what to try, from what was measured
    # what fixing it would save the job (the costlier stragglers fixed first: ``analysis/cost.py``), in
    # seconds and as a share of the job's time while it was flagged
    saves_seconds: float | None = None
    saves_share: float | None = None
    episode_spans: list[list[float] | None] = field(default_factory=list)  # per episode: Unix seconds, as time_span
    attempt: int | None = None  # with several attempts: the index in ``attempts`` of the one it was flagged in


@dataclass
class MinorEntry:
    """A rank flagged only briefly, at a negligible cost: every episode ended, under 128 flagged steps in all,
    and fixing it would have saved the job less than ``min_cost_share`` of its time (``detect._headline``).
    A detail, not a straggler."""

    rank: int
    cause: str
    slowdown: float
    episodes: list[list[int | None]]  # as ``StragglerEntry.episodes``
    lost_seconds: float | None
    saves_seconds: float | None
    host: str | None = None


@dataclass
class RankRow:
    """One rank's medians (ms) over the run, its busy time over its peers' (``busy_vs_peers``: the median over
    its steps; a flagged straggler's ``slowdown`` is over its flagged steps only) and whether it was flagged."""

    rank: int
    host: str | None
    role: str | None
    steps: int
    step_ms: float | None
    busy_ms: float | None
    comm_wait_ms: float | None
    data_wait_ms: float | None
    forward_ms: float | None
    backward_ms: float | None
    allreduce_wait_ms: float | None
    collective_wait_ms: float | None
    eval_ms: float | None
    optimizer_ms: float | None
    other_ms: float | None
    busy_vs_peers: float | None  # median over its steps of its busy time over its peer group's healthy reference
    flagged: bool
    work: float | None = None  # median work per step (units of the report's ``imbalance.unit``); None: not recorded
    busy_per_work_us: float | None = None  # median busy microseconds per unit of work


@dataclass
class ImbalanceEntry:
    """Load imbalance: ranks given unequal work in the same step (``analysis/imbalance.py``)."""

    unit: str  # what a unit of work is: "elements", "tokens", or what ``note_work`` was told
    steps: int  # steps with work recorded on at least two ranks of a group
    detected: bool  # the imbalance costs at least ``DetectConfig.imbalance_min_slowdown``
    lost_seconds: float | None  # job time lost because ranks got unequal work (what-if: equal work per step)
    lost_gpu_seconds: float | None
    slowdown: float | None  # the job slowdown S imbalance alone causes: T / (T - lost)
    explained: float | None  # share (0..1) of the spread of busy time across ranks that work size explains
    seconds_per_unit: float | None  # a healthy rank's busy seconds per unit of work
    work_spread: float | None  # median over steps of (heaviest - mean) / mean work of a step
    heaviest_ranks: list[int] = field(default_factory=list)  # ranks that drew the heaviest work most often
    heaviest_share: float | None = None  # of the steps, for the first of ``heaviest_ranks``
    varies: bool = True  # the work differs between ranks or steps (False: the same batch every time)
    phase_seconds_per_unit: dict[str, float] = field(default_factory=dict)  # per phase: healthy seconds per unit
    hints: list[str] = field(default_factory=list)  # what to try, from what was measured
    note: str | None = None  # why a figure is missing


@dataclass
class Unavailable:
    reason: str
    ranks: list[int]


@dataclass
class GroupEntry:
    group: str
    ranks: list[int]
    slowdown: float


@dataclass
class Attempt:
    """One attempt of the run (``analysis/attempts.py``): a restart of the job, or an attach again; the
    optional keys are None where the files do not say (an earlier release's, or a crash before attach)."""

    restart: int
    attach: int
    first_step: int
    last_step: int
    world: int | None = None  # 0 for the first; one more where the ranks or their nodes changed
    world_size: int | None = None
    ranks: int | None = None  # that recorded steps in it
    nodes: int | None = None
    joined: list[int] | None = None  # ranks, since the attempt before
    left: list[int] | None = None
    nodes_joined: list[str] | None = None
    nodes_left: list[str] | None = None
    moved: list[int] | None = None  # ranks on another node than in the attempt before
    ended: str | None = None  # why it ended, from the ranks' events and where each stopped recording
    job_seconds: float | None = None
    lost_seconds: float | None = None  # to stragglers, jitter and unequal groups, over its own steps
    lost_gpu_seconds: float | None = None  # its lost seconds times its own world size


@dataclass
class Events:
    count: int
    skipped_lines: int


@dataclass
class Report:
    run_id: str | None
    world_size: int | None
    ranks_seen: int
    steps: int
    first_step: int | None
    last_step: int | None
    job_seconds: float | None
    ideal_seconds: float | None
    job_slowdown: float | None  # S = actual / ideal
    lost_seconds: float | None
    lost_gpu_seconds: float | None
    communication_bound: bool | None
    comm_fraction: float | None
    stragglers: list[StragglerEntry]
    busy_unavailable: list[Unavailable]
    group_imbalance: list[GroupEntry]
    hangs: list[dict[str, Any]]  # ``hangs.py``'s diagnoses
    thresholds: dict[str, float | None]
    ranks: list[RankRow]
    run_dir: str | None = None
    events: Events | None = None
    attempts: list[Attempt] | None = None
    log_events: list[dict[str, Any]] | None = None  # with --logs: PyTorch's own messages
    first_failure: dict[str, Any] | None = None
    log_lines: int | None = None
    log_skipped_lines: int | None = None
    flight_recorder: dict[str, Any] | None = None  # with Flight Recorder dumps: ``flightrec.analyze_dumps``
    hang_verdict: dict[str, Any] | None = None  # ``hangverdict.reconcile`` over every source
    imbalance: ImbalanceEntry | None = None  # None: no work per step was recorded
    actions: list[dict[str, Any]] = field(default_factory=list)  # the policies' (``policy.actions_from_events``)
    arrivals: dict[str, Any] | None = None  # the arrival order at the collectives (``arrivals.py``), when recorded
    # where ``lost_seconds`` went: ``stragglers`` (what fixing the flagged ones would save), ``imbalance``
    # (unequal work), ``jitter`` (the rest: whichever rank is slowest at a step, by chance)
    lost_split: dict[str, float] | None = None
    # the time jitter alone would cost at 2, 8 and 64 times today's ranks (``jittertax.py``)
    jitter_tax: dict[str, Any] | None = None
    minor: list[MinorEntry] = field(default_factory=list)  # brief flags of negligible cost: details
    # ranks alone in their peer group (a pipeline stage of one rank): compared with nobody, never flagged
    unpaired: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # an op-level trace's what-if
    schema: str = REPORT_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": self.schema}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("schema", "extra") or (value is None and f.name in _OPTIONAL):
                continue
            out[f.name] = _plain(value)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """A report read back (``analyze --format json``'s output); raises ``ValueError`` for another schema."""
        if data.get("schema") != REPORT_SCHEMA:
            raise ValueError(f"not a {REPORT_SCHEMA} report (schema {data.get('schema')!r})")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known and k != "extra"}
        kw["stragglers"] = [StragglerEntry(**{**s, "context": [ContextSignal(**c) for c in s.get("context", [])],
                                              "code": [CodeSite(**c) for c in s.get("code", [])]})
                            for s in data["stragglers"]]  # fmt: skip
        kw["minor"] = [MinorEntry(**m) for m in data.get("minor") or []]
        kw["busy_unavailable"] = [Unavailable(**u) for u in data["busy_unavailable"]]
        kw["group_imbalance"] = [GroupEntry(**g) for g in data["group_imbalance"]]
        kw["ranks"] = [RankRow(**r) for r in data["ranks"]]
        if data.get("imbalance") is not None:
            kw["imbalance"] = ImbalanceEntry(**data["imbalance"])
        if data.get("events") is not None:
            kw["events"] = Events(**data["events"])
        if data.get("attempts") is not None:
            kw["attempts"] = [Attempt(**a) for a in data["attempts"]]
        return cls(**kw, extra={k: v for k, v in data.items() if k not in known})


#: Keys the JSON has only when the analysis had their source.
_OPTIONAL = {"arrivals", "lost_split", "jitter_tax", "run_dir", "events", "attempts", "log_events",
             "first_failure", "log_lines", "log_skipped_lines", "flight_recorder", "hang_verdict", "imbalance",
             "unpaired"}


_SCALARS = frozenset({int, float, str, bool})
#: Dataclasses whose fields are scalars or None only: a dict of their fields is a copy of their attributes.
_FLAT = frozenset({RankRow})


def _plain(value: Any) -> Any:
    """``value`` as plain lists and dicts, its dataclasses as dicts of their fields (as ``asdict`` gives, without
    its deep copies of every value: a report of thousands of ranks is converted at every live update)."""
    if value is None or type(value) in _SCALARS:  # most values: said first
        return value
    if type(value) in _FLAT:  # a row per rank: its fields are scalars
        return value.__dict__.copy()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    names = getattr(type(value), "__dataclass_fields__", None)
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    return value
