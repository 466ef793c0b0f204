"""NVML through ctypes (no package needed): a GPU's energy counter, SM clock and power, and a
thread that samples the clocks while a step runs.

A step's GEMMs run at the GPUs' power cap, where a kernel that draws more power runs at
lower clocks (docs/measurements.md, "What the step does show"): `ClockSampler` records what
the clocks were while each variant ran, so that two variants' kernels can be compared at
the clocks they actually had. Off a GPU (no libnvidia-ml) there are no GPUs and nothing is
sampled.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time

CLOCK_SM = 1  # NVML_CLOCK_SM
# NVML's clock-event reasons (nvmlClocksEventReasons): why the clocks are below the maximum
CLOCK_EVENT_REASONS = {0x1: "idle", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                       0x20: "sync_boost", 0x40: "sw_thermal", 0x80: "hw_thermal",
                       0x100: "hw_power_brake"}


def _library():
  try:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
  except OSError:
    return None
  return lib if lib.nvmlInit_v2() == 0 else None


class Gpu:
  """One GPU's counters by NVML index (NVML's order, not CUDA_VISIBLE_DEVICES'); each
  reading None where NVML fails."""

  def __init__(self, lib, index: int):
    self.lib, self.index = lib, index
    self.handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)):
      self.lib = None

  def _read(self, fn: str, *args, value_type=ctypes.c_uint):
    value = value_type()
    if self.lib and not getattr(self.lib, fn)(self.handle, *args, ctypes.byref(value)):
      return value.value
    return None

  def energy_mj(self) -> int | None:
    """mJ since the driver loaded."""
    return self._read("nvmlDeviceGetTotalEnergyConsumption", value_type=ctypes.c_ulonglong)

  def sm_mhz(self) -> int | None:
    return self._read("nvmlDeviceGetClockInfo", CLOCK_SM)

  def power_w(self) -> float | None:
    mw = self._read("nvmlDeviceGetPowerUsage")
    return None if mw is None else mw / 1e3

  def clock_event_reasons(self) -> int | None:
    """The bit mask of ``CLOCK_EVENT_REASONS`` active now."""
    return self._read("nvmlDeviceGetCurrentClocksEventReasons", value_type=ctypes.c_ulonglong)


def gpus() -> list[Gpu]:
  """Every GPU NVML sees, or [] without NVML (CPU)."""
  lib = _library()
  if lib is None:
    return []
  count = ctypes.c_uint()
  if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)):
    return []
  return [Gpu(lib, i) for i in range(count.value)]


class ClockSampler:
  """Inside ``with``: each GPU's SM clock, power and clock-event reasons every ``period_s``,
  from a thread (the NVML calls release the GIL, so the host keeps dispatching).
  ``summary()``: per GPU index, the clock's mean, 10th percentile, median and minimum in MHz,
  the mean power in W, the sample count and, where NVML gives them, the share of samples
  with each reason (``CLOCK_EVENT_REASONS``); None with no GPU or no sample."""

  def __init__(self, devices: list, period_s: float = 0.002):
    self.devices, self.period_s = devices, period_s
    self.samples: dict[int, list[tuple[int, float | None]]] = {d.index: [] for d in devices}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      for d in self.devices:
        mhz = d.sm_mhz()
        if mhz is not None:
          self.samples[d.index].append((mhz, d.power_w(), d.clock_event_reasons()))
      time.sleep(self.period_s)

  def __enter__(self):
    if self.devices:
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()

  def summary(self) -> dict[int, dict] | None:
    out = {}
    for index, samples in self.samples.items():
      if not samples:
        continue
      mhz = sorted(m for m, _, _ in samples)
      watts = [w for _, w, _ in samples if w is not None]
      out[index] = dict(mean_mhz=statistics.fmean(mhz), p10_mhz=mhz[len(mhz) // 10],
                        median_mhz=statistics.median(mhz), min_mhz=mhz[0],
                        mean_w=statistics.fmean(watts) if watts else None,
                        samples=len(mhz))
      masks = [r for _, _, r in samples if r is not None]
      if masks:
        out[index]["reasons"] = {name: sum(bool(r & bit) for r in masks) / len(masks)
                                 for bit, name in CLOCK_EVENT_REASONS.items()}
    return out or None
