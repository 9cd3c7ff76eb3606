"""CPU threads: OpenMP waits that yield a shared core, and a torch pool sized to the CPUs we own.

Why (measured 2026-11-27 on a 2-core machine, the 200-row demo `batchgen run
jobs/summarize.yaml` beside `python3 -c 'while True: pass'`): torch's OpenMP workers spin-wait
between parallel regions (libgomp's default). A spinning worker burns its share of the contested
core, then waits a whole scheduler slice to run its half of the next op: the demo took 38-160 s
beside the loop against 6-16 s without it, 87% of its perf samples in libgomp's spin loops
(61 s of CPU for 160 s of wall time, 18,000 involuntary context switches). Sleeping workers are
woken at once when work arrives: with OMP_WAIT_POLICY=PASSIVE the same pair took 10-13 s and
6-7 s. libgomp reads the policy once, when torch loads it: it has to be in the environment
before `import torch`.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping

# Set when absent (a user's own choice wins). KMP_BLOCKTIME is Intel OpenMP's spin time (ms),
# for torch builds linked against libiomp instead of libgomp.
OPENMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
CGROUP_ROOT = "/sys/fs/cgroup"


def quiet_openmp_waits(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put OPENMP_WAIT_DEFAULTS into `environ` where the user has not set them; returns what was
    set. Call before torch is imported (the CLI and `import batchgen` do)."""
    added = {k: v for k, v in OPENMP_WAIT_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


def cgroup_cpu_limit(root: str = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup quota allows (e.g. 1.5), or None without a quota.

    cgroup v2: `cpu.max` holds "QUOTA PERIOD" or "max PERIOD"; cgroup v1: `cpu/cpu.cfs_quota_us`
    (-1: none) over `cpu/cpu.cfs_period_us`.
    """
    text = _read(os.path.join(root, "cpu.max"))
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota = _read(os.path.join(root, "cpu", "cpu.cfs_quota_us"))
    period = _read(os.path.join(root, "cpu", "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cpu_budget(affinity: int, slurm_cpus_per_task: str | None, cgroup_limit: float | None) -> int:
    """Threads for torch: the CPUs in the affinity mask, at most SLURM_CPUS_PER_TASK, at most the
    whole CPUs of the cgroup quota (a thread beyond the quota gets throttled mid-op, and every
    other thread then waits for it at the op's barrier); at least 1. An unreadable
    SLURM_CPUS_PER_TASK is ignored."""
    n = max(1, affinity)
    if slurm_cpus_per_task:
        try:
            slurm = int(slurm_cpus_per_task)
        except ValueError:
            slurm = 0
        if slurm >= 1:
            n = min(n, slurm)
    if cgroup_limit is not None:
        n = min(n, max(1, math.floor(cgroup_limit + 1e-6)))
    return n


def default_cpu_threads(environ: MutableMapping[str, str] = os.environ) -> int:
    """cpu_budget of this process: its affinity mask, Slurm's allocation, its cgroup quota."""
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    else:  # macOS, Windows
        affinity = os.cpu_count() or 1
    return cpu_budget(affinity, environ.get("SLURM_CPUS_PER_TASK"), cgroup_cpu_limit())


def cpu_threads_to_set(
    configured: int | None, environ: MutableMapping[str, str] = os.environ
) -> int | None:
    """The torch thread count the engine sets on CPU: the `cpu_threads` option when given; None
    (leave torch's) when the user set OMP_NUM_THREADS; else default_cpu_threads()."""
    if configured is not None:
        return configured
    if environ.get("OMP_NUM_THREADS"):
        return None
    return default_cpu_threads(environ)
