"""The GPU's SM clock, board power and clock-event reasons while a timed run executes.

A run that holds the GPU at its power limit runs at a lower SM clock than the burst ceilings
see (llama3.1-8b `nano` on an H100: 690 W of 700, 1,400-1,900 MHz against 1,980; measured
2026-11-23 at 12e5315, examples/benchmarks/RESULTS.md), and how low depends on the board. So
each timed run records what the GPU did during it. Samples come from NVML (ctypes, no extra
package) in a child process, `python -m batchgen.bench.gpu_power UUID INTERVAL` (samples on
stdout until its stdin closes), so the sampler never takes the GIL from the engine's host
loop. Where NVML or a CUDA device is missing, the summary is None and the reason is kept.
"""

from __future__ import annotations

import ctypes
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the sampler's child process must start without importing torch
    import torch

NVML_CLOCK_SM = 1
# nvmlClocksEventReasons bits (nvml.h): what held the clock below its maximum.
REASON_POWER_CAP = 0x4  # SW power cap: the board's power limit
REASON_HW_SLOWDOWN = 0x8 | 0x80  # HW slowdown, HW power brake
REASON_THERMAL = 0x20 | 0x40  # SW / HW thermal slowdown
INTERVAL_S = 0.2  # NVML averages board power over longer than this anyway


class NvmlError(RuntimeError):
    pass


class Nvml:
    """The few NVML calls the sampler needs, on the device with this UUID."""

    def __init__(self, uuid: str) -> None:
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise NvmlError(f"NVML not loadable: {e}") from None
        self._call("nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", uuid.encode(), ctypes.byref(self.handle))
        name = "nvmlDeviceGetCurrentClocksEventReasons"  # older drivers: ...ThrottleReasons
        self._reasons = name if hasattr(self.lib, name) else name.replace("Event", "Throttle")

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise NvmlError(f"{name} returned NVML error {rc}")

    def _uint(self, name: str, *args) -> int:
        value = ctypes.c_uint()
        self._call(name, self.handle, *args, ctypes.byref(value))
        return value.value

    def power_limit_w(self) -> float:
        return self._uint("nvmlDeviceGetEnforcedPowerLimit") / 1e3

    def sample(self) -> tuple[int, float, int]:
        """(SM MHz, board W, clock-event reason bits)."""
        reasons = ctypes.c_ulonglong()
        self._call(self._reasons, self.handle, ctypes.byref(reasons))
        mhz = self._uint("nvmlDeviceGetClockInfo", NVML_CLOCK_SM)
        return mhz, self._uint("nvmlDeviceGetPowerUsage") / 1e3, reasons.value


def summarize(samples: list[tuple[int, float, int]], limit_w: float | None) -> dict[str, Any]:
    """Samples (SM MHz, W, reason bits) -> the run's clock and power record."""
    mhz = sorted(s[0] for s in samples)
    n = len(samples)

    def share(bits: int) -> float:
        return sum(1 for s in samples if s[2] & bits) / n

    return {
        "samples": n,
        "sm_mhz_median": statistics.median(mhz),
        "sm_mhz_p10": mhz[n // 10],
        "power_w_mean": sum(s[1] for s in samples) / n,
        "power_limit_w": limit_w,
        "power_capped": share(REASON_POWER_CAP),
        "thermal_or_hw_slowdown": share(REASON_THERMAL | REASON_HW_SLOWDOWN),
    }


def device_uuid(device: torch.device) -> str | None:
    """NVML's name for a CUDA device ("GPU-" + its UUID), None off CUDA."""
    if device.type != "cuda":
        return None
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class PowerSampler:
    """Context manager: samples the GPU with NVML UUID `uuid` every `interval` s in a child
    process while the block runs; then `summary` holds summarize()'s record (None when nothing
    was sampled, with the reason in `error`). uuid None (not a CUDA run) samples nothing."""

    def __init__(self, uuid: str | None, interval: float = INTERVAL_S) -> None:
        self.uuid = uuid
        self.interval = interval
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None if uuid else "not a CUDA device"
        self._child: subprocess.Popen | None = None
        self._out: Any = None

    def __enter__(self) -> PowerSampler:
        if self.uuid is None:
            return self
        # Append mode: the child's writes land at the end even while we seek to read.
        self._out = tempfile.TemporaryFile(mode="a+")
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "batchgen.bench.gpu_power", self.uuid, str(self.interval)],
                stdin=subprocess.PIPE,
                stdout=self._out,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError as e:  # the run goes on unsampled
            self.error = f"could not start the sampler: {e}"
            self._out.close()
            return self
        # The child's first line says whether NVML opened; wait for it (outside the timing).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._child.poll() is None:
            self._out.seek(0)
            if self._out.readline().endswith("\n"):
                break
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        if self._child is None:
            return
        self._child.stdin.close()  # the child stops at end of input
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._out.seek(0)
        self.summary, self.error = parse(self._out.read())
        self._out.close()


def parse(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The child's output -> (summary, error)."""
    lines = text.splitlines()
    if not lines:
        return None, "the sampler printed nothing"
    head = lines[0].split(" ", 1)
    if head[0] != "ok":
        return None, head[1] if len(head) > 1 else "the sampler failed"
    samples = []
    for line in lines[1:]:
        parts = line.split()
        if len(parts) == 3:
            samples.append((int(parts[0]), float(parts[1]), int(parts[2])))
    if not samples:
        return None, "no samples (the run was shorter than the interval)"
    return summarize(samples, float(head[1])), None


def _sample_until_eof(uuid: str, interval: float) -> None:
    try:
        nvml = Nvml(uuid)
        limit = nvml.power_limit_w()
        nvml.sample()  # a query this GPU does not support fails here, before "ok"
    except NvmlError as e:
        print(f"unavailable {e}", flush=True)
        return
    print(f"ok {limit}", flush=True)
    while True:
        try:
            mhz, watts, reasons = nvml.sample()
        except NvmlError:
            return  # keep what was sampled
        print(f"{mhz} {watts:.1f} {reasons}", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], interval)
        if ready and not os.read(sys.stdin.fileno(), 1):
            return  # the parent closed our input: its timed run is over


if __name__ == "__main__":
    _sample_until_eof(sys.argv[1], float(sys.argv[2]))
