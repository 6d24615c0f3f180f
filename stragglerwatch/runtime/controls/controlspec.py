"""What can change in a running rank, and the protocol of asking for it: the keys (:data:`CONTROL_KEYS`),
their parsers (:func:`parse_settings`), the control and acknowledgement files' names, and
:class:`ControlSurface`, the face of :class:`~stragglerwatch.runtime.controls.control.Controls` that the control
file, the debug server and its starter use (so that they need not import the controls, which start them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.runtime.log import Problems

#: The settings that can change at run time.
CONTROL_KEYS = ("recording", "watchdog_timeout_s", "flush_interval_s")
CONTROL_FILE = "control.json"
ACK_FILE = "control-ack-{rank:05d}.json"
DEBUG_SERVER_FILE = "debug-server.json"  # rank 0's frontend URL, while it runs (debugserver.py)
VERSION = 1
MAX_REQUESTS = 50
MAX_ACKS = 50
MIN_WATCHDOG_S = 0.5  # the watchdog polls every 0.2 s: a shorter threshold means nothing
FLUSH_RANGE_S = (0.05, 3600.0)
_ON = ("on", "true", "1", "yes")
_OFF = ("off", "false", "0", "no")
_AUTO = ("auto", "adaptive", "none", "default")


class ControlError(ValueError):
    """A control request that cannot be made; the message is one line for the user."""


def _number(key: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be a number of seconds, not {str(value)!r}") from None
    if not math.isfinite(x):
        raise ControlError(f"{key} must be a finite number of seconds, not {str(value)!r}")
    return x


def _parse_one(key: str, value: Any) -> Any:
    if key == "recording":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _ON or text in _OFF:
            return text in _ON
        raise ControlError(f"recording must be 'on' or 'off', not {str(value)!r}")
    if key == "watchdog_timeout_s":
        if value is None or str(value).strip().lower() in _AUTO:
            return None
        x = _number(key, value)
        if x == 0:
            raise ControlError("watchdog_timeout_s=0 (no watchdog) can only be chosen at attach; "
                               f"at run time give seconds (at least {MIN_WATCHDOG_S}) or 'auto'")  # fmt: skip
        if x < MIN_WATCHDOG_S:
            raise ControlError(f"watchdog_timeout_s must be at least {MIN_WATCHDOG_S} s or 'auto', not {value!r}")
        return x
    if key == "flush_interval_s":
        x = _number(key, value)
        lo, hi = FLUSH_RANGE_S
        if not lo <= x <= hi:
            raise ControlError(f"flush_interval_s must be between {lo} and {hi:g} s, not {value!r}")
        return x
    raise ControlError(f"unknown setting {key!r} (can change at run time: {', '.join(CONTROL_KEYS)})")


def parse_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The values of ``settings`` (strings as a URL or a command line gives them, or Python values),
    and one line per setting that cannot be used."""
    values, errors = {}, []
    if not settings:
        errors.append(f"nothing to change (give one or more of {', '.join(CONTROL_KEYS)})")
    for key, value in settings.items():
        try:
            values[str(key)] = _parse_one(str(key), value)
        except ControlError as exc:
            errors.append(str(exc))
    return values, errors


def show(key: str, value: Any) -> str:
    """A setting's value as the user writes it."""
    if key == "recording":
        return "on" if value else "off"
    if key == "watchdog_timeout_s" and value is None:
        return "auto"
    return f"{value:g} s" if isinstance(value, (int, float)) else str(value)


def clean(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None, so that it is valid JSON for any reader."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


class ControlSurface(Protocol):
    """What the control file, the debug server and its starter need of a rank's
    :class:`~stragglerwatch.runtime.controls.control.Controls` (a protocol: ``Controls`` starts them, so they do
    not import it)."""

    debug_server: Any

    @property
    def rank(self) -> int | None: ...

    @property
    def info(self) -> RunInfo | None: ...

    @property
    def problems(self) -> Problems: ...

    def apply(self, settings: Mapping[str, Any], source: str = ...) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...
