"""The GPU clock and power sampler of the bench's timed runs (batchgen.bench.gpu_power)."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from batchgen.bench import gpu_power
from batchgen.bench.report import format_gpu


def test_summarize_gives_clock_power_and_cap_shares():
    samples = [(1500 + 10 * i, 600.0 + i, 0x4 if i < 15 else 0) for i in range(20)]
    samples[3] = (1530, 603.0, 0x4 | 0x20)  # thermal as well
    s = gpu_power.summarize(samples, 700.0)
    assert s["samples"] == 20
    assert s["sm_mhz_median"] == 1595  # median of 1500..1690 step 10
    assert s["sm_mhz_p10"] == 1520
    assert s["power_w_mean"] == pytest.approx(609.5)
    assert s["power_limit_w"] == 700.0
    assert s["power_capped"] == 0.75
    assert s["thermal_or_hw_slowdown"] == 0.05


def test_parse_reads_the_childs_lines_and_its_failures():
    summary, error = gpu_power.parse("ok 700.0\n1700 690.5 4\n1800 680.0 0\n")
    assert error is None
    assert summary["samples"] == 2 and summary["power_capped"] == 0.5
    assert summary["sm_mhz_median"] == 1750
    assert gpu_power.parse("unavailable NVML not loadable: no lib\n") == (
        None,
        "NVML not loadable: no lib",
    )
    assert gpu_power.parse("")[0] is None and "nothing" in gpu_power.parse("")[1]
    summary, error = gpu_power.parse("ok 700.0\n")
    assert summary is None and "no samples" in error


def test_sampler_off_cuda_starts_nothing():
    with gpu_power.PowerSampler(None) as s:
        pass
    assert s.summary is None and s.error == "not a CUDA device"
    assert gpu_power.device_uuid(torch.device("cpu")) is None


def test_sampler_child_reports_why_it_could_not_sample():
    # A UUID no GPU has: without NVML (the CPU machine) or with it, the child says why, the
    # block runs to its end, and nothing is invented.
    with gpu_power.PowerSampler("GPU-00000000-0000-0000-0000-000000000000", 0.02) as s:
        time.sleep(0.05)
    assert s.summary is None
    assert "nvml" in s.error.lower()


def test_sampling_loop_stops_when_its_input_closes(monkeypatch, capsys):
    read_fd, write_fd = os.pipe()
    calls = []

    class FakeNvml:
        def __init__(self, uuid: str) -> None:
            self.uuid = uuid

        def power_limit_w(self) -> float:
            return 700.0

        def sample(self) -> tuple[int, float, int]:
            # The parent's run ends (its end of the pipe closes) at the 6th query: the probe
            # before "ok" and 5 samples. Counted, not timed, so a loaded machine changes nothing.
            calls.append(1)
            assert len(calls) <= 50, "the loop did not stop when its input closed"
            if len(calls) == 6:
                os.close(write_fd)
            return 1700, 690.0, 0x4

    monkeypatch.setattr(gpu_power, "Nvml", FakeNvml)
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_fd))
    gpu_power._sample_until_eof("GPU-x", 0.02)
    summary, error = gpu_power.parse(capsys.readouterr().out)
    assert error is None
    assert summary["samples"] == 5 and len(calls) == 6
    assert summary["power_capped"] == 1.0 and summary["power_limit_w"] == 700.0


def test_report_line_names_clock_power_and_cap():
    summary = gpu_power.summarize([(1740, 690.0, 4)] * 9 + [(1980, 650.0, 0)], 700.0)
    line = format_gpu(summary)
    assert line == (
        "GPU during the median run: SM 1,740 MHz median (p10 1,740), 686 W mean of a 700 W "
        "limit; power cap in 90% of 10 samples"
    )
    assert format_gpu({"error": "NVML not loadable: x"}) == (
        "GPU clock and power not sampled: NVML not loadable: x"
    )
    assert format_gpu(None) is None


@pytest.mark.gpu
def test_sampler_reads_the_gpu_during_work():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    with gpu_power.PowerSampler(gpu_power.device_uuid(device), 0.02) as s:
        end = time.perf_counter() + 2.0  # ~100 samples due; 5 asked, so a busy host passes
        while time.perf_counter() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    assert s.error is None, s.error
    assert s.summary["samples"] >= 5
    assert 100 < s.summary["sm_mhz_median"] < 5000
    assert s.summary["power_w_mean"] > 20 and s.summary["power_limit_w"] > 100


def test_sampler_that_cannot_start_leaves_the_run_unsampled(monkeypatch):
    def no_child(*args, **kwargs):
        raise OSError("no python here")

    monkeypatch.setattr(gpu_power.subprocess, "Popen", no_child)
    with gpu_power.PowerSampler("GPU-x") as s:
        pass
    assert s.summary is None and s.error == "could not start the sampler: no python here"


def test_sampling_loop_reports_a_query_the_gpu_refuses(monkeypatch, capsys):
    class NoPower:
        def __init__(self, uuid: str) -> None:
            pass

        def power_limit_w(self) -> float:
            return 700.0

        def sample(self):
            raise gpu_power.NvmlError("nvmlDeviceGetPowerUsage returned NVML error 3")

    monkeypatch.setattr(gpu_power, "Nvml", NoPower)
    gpu_power._sample_until_eof("GPU-x", 0.01)
    assert gpu_power.parse(capsys.readouterr().out) == (
        None,
        "nvmlDeviceGetPowerUsage returned NVML error 3",
    )
