"""CPU thread settings: OpenMP's passive wait set before torch loads, the thread budget from the
affinity mask, SLURM_CPUS_PER_TASK and the cgroup quota, and the cpu_threads engine option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.config import ConfigError, EngineConfig
from batchgen.cpu_threads import (
    cgroup_cpu_limit,
    cpu_budget,
    cpu_threads_to_set,
    default_cpu_threads,
    quiet_openmp_waits,
)

REPO = Path(__file__).resolve().parents[1]


def test_passive_wait_only_where_the_user_chose_nothing():
    env = {"KMP_BLOCKTIME": "200"}
    assert quiet_openmp_waits(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "200"}
    env = {"OMP_WAIT_POLICY": "active"}
    quiet_openmp_waits(env)
    assert env["OMP_WAIT_POLICY"] == "active" and env["KMP_BLOCKTIME"] == "0"


@pytest.mark.parametrize("preset, seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_import_batchgen_sets_the_policy_before_torch_loads(preset, seen):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    env["PYTHONPATH"] = str(REPO)
    code = (
        "import sys, os, batchgen; assert 'torch' not in sys.modules; "
        "from batchgen import LLM; import torch; print(os.environ['OMP_WAIT_POLICY'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == seen


@pytest.mark.parametrize(
    "affinity, slurm, quota, expected",
    [
        (8, None, None, 8),
        (8, "4", None, 4),  # Slurm's allocation
        (8, "16", None, 8),  # never more than the mask
        (8, None, 2.0, 2),  # cgroup quota of two CPUs
        (8, None, 1.5, 1),  # a part CPU gets no thread of its own
        (8, None, 0.5, 1),  # at least one
        (8, "3", 2.0, 2),
        (8, "", None, 8),
        (8, "two", None, 8),  # unreadable: ignored
        (0, None, None, 1),
    ],
)
def test_budget(affinity, slurm, quota, expected):
    assert cpu_budget(affinity, slurm, quota) == expected


def test_cgroup_v2_and_v1_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(str(v1)) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_limit(str(v1)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_threads_to_set(monkeypatch):
    assert cpu_threads_to_set(3, {"OMP_NUM_THREADS": "1"}) == 3  # the option wins
    assert cpu_threads_to_set(None, {"OMP_NUM_THREADS": "1"}) is None  # torch already took it
    mask = len(os.sched_getaffinity(0))
    assert cpu_threads_to_set(None, {}) == default_cpu_threads({}) <= mask
    assert cpu_threads_to_set(None, {"SLURM_CPUS_PER_TASK": "1"}) == 1


def test_engine_option_is_validated_and_applied(tiny_model_dir):
    import torch

    from batchgen import LLM

    with pytest.raises(ConfigError, match="cpu_threads=0"):
        EngineConfig(model="m", cpu_threads=0)
    before = torch.get_num_threads()
    try:
        LLM(tiny_model_dir("llama"), device="cpu", max_model_len=64, num_kv_blocks=8, cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
