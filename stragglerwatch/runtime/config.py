"""Everything ``attach`` can be told, in one place: :class:`Config`.

Design: each field is an ``attach`` keyword argument of the same name; a few can also come
from the job's environment (``STRAGGLERWATCH_*``), so a launcher can switch them on without
touching the training script. An argument given to ``attach`` wins over the environment,
which wins over the default. :meth:`Config.resolve` applies that order once, at attach
time; nothing reads the environment afterwards.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from stragglerwatch._units import parse_slowdown
from stragglerwatch.analysis.policy import CAUSES as STRAGGLER_CAUSES
from stragglerwatch.analysis.policy import ActRule
from stragglerwatch.runtime.log import Problems

#: Environment variable of each field that has one.
ENV = {
    "run_dir": "STRAGGLERWATCH_RUN_DIR",
    "run_id": "STRAGGLERWATCH_RUN_ID",
    "prometheus_port": "STRAGGLERWATCH_PROMETHEUS_PORT",
    "prometheus_addr": "STRAGGLERWATCH_PROMETHEUS_ADDR",
    "prometheus_mode": "STRAGGLERWATCH_PROMETHEUS_MODE",
    "sd_dir": "STRAGGLERWATCH_SD_DIR",
    "debug_server_port": "STRAGGLERWATCH_DEBUG_SERVER_PORT",
    "debug_server_host": "STRAGGLERWATCH_DEBUG_SERVER_HOST",
    "timing": "STRAGGLERWATCH_TIMING",
    "code_sample_hz": "STRAGGLERWATCH_CODE_SAMPLE_HZ",
    "on_hang": "STRAGGLERWATCH_ON_HANG",
    "hang_abort_s": "STRAGGLERWATCH_HANG_ABORT_S",
    "hang_silent_s": "STRAGGLERWATCH_HANG_SILENT_S",
    "on_straggler": "STRAGGLERWATCH_ON_STRAGGLER",
    "straggler_after_s": "STRAGGLERWATCH_STRAGGLER_AFTER_S",
    "exclude_file": "STRAGGLERWATCH_EXCLUDE_FILE",
}
DISABLE_ENV = "STRAGGLERWATCH_DISABLE"
#: Values of ``prometheus_mode``: the exporter's series (``exporter.py``'s docstring).
MODES = ("full", "lean")
#: Values of ``timing``: which clock times the phases (``devices.py``).
TIMINGS = ("auto", "host", "cuda")
#: Values of ``on_hang``: record the hang (the default), or also end the job's ranks (docs/policies.md).
HANG_POLICIES = ("record", "abort")
#: The built-in action of ``on_straggler``: write the straggler's host into exclusion files.
EXCLUDE = "exclude"
#: The default and the highest rate of the code sampler (samples per second).
CODE_HZ, MAX_CODE_HZ = 20.0, 200.0


def _env_port(from_env: dict[str, Any], name: str, lowest: int, consequence: str, problems: Problems | None) -> None:
    """``from_env[name]`` as a port number (at least ``lowest``); a value that is not one is reported and dropped."""
    if name not in from_env:
        return
    try:
        from_env[name] = int(from_env[name])
        if not lowest <= from_env[name] < 65536:
            raise ValueError
    except ValueError:
        if problems is not None:
            problems.report("config", f"{ENV[name]}={from_env[name]!r} is not a port: {consequence}", key=name)
        del from_env[name]


def _env_policies(from_env: dict[str, Any], problems: Problems | None) -> None:
    """The policies' settings from the environment; a value that cannot be used is reported and dropped."""

    def drop(name: str, consequence: str) -> None:
        if problems is not None:
            problems.report("config", f"{ENV[name]}={from_env[name]!r} {consequence}", key=name)
        del from_env[name]

    if "on_hang" in from_env:
        from_env["on_hang"] = from_env["on_hang"].lower()
        if from_env["on_hang"] not in HANG_POLICIES:
            drop("on_hang", "is not 'record' or 'abort': hangs are recorded only")
    if "on_straggler" in from_env:
        from_env["on_straggler"] = from_env["on_straggler"].lower()
        if from_env["on_straggler"] != EXCLUDE:
            drop("on_straggler", f"is not {EXCLUDE!r} (a callable is given to attach()): no straggler action")
    for name in ("hang_abort_s", "hang_silent_s", "straggler_after_s"):
        if name in from_env:
            try:
                from_env[name] = float(from_env[name])
                if not (from_env[name] > 0 if name.startswith("hang_") else from_env[name] >= 0):
                    raise ValueError
            except ValueError:
                drop(name, "is not a number of seconds: the default is used")


class ConfigError(ValueError):
    """A setting that cannot be used; the message is one line for the user."""


#: The words a boolean setting is read from (any case).
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: ``STRAGGLERWATCH_*`` variables that other parts read (the dashboard, the command line, the test suite): not
#: a typo of a setting's.
OTHER_ENV = {"STRAGGLERWATCH_DEBUG", "STRAGGLERWATCH_HOST", "STRAGGLERWATCH_PORT", "STRAGGLERWATCH_MAX_RUNS",
             "STRAGGLERWATCH_POLL_S", "STRAGGLERWATCH_REFRESH_MS", "STRAGGLERWATCH_SOURCE", "STRAGGLERWATCH_THREADS",
             "STRAGGLERWATCH_WORKERS", "STRAGGLERWATCH_REQUIRE_ALL", "STRAGGLERWATCH_NODE_DIR",
             "STRAGGLERWATCH_TEST_CONTEND", "STRAGGLERWATCH_WINDOW_STEPS"}  # fmt: skip


def parse_bool(name: str, value: Any) -> bool:
    """A boolean setting: True or False, 1 or 0, or one of :data:`TRUE_WORDS` / :data:`FALSE_WORDS`;
    :class:`ConfigError` for anything else ("no" is not True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ConfigError(f"{name}={value!r} is not a boolean (True or False; or one of "
                      f"{', '.join(TRUE_WORDS + FALSE_WORDS)})")  # fmt: skip


def _env_disables(value: str, problems: Problems | None) -> bool:
    """``$STRAGGLERWATCH_DISABLE`` read as every boolean is; a value that is none is reported, and disables (what
    its setter most likely meant)."""
    try:
        return parse_bool(DISABLE_ENV, value)
    except ConfigError as exc:
        if problems is not None:
            problems.report("config", f"{exc}: stragglerwatch is disabled", key="disable")
        return True


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """The ``STRAGGLERWATCH_*`` variables of ``env`` that no part of stragglerwatch reads (a typo, most often)."""
    known = set(ENV.values()) | {DISABLE_ENV} | OTHER_ENV
    return sorted(k for k in env if k.startswith("STRAGGLERWATCH_") and k not in known)


@dataclass(frozen=True)
class Config:
    """How one model is watched. Every field is also an ``attach`` keyword argument."""

    run_dir: str | os.PathLike[str] | None = None
    """Where all ranks write. Default: ``$STRAGGLERWATCH_RUN_DIR``, else
    ``./stragglerwatch-runs/<run id>``."""

    run_id: str | None = None
    """The run's name in reports, Prometheus labels and target files (``$STRAGGLERWATCH_RUN_ID``).
    Default: the run dir's name plus a suffix unique to the job, or the run id already in the run
    dir's ``run.json`` (a restart continues its run)."""

    optimizer: Any = None
    """The optimizer whose ``step()`` ends a training step. Default: the last optimizer to step
    in an iteration, learned from the first one. Every optimizer's ``step()`` is optimizer time."""

    watchdog_timeout_s: float | None = None
    """Seconds without progress before the watchdog records a stall. Default ``None`` adapts: 10x
    the median recent step, at least 10 s (60 s until three steps are done); ``0`` turns it off."""

    native_stacks: bool = True
    """Also dump the stacks of a rank stuck in native code holding the GIL (which the watchdog
    thread cannot do), with ``faulthandler`` on a timer into ``stacks-NNNNN.txt``. Turn it off
    if the application arms ``faulthandler.dump_traceback_later`` itself (there is only one)."""

    prometheus_port: int | None = None
    """Serve ``/metrics`` on this port plus the local rank (``$STRAGGLERWATCH_PROMETHEUS_PORT``).
    Default: no exporter."""

    prometheus_addr: str | None = None
    """The exporter's bind address (``$STRAGGLERWATCH_PROMETHEUS_ADDR``). Default ``0.0.0.0``."""

    prometheus_mode: str | None = None
    """Which series the exporter serves (``$STRAGGLERWATCH_PROMETHEUS_MODE``): ``"full"`` (the default:
    histograms of step, busy and phase times, every context gauge; 239 series a CPU rank, 260 a GPU
    rank, plus 3 to 7 of the code sampler) or ``"lean"`` (the same names as summaries without
    buckets, only the context the dashboards show; 41 a CPU rank, 50 to 57 a GPU rank, plus the
    code sampler's), for jobs of a thousand ranks and more. The shipped
    rules and dashboards work with both."""

    sd_dir: str | os.PathLike[str] | None = None
    """Where the exporter writes its file_sd target file (``$STRAGGLERWATCH_SD_DIR``). Default:
    the run dir."""

    role: str | None = None
    """This rank's peer group, e.g. ``"stage3"`` of a pipeline: ranks are compared only within it. Default:
    taken from the ``PipelineStage`` that runs the model (``pp=<its place in the pipeline>``) and from the
    device mesh's dimensions that are not data parallel (``tp=1``); none for plain data parallelism."""

    bucket_timings: bool = False
    """Also record each gradient bucket's ready time and all-reduce duration, through a DDP
    communication hook (costs host time per bucket)."""

    comm_hook: Any = None
    """``(state, hook)``: your own DDP communication hook, registered and timed by stragglerwatch
    (implies ``bucket_timings``; PyTorch allows one comm hook per model)."""

    flush_interval_s: float = 1.0
    """How often the log thread writes the finished steps (and the most a crash can lose)."""

    fsync_interval_s: float = 10.0
    """How often the step log is also fsynced: what a machine crash (not a process crash) can lose."""

    context_interval_s: float = 1.0
    """Seconds between two samples of the rank's host and GPU context (CPU pressure and steal, its
    threads' scheduling, its data-loader workers, memory; the GPU's clocks, throttle reasons, heat,
    power and errors through NVML), taken on a background thread into ``context-NNNNN.arrows``.
    At least 1 s; ``0`` turns the sampler off."""

    code_sample_hz: float | None = None
    """How often a background thread looks at where in the code the training thread is
    (``$STRAGGLERWATCH_CODE_SAMPLE_HZ``), so that ``analyze`` can name the code locations of a slow
    rank's excess (``code-NNNNN.arrows``). Default 20 per second (its cost: docs/accuracy-overhead.md);
    ``0`` turns it off; at most 200."""

    debug_server_port: int | None = None
    """Serve this rank's live state and runtime controls in PyTorch's debug server
    (``$STRAGGLERWATCH_DEBUG_SERVER_PORT``; ``debugserver.py``): every rank starts a worker server on
    an ephemeral port, and rank 0 the frontend on this port (``0``: an ephemeral one, logged), with the
    page ``/stragglerwatch``. Default: none (opt-in)."""

    debug_server_host: str | None = None
    """The debug server's bind address, for the ranks' worker servers and rank 0's frontend
    (``$STRAGGLERWATCH_DEBUG_SERVER_HOST``). Default ``127.0.0.1``: only this machine can connect;
    give the node's address (on a trusted network) for a job of several nodes."""

    control_interval_s: float = 1.0
    """How often the rank looks (one ``stat``) for a new request in the run dir's ``control.json``,
    written by ``stragglerwatch control RUN_DIR --set ...``: one rank per host looks at the shared file and
    copies it to a node-local directory (``$STRAGGLERWATCH_NODE_DIR``, else ``/dev/shm``), where the
    host's other ranks look; ``0`` turns the control file off."""

    timing: str | None = None
    """Which clock times the phases (``$STRAGGLERWATCH_TIMING``): ``"cuda"`` (events on the compute
    stream, read lazily), ``"host"`` (``perf_counter``), or ``"auto"`` (the default): ``cuda`` when
    the model computes on a GPU (its device mesh, DDP's device, any parameter or buffer on CUDA, or an
    NCCL job's current device), else ``host``."""

    close_timeout_s: float = 5.0
    """The most ``close()`` (and exit) waits for the GPU to finish the last steps' events and for
    the log thread; steps still unresolved then are counted (``unresolved_steps``) and recorded in
    an ``unresolved`` event, never waited for."""

    on_hang: str | None = None
    """What a confirmed hang does (``$STRAGGLERWATCH_ON_HANG``): ``"record"`` (the default: the events,
    stacks and Flight Recorder dump) or ``"abort"``: a rank still stalled half of ``hang_abort_s`` after
    its diagnosis, while the culprit it waits for has made no progress (CPU time, I/O, Python running,
    collectives, GPU) for as long, ends: on gloo it aborts its process groups, lets its SIGTERM handler
    run where the main thread can run it, and exits with status 75 (``HANG_EXIT_STATUS``) by
    ``hang_abort_s``; on NCCL it exits with status 75 at once, running no application code (its state
    may be corrupted; see ``hang_handler``). ``torchrun --max-restarts`` or the scheduler then restarts
    the job from its last checkpoint before the collective timeout (the Policies page)."""

    hang_abort_s: float | None = None
    """With ``on_hang="abort"``: the most seconds from a rank's diagnosis (or, where its culprit was busy,
    its decision) to its exit (``$STRAGGLERWATCH_HANG_ABORT_S``). The first half is waited for (a culprit
    busy or silent is waited for longer), the second half is for the SIGTERM handler. Default: twice the
    watchdog's threshold at the stall. Only a bound chosen here arms faulthandler's exit for a rank
    holding the GIL in native code (at the watchdog's threshold + 2 s + this bound)."""

    hang_silent_s: float = 300.0
    """With ``on_hang="abort"``: how long a culprit that leaves no note (its watchdog cannot run: dead, or
    holding the GIL in native code, as a large pickle does) must have been silent before the others act,
    where its process cannot be read from their host (``$STRAGGLERWATCH_HANG_SILENT_S``)."""

    hang_handler: Any = None
    """With ``on_hang="abort"``: a callable run on the watchdog thread before the rank ends, bounded by
    ``hang_abort_s``, and told a dict (``rank``, ``stall_id``, ``culprit_ranks``, ``victim_ranks``,
    ``step``, ``phase``, ``backend``, ``state_suspect``). On NCCL it is the only application code that runs:
    ``state_suspect`` is True there (queued kernels may have run on half-reduced buffers: save nothing
    you will resume from). Default: none."""

    on_straggler: Any = None
    """What rank 0 does when a rank stays flagged as a straggler (``$STRAGGLERWATCH_ON_STRAGGLER``):
    ``"exclude"`` (write its host into ``exclude_file``), a callable that receives the verdict (a dict:
    rank, host, cause, since, flagged_s, slowdown, lost_seconds, hints, host_evidence, exclude,
    not_excluded, ...), or a list of these. Once per episode, never for load imbalance, a cause not in
    ``straggler_causes`` or a rank busier by design (rank 0's duties, an unlabelled pipeline stage); the
    ``"exclude"`` action only with the evidence of ``exclude_needs_evidence``. Default: none."""

    straggler_after_s: float | None = None
    """How long (seconds of the job's steps) a rank must have been flagged, and still be, before
    ``on_straggler`` acts (``$STRAGGLERWATCH_STRAGGLER_AFTER_S``). Default 300 (``ActRule.after_s``)."""

    straggler_min_slowdown: float = ActRule.min_slowdown
    """The least slowdown (busy time over its peers', for the same work, as a ratio: ``1.15``, ``"1.15x"`` or
    ``"15%"``) that ``on_straggler`` acts on: above the detector's flag, so that the few-percent drift a
    healthy node wanders by never acts."""

    straggler_min_steps: int = ActRule.min_steps
    """The fewest steps a rank must have been flagged for before ``on_straggler`` acts: a chance run
    of slow steps in noisy jobs lasts tens of steps, never this many."""

    straggler_causes: tuple[str, ...] = STRAGGLER_CAUSES
    """The causes ``on_straggler`` acts on (``data``, ``compute``, ``optimizer``, ``other``)."""

    exclude_file: str | os.PathLike[str] | None = None
    """Where ``on_straggler="exclude"`` writes (``$STRAGGLERWATCH_EXCLUDE_FILE``): the hosts one a line,
    and beside it ``<file>.slurm``, the same hosts as one Slurm hostlist (``--exclude``). Default:
    ``excluded-hosts.txt`` in the run dir."""

    exclude_needs_evidence: bool = True
    """``on_straggler="exclude"`` acts only on a cause a node change can fix, with a signal of that node
    behind it: ``compute`` or ``optimizer`` with its GPU's (clock, throttling, errors) or its host's CPU
    contention, ``data`` with its host's I/O pressure or its loader's CPUs or memory taken, never
    ``other``. ``False``: every cause but ``other`` of ``straggler_causes``, with or without evidence."""

    exclude_expire_s: float | None = 3 * 86400.0
    """How long a host stays in ``exclude_file``: a line added longer ago is dropped when the file is next
    written (and when rank 0's policy starts). ``None``: never. Default three days."""

    straggler_window_steps: int = 2000
    """The steps of every rank the analysis behind ``on_straggler`` keeps (in a process of its own, about
    100 bytes a rank a step); an episode longer than that is followed from window to window."""

    policy_interval_s: float = 30.0
    """How often rank 0 analyses the run dir for ``on_straggler`` (in a child process of lower priority)."""

    enabled: bool = True
    """``False`` (or ``$STRAGGLERWATCH_DISABLE=1``) makes ``attach`` a no-op returning an inert handle."""

    def __post_init__(self) -> None:
        """Each setting checked where it is given: a boolean given as a word is read strictly, a number must
        be one, and the values must make sense together (:meth:`check`); :class:`ConfigError` otherwise."""
        try:  # a slowdown, as everywhere: a ratio, also as text ("1.15x", "15%")
            object.__setattr__(self, "straggler_min_slowdown",
                               parse_slowdown("straggler_min_slowdown", self.straggler_min_slowdown))  # fmt: skip
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for f in fields(self):
            kind = str(f.type).replace(" | None", "").strip()
            value = getattr(self, f.name)
            if value is None or kind not in ("bool", "int", "float"):
                continue
            if kind == "bool":
                object.__setattr__(self, f.name, parse_bool(f.name, value))
            elif isinstance(value, bool) or not isinstance(value, numbers.Real) or (
                    kind == "int" and not isinstance(value, numbers.Integral)):  # fmt: skip
                what = "an integer" if kind == "int" else "a number"
                raise ConfigError(f"{f.name}={value!r} is not {what}")
        self.check()

    @classmethod
    def resolve(
        cls,
        base: Config | None = None,
        environ: Mapping[str, str] | None = None,
        problems: Problems | None = None,
        **given: Any,
    ) -> Config:
        """``base`` (or the defaults), then the environment, then the arguments ``given`` (those not
        None). Raises :class:`ConfigError` for an argument that cannot be used; an environment
        value that cannot is reported to ``problems`` and ignored (a typo in a launcher's
        environment must not stop the job)."""
        env = os.environ if environ is None else environ
        config = base or cls()
        from_env: dict[str, Any] = {}
        for name, var in ENV.items():
            value = env.get(var, "").strip()
            if value and getattr(config, name) is None:
                from_env[name] = value
        _env_port(from_env, "prometheus_port", 1, "no exporter", problems)
        if "prometheus_mode" in from_env:
            from_env["prometheus_mode"] = from_env["prometheus_mode"].lower()
            if from_env["prometheus_mode"] not in MODES:
                if problems is not None:
                    problems.report("config", f"{ENV['prometheus_mode']}={from_env['prometheus_mode']!r} is not "
                                    "'full' or 'lean': the exporter serves the full series",
                                    key="prometheus_mode")  # fmt: skip
                del from_env["prometheus_mode"]
        _env_port(from_env, "debug_server_port", 0, "no debug server", problems)
        if "timing" in from_env:
            from_env["timing"] = from_env["timing"].lower()
            if from_env["timing"] not in TIMINGS:
                if problems is not None:
                    problems.report("config", f"{ENV['timing']}={from_env['timing']!r} is not one of "
                                    f"{', '.join(TIMINGS)}: timing is chosen automatically", key="timing")  # fmt: skip
                del from_env["timing"]
        if "code_sample_hz" in from_env:
            try:
                from_env["code_sample_hz"] = float(from_env["code_sample_hz"])
                if not 0 <= from_env["code_sample_hz"] <= MAX_CODE_HZ:
                    raise ValueError
            except ValueError:
                if problems is not None:
                    problems.report("config", f"{ENV['code_sample_hz']}={from_env['code_sample_hz']!r} is not a "
                                    f"rate from 0 to {MAX_CODE_HZ:g}: the default rate is used",
                                    key="code_sample_hz")  # fmt: skip
                del from_env["code_sample_hz"]
        _env_policies(from_env, problems)
        typos = unknown_env(env)
        if typos and problems is not None:
            problems.report("config", f"{', '.join(typos)}: no such setting, ignored (the settings' variables: "
                            "docs, Instrumenting, Settings)", key="unknown-env")  # fmt: skip
        if env.get(DISABLE_ENV, "").strip() and _env_disables(env[DISABLE_ENV], problems):
            from_env["enabled"] = False
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown}")
        explicit = {k: v for k, v in given.items() if v is not None}
        if from_env.get("enabled") is False:
            explicit.pop("enabled", None)
        config = replace(config, **{**from_env, **explicit})
        config.check()
        return config

    def check(self) -> None:
        if self.flush_interval_s <= 0 or self.fsync_interval_s < 0:
            raise ConfigError("flush_interval_s must be > 0 and fsync_interval_s >= 0")
        if self.watchdog_timeout_s is not None and self.watchdog_timeout_s < 0:
            raise ConfigError("watchdog_timeout_s must be >= 0 (0 turns the watchdog off)")
        if self.context_interval_s != 0 and not self.context_interval_s >= 1.0:
            raise ConfigError(f"context_interval_s must be >= 1 (or 0: no sampling), not {self.context_interval_s}")
        if self.prometheus_port is not None and not 0 < int(self.prometheus_port) < 65536:
            raise ConfigError(f"prometheus_port {self.prometheus_port} is not a port")
        if self.debug_server_port is not None and not 0 <= int(self.debug_server_port) < 65536:
            raise ConfigError(f"debug_server_port {self.debug_server_port} is not a port (0: an ephemeral one)")
        if self.control_interval_s != 0 and not self.control_interval_s >= 0.1:
            raise ConfigError(f"control_interval_s must be >= 0.1 (or 0: no control file), "
                              f"not {self.control_interval_s}")
        if self.timing is not None and self.timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, not {self.timing!r}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s must be >= 0, not {self.close_timeout_s}")
        if self.code_sample_hz is not None and not 0 <= self.code_sample_hz <= MAX_CODE_HZ:
            raise ConfigError(f"code_sample_hz must be from 0 (off) to {MAX_CODE_HZ:g}, not {self.code_sample_hz}")
        if self.prometheus_mode is not None and self.prometheus_mode not in MODES:
            raise ConfigError(f"prometheus_mode must be 'full' or 'lean', not {self.prometheus_mode!r}")
        self._check_policies()

    def _check_policies(self) -> None:
        if self.on_hang is not None and self.on_hang not in HANG_POLICIES:
            raise ConfigError(f"on_hang must be 'record' or 'abort', not {self.on_hang!r}")
        if self.hang_abort_s is not None and not self.hang_abort_s > 0:
            raise ConfigError(f"hang_abort_s must be > 0 (seconds from diagnosis to exit), not {self.hang_abort_s}")
        if not self.hang_silent_s > 0:
            raise ConfigError(f"hang_silent_s must be > 0 (seconds), not {self.hang_silent_s}")
        if self.hang_handler is not None and not callable(self.hang_handler):
            raise ConfigError(f"hang_handler must be a callable that takes a dict, not {self.hang_handler!r}")
        if self.on_hang == "abort" and self.watchdog_timeout_s == 0:
            raise ConfigError("on_hang='abort' needs the watchdog, which watchdog_timeout_s=0 turns off")
        for action in self.straggler_actions():
            if not callable(action) and action != EXCLUDE:
                raise ConfigError(f"on_straggler takes {EXCLUDE!r}, a callable or a list of these, not {action!r}")
        if self.straggler_after_s is not None and not self.straggler_after_s >= 0:
            raise ConfigError(f"straggler_after_s must be >= 0, not {self.straggler_after_s}")
        if not self.straggler_min_slowdown > 1.0:
            raise ConfigError(f"straggler_min_slowdown must be a slowdown ratio above 1 (1.15: 15% busier than its "
                              f"peers), not {self.straggler_min_slowdown}")  # fmt: skip
        if self.straggler_min_steps < 1:
            raise ConfigError(f"straggler_min_steps must be >= 1, not {self.straggler_min_steps}")
        unknown = sorted(set(self.straggler_causes) - set(STRAGGLER_CAUSES))
        if isinstance(self.straggler_causes, str) or unknown:
            raise ConfigError(f"straggler_causes is a tuple of {', '.join(STRAGGLER_CAUSES)}, "
                              f"not {self.straggler_causes!r}")
        if not self.policy_interval_s >= 0.5:
            raise ConfigError(f"policy_interval_s must be >= 0.5, not {self.policy_interval_s}")
        if not isinstance(self.exclude_needs_evidence, bool):
            raise ConfigError(f"exclude_needs_evidence is True or False, not {self.exclude_needs_evidence!r}")
        if self.exclude_expire_s is not None and not self.exclude_expire_s > 0:
            raise ConfigError(f"exclude_expire_s must be > 0 seconds (or None: never), not {self.exclude_expire_s}")
        if not (isinstance(self.straggler_window_steps, int) and self.straggler_window_steps >= 256):
            raise ConfigError(f"straggler_window_steps must be an integer >= 256, not {self.straggler_window_steps!r}")

    def act_rule(self) -> ActRule:
        """The rule ``on_straggler`` acts by."""
        after = ActRule.after_s if self.straggler_after_s is None else float(self.straggler_after_s)
        return ActRule(after, float(self.straggler_min_slowdown), int(self.straggler_min_steps),
                       tuple(self.straggler_causes), bool(self.exclude_needs_evidence))  # fmt: skip

    def straggler_actions(self) -> list[Any]:
        """``on_straggler`` as a list of actions (empty: none)."""
        if self.on_straggler is None:
            return []
        return list(self.on_straggler) if isinstance(self.on_straggler, (list, tuple)) else [self.on_straggler]
