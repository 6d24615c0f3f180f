"""A stand-in for the ``pynvml`` module (nvidia-ml-py) on machines without a GPU: the real
library's function names, signatures, constants and error type, over devices whose state a test
sets. ``tests/test_context.py`` checks the signatures against the installed bindings."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
nvmlEventTypeXidCriticalError = 0x8
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NVML_ERROR_GPU_IS_LOST: "GPU is lost", NVML_ERROR_NOT_SUPPORTED: "Not Supported"}.get(
            self.value, f"NVML Error with code {self.value}"
        )


@dataclass
class Device:
    """The state of one fake GPU; a field set to None is NOT_SUPPORTED on it."""

    index: int = 0
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    sm_clock: int | None = 1980
    sm_clock_max: int | None = 1980
    reasons: int | None = 0
    temperature: int | None = 60
    power_mw: int | None = 500_000
    power_limit_mw: int | None = 700_000
    util: int | None = 95
    ecc: dict[int, int] | None = field(default_factory=lambda: {0: 0, 1: 0})
    pcie_replays: int | None = 0
    nvlinks: int = 0  # active links
    nvlink_errors: int = 0  # per link and counter
    lost: bool = False  # every query fails with GPU_IS_LOST


@dataclass
class Utilization:
    gpu: int
    memory: int


@dataclass
class EventData:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


class FakeNVML(types.ModuleType):
    """``FakeNVML([Device(...), ...])``: put it in ``sys.modules["pynvml"]`` or pass it as ``nvml``."""

    def __init__(self, devices: list[Device], events_supported: bool = True, init_error: int | None = None,
                 old_driver: bool = False):  # fmt: skip
        super().__init__("pynvml")
        for name, value in globals().items():
            if name.isupper() or name.startswith("nvml"):
                setattr(self, name, value)
        self.NVMLError = NVMLError
        self.devices = devices
        self.events_supported = events_supported
        self.init_error = init_error
        self.old_driver = old_driver
        self.pending: list[EventData] = []  # XID events not yet delivered
        self.calls: list[str] = []
        self.initialized = 0

    def _dev(self, handle: Any) -> Device:
        dev = self.devices[handle]
        if dev.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return dev

    def _field(self, handle: Any, name: str) -> Any:
        value = getattr(self._dev(handle), name)
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    # the real library's entry points, with its parameter names
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.initialized -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        for i, d in enumerate(self.devices):
            if d.index == index:
                return i
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        for i, d in enumerate(self.devices):
            if d.uuid == uuid:
                return i
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._dev(handle).index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._dev(handle).uuid

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        assert type == NVML_CLOCK_SM
        return self._field(handle, "sm_clock")

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        assert type == NVML_CLOCK_SM
        return self._field(handle, "sm_clock_max")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._field(handle, "reasons")

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._field(handle, "temperature")

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int = 0x100000C) -> int:
        if self.old_driver:  # the driver's library predates the entry point
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self.nvmlDeviceGetTemperature(handle, sensor)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._field(handle, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._field(handle, "power_limit_mw")

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Utilization:
        return Utilization(self._field(handle, "util"), 0)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        assert counterType == NVML_VOLATILE_ECC
        return self._field(handle, "ecc")[errorType]

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._field(handle, "pcie_replays")

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        dev = self._dev(device)
        if dev.nvlinks == 0:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return NVML_FEATURE_ENABLED if link < dev.nvlinks else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        return self._dev(device).nvlink_errors

    def nvmlEventSetCreate(self) -> Any:
        return {"devices": []}

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        if not self.events_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        assert eventTypes == nvmlEventTypeXidCriticalError
        eventSet["devices"].append(handle)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> EventData:
        self.calls.append(f"wait {timeoutms}")
        for k, event in enumerate(self.pending):
            if event.device in eventSet["devices"]:
                return self.pending.pop(k)
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        eventSet["devices"].clear()

    def xid(self, handle: int, code: int) -> None:
        """The driver reports XID ``code`` on device ``handle``."""
        self.pending.append(EventData(handle, nvmlEventTypeXidCriticalError, code))
