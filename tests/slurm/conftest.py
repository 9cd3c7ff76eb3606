"""A one-node Slurm cluster for the test run: munged, slurmctld and slurmd from Debian's
packages, all state under a temp directory, torn down (jobs cancelled, daemons stopped)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
# .ci/run sets this: there a missing Slurm is a failure, never a skip.
REQUIRED = os.environ.get("BATCHGEN_REQUIRE_SLURM") == "1"


def _have() -> bool:
    return all(shutil.which(t, path=PATH) for t in TOOLS)


def _install() -> str:
    """apt-get install Slurm and munge (as root on Debian/Ubuntu); returns what went wrong."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "not root, or no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The running daemons and the environment (SLURM_CONF) their clients need."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(root / "slurm.conf")}
        self.procs: list[subprocess.Popen] = []

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr}")
        return done.stdout

    def start(self) -> None:
        root = self.root
        for d in ("munge", "state", "spool", "log"):
            (root / d).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = root / "munge" / "munge.sock"
        self.munge = [f"--socket={sock}"]
        subprocess.run(
            ["munged", "--force", *self.munge, f"--key-file={key}",
             f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged'}",
             f"--seed-file={root / 'munge' / 'seed'}"],
            env=self.env, check=True, capture_output=True,
        )  # fmt: skip
        conf = f"""ClusterName=batchgentest
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobRequeue=1
MinJobAge=600
KillWait=30
SlurmdParameters=config_overrides
NodeName={self.host} CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        (root / "slurm.conf").write_text(conf)
        for daemon in ("slurmctld", "slurmd"):
            log = open(root / "log" / f"{daemon}.out", "w")
            cmd = [daemon, "-D", "-f", str(root / "slurm.conf")]
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log))
            time.sleep(1)
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%T", check=False):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("the Slurm node did not come up:\n" + self.logs())
            time.sleep(0.5)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text()[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.monotonic() + 60
        while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        subprocess.run(["munged", "--stop", *self.munge], env=self.env, capture_output=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if not _have():
        problem = _install()
        if not _have():
            message = f"Slurm is not installed and could not be installed ({problem.strip()})"
            if REQUIRED:
                pytest.fail(message)
            pytest.skip(message)
    if os.geteuid() != 0:
        if REQUIRED:
            pytest.fail("the Slurm test starts slurmd, which must run as root")
        pytest.skip("the Slurm test starts slurmd, which must run as root")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        leftovers = [p.pid for p in cluster.procs if p.poll() is None]
        assert not leftovers, f"Slurm daemons still running: {leftovers}"
