"""GPU context of one rank through NVML: clocks and why they are held down, heat, power, errors.

Design: :func:`open_gpu` finds the rank's device in NVML (by the UUID torch reports for it, else
by ``CUDA_VISIBLE_DEVICES``), and :class:`GpuSampler` reads it at each sample: SM clock and its
maximum, the current clock event reasons (the "throttle reasons": a bitmask, decoded with
:func:`decode_reasons`), temperature, power and its enforced limit, utilisation, volatile ECC
error counts, the PCIe replay counter, the NVLink error counters of its active links, and the XID
critical errors NVML delivered since the previous sample (an event set polled with a zero timeout:
NVML has no other way to read them). The NVML module (``pynvml``, from the ``nvidia-ml-py``
package: the ``gpu`` extra) is imported only here, only for a rank on a GPU.

No NVML, no driver, no GPU, a query the device does not support: all normal and silent (the
field is NaN and is not asked again). Nothing here raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

NAN = float("nan")

#: Fields of a GPU sample, and their values on a rank without a GPU.
EMPTY: dict[str, Any] = {
    "gpu": -1, "gpu_uuid": "", "sm_clock_mhz": NAN, "sm_clock_max_mhz": NAN, "clock_reasons": -1,
    "temperature_c": NAN, "power_w": NAN, "power_limit_w": NAN, "gpu_util": NAN, "ecc_uncorrected": NAN,
    "ecc_corrected": NAN, "pcie_replays": NAN, "nvlink_errors": NAN, "xid_events": 0, "xid": 0,
}  # fmt: skip
#: NVML errors that mean "this device cannot say": the field is unknown, silently.
_QUIET = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION",
          "NVML_ERROR_INVALID_ARGUMENT")  # fmt: skip


def load_nvml() -> Any:
    """The ``pynvml`` module, or None where it is not installed (silently)."""
    try:
        import pynvml
    except Exception:
        return None
    return pynvml


def _nvml_uuid(uuid: str) -> str:
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def cuda_uuid(index: int) -> str | None:
    """The UUID torch reports for CUDA device ``index`` (as NVML spells it), or None."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return _nvml_uuid(uuid) if uuid else None
    except Exception:
        return None


def _handle(nvml: Any, index: int, uuid: str | None) -> Any:
    if uuid:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible):
        entry = visible[index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(entry))
    return nvml.nvmlDeviceGetHandleByIndex(index)


def open_gpu(index: int, nvml: Any = None, uuid: str | None = None, on_error: Callable[[str, str], None] | None = None
             ) -> GpuSampler | None:  # fmt: skip
    """A sampler of CUDA device ``index`` of this process, or None without NVML or that device."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # no driver, no library: a machine without a GPU
        return None
    try:
        return GpuSampler(nvml, _handle(nvml, index, uuid or cuda_uuid(index)), on_error)
    except Exception:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        return None


class GpuSampler:
    """Reads one device; ``sample()`` returns the fields of :data:`EMPTY`."""

    def __init__(self, nvml: Any, handle: Any, on_error: Callable[[str, str], None] | None = None):
        self.nvml, self.handle, self.on_error = nvml, handle, on_error
        self._unsupported: set[str] = set()
        self.index = int(self._get("nvmlDeviceGetIndex", handle, default=-1))
        self.uuid = str(self._get("nvmlDeviceGetUUID", handle, default=""))
        self.max_sm = self._get("nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM)
        self.links = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
            state = self._get("nvmlDeviceGetNvLinkState", handle, link, default=None, remember=False)
            if state is None and link == 0:
                break  # no NVLink on this device
            if state == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                self.links.append(link)
        self.nvlink_counters = [getattr(nvml, f"NVML_NVLINK_ERROR_DL_{c}") for c in ("REPLAY", "RECOVERY", "CRC_FLIT",
                                "CRC_DATA") if hasattr(nvml, f"NVML_NVLINK_ERROR_DL_{c}")]  # fmt: skip
        self.xid_events, self.last_xid = 0, 0
        self._events = self._open_events()

    def _get(self, name: str, *args: Any, default: Any = NAN, remember: bool = True) -> Any:
        """``nvml.<name>(*args)``, or ``default`` where the device or the bindings cannot say."""
        if name in self._unsupported:
            return default
        nvml = self.nvml
        try:
            return getattr(nvml, name)(*args)
        except AttributeError:  # bindings older than the query
            self._unsupported.add(name)
        except Exception as exc:
            if getattr(exc, "value", None) in {getattr(nvml, n, None) for n in _QUIET}:
                if remember:
                    self._unsupported.add(name)
            elif self.on_error is not None:  # e.g. "GPU is lost": worth a line
                self.on_error(name, f"{type(exc).__name__}: {exc}")
        return default

    def _open_events(self) -> Any:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception:
            return None
        try:
            nvml.nvmlDeviceRegisterEvents(self.handle, nvml.nvmlEventTypeXidCriticalError, events)
            return events
        except Exception:  # not supported (or not allowed) here: no XIDs, silently
            try:
                nvml.nvmlEventSetFree(events)
            except Exception:
                pass
            return None

    def _drain_xids(self) -> None:
        nvml, xid_type = self.nvml, self.nvml.nvmlEventTypeXidCriticalError
        for _ in range(256):  # bounded: a storm of events is counted over several samples
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except Exception as exc:
                if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_TIMEOUT", 10):  # broke: stop polling
                    self._free_events()
                return
            if int(data.eventType) & xid_type:
                self.xid_events += 1
                self.last_xid = int(data.eventData)

    def _free_events(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            try:
                self.nvml.nvmlEventSetFree(events)
            except Exception:
                pass

    def _temperature(self) -> float:
        sensor = self.nvml.NVML_TEMPERATURE_GPU
        temp = self._get("nvmlDeviceGetTemperatureV", self.handle, sensor, default=None)  # drivers >= 570
        if temp is None:
            temp = self._get("nvmlDeviceGetTemperature", self.handle, sensor)
        return float(temp)

    def _reasons(self) -> int:
        mask = self._get("nvmlDeviceGetCurrentClocksEventReasons", self.handle, default=None)
        if mask is None:
            mask = self._get("nvmlDeviceGetCurrentClocksThrottleReasons", self.handle, default=None)
        return -1 if mask is None else int(mask)

    def sample(self) -> dict[str, Any]:
        nvml, h, get = self.nvml, self.handle, self._get
        util = get("nvmlDeviceGetUtilizationRates", h, default=None)
        power, limit = get("nvmlDeviceGetPowerUsage", h), get("nvmlDeviceGetEnforcedPowerLimit", h)
        ecc = {kind: get("nvmlDeviceGetTotalEccErrors", h, getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{kind.upper()}"),
                         nvml.NVML_VOLATILE_ECC) for kind in ("uncorrected", "corrected")}  # fmt: skip
        nvlink = NAN
        if self.links and self.nvlink_counters:
            counts = [get("nvmlDeviceGetNvLinkErrorCounter", h, link, c) for link in self.links
                      for c in self.nvlink_counters]  # fmt: skip
            known = [c for c in counts if c == c]
            nvlink = float(sum(known)) if known else NAN
        if self._events is not None:
            self._drain_xids()
        return {
            "gpu": self.index, "gpu_uuid": self.uuid,
            "sm_clock_mhz": float(get("nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": float(self.max_sm), "clock_reasons": self._reasons(),
            "temperature_c": self._temperature(),
            "power_w": power / 1000.0, "power_limit_w": limit / 1000.0,
            "gpu_util": float(util.gpu) / 100.0 if util is not None else NAN,
            "ecc_uncorrected": float(ecc["uncorrected"]), "ecc_corrected": float(ecc["corrected"]),
            "pcie_replays": float(get("nvmlDeviceGetPcieReplayCounter", h)), "nvlink_errors": nvlink,
            "xid_events": self.xid_events, "xid": self.last_xid,
        }  # fmt: skip

    def close(self) -> None:
        self._free_events()
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass
