"""examples/slurm/: the scripts parse, and run as Slurm would run them (Slurm's variables set
by hand, `srun` and `scontrol` stubbed): a stopped task requeues itself and its rerun finishes
the job; the multi-GPU script runs one process per GPU, each on its own shards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "slurm"
ARRAY, MULTI = SCRIPTS / "array.sbatch", SCRIPTS / "multi_gpu.sbatch"


# srun: drop its own options, run SLURM_NTASKS (or --ntasks) copies of the command with
# SLURM_PROCID set, pass USR1/TERM on to them, exit with the highest status (as srun does).
SRUN = r"""#!/bin/bash
n=${SLURM_NTASKS:-1}
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) n=${1#--ntasks=}; shift ;;
    -*) shift ;;
    *) break ;;
  esac
done
echo "srun x$n: $*" >> "$STUB_LOG"
pids=()
for ((p = 0; p < n; p++)); do
  SLURM_PROCID=$p "$@" &
  pids+=($!)
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for pid in "${pids[@]}"; do
  while :; do
    wait "$pid"; r=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  [ "$r" -gt "$rc" ] && rc=$r
done
exit "$rc"
"""

SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
"""


def install_stubs(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        os.chmod(path, 0o755)


def test_scripts_parse_and_ask_for_requeue_and_the_early_signal():
    for script in (ARRAY, MULTI):
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text
        assert "scontrol requeue" in text and "\nsrun " in text and " &\npid=$!\n" in text


def workspace(tmp: Path, model: str, rows: int, shard_rows: int) -> dict[str, str]:
    with open(tmp / "in.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i:04d}", "text": f"document {i} about rivers"}) + "\n")
    job = {
        "model": {"path": model, "max_num_seqs": 8, "max_model_len": 128, "dtype": "float32"},
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "Summarize: {text}\nSummary:"},
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": shard_rows},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    install_stubs(tmp / "bin")
    return {
        **os.environ,
        "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "STUB_LOG": str(tmp / "stub.log"),
        "JOB": "job.yaml",
        "BATCHGEN": f"{sys.executable} -m batchgen",
        "GRACE": "5",
        "SLURM_JOB_ID": "78",
        "SLURM_ARRAY_JOB_ID": "77",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_STEP": "1",
    }


def ids(out: Path) -> list[str]:
    import polars as pl

    return pl.read_parquet(out / "part-*.parquet")["id"].to_list()


@pytest.mark.slow
def test_array_task_stopped_by_usr1_requeues_itself_and_its_rerun_finishes(
    tmp_path, tiny_model_dir
):
    env = workspace(tmp_path, tiny_model_dir("llama"), rows=300, shard_rows=50)
    env.update(SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_COUNT="1")
    log = tmp_path / "task.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(ARRAY)], cwd=tmp_path, env=env, stdout=f,
                                stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while "model loaded" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch shell
    assert proc.wait(timeout=60) == 75, log.read_text()
    text = log.read_text()
    assert "SIGUSR1: no new rows" in text and "requeueing this task" in text
    assert (tmp_path / "stub.log").read_text().splitlines()[-1] == "scontrol requeue 77_0"
    assert not (tmp_path / "out/_SUCCESS").exists()
    # Slurm starts the requeued task again: it resumes and finishes the job.
    again = subprocess.run(["bash", str(ARRAY)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert (tmp_path / "out/_SUCCESS").exists()
    assert ids(tmp_path / "out") == [f"r{i:04d}" for i in range(300)]
    assert (tmp_path / "stub.log").read_text().count("scontrol") == 1


@pytest.mark.slow
def test_multi_gpu_script_runs_one_process_per_gpu_on_its_own_shards(tmp_path, tiny_model_dir):
    env = workspace(tmp_path, tiny_model_dir("llama"), rows=120, shard_rows=30)
    env.update(SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_COUNT="1", SLURM_NTASKS="2")
    done = subprocess.run(["bash", str(MULTI)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "srun x2: bash -c" in (tmp_path / "stub.log").read_text()
    tasks = re.findall(r"shards committed: 2/2 of task (\d/\d)", done.stdout)
    assert sorted(tasks) == ["0/2", "1/2"], done.stdout
    assert ids(tmp_path / "out") == [f"r{i:04d}" for i in range(120)]
